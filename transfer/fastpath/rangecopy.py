"""Copying one fast-path range out of a shared pool, with the digest of what was copied.

``FastPath.fetch`` (``transfer.fastpath.client``) hands each range it copies
to ``copy_range``: the pages of some layers, from where the rank's
descriptor (or the caller's ``expect``) says they are, into the caller's
pages, and on the destination's device a digest of what arrived, which the
fetch compares with the rank's. ``Prepared`` is what a fetch makes for its
asked pages once, before the ranges come.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lanekv.kernels.page_digest import PageDigest
from lanekv.transfer.fastpath.poolcopy import PlannedCopy, copy_pages, page_runs
from lanekv.transfer.fastpath.sidestreams import Streams
from lanekv.transfer.fastpath.tuning import DEFAULT_COPY, CopyTuning
from lanekv.transfer.protocol.descriptors import Descriptor


def copy_groups(start: int, end: int, size: int, last_min: int) -> list[tuple[int, int]]:
    """Layers ``[start, end)`` in groups of ``size``, the last one cut in halves while a half
    has at least ``last_min`` layers (8, 8, 8, 4, 2, 2 for 32 layers, 8 and 2)."""
    if size < 1 or last_min < 1:
        raise ValueError(f"size and last_min must be >= 1, got size={size}, last_min={last_min}")
    groups = [(first, min(end, first + size)) for first in range(start, end, size)]
    if not groups:
        return groups
    first, last = groups.pop()
    while last - first >= 2 * last_min:
        half = (last - first) // 2
        groups.append((first, first + half))
        first += half
    groups.append((first, last))
    return groups


class Prepared:
    """What a fetch makes for its asked pages: the pages, where they go here (``dst``),
    and a digest of them over every layer (at their places among all layers) that
    each range of the asked pages adds its layers to (``digest``: made at first use,
    or by ``make``)."""

    def __init__(self, pages: tuple[int, ...], dst: list[int], dst_pool: torch.Tensor, page_size: int,
                 num_layers: int, streams: Streams) -> None:
        self.pages, self.dst = pages, dst
        self._made: PageDigest | None = None
        self._args = (dst_pool, page_size, num_layers, streams)

    @property
    def digest(self) -> PageDigest:
        if self._made is None:
            dst_pool, page_size, num_layers, streams = self._args
            self._made = _digest(dst_pool, self.dst, page_size, 0, num_layers, streams)
        return self._made

    def make(self) -> Prepared:
        self.digest  # noqa: B018 - made now, while nothing waits for it
        return self

    def discard(self) -> None:
        """Forget the digest: the next use makes a new one."""
        self._made = None


def copy_range(src: torch.Tensor, d: Descriptor, dst: list[int], dst_pool: torch.Tensor, streams: Streams,
               ready: Prepared, page_size: int, tuning: CopyTuning = DEFAULT_COPY) -> tuple[torch.Tensor, int]:
    """Queue the copy of range ``d`` from ``src`` into pages ``dst`` of ``dst_pool`` and the
    digest of what it copied (a 0-dim tensor on the device); also how many runs of
    consecutive pages it copied.

    On a GPU the copies go in groups of ``tuning.group_layers`` layers, all queued
    before any host work of the digests, and each group's digest runs on a
    stream of its own as soon as that group is copied, so digesting hides
    under the copies still running; the groups' digests add up to the
    range's (each layer is digested at its place among all layers). The
    copies go on the streams planned with them.
    """
    ps = page_size
    planned = PlannedCopy.plan(src, d.physical, dst_pool, dst, ps, d.layer_start, d.layer_end, tuning=tuning)
    if planned is None:  # CPU pools or scattered pages: the range in one go, then its digest
        copy_pages(src, d.physical, dst_pool, dst, ps, d.layer_start, d.layer_end, tuning=tuning)
        digest = ready.digest if d.pages == ready.pages else \
            _digest(dst_pool, dst, ps, d.layer_start, d.layer_end, streams)
        with streams.digesting():
            digest.add(d.layer_start, d.layer_end)
            return digest.total(d.layer_start, d.layer_end), len(page_runs(d.physical, dst))
    groups = copy_groups(d.layer_start, d.layer_end, tuning.group_layers, tuning.last_group_min_layers)
    marks = []
    for first, last in groups:
        planned.issue(first, last)  # on the copy streams chosen when planned
        marks.append(streams.mark())
    digest = ready.digest if d.pages == ready.pages else \
        _digest(dst_pool, dst, ps, d.layer_start, d.layer_end, streams)
    with streams.digesting(wait=False) as after:
        for (first, last), mark in zip(groups, marks):
            after(mark)
            digest.add(first, last)
        return digest.total(d.layer_start, d.layer_end), planned.runs


def _digest(pool: torch.Tensor, pages: Sequence[int], page_size: int, layer_start: int, layer_end: int,
            streams: Streams) -> PageDigest:
    """A digest of ``pages`` of ``pool`` over these layers, each at its place among all
    layers. Made on the digest stream, which alone uses it: memory made on a copy
    stream could be handed out again there while a digest still reads it."""
    with streams.digesting(wait=False):
        index = torch.tensor(pages, dtype=torch.int64)
        if pool.is_cuda:
            index = index.pin_memory().to(pool.device, non_blocking=True)
        return PageDigest(pool, index, page_size, layer_start, layer_end, first_layer=0)
