"""NIXL as a transport, over UCX TCP between host-memory pools of real daemons (the
prefill ranks are processes): greedy tokens equal transformers' for cp 1-3, every rank
read through NIXL; a byte flipped in a NIXL-read page is caught by the rank's digest and
the rank fetched again over gRPC. Also the runs of pages a read moves."""

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
    flip = threading.Event()

    def recorded(self, job):
        fetched = fetch(self, job)
        paths.append(dict(fetched.paths))
        return fetched

    def flipping_read(self, remote, memory, pairs, remote_device, local_memory, local_device, deadline):
        read(self, remote, memory, pairs, remote_device, local_memory, local_device, deadline)
        if flip.is_set() and f"rank{cp - 1}-" in remote:  # the last rank's first range: one byte flipped
            flip.clear()
            byte = ctypes.c_uint8.from_address(pairs[0][1] + 5)
            byte.value ^= 0x10

    monkeypatch.setattr(KVFetcher, "fetch", recorded)
    monkeypatch.setattr(agent_module.Agent, "read", flipping_read)
    engine = EngineConfig(str(checkpoint), cp_size=cp, page_size=4, pages_per_lane=32, start_timeout_s=120)
    with running_pair(engine, transport="nixl") as (_, decode), grpc.insecure_channel(decode.endpoint) as channel:
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
        assert generate(PROMPTS[1]) == expected[1]
        assert paths[-1] == {r: "nixl" for r in paths[-1]}
