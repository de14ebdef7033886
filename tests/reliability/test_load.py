"""Many concurrent Generate streams and full pools: nothing lost, corrupted or leaked.

One prefill daemon (CP 2) and two decode daemons in this process, over
loopback gRPC: ``load`` (a pool that holds about a third of what the streams
ask for, so that most of them wait for pages) and ``tight`` (a small pool and
a short page wait, for admission control). Every reference output comes from
``decode.colocated.generate_colocated`` on the same checkpoint: one process,
no CP, no transfer, the requests of one length batched together.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import NamedTuple

import grpc
import pytest
import torch

from decode.colocated import generate_colocated
from decode.daemon import DecodeConfig, DecodeDaemon
from decode.pool import PagePool
from prefill.checkpoint import load_model
from prefill.daemon import DaemonConfig, PrefillDaemon
from prefill.engine_config import EngineConfig
from prefill.sampling import SamplingParams
from proto import lanekv_pb2 as pb
from proto import lanekv_pb2_grpc
from tests.checkpoints import VOCAB_SIZE, write_llama
from transfer.requests import sampling_to_proto

Code = grpc.StatusCode
PAGE_SIZE = 4
PAGES_PER_LANE = 256  # the prefill pools hold 512 pages = 2048 tokens
LOAD_POOL = 480  # < the prefill pools: whatever decode admits, prefill has pages for
TIGHT_POOL = 320
STREAMS = 128
# Greedy on write_llama's weights this prompt runs 900 tokens without an end-of-sequence token.
LONG = ([11, 12, 13, 14, 15], 900)  # (5 + 899) / 4 = 226 of the tight pool's 320 pages


class Job(NamedTuple):
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    cancel_after: int | None = None  # the client cancels once it holds this many tokens

    def request(self) -> pb.GenerateRequest:
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=self.prompt), max_new_tokens=self.max_new_tokens,
                                  request_id=self.request_id,
                                  sampling=sampling_to_proto(self.sampling, pb.SamplingParams))


class Outcome(NamedTuple):
    tokens: list[int]
    code: grpc.StatusCode
    details: str


class Rig(NamedTuple):
    prefill: PrefillDaemon
    load: DecodeDaemon
    tight: DecodeDaemon
    checkpoint: str


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    checkpoint = str(write_llama(tmp_path_factory.mktemp("load-llama")))
    prefill = PrefillDaemon(EngineConfig(checkpoint, cp_size=2, page_size=PAGE_SIZE, pages_per_lane=PAGES_PER_LANE,
                                         start_timeout_s=120), DaemonConfig(lease_s=600))
    decoders: list[DecodeDaemon] = []
    try:
        for pool_pages, wait_s in ((LOAD_POOL, 60.0), (TIGHT_POOL, 0.25)):
            decoders.append(DecodeDaemon(DecodeConfig(checkpoint, prefill.endpoint, page_size=PAGE_SIZE,
                                                      pool_pages=pool_pages, page_wait_s=wait_s, device="cpu",
                                                      max_workers=STREAMS + 16)))
        yield Rig(prefill, *decoders, checkpoint)
    finally:
        for daemon in decoders:
            daemon.stop(grace_s=1.0)
        prefill.stop()


def _references(checkpoint: str, jobs: Sequence[Job]) -> dict[str, list[int]]:
    """Each job's output from a colocated run, jobs of one max_new_tokens batched together."""
    loaded = load_model(checkpoint)
    out = {}
    for max_new in sorted({job.max_new_tokens for job in jobs}):
        group = [job for job in jobs if job.max_new_tokens == max_new]
        pool = PagePool.for_model(loaded.config, 2048, PAGE_SIZE, torch.float32, torch.device("cpu"))
        outputs = generate_colocated(loaded.model, pool, [job.prompt for job in group],
                                     [job.sampling for job in group], max_new)
        out.update((job.request_id, tokens) for job, tokens in zip(group, outputs))
    return out


