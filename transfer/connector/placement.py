"""Placing a chunk received over gRPC (host memory) into pages of the decode pool.

On a GPU the chunk is first copied into pinned host memory (one memmove,
outside the GIL), then sent to the device without waiting, all on the
current stream. Measured on an H200 host (``bench/fastpath_probe.py``,
8 MiB chunks): a pageable host-to-device copy takes 1.1-1.2 ms per chunk
however many threads place at once (the driver stages it through a buffer
of its own); the pinned way takes 1.0 ms in one thread, 0.63 ms per chunk in
two and 0.37 ms in four. Through a whole fetch the two measured the same
within run-to-run noise (3.1-3.8 GB/s).

On the device the chunk's pages go to their places with a few 2-D copies
(``poolcopy.PlannedCopy``, one per run of consecutive destination pages) when
they form up to ``MAX_RUN_COPIES`` runs, else with ``scatter_pages``. Both
run on the current stream; the copies cost less host time per chunk than a
kernel launch and its page index (host time a fetch's threads share).

On the host (a CPU pool) the same runs move as one strided torch copy each
(``_place_runs``); more runs go through ``scatter_pages``.

Pinned buffers come from torch's host allocator, which reuses one only after
the copy queued from it has run. Later work on the same stream (the decode
steps) sees the placed pages.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from lanekv.kernels.page_copy import scatter_pages
from lanekv.transfer.fastpath.poolcopy import MAX_RUN_COPIES, PlannedCopy, page_runs


def place_chunk(pool: torch.Tensor, physical: Sequence[int], payload: torch.Tensor, page_size: int,
                layer_start: int, layer_end: int) -> None:
    """Scatter ``payload`` ``[layers, kv, len(physical) * page_size, Hkv, D]`` into ``physical``
    pages of ``pool`` (``kv = 2`` K and V for GQA; an MLA pool is ``[L, 1, rows, 1, R + P]``,
    one latent plane).

    ValueError (from ``scatter_pages``) when the payload does not fit.
    """
    if pool.is_cuda:
        staged = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
        if payload.is_contiguous():
            ctypes.memmove(staged.data_ptr(), payload.data_ptr(), payload.numel() * payload.element_size())
        else:
            staged.copy_(payload)
        payload = staged.to(pool.device, non_blocking=True)
        planned = PlannedCopy.plan(payload, range(len(physical)), pool, physical, page_size, layer_start,
                                   layer_end, src_layer_start=0)
        if planned is not None:
            planned.issue(layer_start, layer_end)
            return
        index = torch.tensor(list(physical), dtype=torch.int64).pin_memory().to(pool.device, non_blocking=True)
    else:
        if _place_runs(pool, physical, payload, page_size, layer_start, layer_end):
            return
        index = torch.tensor(list(physical), dtype=torch.int64)
    scatter_pages(payload, pool, index, page_size, layer_start, layer_end)


def _place_runs(pool: torch.Tensor, physical: Sequence[int], payload: torch.Tensor, page_size: int,
                layer_start: int, layer_end: int) -> bool:
    """A host pool: each run of consecutive destination pages as one strided torch copy (it drops
    the GIL while it copies); False where ``scatter_pages`` must do it (more than
    ``MAX_RUN_COPIES`` runs, or anything that does not fit, which it then refuses by name)."""
    layers = layer_end - layer_start
    if not physical or payload.dim() != 5 or pool.dim() != 5 or payload.dtype != pool.dtype \
            or tuple(payload.shape) != (layers, *pool.shape[1:2], len(physical) * page_size, *pool.shape[3:]) \
            or not 0 <= layer_start < layer_end <= pool.shape[0] or len(set(physical)) != len(physical) \
            or min(physical) < 0 or (max(physical) + 1) * page_size > pool.shape[2]:
        return False
    runs = page_runs(range(len(physical)), physical)
    if len(runs) > MAX_RUN_COPIES:
        return False
    for src, dst, count in runs:
        pool[layer_start:layer_end, :, dst * page_size:(dst + count) * page_size].copy_(
            payload[:, :, src * page_size:(src + count) * page_size])
    return True
