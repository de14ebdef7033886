"""What a KV transport is to the decode side, and the one error a fetch raises.

A transport (``KVTransport``) moves the pages of some owner ranks of one
request (a ``FetchJob``) into the decode pool, verified, and marks in the
job's ``Coverage`` each layer of each page it placed. ``KVFetcher``
(``transfer.connector.fetcher``) is its only caller; the registry
(``transfer.connector.registry``) builds each one from the daemon's
``TransportContext``. Whatever fails inside a transport leaves it as a
``KVFetchError`` carrying the gRPC status the daemon answers with; bytes a
transport could not verify are never marked placed.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import torch
from lanekv.runtime.metrics import Counter
from lanekv.runtime.status import Refusal
from lanekv.transfer.errors import CorruptChunk, RemoteError, TransferError
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.stats import RankStats

__all__ = ["RankStats"]  # each transport reports a rank it fetched as one

Code = grpc.StatusCode
# A rank's status after every try that says it (or the path to it) is down for now.
TRANSIENT = (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.RESOURCE_EXHAUSTED, Code.CANCELLED)
# Destination pages in the pool of a request's logical pages (the decode page table).
PagesFor = Callable[[Sequence[int]], list[int]]
# Frees a request's pages at the ranks of ``endpoints``: (endpoints, request_id, fingerprint,
# timeout=, epoch=) -> pages freed; raises ``KVFetchError``.
Release = Callable[..., int]


class KVFetchError(TransferError, Refusal):
    """A request's KV fetch failed; ``code`` is the status the Generate call ends with.

    It is a ``Refusal`` too, so a daemon answers it as it is.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        Refusal.__init__(self, code, message)


def fetch_error(err: TransferError, deadline: float) -> KVFetchError:
    """The fetch error of a transfer that failed with ``err``: DATA_LOSS for damaged
    chunks, UNAVAILABLE (DEADLINE_EXCEEDED once ``deadline`` passed) for a rank
    or a path that is down, ABORTED for anything else (a rank's refusal)."""
    if isinstance(err, KVFetchError):
        return err
    if isinstance(err, CorruptChunk):
        return KVFetchError(Code.DATA_LOSS, f"KV transfer: {err}")
    code = Code.ABORTED
    if isinstance(err, RemoteError) and err.code in TRANSIENT:
        code = Code.DEADLINE_EXCEEDED if time.monotonic() >= deadline else Code.UNAVAILABLE
    return KVFetchError(code, f"KV transfer: {err}")


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic``); DEADLINE_EXCEEDED once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise KVFetchError(Code.DEADLINE_EXCEEDED, "the request ran out of time before decoding")
    return left


@dataclass(frozen=True)
class FetchJob:
    """One request's KV to fetch: every layer of the pages each owner rank holds.

    ``pages`` may be any subset of the request's pages (those after a prefix the
    decode side holds already): a transport fetches and marks exactly these."""

    request_id: str
    fingerprint: str  # the layout contract both sides agreed on
    epoch: str | None  # `<epoch>:<capability>`: the prefill daemon start, the request's capability
    endpoints: tuple[str, ...]  # the KVTransfer endpoint of every prefill rank, by rank
    pages: Mapping[int, list[int]]  # owner rank -> its logical pages, in manifest order
    num_layers: int
    page_size: int
    pool: torch.Tensor  # the decode pool (``kernels.kv_layout``), where the pages go
    pages_for: PagesFor
    deadline: float  # time.monotonic() when the fetch must be done
    # Where a rank keeps a logical page (``Topology.physical_of``): once every layer
    # is written, the fast path copies from there before the rank announces.
    physical_of: Callable[[int], int] | None = None
    # Whether every layer is written: waits up to the seconds given for the prefill's
    # answer; True once it came, False if the prefill failed, None while it runs.
    # None (no callable): every layer is written already.
    written: Callable[[float], bool | None] | None = None
    # A tensor-parallel decode rank's KV heads of each row, (first, count); None: whole
    # rows. The pool holds only these (every transport serves a head range; NIXL through
    # the prefill rank's staging region).
    heads: tuple[int, int] | None = None
    # Each rank's sender relays (``transfer.rank.relay``), by rank; () or an empty
    # entry: none (an older prefill), its streams go to the rank's endpoint.
    relays: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {name}={getattr(self, name)}")
        outside = [rank for rank in self.pages if not 0 <= rank < len(self.endpoints)]
        if outside:
            raise ValueError(f"pages: owner ranks {outside} have no endpoint among {len(self.endpoints)}")