def _run(daemon: DecodeDaemon, job: Job, started: threading.Event | None = None) -> Outcome:
    """One Generate stream to its end, or cancelled by the client at ``job.cancel_after`` tokens."""
    tokens: list[int] = []
    with grpc.insecure_channel(daemon.endpoint) as channel:
        call = lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(job.request(), timeout=120)
        try:
            for reply in call:
                tokens += reply.token_ids
                if started is not None:
                    started.set()
                if job.cancel_after is not None and len(tokens) >= job.cancel_after:
                    call.cancel()
        except grpc.RpcError as err:
            return Outcome(tokens, err.code(), err.details() or "")
    return Outcome(tokens, Code.OK, "")


def _run_all(daemon: DecodeDaemon, jobs: Sequence[Job]) -> list[Outcome]:
    with futures.ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="load-client") as pool:
        return list(pool.map(lambda job: _run(daemon, job), jobs))


def _jobs(seed: int, count: int, cancel_share: float) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 120))]
        max_new = rng.randint(4, 24)
        sampling = SamplingParams() if i % 2 else SamplingParams(
            temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 40]), top_p=rng.choice([1.0, 0.9]),
            seed=rng.randrange(2**63))
        cancel = rng.randint(1, max_new - 1) if rng.random() < cancel_share else None
        jobs.append(Job(f"load-{seed}-{i}", prompt, sampling, max_new, cancel))
    return jobs


def _settled(rig: Rig) -> bool:
    prefill_free = rig.prefill.engine.allocator.free_counts() == [PAGES_PER_LANE] * 2
    return prefill_free and not rig.prefill.leases.held() and all(
        (s.free_pages, s.reserved_pages, s.active_requests) == (s.total_pages, 0, 0)
        for s in (rig.load.stats(), rig.tight.stats()))


def _wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def _busy_threads() -> set[int]:
    """Live threads other than idle executor workers (those wait for a task inside ``_worker``).

    gRPC servers keep the workers of their thread pools, so the thread count
    after a burst stays above its start; a thread that still runs anything
    after the burst, though, is a leak.
    """
    frames = sys._current_frames()
    busy = set()
    for thread in threading.enumerate():
        frame = frames.get(thread.ident)
        idle = frame is not None and frame.f_code.co_name == "_worker" and frame.f_code.co_filename.endswith(
            "thread.py") and "concurrent" in frame.f_code.co_filename
        if not idle:
            busy.add(thread.ident)
    return busy


@pytest.mark.timeout(120)
def test_concurrent_streams_with_cancellations_equal_their_sequential_runs(rig):
    jobs = _jobs(seed=3, count=STREAMS, cancel_share=0.2)
    want = _references(rig.checkpoint, jobs)
    assert _wait_until(lambda: _settled(rig))
    threads_before = _busy_threads()
    before = rig.load.stats()

    outcomes = _run_all(rig.load, jobs)

    cancelled = 0
    for job, out in zip(jobs, outcomes):
        reference = want[job.request_id]
        if job.cancel_after is None:
            assert (out.code, out.tokens) == (Code.OK, reference), (job, out.details)
        else:  # the stream may have ended before the cancel arrived
            assert out.code in (Code.OK, Code.CANCELLED), (job, out.details)
            assert out.tokens == reference[: len(out.tokens)], job
            cancelled += out.code == Code.CANCELLED
    assert cancelled >= STREAMS // 10
    assert _wait_until(lambda: _settled(rig)), (rig.load.stats(), rig.prefill.engine.allocator.free_counts())
    after = rig.load.stats()
    assert after.finished - before.finished == STREAMS - cancelled
    assert after.cancelled - before.cancelled == cancelled
    assert after.refused == before.refused
    assert _wait_until(lambda: _busy_threads() == threads_before), (
        [t.name for t in threading.enumerate() if t.ident in _busy_threads() - threads_before])


