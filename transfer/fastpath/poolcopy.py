"""Copying pages of layers from one pool to another, page i to page i.

The fast path copies a rank's pages out of its shared pool with these, and
placing a gRPC chunk copies its pages into the decode pool by the same runs.
Pages that form a few runs of consecutive pages (in both pools) move run by
run: between GPUs ``PlannedCopy`` (one ``cudaMemcpy2DAsync`` per run and
group of layers, ``transfer.fastpath.devcopy``), on the CPU one strided torch copy.
Scattered pages go through ``gather_pages``, one copy, ``scatter_pages``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lanekv.kernels.backend import on_device
from lanekv.kernels.page_copy import gather_pages, scatter_pages
from lanekv.transfer.fastpath.devcopy import BlockCopy, RowSliceCopy
from lanekv.transfer.fastpath.tuning import DEFAULT_COPY, CopyTuning


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, count) runs where both page lists go up by one."""
    if src and len(src) == len(dst) and _consecutive(src) and _consecutive(dst):
        return [(src[0], dst[0], len(src))]  # the usual case, without a Python loop over the pages
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def _consecutive(pages: Sequence[int]) -> bool:
    return pages[-1] - pages[0] == len(pages) - 1 and list(pages) == list(range(pages[0], pages[0] + len(pages)))


# Up to this many runs of consecutive pages a copy moves run by run (dense
# copies on the copy engines); more, and it gathers, copies once and scatters.
MAX_RUN_COPIES = 4
# The largest buffer such a gathered copy stages at once (on each device).
MAX_STAGING_BYTES = 256 << 20


def copy_pages(src_pool: torch.Tensor, src_pages: Sequence[int], dst_pool: torch.Tensor,
               dst_pages: Sequence[int], page_size: int, layer_start: int, layer_end: int,
               *, tuning: CopyTuning = DEFAULT_COPY) -> None:
    """Copy pages of layers ``[layer_start, layer_end)`` from one pool to another, page i to page i.

    When both page lists are a few runs of consecutive pages, each run over
    the layers is ``kv * layers`` dense blocks (K and V, or one MLA latent
    plane) at one pitch in both pools and moves as one strided copy (between GPUs ``PlannedCopy``: one 2-D copy on
    the copy engines; on the CPU one torch copy). Scattered pages go in three
    steps whatever their number: ``gather_pages`` on the source device into
    one dense buffer, one copy of it to the destination device,
    ``scatter_pages`` there.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    planned = PlannedCopy.plan(src_pool, src_pages, dst_pool, dst_pages, page_size, layer_start, layer_end,
                               tuning=tuning)
    if planned is not None:
        planned.issue(layer_start, layer_end)
        return
    runs = page_runs(src_pages, dst_pages)
    if len(runs) <= MAX_RUN_COPIES:
        layers = slice(layer_start, layer_end)
        for s, d, n in runs:
            dst_pool[layers, :, d * page_size:(d + n) * page_size].copy_(
                src_pool[layers, :, s * page_size:(s + n) * page_size], non_blocking=True)
        return
    _copy_scattered(src_pool, src_pages, dst_pool, dst_pages, page_size, layer_start, layer_end)


class PlannedCopy:
    """``copy_pages`` of a range of layers between two GPU pools, planned once (its runs
    of pages and their 2-D copies) and issued a group of layers at a time with
    little host work: the fast path copies a range in groups so that each
    group's digest runs under the next group's copy.

    ``plan`` returns None where ``copy_pages`` must do it (CPU pools,
    scattered pages, views CUDA cannot copy in 2-D, pages or layers that are
    not in the pools). ``src_layer_start``: the source's layer of
    ``layer_start`` (default the same; 0 for a buffer of just these layers,
    such as a received chunk).
    """

    def __init__(self, copies: list[BlockCopy | RowSliceCopy], layer_start: int, planes: int = 2) -> None:
        self._copies, self._layer_start, self._planes = copies, layer_start, planes

    @property
    def runs(self) -> int:
        """Runs of consecutive pages: one 2-D copy each."""
        return len(self._copies)

    @classmethod
    def plan(cls, src_pool: torch.Tensor, src_pages: Sequence[int], dst_pool: torch.Tensor,
             dst_pages: Sequence[int], page_size: int, layer_start: int, layer_end: int,
             *, src_layer_start: int | None = None, tuning: CopyTuning = DEFAULT_COPY) -> PlannedCopy | None:
        src_first = layer_start if src_layer_start is None else src_layer_start
        if not (src_pool.is_cuda and dst_pool.is_cuda) or len(src_pages) != len(dst_pages) or not src_pages \
                or min(layer_start, src_first, min(src_pages), min(dst_pages)) < 0:
            return None  # (negative indices would slice from the end)
        runs = page_runs(src_pages, dst_pages)
        if len(runs) > MAX_RUN_COPIES:
            return None
        dst_layers = slice(layer_start, layer_end)
        src_layers = slice(src_first, src_first + layer_end - layer_start)
        copies = []
        for s, d, n in runs:
            # A run past a pool's end slices short: the shapes differ and plan says None.
            dst_run = dst_pool[dst_layers, :, d * page_size:(d + n) * page_size]
            src_run = src_pool[src_layers, :, s * page_size:(s + n) * page_size]
            # Whole rows: one 2-D copy per run; a view of some KV heads (a TP decode
            # rank's): one 2-D copy of the rows' slices per layer and plane.
            plan = BlockCopy.plan(dst_run, src_run, push=tuning.push, keep_gil=tuning.keep_gil) \
                or RowSliceCopy.plan(dst_run, src_run, push=tuning.push, keep_gil=tuning.keep_gil)
            if plan is None:
                return None
            copies.append(plan)
        return cls(copies, layer_start, src_pool.shape[1])

    def issue(self, first: int, last: int) -> None:
        """Copy layers ``[first, last)`` of the planned range (a block per plane and layer:
        K and V, or the MLA latent)."""
        planes = self._planes
        for copy in self._copies:
            copy.issue(planes * (first - self._layer_start), planes * (last - first))


def _copy_scattered(src_pool: torch.Tensor, src_pages: Sequence[int], dst_pool: torch.Tensor,
                    dst_pages: Sequence[int], page_size: int, layer_start: int, layer_end: int) -> None:
    with on_device(src_pool.device):
        src_index = torch.as_tensor(list(src_pages), dtype=torch.int64).to(src_pool.device)
    with on_device(dst_pool.device):
        dst_index = torch.as_tensor(list(dst_pages), dtype=torch.int64).to(dst_pool.device)
    layer_bytes = src_pool.shape[1] * len(src_pages) * page_size * src_pool[0, 0, 0].numel() \
        * src_pool.element_size()
    step = max(1, MAX_STAGING_BYTES // layer_bytes)  # layers per buffer
    rows = None if src_pool.is_contiguous() else \
        (src_index[:, None] * page_size + torch.arange(page_size, device=src_index.device)).reshape(-1)
    for first in range(layer_start, layer_end, step):
        last = min(layer_end, first + step)
        with on_device(src_pool.device):
            # A view of some KV heads (a TP decode rank's) is no pool gather_pages reads:
            # its rows are picked by torch, the heads' bytes only.
            buf = gather_pages(src_pool, src_index, page_size, first, last) if rows is None else \
                src_pool[first:last].index_select(2, rows)
        with on_device(dst_pool.device):
            scatter_pages(buf.to(dst_pool.device), dst_pool, dst_index, page_size, first, last)
