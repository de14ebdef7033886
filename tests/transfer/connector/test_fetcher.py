"""``KVFetcher`` against one in-process rank on CPU: the transport it picks, its fallback
from the fast path to gRPC, and its one error type.

A rank whose pool the fast path reaches is copied in place ("shm"); one that
refuses the attach, and one whose copy fails its digest, are fetched over
gRPC; when gRPC fails too, or a rank is down, the fetch raises one
``KVFetchError`` (a ``TransferError``) with the status the daemon answers with.
"""

from __future__ import annotations

import time

import grpc
import lanekv.transfer.grpcfetch.spans as spans_module
import pytest
import torch
from lanekv.kernels.page_digest import PageDigest
from lanekv.runtime.metrics import Registry
from lanekv.runtime.rpc_metrics import lanekv_metrics
from lanekv.runtime.status import Refusal
from lanekv.transfer.connector.base import FetchJob, KVFetchError
from lanekv.transfer.connector.fastpath import FastPathTransport
from lanekv.transfer.connector.fetcher import KVFetcher
from lanekv.transfer.connector.grpc import GrpcTransport
from lanekv.transfer.errors import TransferError
from lanekv.transfer.fastpath.client import FastPath
from lanekv.transfer.protocol.descriptors import SHM
from lanekv.transfer.protocol.wire import frame_chunk, split_chunk

from tests.reliability.kv_cluster import LAYERS, PAGE, rows_of
from tests.transfer.fastpath.rig import fill, shm_rank

Code = grpc.StatusCode
PAGES = [(p, (3 * p + 1) % 8) for p in range(5)]  # (logical, physical at the rank)
SLOT = {logical: 9 - logical for logical, _ in PAGES}  # where each logical page goes here


@pytest.fixture
def rank():
    with shm_rank() as (source, pool, endpoint, agreement, kv):
        for layer in range(LAYERS):
            fill(pool, [phys for _, phys in PAGES], layer)
        source.add("req", PAGES)
        yield source, pool, endpoint, agreement, kv


def _fetcher(rank, *, fast: bool = True):
    _, _, _, agreement, kv = rank
    failures = lanekv_metrics(Registry()).failures
    grpc_transport = GrpcTransport(kv)
    transports = [FastPathTransport(FastPath(kv, agreement, transports=[SHM]), failures)] if fast else []
    return KVFetcher([*transports, grpc_transport], grpc_transport.release), failures


def _job(rank, *, timeout: float = 30.0):
    _, _, endpoint, agreement, _ = rank
    dst = torch.full((LAYERS, 2, 10 * PAGE, 2, 8), -1.0, dtype=torch.float16)
    job = FetchJob("req", agreement.fingerprint, None, (endpoint,), {0: [p for p, _ in PAGES]}, LAYERS, PAGE,
                   dst, lambda ps: [SLOT[p] for p in ps], time.monotonic() + timeout)
    return job, dst


def _assert_fetched(rank, dst):
    pool = rank[1]
    want = pool[:, :, rows_of([phys for _, phys in PAGES])]
    assert torch.equal(dst[:, :, rows_of([SLOT[p] for p, _ in PAGES])], want)


class _WrongDigest(PageDigest):  # on the decode side only: the rank digests with PageDigest too
    def total(self, first=None, last=None):
        return torch.tensor(12345)


def test_a_rank_that_shares_its_pool_is_copied_in_place(rank):
    fetcher, failures = _fetcher(rank)
    job, dst = _job(rank)
    fetched = fetcher.fetch(job)
    assert fetched.paths == {0: SHM}
    assert fetched.stats.chunks == 1 and fetched.stats.retries == 0
    assert fetched.stats.bytes == len(PAGES) * LAYERS * 2 * PAGE * 2 * 8 * 2
    _assert_fetched(rank, dst)
    assert failures.labels(cause="fastpath_digest").value == 0


