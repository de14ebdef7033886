"""The decode daemon against a real CP-2 prefill daemon on loopback: refusals
of bad input (and serving on afterwards), no page leaked on either side after
finished, cancelled, timed-out and refused requests, the page budget, its own
KVTransfer endpoint, and ``lanekv decode`` subprocesses that refuse to start
against a prefill daemon with another page size, dtype, weights or RoPE.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from lanekv.decode.config import AUTO_FETCH_PROCESSES, DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc

from lanekv.client_commands import fetch_contract
from tests.checkpoints import write_deepseek_v3, write_llama

REPO = Path(__file__).resolve().parents[2]
PAGE_SIZE = 4
POOL_PAGES = 240
# Greedy on write_llama's weights, this prompt runs 900 tokens without an end-of-sequence
# token: long enough (seconds on a CPU) to be cancelled or to fill the pool midway.
LONG_PROMPT = [11, 12, 13, 14, 15]
LONG_NEW_TOKENS = 900  # (5 + 899) / 4 = 226 of the 240 pool pages
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("decode-daemon-llama"))


@pytest.fixture(scope="module")
def prefill(checkpoint):
    daemon = PrefillDaemon(
        EngineConfig(str(checkpoint), cp_size=2, page_size=PAGE_SIZE, pages_per_lane=128, start_timeout_s=120),
        DaemonConfig(lease_s=600),
    )
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def decode(checkpoint, prefill):
    daemon = DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=PAGE_SIZE,
                                       pool_pages=POOL_PAGES, device="cpu", page_wait_s=0.3))
    yield daemon
    daemon.stop(grace_s=1.0)


@pytest.fixture(scope="module")
def stub(decode):
    with grpc.insecure_channel(decode.endpoint) as channel:
        yield lanekv_pb2_grpc.DecodeServiceStub(channel)


def _request(ids, max_new_tokens, **kw) -> lanekv_pb2.GenerateRequest:
    return lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=max_new_tokens, **kw)


def _tokens(stub, request, timeout=60) -> list[int]:
    return [t for reply in stub.Generate(request, timeout=timeout) for t in reply.token_ids]


def _wait_until(predicate, timeout_s=10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def _settled(decode, prefill, prefill_free) -> bool:
    stats = decode.stats()
    return (stats.free_pages == POOL_PAGES and stats.reserved_pages == 0 and stats.active_requests == 0
            and prefill.engine.allocator.free_counts() == prefill_free and prefill.leases.held() == {})


@pytest.mark.timeout(60)
def test_bad_input_gets_a_status_and_the_daemon_serves_on(decode, prefill, stub):
    prefill_free = prefill.engine.allocator.free_counts()
    refused_before = decode.stats().refused
    bad = [
        (lanekv_pb2.GenerateRequest(max_new_tokens=4), Code.INVALID_ARGUMENT, "give text or token_ids"),
        (_request([], 4), Code.INVALID_ARGUMENT, "no tokens"),
        (_request([5, 300], 4), Code.INVALID_ARGUMENT, "outside the vocabulary"),
        (_request([5, -1], 4), Code.INVALID_ARGUMENT, "outside the vocabulary"),
        (_request([5, 6], 0), Code.INVALID_ARGUMENT, "max_new_tokens"),
        (_request([5] * 10, 1015), Code.OUT_OF_RANGE, "1024 positions"),
        (_request([5] * 1025, 1), Code.OUT_OF_RANGE, "tokens"),
        (_request([5, 6], 4, stop_token_ids=[7, 300]), Code.INVALID_ARGUMENT, "stop_token_ids"),
        (_request([5, 6], 4, request_id=""), Code.INVALID_ARGUMENT, "request_id"),
        (lanekv_pb2.GenerateRequest(text="hello", max_new_tokens=4), Code.INVALID_ARGUMENT, "tokenizer"),
        (_request([5, 6], 4, sampling=lanekv_pb2.SamplingParams(temperature=-1)), Code.INVALID_ARGUMENT,
         "temperature"),
        # (10 + 999) / 4 = 253 pages: more than the whole pool, refused before any prefill
        (_request([5] * 10, 1000), Code.RESOURCE_EXHAUSTED, f"the decode pool has {POOL_PAGES}"),
    ]
    for request, code, text in bad:
        with pytest.raises(grpc.RpcError) as err:
            _tokens(stub, request)
        assert err.value.code() == code, (request, err.value.details())
        assert text in err.value.details()
    assert decode.stats().refused - refused_before == len(bad)
    # Nothing was prefilled for any of them, and the daemon still serves.
    assert prefill.engine.allocator.free_counts() == prefill_free
    assert len(_tokens(stub, _request([5, 6, 7], 5))) == 5
    # A stop id ends the generation, with the stop token as its last output.
    full = _tokens(stub, _request([5, 6, 7], 8))
    stopped = _tokens(stub, _request([5, 6, 7], 8, stop_token_ids=[full[3]]))
    assert stopped == full[: full.index(full[3]) + 1]
    assert _wait_until(lambda: _settled(decode, prefill, prefill_free))


@pytest.mark.timeout(90)
def test_no_page_leaks_after_finished_cancelled_and_refused_requests(decode, prefill, stub):
    prefill_free = prefill.engine.allocator.free_counts()
    before = decode.stats()
    assert before.free_pages == POOL_PAGES

    # Finished: a few short requests at once.
    outs: list = []
    threads = [threading.Thread(target=lambda n=n: outs.append(_tokens(stub, _request(list(range(3, 3 + n)), 6))))
               for n in (1, 17, 40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(outs) == 3 and all(1 <= len(o) <= 6 for o in outs)

    # Cancelled midway: a long stream the client leaves after three replies.
    call = stub.Generate(_request(LONG_PROMPT, LONG_NEW_TOKENS, request_id="long"), timeout=120)
    received = [next(call) for _ in range(3)]
    assert not any(r.finished for r in received)
    # While it holds 226 of 240 pages: the same id again, and a request that must wait for pages.
    with pytest.raises(grpc.RpcError) as err:
        _tokens(stub, _request([5, 6], 4, request_id="long"))
    assert err.value.code() == Code.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as err:
        _tokens(stub, _request([5] * 10, 60))  # 18 pages
    assert err.value.code() == Code.RESOURCE_EXHAUSTED and "stayed full" in err.value.details()
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == Code.CANCELLED

    # Timed out by its deadline while streaming.
    with pytest.raises(grpc.RpcError) as err:
        _tokens(stub, _request(LONG_PROMPT, LONG_NEW_TOKENS), timeout=0.5)
    assert err.value.code() == Code.DEADLINE_EXCEEDED

    assert _wait_until(lambda: _settled(decode, prefill, prefill_free)), (
        decode.stats(), prefill.engine.allocator.free_counts(), prefill.leases.held())
    after = decode.stats()
    assert after.cancelled - before.cancelled == 2
    assert after.finished - before.finished == 3
    # The pool is whole again: the long request now fits, and runs to its end.
    assert len(_tokens(stub, _request(LONG_PROMPT, 300))) == 300
    assert _wait_until(lambda: _settled(decode, prefill, prefill_free))


@pytest.mark.timeout(30)
def test_decode_serves_its_contract_and_no_pages(decode, prefill):
    ours = fetch_contract(decode.endpoint, timeout=10)
    assert ours.agreement == prefill.contract.agreement
    assert ours.topology == prefill.topology  # the topology it was told
    with grpc.insecure_channel(decode.endpoint) as channel:
        kv = lanekv_pb2_grpc.KVTransferStub(channel)
        reply = kv.Handshake(lanekv_pb2.HandshakeRequest(contract=prefill.contract.agreement.encode()), timeout=10)
        assert reply.ok and reply.fingerprint == prefill.contract.fingerprint
        fingerprint = prefill.contract.fingerprint
        with pytest.raises(grpc.RpcError) as err:
            list(kv.FetchKV(lanekv_pb2.FetchRequest(request_id="x", fingerprint=fingerprint), timeout=10))
        assert err.value.code() == Code.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            kv.Release(lanekv_pb2.ReleaseRequest(request_id="x", fingerprint=fingerprint), timeout=10)
        assert err.value.code() == Code.NOT_FOUND


@pytest.mark.timeout(180)
def test_decode_refuses_to_start_against_a_mismatched_prefill(checkpoint, prefill, tmp_path):
    other_weights = write_llama(tmp_path / "seed7", seed=7)
    other_rope = tmp_path / "rope"
    shutil.copytree(checkpoint, other_rope)
    config = json.loads((other_rope / "config.json").read_text())
    # Newer transformers write theta inside rope_parameters, older ones beside it.
    config.get("rope_parameters", config)["rope_theta"] = 20000.0
    (other_rope / "config.json").write_text(json.dumps(config))
    cases = {  # field named in the diff -> what differs from the prefill daemon
        "page_size": (checkpoint, ["--page-size", "16"]),
        "kv_dtype": (checkpoint, ["--dtype", "float16"]),
        "weights_digest": (other_weights, []),
        "rope.theta": (other_rope, []),
        # An MLA decode daemon against a GQA prefill daemon.
        "attention": (write_deepseek_v3(tmp_path / "deepseek"), []),
    }
    prefill_free = prefill.engine.allocator.free_counts()
    procs = {}
    for field, (model, flags) in cases.items():
        ready = tmp_path / f"ready-{field}"
        cmd = [sys.executable, "-m", "lanekv.cli", "decode", "--model", str(model), "--prefill", prefill.endpoint,
               "--page-size", str(PAGE_SIZE), "--device", "cpu", "--ready-file", str(ready), *flags]
        procs[field] = (ready, subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                text=True))
    try:
        for field, (ready, proc) in procs.items():
            # A daemon that wrongly starts writes its ready file: fail then, not at the timeout.
            deadline = time.monotonic() + 150
            while proc.poll() is None and not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            if proc.poll() is None:
                proc.kill()
            out, err = proc.communicate(timeout=10)
            assert proc.returncode == 1, (field, out, err)
            assert "disagree on the layout contract" in err and f"\n{field}: decode=" in err, (field, err)
            assert not ready.exists() and "serving" not in out
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert prefill.engine.allocator.free_counts() == prefill_free
    assert prefill.leases.held() == {}


@pytest.mark.timeout(120)
def test_health_says_not_serving_while_no_prefill_daemon_can_take_a_prompt(checkpoint):
    """Its only prefill daemon gone, a decode daemon's health turns NOT_SERVING (a front
    or an orchestrator then sends elsewhere) and a Generate is UNAVAILABLE naming it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    own_prefill = PrefillDaemon(EngineConfig(str(checkpoint), cp_size=1, page_size=PAGE_SIZE, pages_per_lane=64,
                                             start_timeout_s=120), DaemonConfig(lease_s=60))
    lonely = None
    try:
        lonely = DecodeDaemon(DecodeConfig(str(checkpoint), own_prefill.endpoint, page_size=PAGE_SIZE,
                                           pool_pages=64, device="cpu", prefill_health_interval_s=0.2))
        with grpc.insecure_channel(lonely.endpoint) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def status() -> int:
                return health.Check(health_pb2.HealthCheckRequest(service="lanekv.v1.DecodeService"),
                                    timeout=5).status

            assert status() == health_pb2.HealthCheckResponse.SERVING
            assert _tokens(lanekv_pb2_grpc.DecodeServiceStub(channel), _request([5, 6, 7], 2)) != []
            own_prefill.stop()
            assert _wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 10.0)
            with pytest.raises(grpc.RpcError) as err:
                _tokens(lanekv_pb2_grpc.DecodeServiceStub(channel), _request([5, 6, 7], 2), timeout=20)
            assert err.value.code() == Code.UNAVAILABLE and own_prefill.endpoint in err.value.details()
    finally:
        if lonely is not None:
            lonely.stop(grace_s=1.0)
        own_prefill.stop()


