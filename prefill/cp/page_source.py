"""A prefill rank's pages as the transfer service sees them.

The rank's own pool (on its GPU, or the CPU) behind the ``PageSource`` the
KVTransfer server reads. Reads copy pages in wire order with the
``gather_pages`` kernel, then to the host. On a GPU they run on a stream of
their own, after the event of the last layer they read: the prefill that
writes later layers keeps the default stream, and a read never waits for it
(layer-wise streaming, ``transfer.rank.progress``). Nor may it allocate: a new
pinned host block or device segment is an implicit synchronization of the whole
device, so a read that allocates waits for every layer the prefill has queued
(measured on an H200: a first read of layer 0 returned only after 2 s of work
queued behind it), and so is the first launch of a kernel (its module loads). The
source therefore fills torch's host and device caches with the blocks reads take,
and runs its reads once, before it serves any (``_warm_caches``). A release by the decode side is
reported to the parent process (``on_release``), which owns the allocator and
the leases; an expired lease makes the rank ``forget`` the request.

On a GPU the read path's kernels are compiled and loaded when the source is
made, before any prefill runs: loading a CUDA module (Triton's first launch of
a kernel, or of a new specialization of it) may wait for the whole context,
so a first read during a prefill would wait for all the prefill's queued
layers, not only its own (and Triton's compile takes seconds).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from lanekv.kernels.page_copy import gather_pages
from lanekv.runtime.status import DEFAULT_CHUNK_BYTES
from lanekv.transfer.protocol.contract import Agreement
from lanekv.transfer.rank.sources import TensorPageSource


class RankPageSource(TensorPageSource):
    def __init__(
        self,
        agreement: Agreement,
        rank: int,
        pool: torch.Tensor,
        on_release: Callable[[str, list[int]], None],
        shared_path: Path | None = None,
    ) -> None:
        super().__init__(agreement, rank, pool, shared_path=shared_path)
        self._page_size = agreement.page_size
        self._on_release = on_release
        self._stream = torch.cuda.Stream(pool.device) if pool.is_cuda else None
        if self._stream is not None:
            self._warm_caches()

    # Reads in flight at once on one rank (several fetch streams, several decode daemons).
    WARM_READS = 4
    # The smallest host block warmed: torch's host cache rounds each request up to a power of two.
    WARM_MIN_BYTES = 512

    def _warm_caches(self, largest: int = 2 * DEFAULT_CHUNK_BYTES) -> None:
        """Leave in torch's caches the pinned host blocks (every power of two from
        ``WARM_MIN_BYTES`` to ``largest``, ``WARM_READS`` of each) and the device memory
        on the read stream that reads take, so that no read allocates while a prefill runs."""
        with torch.cuda.stream(self._stream):
            device = [torch.empty(largest, dtype=torch.uint8, device=self.pool.device)
                      for _ in range(self.WARM_READS)]
            small = torch.empty(1024, dtype=torch.int64, device=self.pool.device)
        size, host = self.WARM_MIN_BYTES, []
        while size <= largest:
            host.extend(torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(self.WARM_READS))
            size *= 2
        self._stream.synchronize()
        del device, small, host  # back to the caches, for this stream and the host
        # Every specialization a read can launch: gather_pages' buffer strides are specialized
        # on divisibility by 16, which depends on the page count mod 16 only; one layer and all.
        layers, num_pages = self.pool.shape[0], self.pool.shape[2] // self._page_size
        for end in sorted({1, layers}):
            for count in range(1, min(16, num_pages) + 1):
                self.read(range(count), 0, end)
            for count in sorted({1, min(16, num_pages)}):
                self.fresh_digest(range(count), 0, end)
        self._stream.synchronize()

    @contextlib.contextmanager
    def _on_stream(self, after: Any) -> Iterator[None]:
        """Work inside runs on the read stream, after the event of the layers it reads."""
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            yield

    def read(self, physical_pages: Sequence[int], layer_start: int, layer_end: int,
             after: Any = None) -> torch.Tensor:
        if self._stream is None:
            return super().read(physical_pages, layer_start, layer_end, after)
        with self._on_stream(after):
            pages = torch.as_tensor(list(physical_pages), dtype=torch.int64).to(self.pool.device, non_blocking=True)
            out = gather_pages(self.pool, pages, self._page_size, layer_start, layer_end)
            # Pinned (and reused by torch's host cache): a device-to-host copy several times faster.
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            self._stream.synchronize()
            return host

    def fresh_digest(self, physical_pages: Sequence[int], layer_start: int, layer_end: int,
                     after: Any = None, *, heads: slice | None = None) -> int:
        if self._stream is None:
            return super().fresh_digest(physical_pages, layer_start, layer_end, after, heads=heads)
        with self._on_stream(after):
            return super().fresh_digest(physical_pages, layer_start, layer_end, heads=heads)

    def release(self, request_id: str) -> int:
        logical = [page for page, _ in self.pages_of(request_id)]
        freed = super().release(request_id)  # KeyError if a concurrent release won
        self._on_release(request_id, logical)
        return freed

    def forget(self, request_id: str) -> None:
        """The lease expired: the parent already freed the pages; stop serving them."""
        try:
            super().release(request_id)
        except KeyError:
            pass  # released by the decode side in the meantime