@pytest.mark.parametrize("refusal", ["another_host", "no_fast_path"])
def test_a_rank_the_fast_path_does_not_reach_is_fetched_over_grpc(rank, monkeypatch, refusal):
    if refusal == "another_host":
        monkeypatch.setattr("lanekv.transfer.fastpath.client.host_id", lambda: "elsewhere/0")
    fetcher, _ = _fetcher(rank, fast=refusal != "no_fast_path")
    job, dst = _job(rank)
    fetched = fetcher.fetch(job)
    assert fetched.paths == {0: "grpc"}
    assert fetched.stats.per_rank[0].bytes == fetched.stats.bytes > 0
    _assert_fetched(rank, dst)


def test_a_copy_that_fails_its_digest_is_fetched_again_over_grpc(rank, monkeypatch):
    monkeypatch.setattr("lanekv.transfer.fastpath.rangecopy.PageDigest", _WrongDigest)
    fetcher, failures = _fetcher(rank)
    job, dst = _job(rank)
    fetched = fetcher.fetch(job)
    assert fetched.paths == {0: "grpc"} and fetched.stats.retries == 1
    assert failures.labels(cause="fastpath_digest").value == 1
    _assert_fetched(rank, dst)


def test_a_digest_mismatch_then_damaged_grpc_chunks_is_one_data_loss(rank, monkeypatch):
    monkeypatch.setattr("lanekv.transfer.fastpath.rangecopy.PageDigest", _WrongDigest)

    def damaging_split(message):
        header, data = split_chunk(message)
        damaged = bytearray(data)
        damaged[len(damaged) // 3] ^= 0x10
        return split_chunk(frame_chunk(bytes(header), memoryview(bytes(damaged))))

    monkeypatch.setattr(spans_module, "split_chunk", damaging_split)
    fetcher, failures = _fetcher(rank)
    job, _ = _job(rank)
    with pytest.raises(KVFetchError) as caught:
        fetcher.fetch(job)
    err = caught.value
    assert err.code == Code.DATA_LOSS and "checksum" in str(err)
    assert isinstance(err, TransferError) and isinstance(err, Refusal) and err.message == str(err)
    assert failures.labels(cause="fastpath_digest").value == 1  # it fell back first


def test_a_rank_that_refuses_or_is_down_is_one_error_with_its_code(rank):
    source, _, endpoint, agreement, kv = rank
    fetcher, _ = _fetcher(rank, fast=False)
    job, _ = _job(rank)
    source.release("req")  # the rank no longer holds the request: refused, not a transport fault
    with pytest.raises(KVFetchError) as caught:
        fetcher.fetch(job)
    assert caught.value.code == Code.ABORTED and "NOT_FOUND" in str(caught.value)
    down = FetchJob("req", agreement.fingerprint, None, ("127.0.0.1:1",), job.pages, LAYERS, PAGE, job.pool,
                    job.pages_for, time.monotonic() + 5)
    with pytest.raises(KVFetchError) as caught:
        fetcher.fetch(down)
    assert caught.value.code == Code.UNAVAILABLE, caught.value


def test_a_fetch_out_of_time_is_deadline_exceeded(rank):
    fetcher, _ = _fetcher(rank)
    job, dst = _job(rank, timeout=-1.0)
    with pytest.raises(KVFetchError) as caught:
        fetcher.fetch(job)
    assert caught.value.code == Code.DEADLINE_EXCEEDED
    assert torch.all(dst == -1.0)  # nothing was placed


def test_a_fetch_job_names_only_ranks_it_has_endpoints_for():
    with pytest.raises(ValueError, match="owner ranks \\[1\\]"):
        FetchJob("req", "f" * 64, None, ("127.0.0.1:1",), {1: [0]}, LAYERS, PAGE, torch.zeros(1), list, 0.0)
    with pytest.raises(ValueError, match="page_size"):
        FetchJob("req", "f" * 64, None, ("127.0.0.1:1",), {0: [0]}, LAYERS, 0, torch.zeros(1), list, 0.0)
