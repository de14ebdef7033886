"""The MLA kind (DeepSeek-V3) over CP prefill, paged decode and the colocated run."""

from tests.checkpoints import write_deepseek_v3
from tests.model.attention.suite import KindSuite


class TestMLA(KindSuite):
    kind = "mla"
    write = staticmethod(write_deepseek_v3)