class Route(NamedTuple):
    """How a transport reaches a rank: the path's name, and what it holds for it (the
    rank's pool mapped here, for the fast path)."""

    path: str  # "grpc", "shm" or "cuda_ipc"
    source: torch.Tensor | None = None


class FetchOutcome(NamedTuple):
    """What a transport's fetch did."""

    per_rank: dict[int, RankStats]  # the ranks it fetched
    retries: int = 0
    again: tuple[int, ...] = ()  # ranks whose bytes did not verify: to fetch over another transport


class Coverage:
    """The layers placed of each page of a job, one bit each (placed by several threads)."""

    def __init__(self, pages: Mapping[int, Sequence[int]], num_layers: int) -> None:
        self._layers_of = {page: 0 for owned in pages.values() for page in owned}
        self._whole = (1 << num_layers) - 1
        self._lock = threading.Lock()

    def placed(self, pages: Sequence[int], layer_start: int, layer_end: int) -> None:
        # A retry never places a layer twice, and if it did, the bytes would be the same verified ones.
        bits = (1 << layer_end) - (1 << layer_start)
        with self._lock:
            for page in pages:
                self._layers_of[page] |= bits

    def missing(self) -> list[int]:
        """The pages that lack a layer."""
        with self._lock:
            return [page for page, layers in self._layers_of.items() if layers != self._whole]


class TransportFetch(ABC):
    """One transport's fetch of some ranks of a job, begun by ``KVTransport.start``."""

    @abstractmethod
    def wait(self) -> FetchOutcome:
        """Wait until every rank is fetched, placed and marked in the coverage.

        Raises ``KVFetchError`` (the first failure; the others are dropped).
        A rank whose bytes arrived but did not verify is not an error: it is
        in ``FetchOutcome.again``, and none of its pages is marked placed.
        """

    @abstractmethod
    def stop(self) -> None:
        """End what still runs (another part of the fetch failed) and wait for the writes
        into the pool under way: the caller frees the pages after it. Never raises;
        after ``wait`` it does nothing."""


@dataclass(frozen=True)
class TransportContext:
    """What every transport of one decode daemon is built from (``KVTransport.from_context``)."""

    kv: KVClient  # the daemon's channels to the prefill ranks (its handshakes go over them too)
    agreement: Agreement  # the layout this side holds its pool in
    failures: Counter | None = None  # failures by cause (label ``cause``)
    max_inflight_bytes: int = 256 << 20  # received but not yet placed, per request (gRPC)
    max_chunk_bytes: int = 0  # largest chunk asked of a rank; 0: the rank's default (gRPC)
    streams_per_rank: int = 1  # gRPC streams from each owner rank (transfer.grpcfetch.layerwise)


class KVTransport(ABC):
    """A way to move ranks' pages into the decode pool (one instance serves every request).

    ``reaches_every_rank``: ``claim`` never leaves a rank out, so the transport can be
    the last of a fetcher's list (which fetches what the others did not).
    """

    reaches_every_rank = False

    @classmethod
    @abstractmethod
    def from_context(cls, ctx: TransportContext) -> KVTransport:
        """Build it for a daemon. Raises ``ValueError`` naming a bad setting."""

    @abstractmethod
    def claim(self, job: FetchJob, ranks: Sequence[int]) -> dict[int, Route]:
        """The ranks of ``ranks`` this transport fetches for ``job``, with their routes.

        A rank it cannot reach is left out, never an error: the fetcher sends it
        by another transport. Raises ``KVFetchError`` (DEADLINE_EXCEEDED) only
        when the job's time is up.
        """

    @abstractmethod
    def start(self, job: FetchJob, routes: Mapping[int, Route], coverage: Coverage) -> TransportFetch:
        """Begin fetching the ranks of ``routes`` (from ``claim``) into ``job.pool``.

        It may begin in threads of its own and return at once, or leave the work
        to ``TransportFetch.wait`` in the caller's thread: the fetcher starts every
        transport of a job before it waits for any, and waits for them last
        first (the one that reaches every rank, whose work may run in ``wait``,
        before those that run in threads of their own). Raises ``KVFetchError``
        only for a job it cannot begin.
        """
