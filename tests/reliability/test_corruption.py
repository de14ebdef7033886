"""Corruption: damaged chunks are caught, fetched again, and never placed.

``KVClient`` against in-process KVTransfer servers whose ``frame`` hook damages
chosen chunks on their first sending (a payload bit, a truncated payload, a
header byte, a well-formed header naming another page): every damaged chunk
is caught (checksum, header checks, the tiling of the span), only the missing
cells are fetched again, every placed payload is the one the server read from
its pool, each cell once. A chunk damaged on every sending fails the fetch
with ``ChecksumError`` after the policy's tries.

Then through the daemons: a CP-2 prefill daemon and a decode daemon whose
receive path damages every third chunk message: the tokens equal those of a
clean run, every scatter into the decode pool copies a genuine payload, and
each damaged message cost one retry. Damage on every message ends the call
with DATA_LOSS, and no page is left held on either side.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc
import pytest
import torch
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2_grpc
from lanekv.transfer.grpcfetch import spans as spans_module
from lanekv.transfer.grpcfetch.client import ChecksumError, CorruptChunk, KVClient, RetryPolicy
from lanekv.transfer.protocol.wire import ChunkHeader, checksum, frame_chunk, split_chunk
from lanekv.transfer.rank.service import KVTransferService

from tests.checkpoints import write_llama
from tests.reliability.kv_cluster import (
    LAYERS,
    PAGE_LAYER_BYTES,
    generate_request,
    placer,
    same_bits,
    settled,
    start_servers,
    tokens,
    wait_until,
)

Code = grpc.StatusCode
NUM_PAGES = 13
CHUNK_BYTES = 2 * PAGE_LAYER_BYTES
RETRY = RetryPolicy(attempts=3, backoff_s=0.01)
TIMEOUT_S = 10.0


def _flip(data, at: int) -> bytes:
    damaged = bytearray(data)
    damaged[at] ^= 0x10
    return bytes(damaged)


def _damage(kind: str, header: ChunkHeader, data: memoryview, other_page: int) -> bytes:
    """The framed chunk, damaged as ``kind`` says."""
    encoded = header.encode()
    if kind == "payload-bit":
        return frame_chunk(encoded, _flip(data, data.nbytes // 2))
    if kind == "payload-truncated":
        return frame_chunk(encoded, bytes(data)[:-8])
    if kind == "header-byte":
        return frame_chunk(_flip(encoded, len(encoded) // 2), data)
    if kind == "header-page":  # well-formed, checksum right, but it names another page
        return frame_chunk(dataclasses.replace(header, pages=(other_page, *header.pages[1:])).encode(), data)
    raise ValueError(f"unknown kind {kind!r}")


def _payload_checksum(tensor: torch.Tensor) -> int:
    return checksum(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))


@pytest.fixture
def damaging(monkeypatch):
    """Patch the servers' ``frame``: chunks whose (rank, layer_start) is in ``plan`` are damaged
    (the first chunk of that layer; once, or on every sending when ``always``); every genuine
    chunk's checksum is kept by (rank, layer_start, layer_end, pages)."""
    state = {"plan": {}, "always": False, "damaged": 0, "genuine": {}}
    frame = KVTransferService.frame

    def framed(self, header, data):
        key = (header.rank, header.layer_start, header.layer_end, header.pages)
        state["genuine"][key] = header.checksum
        kind = state["plan"].get((header.rank, header.layer_start))
        first_of_layer = header.pages[0] == min(p for p, _ in self._source.pages_of(header.request_id))
        if kind is not None and first_of_layer:
            if not state["always"]:
                del state["plan"][header.rank, header.layer_start]
            state["damaged"] += 1
            owned = [p for p, _ in self._source.pages_of(header.request_id)]
            return _damage(kind, header, data, next(p for p in owned if p not in header.pages))
        return frame(self, header, data)

    monkeypatch.setattr(KVTransferService, "frame", framed)
    return state


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["payload-bit", "payload-truncated", "header-byte", "header-page"])
def test_damaged_chunks_are_fetched_again_and_never_placed(damaging, kind):
    cluster = start_servers(2, NUM_PAGES)
    try:
        damaging["plan"].update({(0, 1): kind, (1, 3): kind})
        dest, log, placed = torch.zeros_like(cluster.full), [], []
        place = placer(dest, log)

        def checked_place(header, tensor):
            placed.append(((header.rank, header.layer_start, header.layer_end, header.pages),
                           _payload_checksum(tensor)))
            place(header, tensor)

        with KVClient(retry=RETRY) as kv:
            stats = kv.fetch(cluster.endpoints, "req", cluster.fingerprint, checked_place,
                             max_chunk_bytes=CHUNK_BYTES, timeout=TIMEOUT_S, layer_end=LAYERS,
                             pages={r: cluster.pages_of(r) for r in (0, 1)})
        assert damaging["damaged"] == 2 and (stats.per_rank[0].retries, stats.per_rank[1].retries) == (1, 1)
        assert same_bits(dest, cluster.full)
        assert len(log) == len(set(log)) == LAYERS * NUM_PAGES
        # Every placed payload is the one its server read from the pool, under its true header.
        assert all(damaging["genuine"][key] == digest for key, digest in placed)
    finally:
        cluster.stop()


