"""The decode daemon's warm-up request (``DecodeDaemon.warm_up``): one short request
through each prefill daemon and the whole pipeline. It leaves no trace in the decode
daemon's metrics or counts, in either side's prefix cache or in the routing memory,
and holds nothing on either side afterwards. Against a
prefill daemon that is down it logs, returns 0 and the daemon serves on.
``lanekv decode --warm-up-request`` runs it before its ready file; the tokens of the
first request after it equal a colocated run's. ``--no-warm-up-request`` skips it.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from lanekv.decode.colocated import generate_colocated
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.decode.engine import TokenEvent
from lanekv.decode.pool import PagePool
from lanekv.decode.streams import Streams
from lanekv.model.checkpoint import load_model
from lanekv.model.sampling import SamplingParams
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.metrics import Registry
from lanekv.runtime.rpc_metrics import lanekv_metrics
from lanekv.transfer.protocol.stats import FetchStats, RankStats

from tests.checkpoints import VOCAB_SIZE, write_llama
from tests.markers import requires_gpu
from tests.reliability.kv_cluster import wait_until

REPO = Path(__file__).resolve().parents[2]
PAGE_SIZE = 4
POOL_PAGES = 64
PROMPT = [9, 10, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("warm-up-llama"))


@pytest.fixture(scope="module")
def prefill(checkpoint):
    daemon = PrefillDaemon(
        EngineConfig(str(checkpoint), cp_size=2, page_size=PAGE_SIZE, pages_per_lane=64, device="cpu",
                     start_timeout_s=120),
        DaemonConfig(lease_s=600),
    )
    yield daemon
    daemon.stop()


def _colocated(checkpoint, ids: list[int], max_new_tokens: int) -> list[int]:
    loaded = load_model(checkpoint)
    pool = PagePool.for_model(loaded.config, POOL_PAGES, PAGE_SIZE, torch.float32)
    return generate_colocated(loaded.model, pool, [ids], SamplingParams(), max_new_tokens)[0]


def _generate(endpoint: str, ids: list[int], max_new_tokens: int) -> list[int]:
    with grpc.insecure_channel(endpoint) as channel:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
        request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=max_new_tokens)
        return [t for reply in stub.Generate(request, timeout=60) for t in reply.token_ids]


# The warm-up's prompt (DecodeDaemon.warm_up: two pages here).
_WARM_UP_IDS = [(7 * i + 1) % VOCAB_SIZE for i in range(2 * PAGE_SIZE)]


def _prefix_state(prefill: PrefillDaemon) -> tuple:
    """What the prefill daemon's prefix cache holds and counted, and its prefix metrics."""
    cache = prefill.cache
    lines = [line for line in prefill.registry.render().splitlines() if "prefix_cache" in line]
    return cache.cached_pages, cache.peek(_WARM_UP_IDS), dataclasses.replace(cache.stats), lines


def _prefill_idle(prefill: PrefillDaemon, free: object) -> bool:
    return prefill.engine.allocator.free_counts() == free and prefill.leases.held() == {}


def test_an_uncounted_stream_gets_its_events_but_no_metrics_or_counts():
    registry = Registry()
    streams = Streams(lanekv_metrics(registry))
    before = registry.render()
    events = streams.open("warm", counted=False)
    assert streams.open("warm") is None  # its id is in use like any other
    assert streams.counts().active == 0
    streams.transferred("warm", 8, FetchStats(512, 2, 0.01, {0: RankStats(512, 2, 0.01)}), 0.01)
    streams.deliver([TokenEvent("warm", 5, 1, True, "length")])
    assert events.get_nowait().token_id == 5
    streams.close("warm", "finished", grpc.StatusCode.OK, "")
    assert registry.render() == before
    assert streams.counts() == (0, 0, 0, 0)
    # The id is free again, and a counted stream under it counts.
    assert streams.open("warm") is not None
    streams.close("warm", "refused", grpc.StatusCode.UNAVAILABLE, "down")
    assert streams.counts().refused == 1 and registry.render() != before


@pytest.mark.timeout(120)
def test_the_warm_up_goes_through_every_step_and_leaves_no_trace(checkpoint, prefill, caplog):
    free = prefill.engine.allocator.free_counts()
    decode = DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=PAGE_SIZE,
                                       pool_pages=POOL_PAGES, device="cpu"))
    try:
        assert not decode.warms_up_by_default  # a CPU pool: only when asked
        before, metrics = decode.stats(), decode.registry.render()
        theirs = _prefix_state(prefill)
        ours = (decode.prefix_cache.cached_pages, dataclasses.replace(decode.prefix_cache.stats), decode.prefills.picks,
                [t.memory.cached_tokens(_WARM_UP_IDS) for t in decode.prefills.targets])
        with caplog.at_level(logging.INFO, logger="lanekv.decode"):
            assert decode.warm_up() == 1
        lines = [r.getMessage() for r in caplog.records if "warm-up request" in r.getMessage()]
        # Two pages of prompt, prefilled by both ranks, fetched, decoded one step.
        assert len(lines) == 1 and f"through prefill {prefill.endpoint}: 8 prompt tokens" in lines[0], lines
        assert "2 tokens in" in lines[0] and "0:" in lines[0] and "1:" in lines[0], lines[0]
        assert decode.stats() == before  # no request counted, every page and promise back
        assert decode.registry.render() == metrics
        assert wait_until(lambda: _prefill_idle(prefill, free))
        # Neither prefix cache matched or kept its made-up prompt, nor did our routing memory.
        assert _prefix_state(prefill) == theirs
        assert (decode.prefix_cache.cached_pages, decode.prefix_cache.stats, decode.prefills.picks,
                [t.memory.cached_tokens(_WARM_UP_IDS) for t in decode.prefills.targets]) == ours
        assert ours[0] == 0 and ours[3] == [0]
        # The first client request after it decodes as a colocated run does.
        assert _generate(decode.endpoint, PROMPT, 6) == _colocated(checkpoint, PROMPT, 6)
        assert decode.stats().finished == before.finished + 1
    finally:
        decode.stop(grace_s=1.0)


