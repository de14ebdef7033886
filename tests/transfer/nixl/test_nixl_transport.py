"""NIXL as a transport, over UCX TCP between host-memory pools of real daemons (the
prefill ranks are processes): greedy tokens equal transformers' for cp 1-3, every rank
read through NIXL; a byte flipped in a NIXL-read page is caught by the rank's digest and
the rank fetched again over gRPC, as is a rank whose read NIXL failed (each counted by
cause). Also the runs of pages a read moves, UCX's error handling mode, and the
registrations released when a pool is freed or a rank stops."""

from __future__ import annotations

import ctypes
import threading

import grpc
import pytest
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.transfer.connector.fetcher import KVFetcher
from lanekv.transfer.nixl import agent as agent_module
from lanekv.transfer.nixl.runs import PoolRegion, page_runs, read_pairs

from tests.checkpoints import write_llama
from tests.daemons import running_pair
from tests.decode.test_decode_engine import hf_greedy

NEEDS_NIXL = pytest.mark.skipif(not agent_module.available(),
                                reason="NIXL is not installed (pip install 'lanekv[nixl]'; make install does)")
PROMPTS = [[(5 * i + 7) % 120 + 3 for i in range(30)], [9, 8, 7, 6, 5, 4, 3]]


def test_runs_of_pages_are_few_descriptors_per_layer_and_plane():
    assert page_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    remote, local = PoolRegion(1000, 2, 40, 8), PoolRegion(5000, 2, 24, 8)  # page size 4: 10 and 6 pages
    pairs = read_pairs(remote, local, [4, 5, 6, 9], [0, 1, 2, 3], 4, 1, 3)
    assert len(pairs) == 2 * 2 * 2  # runs x layers x planes
    # Layer 1, plane 0, the run of three pages: rows 16-27 remotely, rows 0-11 here.
    assert pairs[0] == (1000 + ((1 * 2 + 0) * 40 + 16) * 8, 5000 + ((1 * 2 + 0) * 24 + 0) * 8, 3 * 4 * 8)
    with pytest.raises(ValueError, match="outside"):
        read_pairs(remote, local, [9, 10], [0, 1], 4, 0, 1)
    with pytest.raises(ValueError, match="planes or row bytes"):
        read_pairs(remote, PoolRegion(0, 1, 24, 8), [0], [0], 4, 0, 1)


@NEEDS_NIXL
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_nixl_over_ucx_tcp_gives_transformers_tokens_and_a_flipped_byte_is_fetched_again(
        cp, tmp_path, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # the rank processes inherit it: UCX over TCP only
    checkpoint = write_llama(tmp_path / "llama", num_layers=2)
    expected = hf_greedy(checkpoint, PROMPTS, 5)
    paths: list[dict[int, str]] = []
    fetch, read = KVFetcher.fetch, agent_module.Agent.read
    flip, fail = threading.Event(), threading.Event()

    def recorded(self, job):
        fetched = fetch(self, job)
        paths.append(dict(fetched.paths))
        return fetched

    def flipping_read(self, remote, memory, pairs, remote_device, local_memory, local_device, deadline):
        if fail.is_set() and f"rank{cp - 1}-" in remote:  # the last rank's first read fails, as NIXL says
            fail.clear()
            raise agent_module.NixlReadFailed(f"a NIXL read from {remote} failed (the peer died or refused it)")
        read(self, remote, memory, pairs, remote_device, local_memory, local_device, deadline)
        if flip.is_set() and f"rank{cp - 1}-" in remote:  # the last rank's first range: one byte flipped
            flip.clear()
            byte = ctypes.c_uint8.from_address(pairs[0][1] + 5)
            byte.value ^= 0x10

    monkeypatch.setattr(KVFetcher, "fetch", recorded)
    monkeypatch.setattr(agent_module.Agent, "read", flipping_read)
    engine = EngineConfig(str(checkpoint), cp_size=cp, page_size=4, pages_per_lane=32, start_timeout_s=120)
    # No decode-side prefix cache: every request moves all its pages.
    with running_pair(engine, transport="nixl", prefix_cache=False) as (_, decode), grpc.insecure_channel(decode.endpoint) as channel:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)

        def generate(ids):
            request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=5)
            return [t for reply in stub.Generate(request, timeout=120) for t in reply.token_ids]

        assert generate(PROMPTS[0]) == expected[0]
        assert paths[-1] == dict.fromkeys(range(cp), "nixl")  # every owner rank read through NIXL
        flip.set()
        assert generate(PROMPTS[0]) == expected[0]
        assert not flip.is_set()  # the flip happened
        assert paths[-1][cp - 1] == "grpc" and all(paths[-1][r] == "nixl" for r in range(cp - 1))
        failures = decode.metrics.failures
        assert failures.labels(cause="nixl_digest").value == 1
        endpoint = decode.prefill_contract.topology.endpoints[cp - 1]
        before = decode.nixl._peers[endpoint]
        fail.set()
        assert generate(PROMPTS[0]) == expected[0]
        assert not fail.is_set()  # the read failed
        assert paths[-1][cp - 1] == "grpc" and all(paths[-1][r] == "nixl" for r in range(cp - 1))
        assert failures.labels(cause="nixl_read").value == 1 and failures.labels(cause="nixl_digest").value == 1
        assert endpoint not in decode.nixl._peers  # its agent dropped: attached again at the next fetch
        assert generate(PROMPTS[0]) == expected[0]
        assert paths[-1] == dict.fromkeys(range(cp), "nixl")
        assert decode.nixl._peers[endpoint].start == before.start
        assert generate(PROMPTS[1]) == expected[1]
        assert paths[-1] == {r: "nixl" for r in paths[-1]}