@pytest.mark.timeout(120)
def test_a_full_decode_pool_refuses_without_corrupting_the_running(rig):
    rng = random.Random(5)
    long = Job("long", LONG[0], SamplingParams(), LONG[1])
    # 5 pages each: they fit beside the long one (94 pages free)
    small = [Job(f"small-{i}", [rng.randrange(3, VOCAB_SIZE) for _ in range(12)],
                 SamplingParams(temperature=0.8, seed=i) if i % 2 else SamplingParams(), 8) for i in range(6)]
    # 100 pages each: they cannot, while the long one runs
    big = [Job(f"big-{i}", [rng.randrange(3, VOCAB_SIZE) for _ in range(40)], SamplingParams(), 361)
           for i in range(4)]
    want = _references(rig.checkpoint, [long, *small])
    assert len(want["long"]) == LONG[1]  # no early end-of-sequence: it holds its pages throughout
    before = rig.tight.stats()

    started = threading.Event()
    with futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="long-client") as pool:
        running = pool.submit(_run, rig.tight, long, started)
        assert started.wait(60)
        small_out = _run_all(rig.tight, small)
        big_out = _run_all(rig.tight, big)
        long_out = running.result(timeout=120)

    assert (long_out.code, long_out.tokens) == (Code.OK, want["long"]), long_out.details
    for job, out in zip(small, small_out):
        assert (out.code, out.tokens) == (Code.OK, want[job.request_id]), (job, out.details)
    for out in big_out:
        assert out.code == Code.RESOURCE_EXHAUSTED and "stayed full" in out.details, out
        assert out.tokens == []
    assert _wait_until(lambda: _settled(rig)), rig.tight.stats()
    after = rig.tight.stats()
    assert (after.finished - before.finished, after.refused - before.refused) == (1 + len(small), len(big))


@pytest.mark.timeout(120)
def test_full_prefill_pools_refuse_without_corrupting_the_pinned(rig):
    rng = random.Random(6)
    # Two pinned prompts of 1000 tokens hold 500 of the 512 prefill pages (6 left per lane).
    pinned = [[rng.randrange(3, VOCAB_SIZE) for _ in range(1000)] for _ in range(2)]
    flood = [Job(f"flood-{i}", [rng.randrange(3, VOCAB_SIZE) for _ in range(60)], SamplingParams(), 6)
             for i in range(8)]  # 15 prefill pages each: more than is left
    fits = Job("fits", [7, 8, 9, 10, 11, 12], SamplingParams(temperature=1.0, seed=9), 6)  # 2 pages
    want = _references(rig.checkpoint, [*flood, fits])
    with grpc.insecure_channel(rig.prefill.endpoint) as channel:
        stub = lanekv_pb2_grpc.PrefillServiceStub(channel)
        replies = [stub.Prefill(pb.PrefillRequest(token_ids=pb.TokenIds(ids=ids), request_id=f"pin-{i}"),
                                timeout=120) for i, ids in enumerate(pinned)]
    with grpc.insecure_channel(replies[0].endpoints[0]) as rank0:
        held = [list(lanekv_pb2_grpc.KVTransferStub(rank0).FetchKV(
            pb.FetchRequest(request_id=r.request_id, fingerprint=r.contract_fingerprint), timeout=60))
            for r in replies]

    outcomes = _run_all(rig.load, [*flood, fits])
    for out in outcomes[:-1]:
        assert out.code == Code.RESOURCE_EXHAUSTED and "prefill pool" in out.details, out
    assert (outcomes[-1].code, outcomes[-1].tokens) == (Code.OK, want["fits"]), outcomes[-1].details
    assert rig.load.stats().reserved_pages == 0  # refused by prefill: the decode pages came back

    # The pinned pages are as they were; released, the refused requests run.
    with grpc.insecure_channel(replies[0].endpoints[0]) as rank0:
        kv = lanekv_pb2_grpc.KVTransferStub(rank0)
        for reply, chunks in zip(replies, held):
            request = pb.FetchRequest(request_id=reply.request_id, fingerprint=reply.contract_fingerprint)
            assert list(kv.FetchKV(request, timeout=60)) == chunks
    for reply in replies:
        for endpoint in reply.endpoints:
            with grpc.insecure_channel(endpoint) as rank:
                lanekv_pb2_grpc.KVTransferStub(rank).Release(
                    pb.ReleaseRequest(request_id=reply.request_id, fingerprint=reply.contract_fingerprint),
                    timeout=30)
    assert _wait_until(lambda: _settled(rig))
    retried = _run_all(rig.load, flood)
    for job, out in zip(flood, retried):
        assert (out.code, out.tokens) == (Code.OK, want[job.request_id]), (job, out.details)
    assert _wait_until(lambda: _settled(rig))