def test_receiver_processes_are_sized_to_the_streams_of_a_fetch(checkpoint, monkeypatch):
    """On a GPU, by default, no stream of one fetch is received in a thread of the daemon:
    fetch_streams x the largest prefill CP processes, at least the 4 started at load."""
    config = DecodeConfig(str(checkpoint), "127.0.0.1:1", page_size=PAGE_SIZE, device="cpu")
    assert config.fetch_processes_for([4]) == 0  # CPU pools: threads here
    monkeypatch.setattr(DecodeConfig, "resolved_device", property(lambda self: "cuda"))
    assert config.resolved_fetch_processes == 4 and config.resolved_fetch_streams == 2
    assert config.fetch_processes_for([]) == 4
    assert config.fetch_processes_for([1, 2]) == 4
    assert config.fetch_processes_for([2, 3]) == 6
    assert config.fetch_processes_for([16]) == AUTO_FETCH_PROCESSES
    assert replace(config, fetch_streams=4).fetch_processes_for([3]) == 12
    assert replace(config, fetch_processes=2).fetch_processes_for([8]) == 2  # the setting wins

    class Pool:
        size = 4

        def grow_to(self, count):
            self.size = count
            return count

    def sized(contracts, receivers):
        fake = SimpleNamespace(config=config, kv=SimpleNamespace(receivers=receivers))
        DecodeDaemon._size_receivers(fake, contracts)
        return receivers

    topology = SimpleNamespace(topology=SimpleNamespace(cp_size=3))
    assert sized({"a:1": topology, "b:2": None}, Pool()).size == 6  # a daemon not reached counts nothing
    assert sized({"a:1": None}, Pool()).size == 4
    assert sized({"a:1": topology}, None) is None  # no receivers: nothing to grow
    # A prefill daemon that joins after start, with a larger CP, adds its streams' receivers.
    joined = SimpleNamespace(topology=SimpleNamespace(cp_size=5))
    fake = SimpleNamespace(config=config, kv=SimpleNamespace(receivers=Pool()),
                           _handshake=lambda endpoint, patient: joined)
    fake._size_receivers = lambda contracts: DecodeDaemon._size_receivers(fake, contracts)
    assert DecodeDaemon._rejoin(fake, "c:3") is joined.topology and fake.kv.receivers.size == 10