@pytest.mark.timeout(30)
def test_a_chunk_damaged_every_time_fails_the_fetch(damaging):
    cluster = start_servers(2, NUM_PAGES)
    try:
        damaging.update(always=True)
        damaging["plan"][1, 2] = "payload-bit"
        log: list = []
        with KVClient(retry=RETRY) as kv:
            start = time.monotonic()
            with pytest.raises(ChecksumError) as caught:
                kv.fetch(cluster.endpoints, "req", cluster.fingerprint, placer(torch.zeros_like(cluster.full), log),
                         max_chunk_bytes=CHUNK_BYTES, timeout=TIMEOUT_S, layer_end=LAYERS,
                         pages={r: cluster.pages_of(r) for r in (0, 1)})
        assert caught.value.rank == 1 and "after 3 tries" in str(caught.value)
        assert caught.value.code == Code.DATA_LOSS and time.monotonic() - start < 2.0
        assert damaging["damaged"] == 3
        first_run = tuple(cluster.pages_of(1)[:2])
        assert not any((1, 2, page) in log for page in first_run)  # the damaged cells never placed
        assert len(log) == len(set(log))
    finally:
        cluster.stop()


# -- through the daemons ---------------------------------------------------------------

PAGE_SIZE = 4
PROMPT = list(range(30, 70))  # 10 pages: 5 on each rank, 3 chunks per layer
NEW_TOKENS = 6
DAEMON_CHUNK_BYTES = 2 * (2 * PAGE_SIZE * 2 * 16 * 4)  # two pages of one layer of write_llama, float32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    checkpoint = write_llama(tmp_path_factory.mktemp("corruption-llama"))
    prefill = PrefillDaemon(
        EngineConfig(str(checkpoint), cp_size=2, page_size=PAGE_SIZE, pages_per_lane=64, start_timeout_s=120),
        DaemonConfig(lease_s=30, prefix_cache=False),  # every run moves every page (test_prefix_admission: cached)
    )
    decode = DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=PAGE_SIZE, pool_pages=160, transport="grpc",
                                       device="cpu", fetch_chunk_bytes=DAEMON_CHUNK_BYTES, fetch_attempts=4,
                                       prefix_cache=False))
    channel = grpc.insecure_channel(decode.endpoint)
    yield prefill, decode, lanekv_pb2_grpc.DecodeServiceStub(channel)
    channel.close()
    decode.stop(grace_s=1.0)
    prefill.stop()


@pytest.fixture
def receive_damage(monkeypatch):
    """Damage chunk messages where the decode daemon receives them: message n (from 1) when
    ``n % every == 0``, a payload bit or (every other time) a header byte."""
    state = {"every": 0, "seen": 0, "damaged": 0, "genuine": set()}
    split = split_chunk

    def damaging_split(message):
        header_bytes, data = split(message)
        state["genuine"].add(ChunkHeader.decode(header_bytes).checksum)
        state["seen"] += 1
        if state["every"] and state["seen"] % state["every"] == 0:
            state["damaged"] += 1
            if state["damaged"] % 2:
                return split(frame_chunk(bytes(header_bytes), _flip(data, data.nbytes // 3)))
            return split(frame_chunk(_flip(header_bytes, len(header_bytes) // 2), data))
        return header_bytes, data

    monkeypatch.setattr(spans_module, "split_chunk", damaging_split)
    return state


@pytest.mark.timeout(60)
def test_generate_with_damaged_chunks_equals_a_clean_run(pair, receive_damage, monkeypatch, caplog):
    prefill, decode, stub = pair
    free = prefill.engine.allocator.free_counts()
    clean = tokens(stub, generate_request(PROMPT, NEW_TOKENS))
    # Every copy into the decode pool (a scatter, or one copy per run of pages on a host
    # pool) copies a payload whose checksum a server computed.
    import lanekv.transfer.connector.placement as placement

    scatter, runs, scattered = placement.scatter_pages, placement._place_runs, []

    def checked_scatter(buf, *args, **kwargs):
        scattered.append(_payload_checksum(buf) in receive_damage["genuine"])
        return scatter(buf, *args, **kwargs)

    def checked_runs(pool, physical, payload, *args):
        genuine = _payload_checksum(payload) in receive_damage["genuine"]
        placed = runs(pool, physical, payload, *args)
        if placed:
            scattered.append(genuine)
        return placed

    monkeypatch.setattr(placement, "scatter_pages", checked_scatter)
    monkeypatch.setattr(placement, "_place_runs", checked_runs)
    caplog.set_level(logging.INFO, logger="lanekv.decode")
    receive_damage["every"] = 3
    assert tokens(stub, generate_request(PROMPT, NEW_TOKENS, request_id="damaged")) == clean
    assert receive_damage["damaged"] >= 3 and scattered and all(scattered)
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("transfer done request_id=damaged ")]
    assert len(done) == 1 and f" retries={receive_damage['damaged']} " in done[0], (done, receive_damage)
    assert wait_until(lambda: settled(decode, prefill, free))

    # Damage on every message: the call ends with DATA_LOSS and gives everything back.
    receive_damage["every"] = 1
    with pytest.raises(grpc.RpcError) as caught:
        tokens(stub, generate_request(PROMPT, NEW_TOKENS))
    assert caught.value.code() == Code.DATA_LOSS and "after 4 tries" in caught.value.details()
    assert wait_until(lambda: settled(decode, prefill, free))
    receive_damage["every"] = 0
    assert tokens(stub, generate_request(PROMPT, NEW_TOKENS)) == clean


def test_corrupt_chunk_is_the_data_loss_error():
    assert issubclass(ChecksumError, CorruptChunk) and CorruptChunk.code == Code.DATA_LOSS
