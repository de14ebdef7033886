"""The GQA kind (Llama family) over CP prefill, paged decode and the colocated run."""

from tests.checkpoints import write_llama
from tests.model.attention.suite import KindSuite


class TestGQA(KindSuite):
    kind = "gqa"
    write = staticmethod(write_llama)
