"""Transports behind one factory (``transfer.connector.registry``) and a fetcher over a list.

``make_fetcher`` builds the named transports from one ``TransportContext``
and refuses an unknown, repeated or unfit list; a ``KVFetcher`` offers each
rank to its transports in order (a third transport before the fast path takes
its ranks first), and a rank whose bytes did not verify is fetched again by
the last transport, which reaches every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import torch
from lanekv.runtime.metrics import Registry
from lanekv.runtime.rpc_metrics import lanekv_metrics
from lanekv.transfer.connector.base import (
    Coverage,
    FetchJob,
    FetchOutcome,
    KVTransport,
    Route,
    TransportContext,
    TransportFetch,
)
from lanekv.transfer.connector.fastpath import FastPathTransport
from lanekv.transfer.connector.fetcher import KVFetcher
from lanekv.transfer.connector.grpc import GrpcTransport
from lanekv.transfer.connector.registry import TRANSPORTS, make_fetcher
from lanekv.transfer.fastpath.client import FastPath
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.protocol.descriptors import SHM

from tests.reliability.kv_cluster import LAYERS, PAGE, make_agreement, rows_of
from tests.transfer.connector.test_fetcher import PAGES, SLOT, _assert_fetched, _job, rank  # noqa: F401 - the fixture


class _Relay(KVTransport):
    """A stand-in third transport: claims every rank as ``path`` and moves the pages over
    ``inner``; ``send_back``: reports them unverified instead (nothing placed)."""

    def __init__(self, inner: KVTransport, path: str, send_back: bool = False) -> None:
        self.inner, self.path, self.send_back, self.started = inner, path, send_back, []

    @classmethod
    def from_context(cls, ctx: TransportContext) -> _Relay:
        return cls(GrpcTransport.from_context(ctx), "relay")

    def claim(self, job: FetchJob, ranks: Sequence[int]) -> dict[int, Route]:
        return {r: Route(self.path) for r in ranks}

    def start(self, job: FetchJob, routes: Mapping[int, Route], coverage: Coverage) -> TransportFetch:
        self.started.append(sorted(routes))
        if self.send_back:
            return _SentBack(tuple(sorted(routes)))
        return self.inner.start(job, self.inner.claim(job, list(routes)), coverage)


class _SentBack(TransportFetch):
    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks

    def wait(self) -> FetchOutcome:
        return FetchOutcome({}, 0, self.ranks)

    def stop(self) -> None:
        pass


def _context(kv: KVClient, agreement=None) -> TransportContext:
    return TransportContext(kv, agreement or make_agreement(kv_dtype="float16"), lanekv_metrics(Registry()).failures)


def test_the_registry_names_the_transports_in_order_of_preference_grpc_last():
    assert list(TRANSPORTS) == ["fastpath", "nixl", "grpc"]
    assert TRANSPORTS["grpc"].reaches_every_rank
    assert not TRANSPORTS["fastpath"].reaches_every_rank and not TRANSPORTS["nixl"].reaches_every_rank
    with pytest.raises(TypeError):
        TRANSPORTS["mooncake"] = GrpcTransport  # the registry is read-only: one line in the module adds one


def test_make_fetcher_builds_each_named_transport_from_one_context():
    kv = KVClient()
    try:
        fetcher = make_fetcher(["fastpath", "grpc"], _context(kv))
        assert isinstance(fetcher.transport("fastpath"), FastPathTransport)
        assert isinstance(fetcher.transport("grpc"), GrpcTransport)
        assert fetcher.transport("nixl") is None
        assert make_fetcher(["grpc"], _context(kv)).transport("fastpath") is None
    finally:
        kv.close()


@pytest.mark.parametrize("names, words", [
    (["mooncake", "grpc"], "unknown \\['mooncake'\\]"),
    (["grpc", "grpc"], "repeats"),
    (["grpc", "fastpath"], "must end with 'grpc'"),
    ([], "must end with 'grpc'"),
])
def test_make_fetcher_refuses_a_bad_list_naming_it(names, words):
    kv = KVClient()
    try:
        with pytest.raises(ValueError, match=words):
            make_fetcher(names, _context(kv))
    finally:
        kv.close()


def test_a_fetcher_needs_a_last_transport_that_reaches_every_rank():
    kv = KVClient()
    try:
        fast = FastPathTransport.from_context(_context(kv))
        with pytest.raises(ValueError, match="last transport must reach every rank.*FastPathTransport"):
            KVFetcher([fast], lambda *a, **k: 0)
        with pytest.raises(ValueError, match="at least one"):
            KVFetcher([], lambda *a, **k: 0)
    finally:
        kv.close()


def test_a_third_transport_first_in_the_list_takes_its_ranks(rank):  # noqa: F811 - the fixture
    _, _, _, agreement, kv = rank
    ctx = _context(kv, agreement)
    grpc_transport = GrpcTransport.from_context(ctx)
    relay = _Relay(grpc_transport, "relay")
    fetcher = KVFetcher([relay, FastPathTransport(ctx_fastpath(ctx)), grpc_transport], grpc_transport.release)
    job, dst = _job(rank)
    fetched = fetcher.fetch(job)
    assert fetched.paths == {0: "relay"} and relay.started == [[0]]
    assert fetched.stats.per_rank[0].bytes == fetched.stats.bytes > 0
    _assert_fetched(rank, dst)


def test_ranks_a_transport_sends_back_are_fetched_again_by_the_last(rank):  # noqa: F811 - the fixture
    _, _, _, agreement, kv = rank
    grpc_transport = GrpcTransport.from_context(_context(kv, agreement))
    relay = _Relay(grpc_transport, "relay", send_back=True)
    fetcher = KVFetcher([relay, grpc_transport], grpc_transport.release)
    job, dst = _job(rank)
    fetched = fetcher.fetch(job)
    assert fetched.paths == {0: "grpc"} and fetched.stats.retries == 1
    _assert_fetched(rank, dst)


def ctx_fastpath(ctx: TransportContext) -> FastPath:
    """A fast path over ``ctx`` that maps /dev/shm pools only (the rank's kind here)."""
    return FastPath(ctx.kv, ctx.agreement, transports=[SHM])


def test_a_job_may_name_a_subset_of_the_pages(rank):  # noqa: F811 - the fixture
    """A delta fetch (the pages after a prefix the decode side holds): only those move."""
    pool = rank[1]
    fetcher = make_fetcher(["grpc"], _context(rank[4], rank[3]))
    job, dst = _job(rank)
    (first, _), rest = PAGES[0], PAGES[1:]
    delta = FetchJob(job.request_id, job.fingerprint, None, job.endpoints, {0: [p for p, _ in rest]},
                     job.num_layers, job.page_size, job.pool, job.pages_for, job.deadline)
    fetched = fetcher.fetch(delta)
    assert fetched.stats.bytes == len(rest) * LAYERS * 2 * PAGE * 2 * 8 * 2
    assert torch.equal(dst[:, :, rows_of([SLOT[p] for p, _ in rest])], pool[:, :, rows_of([q for _, q in rest])])
    assert torch.all(dst[:, :, rows_of([SLOT[first]])] == -1.0)  # the page of the prefix is not touched