@pytest.mark.timeout(120)
def test_a_warm_up_against_a_prefill_daemon_that_is_down_logs_and_serving_goes_on(checkpoint, caplog):
    own = PrefillDaemon(EngineConfig(str(checkpoint), cp_size=1, page_size=PAGE_SIZE, pages_per_lane=64,
                                     device="cpu", start_timeout_s=120), DaemonConfig(lease_s=60))
    decode = None
    try:
        # Health checks far apart: the prefill daemon is still in the pick when the warm-up runs.
        decode = DecodeDaemon(DecodeConfig(str(checkpoint), own.endpoint, page_size=PAGE_SIZE,
                                           pool_pages=POOL_PAGES, device="cpu", prefill_health_interval_s=60))
        endpoint = own.endpoint
        own.stop()
        before, metrics = decode.stats(), decode.registry.render()
        with caplog.at_level(logging.WARNING, logger="lanekv.decode"):
            assert decode.warm_up() == 0
        warned = [r.getMessage() for r in caplog.records if "warm-up request" in r.getMessage()]
        assert any(f"through prefill {endpoint}: UNAVAILABLE" in m and "serving anyway" in m for m in warned), warned
        assert all(r.exc_info is None for r in caplog.records if "warm-up" in r.getMessage())
        assert decode.stats() == before and decode.registry.render() == metrics
        assert not decode.stopping
    finally:
        if decode is not None:
            decode.stop(grace_s=1.0)
        own.stop()


def _start_cli(checkpoint, prefill: PrefillDaemon, ready: Path, flag: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lanekv.cli", "decode", "--model", str(checkpoint), "--prefill", prefill.endpoint,
           "--page-size", str(PAGE_SIZE), "--pool-pages", str(POOL_PAGES), "--device", "cpu",
           "--ready-file", str(ready), flag]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(180)
def test_lanekv_decode_warms_up_before_its_ready_file(checkpoint, prefill, tmp_path):
    free = prefill.engine.allocator.free_counts()
    procs = {flag: (tmp_path / f"ready{flag}", None) for flag in ("--warm-up-request", "--no-warm-up-request")}
    procs = {flag: (ready, _start_cli(checkpoint, prefill, ready, flag)) for flag, (ready, _) in procs.items()}
    try:
        for flag, (ready, proc) in procs.items():
            assert wait_until(lambda r=ready, p=proc: r.exists() or p.poll() is not None, 150), flag
            assert proc.poll() is None, (flag, proc.communicate(timeout=10))
            expected = _colocated(checkpoint, PROMPT, 5)
            assert _generate(ready.read_text().strip(), PROMPT, 5) == expected, flag
    finally:
        outs = {}
        for flag, (_, proc) in procs.items():
            proc.send_signal(signal.SIGTERM)
            outs[flag] = proc.communicate(timeout=30)
    for flag, (_, proc) in procs.items():
        assert proc.returncode == 0, (flag, outs[flag])
    warmed = [line for line in outs["--warm-up-request"][1].splitlines() if "warm-up request through" in line]
    assert len(warmed) == 1 and "first token after" in warmed[0], outs["--warm-up-request"][1]
    assert "warm-up request" not in outs["--no-warm-up-request"][1]
    assert wait_until(lambda: _prefill_idle(prefill, free))


@requires_gpu
@pytest.mark.timeout(300)
def test_on_cuda_the_warm_up_attaches_the_fast_path_and_decodes_what_grpc_does(checkpoint):
    """The CPU tests above cover the same steps with the shared-memory path."""
    prefill = PrefillDaemon(EngineConfig(str(checkpoint), cp_size=min(2, torch.cuda.device_count()),
                                         page_size=PAGE_SIZE, pages_per_lane=64, device="cuda", start_timeout_s=300),
                            DaemonConfig(lease_s=600))
    decoders = []
    try:
        for transport in ("grpc", "auto"):
            decoders.append(DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=PAGE_SIZE,
                                                      device="cuda", pool_pages=POOL_PAGES, transport=transport)))
        over_grpc, fast = decoders
        assert fast.warms_up_by_default
        ranks = prefill.topology.endpoints
        assert {fast.fastpath.transport(e) for e in ranks} == {"grpc"}  # nothing attached before a request
        before, metrics = fast.stats(), fast.registry.render()
        assert fast.warm_up() == 1
        assert {fast.fastpath.transport(e) for e in ranks} == {"cuda_ipc"}
        assert fast.stats() == before and fast.registry.render() == metrics
        assert _generate(fast.endpoint, PROMPT, 6) == _generate(over_grpc.endpoint, PROMPT, 6)
        assert wait_until(lambda: prefill.leases.held() == {})
    finally:
        for decoder in decoders:
            decoder.stop(grace_s=1.0)
        prefill.stop()
