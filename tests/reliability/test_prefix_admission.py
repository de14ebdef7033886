"""Verified admission into the decode side's prefix cache.

A decode daemon whose receive path damages chunk messages (as
``test_corruption`` does): the damaged chunks are fetched again, and the pages
the decode cache admits hold the bytes the prefill ranks wrote; a later hit
of the same prompt reads them and generates the clean tokens. A fetch that
fails (every message damaged) admits nothing, and both sides settle.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2_grpc
from lanekv.transfer.grpcfetch import spans as spans_module
from lanekv.transfer.protocol.wire import frame_chunk, split_chunk

from tests.checkpoints import write_llama
from tests.prefix_checks import generate, page_bytes, settled
from tests.reliability.kv_cluster import generate_request, tokens, wait_until

Code = grpc.StatusCode
PAGE_SIZE = 4
NEW_TOKENS = 5
CHUNK_BYTES = 2 * (2 * PAGE_SIZE * 2 * 16 * 4)  # two pages of one layer of write_llama, float32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    checkpoint = write_llama(tmp_path_factory.mktemp("admission-llama"))
    prefill = PrefillDaemon(
        EngineConfig(str(checkpoint), cp_size=2, page_size=PAGE_SIZE, pages_per_lane=64, start_timeout_s=120),
        DaemonConfig(lease_s=30),
    )
    decode = DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=PAGE_SIZE, pool_pages=160,
                                       transport="grpc", device="cpu", fetch_chunk_bytes=CHUNK_BYTES,
                                       fetch_attempts=4))
    channel = grpc.insecure_channel(decode.endpoint)
    yield prefill, decode, lanekv_pb2_grpc.DecodeServiceStub(channel)
    channel.close()
    decode.stop(grace_s=1.0)
    prefill.stop()


@pytest.fixture
def damage(monkeypatch):
    """Flip a payload bit of chunk message n (from 1) when ``n % every == 0``."""
    state = {"every": 0, "seen": 0, "damaged": 0}

    def damaging_split(message):
        header, data = split_chunk(message)
        state["seen"] += 1
        if state["every"] and state["seen"] % state["every"] == 0:
            state["damaged"] += 1
            bad = bytearray(data)
            bad[data.nbytes // 3] ^= 0x10
            return split_chunk(frame_chunk(bytes(header), bytes(bad)))
        return header, data

    monkeypatch.setattr(spans_module, "split_chunk", damaging_split)
    return state


def _cached_bytes_agree(prefill, decode, ids) -> int:
    """The decode cache's pages of ``ids`` equal the prefill ranks' pages, bit for bit; how many."""
    n = (len(ids) - 1) // PAGE_SIZE
    theirs = prefill.cache.match(ids)  # logical pages, held while read
    ours = decode.prefix_cache.match(ids, n, count=False)
    try:
        assert len(ours) == len(theirs) == n
        kv = prefill.engine.read_pages(theirs)
        rows = torch.cat([torch.arange(p * PAGE_SIZE, (p + 1) * PAGE_SIZE) for p in ours])
        assert torch.equal(decode.pool.tensor[:, :, rows], kv)
    finally:
        prefill.cache.free(theirs)
        decode.pool.free(ours)
    return n


def _settled(prefill, decode) -> bool:
    stats = decode.stats()
    return (prefill.cache.held_pages == 0 and prefill.leases.held() == {} and stats.reserved_pages == 0
            and stats.active_requests == 0
            and decode.pool.free_list_count == decode.pool.num_pages - decode.prefix_cache.kept())


@pytest.mark.timeout(120)
def test_damaged_chunks_are_fetched_again_and_only_good_bytes_are_admitted(pair, damage):
    prefill, decode, stub = pair
    prompt = list(range(30, 73))  # 10 whole pages and 3 tokens
    damage["every"] = 3
    first = tokens(stub, generate_request(prompt, NEW_TOKENS))
    assert damage["damaged"] >= 3
    damage["every"] = 0
    assert _cached_bytes_agree(prefill, decode, prompt) == 10
    # A later hit reads the admitted pages: only the last page moves, the tokens are the clean ones.
    admitted = decode.prefix_cache.stats.admitted_pages
    assert tokens(stub, generate_request(prompt, NEW_TOKENS)) == first
    assert decode.prefix_cache.stats.admitted_pages == admitted
    decode.prefix_cache.clear()
    prefill.cache.clear()
    damage["every"] = 0
    assert tokens(stub, generate_request(prompt, NEW_TOKENS)) == first  # recomputed and moved again: the same
    assert wait_until(lambda: _settled(prefill, decode))


@pytest.mark.timeout(120)
def test_a_failed_fetch_admits_nothing(pair, damage):
    prefill, decode, stub = pair
    prompt = list(range(100, 131))  # 7 whole pages and 3 tokens
    before = decode.prefix_cache.cached_pages
    damage["every"] = 1
    with pytest.raises(grpc.RpcError) as caught:
        tokens(stub, generate_request(prompt, NEW_TOKENS))
    assert caught.value.code() == Code.DATA_LOSS
    assert decode.prefix_cache.cached_pages == before
    assert decode.prefix_cache.peek(prompt) == 0
    assert wait_until(lambda: _settled(prefill, decode))
    damage["every"] = 0
    # The prefill side cached its pages (its prefill succeeded): the retry computes only the
    # last page (cached_tokens: the seven skipped) and, the decode cache holding none, moves all.
    retried = generate(stub, prompt, NEW_TOKENS)
    got = retried.tokens
    assert retried.cached_tokens == 7 * PAGE_SIZE and retried.moved_bytes == 8 * page_bytes(decode)
    assert got and _cached_bytes_agree(prefill, decode, prompt) == 7
    decode.prefix_cache.clear()
    prefill.cache.clear()
    again = generate(stub, prompt, NEW_TOKENS)
    assert again.tokens == got and again.cached_tokens == 0  # all computed and moved: the same
    assert wait_until(lambda: _settled(prefill, decode))
    settled(prefill, decode)  # and the caches empty to the whole pools
