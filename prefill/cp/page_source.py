"""A prefill rank's pages as the transfer service sees them.

The rank's own pool (on its GPU, or the CPU) behind the ``PageSource`` the
KVTransfer server reads. Reads copy pages in wire order with the
``gather_pages`` kernel, then to the host. On a GPU they run on streams of
their own, after the event of the last layer they read: the prefill that
writes later layers keeps the default stream, and a read never waits for it
(layer-wise streaming, ``transfer.rank.progress``). Each read in flight takes
one of ``READ_STREAMS`` streams to itself: on one shared stream a read of a
written layer would queue behind another fetch stream's read that waits for a
later layer, and each read's ``synchronize`` would wait for every read queued
before it. Nor may a read allocate: a new
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
import queue
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from lanekv.kernels.page_copy import gather_pages
from lanekv.runtime.status import DEFAULT_CHUNK_BYTES
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.chunkseal import U64, seal_tensor
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
        # The read streams not in use (a read takes one for itself: module docstring).
        self._streams: queue.SimpleQueue[torch.cuda.Stream] | None = None
        if pool.is_cuda:
            self._streams = queue.SimpleQueue()
            for _ in range(self.READ_STREAMS):
                self._streams.put(torch.cuda.Stream(pool.device))
            self._warm_caches()

    # Reads in flight at once on one rank (several fetch streams, several decode daemons);
    # a further read waits for a stream to come free.
    READ_STREAMS = 8
    # Pinned host blocks of each size warmed: each read's block lives on until its chunks
    # are framed, while the stream that read it takes the next.
    WARM_HOST_BLOCKS = 2 * READ_STREAMS
    # The smallest host block warmed: torch's host cache rounds each request up to a power of two.
    WARM_MIN_BYTES = 512

    def _warm_caches(self, largest: int = 2 * DEFAULT_CHUNK_BYTES) -> None:
        """Leave in torch's caches the pinned host blocks (every power of two from
        ``WARM_MIN_BYTES`` to ``largest``, ``WARM_HOST_BLOCKS`` of each) and, on every read
        stream, the device memory a read takes (the device cache keeps blocks per stream),
        so that no read allocates while a prefill runs."""
        streams = [self._streams.get() for _ in range(self.READ_STREAMS)]
        device = []
        for stream in streams:
            with torch.cuda.stream(stream):
                device.append(torch.empty(largest, dtype=torch.uint8, device=self.pool.device))
                device.append(torch.empty(1024, dtype=torch.int64, device=self.pool.device))
        size, host = self.WARM_MIN_BYTES, []
        while size <= largest:
            host.extend(torch.empty(size, dtype=torch.uint8, pin_memory=True)
                        for _ in range(self.WARM_HOST_BLOCKS))
            size *= 2
        torch.cuda.synchronize(self.pool.device)
        del device, host  # back to the caches, for each stream and the host
        for stream in streams:
            self._streams.put(stream)
        # Every specialization a read can launch: gather_pages' buffer strides are specialized
        # on divisibility by 16, which depends on the page count mod 16 only; one layer and all.
        layers, num_pages = self.pool.shape[0], self.pool.shape[2] // self._page_size
        for end in sorted({1, layers}):
            for count in range(1, min(16, num_pages) + 1):
                self.read(range(count), 0, end)
            for count in sorted({1, min(16, num_pages)}):
                self.fresh_digest(range(count), 0, end)
        torch.cuda.synchronize(self.pool.device)

    @contextlib.contextmanager
    def _on_stream(self, after: Any) -> Iterator[torch.cuda.Stream]:
        """Work inside runs on a read stream of its own, after the event of the layers it
        reads; the stream goes back to the free ones when the work is done."""
        stream = self._streams.get()
        try:
            with torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after)
                yield stream
        finally:
            self._streams.put(stream)

    def read(self, physical_pages: Sequence[int], layer_start: int, layer_end: int,
             after: Any = None) -> torch.Tensor:
        if self._streams is None:
            return super().read(physical_pages, layer_start, layer_end, after)
        with self._on_stream(after) as stream:
            pages = torch.as_tensor(list(physical_pages), dtype=torch.int64).to(self.pool.device, non_blocking=True)
            out = gather_pages(self.pool, pages, self._page_size, layer_start, layer_end)
            # Pinned (and reused by torch's host cache): a device-to-host copy several times faster.
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            stream.synchronize()  # this read's work only: the stream is its own
            return host

    def read_into(self, physical_pages: Sequence[int], layer_start: int, layer_end: int, after: Any,
                  out: torch.Tensor) -> int:
        """``read`` into ``out`` (a staged relay's slot, page-locked by ``cudaHostRegister``): the
        gather on a read stream of its own, its chunk seal there (a few microseconds of the GPU's,
        none of the relay's CPU), then one device-to-host DMA straight into the slot."""
        if self._streams is None:
            return super().read_into(physical_pages, layer_start, layer_end, after, out)
        with self._on_stream(after) as stream:
            pages = torch.as_tensor(list(physical_pages), dtype=torch.int64).to(self.pool.device, non_blocking=True)
            gathered = gather_pages(self.pool, pages, self._page_size, layer_start, layer_end)
            sealed = seal_tensor(gathered)
            out.copy_(gathered, non_blocking=True)
            stream.synchronize()  # this read's work only: the stream is its own
            return int(sealed.item()) & U64  # done on this stream already: no wait

    def fresh_digest(self, physical_pages: Sequence[int], layer_start: int, layer_end: int,
                     after: Any = None, *, heads: slice | None = None) -> int:
        if self._streams is None:
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
