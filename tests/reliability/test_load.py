"""Many concurrent Generate streams and full pools: nothing lost, corrupted or leaked.

One prefill daemon (CP 2) and two decode daemons in this process, over
loopback gRPC: ``load`` (a pool that holds about a third of what the streams
ask for, so that most of them wait for pages) and ``tight`` (a small pool and
a short page wait, for admission control). Every reference output comes from
``decode.colocated.generate_colocated`` on the same checkpoint: one process,
no CP, no transfer, the requests of one length batched together.
"""

from __future__ import annotations

import collections
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
from lanekv.decode.colocated import generate_colocated
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.decode.pool import PagePool
from lanekv.model.checkpoint import load_model
from lanekv.model.llama import causal_attention
from lanekv.model.sampling import SamplingParams, sample
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2 as pb
from lanekv.proto import lanekv_pb2_grpc
from lanekv.runtime.requests import sampling_to_proto
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY, access_ticket

from tests.checkpoints import VOCAB_SIZE, write_llama

Code = grpc.StatusCode
PAGE_SIZE = 4
PAGES_PER_LANE = 256  # the prefill pools hold 512 pages = 2048 tokens
LOAD_POOL = 480  # < the prefill pools: whatever decode admits, prefill has pages for
TIGHT_POOL = 320
STREAMS = 128
DEFAULT_TIMEOUT_S = 120.0
# Greedy on write_llama's weights this prompt runs 900 tokens without an end-of-sequence token.
LONG = ([11, 12, 13, 14, 15], 900)  # (5 + 899) / 4 = 226 of the tight pool's 320 pages


class Job(NamedTuple):
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    cancel_after: int | None = None  # the client cancels once it holds this many tokens (0: at once)
    timeout_s: float = DEFAULT_TIMEOUT_S  # the client's deadline

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


class Reference:
    """Colocated outputs of jobs, and the judge of a daemon's output against them.

    Batching changes the order of float sums, so two runs of one request may
    pick different tokens where two logits tie within float noise (seen: a gap
    of 1e-6 between the top two). An output that differs from the reference
    passes only if, at its first differing token, nudging the reference's logits
    by ``TIE`` makes the sampler pick the daemon's token; what follows that
    token cannot be compared. A corrupted KV page moves logits far more.
    """

    TIE = 1e-3

    def __init__(self, checkpoint: str) -> None:
        self.loaded = load_model(checkpoint)
        self.outputs: dict[str, list[int]] = {}
        self.ties = 0

    def run(self, jobs: Sequence[Job]) -> None:
        """Generate every job, those of one max_new_tokens batched together."""
        config, model = self.loaded.config, self.loaded.model
        for max_new in sorted({job.max_new_tokens for job in jobs}):
            group = [job for job in jobs if job.max_new_tokens == max_new]
            pool = PagePool.for_model(config, 2048, PAGE_SIZE, torch.float32, torch.device("cpu"))
            outputs = generate_colocated(model, pool, [job.prompt for job in group],
                                         [job.sampling for job in group], max_new)
            self.outputs.update((job.request_id, tokens) for job, tokens in zip(group, outputs))

    def mismatch(self, job: Job, got: list[int], complete: bool = True) -> str | None:
        """None if ``got`` (all of a finished stream, or the start of one) agrees with the reference."""
        want = self.outputs[job.request_id]
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if k is None:
            if len(got) > len(want) or (complete and len(got) != len(want)):
                return f"{len(got)} tokens where the reference has {len(want)}"
            return None
        logits = self._logits(job.prompt + want[:k])
        for token, nudge in ((got[k], self.TIE), (want[k], -self.TIE)):
            nudged = logits.clone()
            nudged[token] += nudge
            if int(sample(nudged[None], [job.sampling], k)[0]) == got[k]:
                self.ties += 1
                return None
        return (f"token {k} is {got[k]} where the reference has {want[k]} "
                f"(logits {logits[got[k]].item():.6f} and {logits[want[k]].item():.6f})")

    def _logits(self, ids: list[int]) -> torch.Tensor:
        model = self.loaded.model
        scale = model.config.softmax_scale
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.arange(len(ids)),
                           lambda layer, q, k, v: causal_attention(q, k, v, scale))
            return model.compute_logits(hidden[-1:])[0]


@pytest.fixture(scope="module")
def reference(rig) -> Reference:
    return Reference(rig.checkpoint)


