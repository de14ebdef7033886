"""The DSA kind (DeepSeek-V3.2) over CP prefill, paged decode and the colocated run."""

from tests.checkpoints import write_deepseek_v32
from tests.model.attention.suite import KindSuite


class TestDSA(KindSuite):
    kind = "dsa"
    write = staticmethod(write_deepseek_v32)
