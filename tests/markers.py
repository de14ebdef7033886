"""Shared pytest markers."""

import pytest
import torch

_no_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU; on CPU the same op is covered by the Triton interpreter and the torch reference",
)


def requires_gpu(test):
    """Run only on a CUDA machine (marked ``gpu``, so ``pytest -m gpu`` selects these)."""
    return pytest.mark.gpu(_no_gpu(test))


# The marks of one case of a parametrized test that needs a GPU: pytest.param(..., marks=GPU_CASE).
GPU_CASE = (pytest.mark.gpu, _no_gpu)