def _daemons(checkpoint, **prefill_config):
    from lanekv.decode.config import DecodeConfig
    from lanekv.decode.daemon import DecodeDaemon
    from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon

    prefill = PrefillDaemon(EngineConfig(str(checkpoint), cp_size=2, page_size=4, pages_per_lane=32,
                                         start_timeout_s=120), DaemonConfig(lease_s=60.0, **prefill_config))
    try:
        decode = DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=4, pool_pages=96,
                                           device="cpu", transport="nixl", release_timeout_s=1.0,
                                           prefix_cache=False))  # every request moves all its pages
    except BaseException:
        prefill.stop()
        raise
    return prefill, decode


def _generate(endpoint: str, ids, timeout: float = 60.0) -> list[int]:
    with grpc.insecure_channel(endpoint) as channel:
        request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=5)
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
        return [t for reply in stub.Generate(request, timeout=timeout) for t in reply.token_ids]


@NEEDS_NIXL
@pytest.mark.timeout(300)
def test_a_killed_prefill_daemon_ends_a_nixl_fetch_unavailable_naming_it_and_nothing_leaks(tmp_path, monkeypatch):
    import multiprocessing
    import time

    from lanekv.prefill.cp.rank_worker import SLOW_LAYER_ENV

    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv(SLOW_LAYER_ENV, "0:4")  # every prefill sleeps after layer 0: a fetch to cut
    checkpoint = write_llama(tmp_path / "llama", num_layers=3)
    before = {child.pid for child in multiprocessing.active_children()}
    prefill, decode = _daemons(checkpoint)
    ranks = [c for c in multiprocessing.active_children() if c.pid not in before and c.name.startswith("lanekv-cp-rank")]
    try:
        assert len(_generate(decode.endpoint, PROMPTS[1])) == 5  # attached: every rank's agent is known here
        outcome: list = []

        def call():
            try:
                outcome.append(("ok", _generate(decode.endpoint, PROMPTS[0], timeout=60)))
            except grpc.RpcError as err:
                outcome.append((err.code(), err.details()))

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(1.5)  # layer 0 is read, the prefill sleeps
        start = time.monotonic()
        for rank in ranks:  # the whole prefill daemon's engine dies at once
            rank.kill()
        caller.join(30)
        elapsed = time.monotonic() - start
        assert outcome and outcome[0][0] == grpc.StatusCode.UNAVAILABLE, outcome
        assert elapsed < 15
        details = outcome[0][1]
        assert any(name in details for name in (*prefill.topology.endpoints, prefill.endpoint, "lanekv-cp-rank")), details
        stats = decode.stats()
        deadline = time.monotonic() + 10
        while (stats.free_pages != stats.total_pages or stats.active_requests) and time.monotonic() < deadline:
            time.sleep(0.1)
            stats = decode.stats()
        assert stats.free_pages == stats.total_pages and stats.active_requests == 0
        # Every agent loaded here is one a peer is kept for (none half dropped).
        assert decode.nixl._agent._remotes == {peer.agent for peer in decode.nixl._peers.values()}
    finally:
        decode.stop(grace_s=1.0)
        prefill.stop()
    assert decode.nixl is not None and decode.nixl._agent is None  # the registration released at the stop


