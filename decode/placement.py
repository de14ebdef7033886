"""Placing a chunk received over gRPC (host memory) into pages of the decode pool.

On a GPU the chunk is first copied into pinned host memory (a host copy
outside the GIL), then sent to the device without waiting and scattered
there, all on the current stream. A pageable
host-to-device copy would instead hold the placing thread for the whole
transfer at a few GB/s (the driver stages it through a buffer of its own),
while the receiving threads wait for the chunk budget it holds.

Pinned buffers come from torch's host allocator, which reuses one only after
the copy queued from it has run. Later work on the same stream (the decode
steps) sees the placed pages.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kernels.page_copy import scatter_pages

# How a received chunk reaches the device: "memmove" (one host copy into pinned
# memory, outside the GIL, then an asynchronous copy), "torch" (the same with
# torch's host copy) or "pageable" (a synchronous copy from the message itself).
HOST_COPY = "memmove"


def place_chunk(pool: torch.Tensor, physical: Sequence[int], payload: torch.Tensor, page_size: int,
                layer_start: int, layer_end: int) -> None:
    """Scatter ``payload`` ``[layers, 2, len(physical) * page_size, Hkv, D]`` into ``physical`` pages of ``pool``.

    ValueError (from ``scatter_pages``) when the payload does not fit.
    """
    index = torch.tensor(list(physical), dtype=torch.int64)
    if pool.is_cuda and HOST_COPY != "pageable":
        staged = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
        if HOST_COPY == "torch" or not payload.is_contiguous():
            staged.copy_(payload)
        else:
            ctypes.memmove(staged.data_ptr(), payload.data_ptr(), payload.numel() * payload.element_size())
        payload = staged.to(pool.device, non_blocking=True)
        index = index.pin_memory().to(pool.device, non_blocking=True)
    elif pool.is_cuda:
        payload, index = payload.to(pool.device), index.to(pool.device)
    scatter_pages(payload, pool, index, page_size, layer_start, layer_end)
