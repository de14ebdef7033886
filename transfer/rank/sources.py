"""Page sources of the KVTransfer service: the ``PageSource`` protocol and its implementations.

``TensorPageSource`` serves the pages of one pool tensor (a prefill rank's,
through ``prefill.cp.page_source.RankPageSource``, or a test's); each request
it holds has a ``LayerProgress`` so FetchKV can send layers as they are
written. ``ContractOnlySource`` holds no pages: a daemon's own port answers
Handshake with it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from lanekv.kernels.page_digest import PageDigest, head_slice_digest, page_digest
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.chunkseal import U64, seal, seal_tensor
from lanekv.transfer.protocol.contract import LayoutContract, Topology
from lanekv.transfer.protocol.descriptors import PoolHandle, as_u64, share_pool
from lanekv.transfer.protocol.wire import kv_dtype
from lanekv.transfer.rank.progress import LayerProgress

_U64 = (1 << 64) - 1
_GAVE_UP = object()  # a request whose digests are not taken as written (see digest_written)
log = logging.getLogger("lanekv.transfer")


class PageSource(Protocol):
    """What a prefill rank exposes to the transfer service."""

    @property
    def rank(self) -> int: ...

    def contract(self) -> LayoutContract: ...

    def pages_of(self, request_id: str) -> list[tuple[int, int]]:
        """(logical page, physical page) pairs of the request owned by this rank.

        KeyError for an unknown request; its message says 'released' for a
        request that was released.
        """
        ...

    def ready(self, request_id: str, layer_end: int, timeout_s: float,
              alive: Callable[[], bool], *, exact: bool = False) -> tuple[int, Any]:
        """Block until the request's layers ``< layer_end`` are written (layer-wise
        streaming); how many are written by then, and a token for ``read``'s
        ``after`` that covers them all (``exact``: only the layers ``< layer_end``,
        ``LayerProgress.wait``). KeyError as for ``pages_of``,
        ``PrefillFailed`` or ``TimeoutError`` when they will not be."""
        ...

    def read(self, physical_pages: Sequence[int], layer_start: int, layer_end: int,
             after: Any = None) -> torch.Tensor:
        """CPU tensor ``[layer_end - layer_start, kv_planes, len(physical_pages) * page_size, kv_heads, head_dim]``."""
        ...

    def read_into(self, physical_pages: Sequence[int], layer_start: int, layer_end: int, after: Any,
                  out: torch.Tensor) -> int:
        """``read`` into ``out``, a contiguous CPU tensor of ``read``'s shape and dtype (a staged
        relay's slot: ``transfer.rank.staging``); returns once the bytes are there, with the
        chunk seal (``protocol.chunkseal``) of the bytes read, taken where they were read."""
        ...

    def digest(self, physical_pages: Sequence[int], layer_start: int, layer_end: int, after: Any = None,
               *, request_id: str | None = None, heads: slice | None = None) -> int:
        """The digest of a descriptor of these pages of ``request_id``: ``page_digest`` of the pages'
        layers, each at its place among all layers (``first_layer=0``), computed where the pool is.
        ``heads``: only these KV heads of each row (a TP decode rank's), as if the pool held no others."""
        ...

    def share(self, transports: Sequence[str]) -> PoolHandle:
        """A handle to the pool for the same-host fast path; ValueError naming why not."""
        ...

    def release(self, request_id: str) -> int:
        """Free the request's pages; return how many. KeyError as for ``pages_of``."""
        ...

    def admits(self, request_id: str, capability: str | None) -> bool:
        """Whether ``capability`` is the one the request was pinned with (True for a
        request pinned without one, and for an id this source does not hold)."""
        ...


class ContractOnlySource:
    """A ``PageSource`` that answers Handshake and holds no pages (a daemon's own
    port: the prefill parent, the decode daemon); FetchKV and Release are NOT_FOUND."""

    rank = 0

    def __init__(self, contract: LayoutContract, why: str) -> None:
        self._contract = contract
        self._why = why

    def contract(self) -> LayoutContract:
        return self._contract

    def pages_of(self, request_id: str) -> list[tuple[int, int]]:
        raise KeyError(self._why)

    def ready(self, request_id: str, layer_end: int, timeout_s: float,
              alive: Callable[[], bool], *, exact: bool = False) -> tuple[int, Any]:
        raise KeyError(self._why)

    def read(self, physical_pages: Sequence[int], layer_start: int, layer_end: int,
             after: Any = None) -> torch.Tensor:
        raise KeyError(self._why)

    def read_into(self, physical_pages: Sequence[int], layer_start: int, layer_end: int, after: Any,
                  out: torch.Tensor) -> int:
        raise KeyError(self._why)

    def digest(self, physical_pages: Sequence[int], layer_start: int, layer_end: int, after: Any = None,
               *, request_id: str | None = None, heads: slice | None = None) -> int:
        raise KeyError(self._why)

    def share(self, transports: Sequence[str]) -> PoolHandle:
        raise ValueError(self._why)

    def release(self, request_id: str) -> int:
        raise KeyError(self._why)

    def admits(self, request_id: str, capability: str | None) -> bool:
        return True  # it holds nothing: pages_of answers NOT_FOUND


class TensorPageSource:
    """An in-memory ``PageSource`` over one pool tensor ``[num_layers, kv_planes, num_pages * page_size, kv_heads, head_dim]``."""

    # Released ids remembered so that a late fetch hears 'released', not 'unknown'.
    RELEASED_MEMORY = 4096
    # A request with at least this many pages here is digested as its layers are
    # written (``digest_written``): one launch per layer; fewer are digested at fetch time.
    DIGEST_AT_WRITE_MIN_PAGES = 16

    def __init__(
        self, agreement: Agreement, rank: int, pool: torch.Tensor, topology: Topology | None = None,
        shared_path: Path | None = None,
    ) -> None:
        rows = pool.shape[2] if pool.dim() == 5 else -1
        expected = (agreement.num_layers, agreement.kv_planes, rows, agreement.num_kv_heads,
                    agreement.head_dim)
        if pool.dim() != 5 or tuple(pool.shape) != expected or rows % agreement.page_size:
            raise ValueError(
                f"pool must be [num_layers, kv_planes, num_pages * page_size, kv_heads, head_dim] = {expected}, got {tuple(pool.shape)}"
            )
        if pool.dtype != kv_dtype(agreement.kv_dtype):
            raise ValueError(f"pool dtype is {pool.dtype}, the agreement says {agreement.kv_dtype}")
        self._agreement = agreement
        self._rank = rank
        self._pool = pool
        self._num_pages = rows // agreement.page_size
        self._topology = topology
        self._shared_path = shared_path  # the /dev/shm file of a CPU pool made by fastpath.shared_cpu_pool
        self._requests: dict[str, list[tuple[int, int]]] = {}
        self._progress: dict[str, LayerProgress] = {}
        self._written: dict[str, Any] = {}  # digests taken as layers were written (_Written, or _GAVE_UP)
        self._capabilities: dict[str, bytes] = {}  # request id -> sha256 of its capability
        self._released: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def pool(self) -> torch.Tensor:
        """``[num_layers, kv_planes, num_pages * page_size, kv_heads, head_dim]``, for subclasses' reads."""
        return self._pool

    def set_topology(self, topology: Topology) -> None:
        with self._lock:
            self._topology = topology

    def contract(self) -> LayoutContract:
        with self._lock:
            if self._topology is None:
                raise RuntimeError(f"rank {self._rank}: topology not set yet")
            return LayoutContract(self._agreement, self._topology)

    def add(self, request_id: str, pages: Sequence[tuple[int, int]], progress: LayerProgress | None = None,
            capability: str | None = None) -> None:
        """Pin (logical page, physical page) pairs of a request on this rank.

        ``progress`` tracks a prefill that is still writing them (FetchKV sends
        each layer once it is written); None: every layer is written already.
        ``capability``: the secret FetchKV and Release must then present
        (``admits``); only its digest is kept.
        """
        pages = [(int(logical), int(physical)) for logical, physical in pages]
        for logical, physical in pages:
            if not 0 <= physical < self._num_pages or logical < 0:
                raise ValueError(
                    f"page ({logical}, {physical}) is outside a pool of {self._num_pages} pages"
                )
        if len({p for p, _ in pages}) != len(pages) or len({p for _, p in pages}) != len(pages):
            raise ValueError(f"request {request_id!r} lists a logical or physical page twice")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already held")
            self._requests[request_id] = pages
            self._progress[request_id] = progress or LayerProgress.done(self._agreement.num_layers)
            if capability is not None:
                self._capabilities[request_id] = _digest(capability)
            self._released.pop(request_id, None)

    def pages_of(self, request_id: str) -> list[tuple[int, int]]:
        with self._lock:
            return list(self._lookup(request_id))

    def admits(self, request_id: str, capability: str | None) -> bool:
        with self._lock:
            expected = self._capabilities.get(request_id)
        if expected is None:
            return True
        return hmac.compare_digest(_digest(capability or ""), expected)

    def ready(self, request_id: str, layer_end: int, timeout_s: float,
              alive: Callable[[], bool], *, exact: bool = False) -> tuple[int, Any]:
        with self._lock:
            self._lookup(request_id)
            progress = self._progress[request_id]
        return progress.wait(layer_end, timeout_s, alive, exact=exact)

    def digest_written(self, request_ids: Sequence[str], layer: int) -> None:
        """Queue the digest of ``layer`` of each request's pages here, and its copy to
        the host (on the current stream: call it where the layer's store was queued,
        before the layer's event).

        Requests with fewer than ``DIGEST_AT_WRITE_MIN_PAGES`` pages here are
        left to ``digest``. A fetch of a finished prefill then seals with a sum
        on the host: on two H200s any GPU work of the rank at fetch time (its
        digest, even the sum of these) waited for, or slowed, the decode
        daemon's copies on the same GPU, since two processes' work on one GPU
        takes turns (the seal came milliseconds after the announcement). A failure
        here (no memory for the digest buffer, a layer out of order) is logged and
        leaves the request to ``digest``: it never fails the prefill.
        """
        for rid in request_ids:
            with self._lock:
                pages, written = self._requests.get(rid), self._written.get(rid)
            if pages is None or len(pages) < self.DIGEST_AT_WRITE_MIN_PAGES or written is _GAVE_UP:
                continue
            try:
                if written is None:
                    written = _Written(tuple(p for _, p in pages), self._pool, self._agreement)
                written.add(rid, layer)
            except (RuntimeError, ValueError) as err:
                # Only a saving: the prefill goes on and fetches digest at fetch time.
                log.warning("rank %d: digests of request %r not taken as written (%s); "
                            "they are taken when fetched", self._rank, rid, err)
                written = _GAVE_UP
            with self._lock:
                if rid in self._requests:
                    self._written[rid] = written

    def digest(self, physical_pages: Sequence[int], layer_start: int, layer_end: int, after: Any = None,
               *, request_id: str | None = None, heads: slice | None = None) -> int:
        """The descriptor digest of these pages' layers (each at its place among all
        layers: ``page_digest(..., first_layer=0)``); from ``digest_written`` when
        that took the request's pages in this order and these layers (whole rows only:
        a head range, ``heads``, is digested now)."""
        known = None if heads is not None else \
            self.written_digest(physical_pages, layer_start, layer_end, after, request_id)
        return self.fresh_digest(physical_pages, layer_start, layer_end, after, heads=heads) \
            if known is None else known

    def fresh_digest(self, physical_pages: Sequence[int], layer_start: int, layer_end: int,
                     after: Any = None, *, heads: slice | None = None) -> int:
        """``digest`` taken now from the pool (on the current stream; ``after``, the layers'
        event, matters to sources that read on a stream of their own)."""
        pages = torch.as_tensor(list(physical_pages), dtype=torch.int64).to(self._pool.device)
        if heads is not None and (heads.start, heads.stop) != (0, self._pool.shape[3]):
            return head_slice_digest(self._pool, pages, self._agreement.page_size, layer_start, layer_end, heads)
        return as_u64(page_digest(self._pool, pages, self._agreement.page_size, layer_start, layer_end,
                                  first_layer=0))

    def written_digest(self, physical_pages: Sequence[int], layer_start: int, layer_end: int, after: Any,
                       request_id: str | None) -> int | None:
        """``digest`` from the digests ``digest_written`` took, without GPU work; None
        where it took none of these (waits for ``after``, the event of the layers)."""
        with self._lock:
            written = self._written.get(request_id) if request_id is not None else None
        if written is None or written is _GAVE_UP or layer_end > written.layers \
                or written.physical != tuple(physical_pages):
            return None
        if after is not None:
            after.synchronize()  # the layers' digests reached the host before their event
        return sum(written.host[layer_start:layer_end].tolist()) & _U64

    def share(self, transports: Sequence[str]) -> PoolHandle:
        return share_pool(self._pool, self._shared_path, transports)

    def read(self, physical_pages: Sequence[int], layer_start: int, layer_end: int,
             after: Any = None) -> torch.Tensor:
        layers = self._pool[layer_start:layer_end]
        num_layers, planes, _, kv_heads, head_dim = layers.shape
        # Index whole pages, not rows: one block of page_size * kv_heads * head_dim
        # per page is ~6x faster on CPU. [num_layers, planes, num_pages, page_size * kv_heads * head_dim]
        blocks = layers.reshape(num_layers, planes, self._num_pages, -1)
        picked = blocks.index_select(2, torch.as_tensor(list(physical_pages), dtype=torch.long))
        return picked.view(num_layers, planes, -1, kv_heads, head_dim)

    def read_into(self, physical_pages: Sequence[int], layer_start: int, layer_end: int, after: Any,
                  out: torch.Tensor) -> int:
        if self._pool.is_cuda:  # a subclass reads on streams of its own (RankPageSource)
            gathered = self.read(physical_pages, layer_start, layer_end, after)
            sealed = seal_tensor(gathered)
            out.copy_(gathered)
            return int(sealed.item()) & U64
        layers = self._pool[layer_start:layer_end]
        blocks = layers.reshape(layers.shape[0], layers.shape[1], self._num_pages, -1)  # as in read
        index = torch.as_tensor(list(physical_pages), dtype=torch.long)
        torch.index_select(blocks, 2, index, out=out.view(blocks.shape[0], blocks.shape[1], len(index), -1))
        return seal(out)  # of the slot's bytes as this rank wrote them, before any relay sees them

    def release(self, request_id: str) -> int:
        with self._lock:
            pages = self._lookup(request_id)
            del self._requests[request_id]
            self._written.pop(request_id, None)
            self._capabilities.pop(request_id, None)
            # One progress serves every request of a prefill batch: releasing this one must
            # not fail the others, so its waiters are only woken (their alive() now says no).
            self._progress.pop(request_id).wake()
            self._released[request_id] = None
            while len(self._released) > self.RELEASED_MEMORY:
                self._released.popitem(last=False)
            return len(pages)

    def _lookup(self, request_id: str) -> list[tuple[int, int]]:
        if request_id in self._requests:
            return self._requests[request_id]
        if request_id in self._released:
            raise KeyError("released")
        raise KeyError("unknown request")


def _digest(capability: str) -> bytes:
    return hashlib.sha256(capability.encode("utf-8", "surrogateescape")).digest()


class _Written:
    """A request's digests taken as its layers were written: of ``physical`` in this order,
    layers ``[0, layers)``, each at its place among all layers; ``host`` holds each
    layer's digest once the layer's event has completed."""

    def __init__(self, physical: tuple[int, ...], pool: torch.Tensor, agreement: Agreement) -> None:
        index = torch.as_tensor(physical, dtype=torch.int64).to(pool.device)
        self.physical, self.layers = physical, 0
        self.digest = PageDigest(pool, index, agreement.page_size, 0, agreement.num_layers, first_layer=0)
        self.host = torch.zeros(agreement.num_layers, dtype=torch.int64, pin_memory=pool.is_cuda)

    def add(self, request_id: str, layer: int) -> None:
        if layer != self.layers:
            raise ValueError(f"request {request_id!r}: layer {layer} digested after {self.layers}: layers go in order")
        self.digest.add(layer, layer + 1)
        self.host[layer].copy_(self.digest.total(layer, layer + 1), non_blocking=True)
        self.layers = layer + 1
