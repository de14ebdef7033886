"""Shared pytest markers."""

import pytest
import torch

requires_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU; on CPU the same op is covered by the Triton interpreter and the torch reference",
)