@NEEDS_NIXL
@pytest.mark.timeout(300)
def test_a_restarted_prefill_daemon_is_never_read_through_the_old_agent(tmp_path, monkeypatch):
    import time

    from tests.reliability.kv_cluster import free_ports

    monkeypatch.setenv("UCX_TLS", "tcp,self")
    checkpoint = write_llama(tmp_path / "llama", num_layers=2)
    expected = hf_greedy(checkpoint, PROMPTS[:1], 5)[0]
    ports = dict(port=free_ports(1), transfer_port_base=free_ports(2))
    old, decode = _daemons(checkpoint, **ports)
    new = None
    try:
        assert _generate(decode.endpoint, PROMPTS[0]) == expected
        old_agents = {endpoint: peer.agent for endpoint, peer in decode.nixl._peers.items()}
        assert len(old_agents) == 2 and all(old.epoch in name for name in old_agents.values())
        old.stop()
        from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon

        new = PrefillDaemon(EngineConfig(str(checkpoint), cp_size=2, page_size=4, pages_per_lane=32,
                                         start_timeout_s=120), DaemonConfig(lease_s=60.0, **ports))
        assert new.epoch != old.epoch and set(new.topology.endpoints) == set(old_agents)
        deadline, tokens = time.monotonic() + 60, None
        while tokens is None and time.monotonic() < deadline:
            try:
                tokens = _generate(decode.endpoint, PROMPTS[0])
            except grpc.RpcError:
                time.sleep(0.5)  # the decode daemon's pick takes the new start back
        assert tokens == expected
        peers = decode.nixl._peers
        assert set(peers) == set(old_agents)
        for endpoint, peer in peers.items():
            assert peer.start == new.epoch and new.epoch in peer.agent and peer.agent != old_agents[endpoint]
        remotes = decode.nixl._agent._remotes
        assert not remotes & set(old_agents.values())  # the old agents are gone, not merely unused
    finally:
        decode.stop(grace_s=1.0)
        old.stop()
        if new is not None:
            new.stop()


@NEEDS_NIXL
@pytest.mark.timeout(60)
def test_ucx_error_handling_is_never_none_and_registrations_are_released(monkeypatch):
    """UCX's error handling mode as NIXL runs it is ``peer`` (``none`` would hang reads from
    a dead peer); a rank's export and the decode side's transport release their
    registrations when the rank stops and when a pool is freed."""
    import time

    import torch
    from lanekv.transfer.connector.nixl import NixlTransport
    from lanekv.transfer.nixl.export import NixlExport

    from tests.reliability.kv_cluster import make_agreement

    monkeypatch.setenv("UCX_TLS", "tcp,self")
    agent = agent_module.Agent("lanekv-test-errmode")
    try:
        assert agent.backend_params()["ucx_error_handling_mode"] == agent_module.ERROR_HANDLING_MODE == "peer"
        # A read NIXL refuses (here: a peer it does not know) has nothing in flight: NixlReadFailed,
        # which the transport may send to gRPC.
        local = torch.zeros(64, dtype=torch.uint8)
        agent.register(local)
        with pytest.raises(agent_module.NixlReadFailed, match="lanekv-nobody"):
            agent.read("lanekv-nobody", "DRAM", [(4096, local.data_ptr(), 64)], 0, "DRAM", 0,
                       time.monotonic() + 5)
    finally:
        agent.close()

    pool = torch.zeros(2, 2, 16, 2, 8)
    export = NixlExport(pool, 0, "start-1")
    reply = export.attach()
    assert "start-1" in reply.agent_name and reply.pool_bytes == pool.numel() * 4 and reply.memory == "DRAM"
    assert export.attach() is reply  # one agent and one registration per start, however many attach
    held = export._agent
    assert held.registrations == 2  # the pool and its staging region of head ranges (at most the pool's size)
    assert reply.staging_bytes == pool.numel() * 4 and reply.staging_addr == export._staging.buffer.data_ptr()
    export.close()  # the rank drains or stops
    assert held.registrations == 0 and not export.attached
    with pytest.raises(RuntimeError, match="closed"):
        export.attach()

    transport = NixlTransport(None, make_agreement(num_layers=2))
    first, second = torch.zeros(2, 2, 16, 2, 8), torch.zeros(2, 2, 8, 2, 8)
    transport._register(first)
    transport._register(second)
    transport._register(first)  # registered once
    assert transport._agent.registrations == 2
    assert transport.release_pool(first) and transport._agent.registrations == 1
    assert not transport.release_pool(first)  # released already
    agent = transport._agent
    transport.close()  # the decode daemon drains
    assert agent.registrations == 0 and transport._agent is None


def test_ucx_tcp_defaults_fill_only_what_the_operator_left_unset():
    environ = {"UCX_TLS": "tcp,self", "UCX_TCP_TX_SEG_SIZE": "64k"}
    added = agent_module.apply_ucx_defaults(environ)
    assert "UCX_TCP_TX_SEG_SIZE" not in added and environ["UCX_TCP_TX_SEG_SIZE"] == "64k"
    assert environ["UCX_TCP_RX_SEG_SIZE"] == added["UCX_TCP_RX_SEG_SIZE"] == "512k"
    assert environ["UCX_RNDV_FRAG_SIZE"] == "host:8m,cuda:8m" and environ["UCX_TLS"] == "tcp,self"
    assert agent_module.apply_ucx_defaults(environ) == {}  # nothing left to fill
