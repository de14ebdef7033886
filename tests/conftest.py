"""Suite-wide setup.

The Triton interpreter must be switched on before any kernel module is
imported (``triton.jit`` picks interpreter or compiler at decoration time), so
this happens here, first. On a CUDA machine the compiled kernels run instead.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