def _run(daemon: DecodeDaemon, job: Job, started: threading.Event | None = None) -> Outcome:
    """One Generate stream to its end, or cancelled by the client at ``job.cancel_after`` tokens."""
    tokens: list[int] = []
    with grpc.insecure_channel(daemon.endpoint) as channel:
        call = lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(job.request(), timeout=job.timeout_s)
        if job.cancel_after == 0:
            call.cancel()
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


def _jobs(seed: int, count: int) -> list[Job]:
    """Mixed prompts, lengths, greedy and seeded sampling; of every ten streams two are
    cancelled midway, one at once and one has a deadline that may end it at any step."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 120))]
        max_new = rng.randint(4, 24)
        sampling = SamplingParams() if i % 2 else SamplingParams(
            temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 40]), top_p=rng.choice([1.0, 0.9]),
            seed=rng.randrange(2**63))
        job = Job(f"load-{seed}-{i}", prompt, sampling, max_new)
        kind = rng.randrange(10)
        if kind < 2:
            job = job._replace(cancel_after=rng.randint(1, max_new - 1))
        elif kind == 2:
            job = job._replace(cancel_after=0)
        elif kind == 3:
            job = job._replace(timeout_s=rng.uniform(0.01, 1.0))
        jobs.append(job)
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


@pytest.mark.timeout(60)
def test_the_judge_refuses_a_substituted_token(reference):
    jobs = _jobs(seed=4, count=16)
    reference.run(jobs)
    rng = random.Random(4)
    for job in jobs:
        want = reference.outputs[job.request_id]
        assert reference.mismatch(job, want) is None
        assert reference.mismatch(job, want[:-1], complete=False) is None
        assert reference.mismatch(job, want[:-1]) is not None  # a finished stream cut short
        for k in rng.sample(range(len(want)), min(4, len(want))):
            for other in (want[k] + 1) % VOCAB_SIZE, rng.randrange(VOCAB_SIZE):
                if other != want[k]:
                    assert reference.mismatch(job, want[:k] + [other] + want[k + 1:]) is not None, (job, k)
    assert reference.ties == 0


@pytest.mark.timeout(120)
def test_concurrent_streams_with_cancellations_equal_their_sequential_runs(rig, reference):
    jobs = _jobs(seed=3, count=STREAMS)
    reference.run(jobs)
    assert _wait_until(lambda: _settled(rig))
    threads_before = _busy_threads()
    before = rig.load.stats()

    outcomes = _run_all(rig.load, jobs)

    ended = collections.Counter(out.code for out in outcomes)
    for job, out in zip(jobs, outcomes):
        if job.cancel_after is None and job.timeout_s == DEFAULT_TIMEOUT_S:
            assert out.code == Code.OK, (job.request_id, out)
        else:  # the stream may have ended before the cancel or the deadline arrived
            assert out.code in (Code.OK, Code.CANCELLED, Code.DEADLINE_EXCEEDED), (job.request_id, out)
        assert reference.mismatch(job, out.tokens, complete=out.code == Code.OK) is None, (job.request_id, out)
    assert ended[Code.CANCELLED] >= STREAMS // 10, ended
    assert reference.ties <= STREAMS // 16, "float noise should decide only rare tokens"
    assert _wait_until(lambda: _settled(rig)), (rig.load.stats(), rig.prefill.engine.allocator.free_counts())
    assert rig.load.stats().finished - before.finished >= ended[Code.OK]
    # No thread that runs anything now was not running before (one that ended is fine).
    assert _wait_until(lambda: _busy_threads() <= threads_before), (
        [t.name for t in threading.enumerate() if t.ident in _busy_threads() - threads_before])


@pytest.mark.timeout(120)
def test_a_full_decode_pool_refuses_without_corrupting_the_running(rig, reference):
    rng = random.Random(5)
    long = Job("long", LONG[0], SamplingParams(), LONG[1])
    # 5 pages each: they fit beside the long one (94 pages free)
    small = [Job(f"small-{i}", [rng.randrange(3, VOCAB_SIZE) for _ in range(12)],
                 SamplingParams(temperature=0.8, seed=i) if i % 2 else SamplingParams(), 8) for i in range(6)]
    # 100 pages each: they cannot, while the long one runs
    big = [Job(f"big-{i}", [rng.randrange(3, VOCAB_SIZE) for _ in range(40)], SamplingParams(), 361)
           for i in range(4)]
    reference.run([long, *small])
    assert len(reference.outputs["long"]) == LONG[1]  # no early end-of-sequence: it holds its pages throughout
    before = rig.tight.stats()

    started = threading.Event()
    with futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="long-client") as pool:
        running = pool.submit(_run, rig.tight, long, started)
        assert started.wait(60)
        small_out = _run_all(rig.tight, small)
        big_out = _run_all(rig.tight, big)
        # Its deadline, not the pool's wait limit, ends this one's wait.
        late_out = _run(rig.tight, big[0]._replace(request_id="late", timeout_s=0.15))
        long_out = running.result(timeout=120)

    for job, out in [(long, long_out), *zip(small, small_out)]:
        assert out.code == Code.OK, (job.request_id, out)
        assert reference.mismatch(job, out.tokens) is None, (job.request_id, out)
    for out in big_out:
        assert out.code == Code.RESOURCE_EXHAUSTED and "stayed full" in out.details, out
        assert out.tokens == []
    assert late_out.code == Code.DEADLINE_EXCEEDED, late_out
    assert _wait_until(lambda: _settled(rig)), rig.tight.stats()
    after = rig.tight.stats()
    assert after.finished - before.finished == 1 + len(small)
    assert after.refused - before.refused >= len(big)
    # The late one's client deadline passes while it waits: whether the page wait gives up
    # first (refused) or gRPC's deadline marks the call abandoned first (cancelled) is a race.
    ended_late = (after.refused - before.refused) + (after.cancelled - before.cancelled)
    assert ended_late == len(big) + 1, (before, after)


@pytest.mark.timeout(120)
def test_full_prefill_pools_refuse_without_corrupting_the_pinned(rig, reference):
    rng = random.Random(6)
    # Two pinned prompts of 1000 tokens hold 500 of the 512 prefill pages (6 left per lane).
    pinned = [[rng.randrange(3, VOCAB_SIZE) for _ in range(1000)] for _ in range(2)]
    flood = [Job(f"flood-{i}", [rng.randrange(3, VOCAB_SIZE) for _ in range(60)], SamplingParams(), 6)
             for i in range(8)]  # 15 prefill pages each: more than is left
    fits = Job("fits", [7, 8, 9, 10, 11, 12], SamplingParams(temperature=1.0, seed=9), 6)  # 2 pages
    reference.run([*flood, fits])
    with grpc.insecure_channel(rig.prefill.endpoint) as channel:
        stub = lanekv_pb2_grpc.PrefillServiceStub(channel)
        replies = [stub.Prefill(pb.PrefillRequest(token_ids=pb.TokenIds(ids=ids), request_id=f"pin-{i}"),
                                timeout=120) for i, ids in enumerate(pinned)]
    rank0_channel = grpc.insecure_channel(replies[0].endpoints[0])
    rank0 = lanekv_pb2_grpc.KVTransferStub(rank0_channel)
    fetches = [pb.FetchRequest(request_id=r.request_id, fingerprint=r.contract_fingerprint) for r in replies]
    tickets = [((EPOCH_METADATA_KEY, access_ticket(None, r.capability)),) for r in replies]
    held = [list(rank0.FetchKV(request, timeout=60, metadata=md)) for request, md in zip(fetches, tickets)]

    outcomes = _run_all(rig.load, [*flood, fits])
    for out in outcomes[:-1]:
        assert out.code == Code.RESOURCE_EXHAUSTED and "prefill pool" in out.details, out
    assert outcomes[-1].code == Code.OK and reference.mismatch(fits, outcomes[-1].tokens) is None, outcomes[-1]
    assert rig.load.stats().reserved_pages == 0  # refused by prefill: the decode pages came back

    # The pinned pages hold what they held; released, the refused requests run.
    assert [list(rank0.FetchKV(request, timeout=60, metadata=md)) for request, md in zip(fetches, tickets)] == held
    rank0_channel.close()
    for reply, md in zip(replies, tickets):
        for endpoint in reply.endpoints:
            with grpc.insecure_channel(endpoint) as channel:
                lanekv_pb2_grpc.KVTransferStub(channel).Release(
                    pb.ReleaseRequest(request_id=reply.request_id, fingerprint=reply.contract_fingerprint),
                    timeout=30, metadata=md)
    assert _wait_until(lambda: _settled(rig))
    for job, out in zip(flood, _run_all(rig.load, flood)):
        assert out.code == Code.OK and reference.mismatch(job, out.tokens) is None, (job.request_id, out)
    assert _wait_until(lambda: _settled(rig))
