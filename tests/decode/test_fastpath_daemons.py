"""Layer-wise streaming and the fast path through real daemons.

- PrefillStream: the pages first (first_token -1), then the first token;
  a FetchKV between the two gets every byte, equal to a fetch after it;
- a decode daemon whose prefill has answered before the fetch copies every
  rank's pages from where the owner-lane rule puts them, before any
  announcement, and generates the same tokens; by default a fetch that
  begins while the prefill runs waits for its answer and does the same;
- a decode daemon whose digests never match (patched here) fetches every
  rank again over gRPC and generates the same tokens, counting the cause;
- on a GPU: the decode daemon maps the ranks' pools over CUDA IPC and
  generates what a gRPC decode daemon generates.
"""

from __future__ import annotations

import logging
import time

import grpc
import pytest
import torch
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.decode.prefill_call import PrefillCall
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.transfer.fastpath.client import FastPath
from lanekv.transfer.fastpath.rankfetch import RankFetch
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY, access_ticket
from lanekv.transfer.protocol.manifest import Manifest

from tests.checkpoints import write_llama
from tests.daemons import running_pair
from tests.markers import requires_gpu
from tests.reliability.kv_cluster import generate_request, wait_until

PAGE_SIZE = 4
PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("fastpath-llama"))


def _engine(checkpoint, **kw) -> EngineConfig:
    return EngineConfig(str(checkpoint), cp_size=2, page_size=PAGE_SIZE, pages_per_lane=64, start_timeout_s=120, **kw)


def _tokens(endpoint: str, ids=PROMPT, **kw) -> list[int]:
    with grpc.insecure_channel(endpoint) as channel:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
        return [t for reply in stub.Generate(generate_request(ids, NEW_TOKENS, **kw), timeout=60)
                for t in reply.token_ids]


def _fetch_all(kv: KVClient, reply, epoch, num_layers: int) -> dict:
    cells = {}

    def place(header, tensor):
        for i, page in enumerate(header.pages):
            for layer in range(header.layer_start, header.layer_end):
                rows = tensor[layer - header.layer_start, :, i * PAGE_SIZE:(i + 1) * PAGE_SIZE]
                cells[layer, page] = rows.clone()

    manifest = Manifest.decode(reply.manifest)
    owners = sorted({p.owner for p in manifest.pages})
    kv.fetch({r: reply.endpoints[r] for r in owners}, reply.request_id, reply.contract_fingerprint, place,
             timeout=30, layer_end=num_layers, epoch=epoch, max_chunk_bytes=1 << 12)
    return cells


@pytest.mark.timeout(120)
def test_prefill_stream_sends_pages_first_and_a_fetch_between_gets_every_byte(checkpoint):
    with running_pair(_engine(checkpoint), pool_pages=64) as (prefill, decode):
        num_layers = decode.agreement.num_layers
        with grpc.insecure_channel(prefill.endpoint) as channel, KVClient() as kv:
            stub = lanekv_pb2_grpc.PrefillServiceStub(channel)
            request = lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=PROMPT), request_id="streamed")
            call = stub.PrefillStream(request, timeout=60)
            first = next(call)
            # The start, and the request's capability: the ranks serve its pages to no one else.
            epoch = access_ticket(dict(call.initial_metadata())[EPOCH_METADATA_KEY], first.reply.capability)
            assert len(first.reply.capability) >= 43
            assert not first.done and first.reply.first_token == -1 and first.reply.request_id == "streamed"
            during = _fetch_all(kv, first.reply, epoch, num_layers)  # may run while the ranks prefill
            last = next(call)
            assert last.done and last.reply.manifest == first.reply.manifest
            assert last.reply.capability == first.reply.capability
            assert list(call) == []
            after = _fetch_all(kv, last.reply, epoch, num_layers)
            assert during.keys() == after.keys() and len(after) == num_layers * len(Manifest.decode(
                first.reply.manifest).pages)
            assert all(torch.equal(during[k], after[k]) for k in after)
            kv.release(dict(enumerate(last.reply.endpoints)), "streamed", last.reply.contract_fingerprint,
                       epoch=epoch)
            # The unary call samples the same first token.
            unary = stub.Prefill(lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=PROMPT)), timeout=60)
            assert unary.first_token == last.reply.first_token >= 0
        assert wait_until(lambda: list(prefill.leases.held()) == [unary.request_id])


@pytest.mark.timeout(120)
def test_a_release_before_the_prefill_ends_frees_every_page_once(checkpoint):
    with running_pair(_engine(checkpoint), pool_pages=64) as (prefill, _):
        free = prefill.engine.allocator.free_counts()
        with grpc.insecure_channel(prefill.endpoint) as channel, KVClient() as kv:
            stub = lanekv_pb2_grpc.PrefillServiceStub(channel)
            ids = PROMPT * 8  # a few pages on each rank
            call = stub.PrefillStream(lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=ids),
                                                                request_id="let-go"), timeout=60)
            first = next(call)
            epoch = access_ticket(dict(call.initial_metadata())[EPOCH_METADATA_KEY], first.reply.capability)
            assert prefill.leases.held()["let-go"] == len(Manifest.decode(first.reply.manifest).pages)
            # The decode side gives up at once: every rank releases, the prefill may still run.
            freed = kv.release(dict(enumerate(first.reply.endpoints)), "let-go", first.reply.contract_fingerprint,
                               epoch=epoch)
            assert freed == len(Manifest.decode(first.reply.manifest).pages)
            last = next(call)  # the prefill still answers
            assert last.done and last.reply.first_token >= 0
        assert wait_until(lambda: prefill.engine.allocator.free_counts() == free)
        assert prefill.leases.held() == {}
        # The id is free again, and the pages work for the next request.
        with grpc.insecure_channel(prefill.endpoint) as channel:
            stub = lanekv_pb2_grpc.PrefillServiceStub(channel)
            again = stub.Prefill(lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=PROMPT),
                                                           request_id="let-go"), timeout=60)
            assert again.first_token >= 0


@pytest.mark.timeout(180)
def test_a_prefill_that_answered_is_copied_before_the_ranks_announce_it(checkpoint, monkeypatch, caplog):
    with running_pair(_engine(checkpoint), pool_pages=64, transport="grpc") as (_, decode):
        expected = _tokens(decode.endpoint)
    started = PrefillCall.started

    def answered_first(self):
        first = started(self)
        self.done()  # the prefill's last message comes before the fetch starts
        return first

    copied_early = []  # per rank: whether its copies were made before it read its first message
    receive = RankFetch.receive

    def receive_and_note(self, *args):
        copied_early.append(self.early is not None)
        return receive(self, *args)

    monkeypatch.setattr(PrefillCall, "started", answered_first)
    monkeypatch.setattr(RankFetch, "receive", receive_and_note)
    with running_pair(_engine(checkpoint), pool_pages=64) as (prefill, decode):
        with caplog.at_level(logging.INFO, logger="lanekv.transfer"):
            assert _tokens(decode.endpoint) == expected
        assert copied_early == [True, True]
        assert not [r for r in caplog.records if "copying again" in r.getMessage()]  # at the right places
        assert decode.metrics.failures.labels(cause="fastpath_digest").value == 0
        assert wait_until(lambda: prefill.leases.held() == {})


@pytest.mark.timeout(180)
def test_the_fast_path_calls_the_ranks_once_the_prefill_has_answered(checkpoint, monkeypatch):
    """The default: a fetch made while the prefill runs waits for its answer, then copies
    every layer from where the owner-lane rule puts it; each rank sends one range."""
    with running_pair(_engine(checkpoint), pool_pages=64, transport="grpc") as (_, decode):
        expected = _tokens(decode.endpoint)
    answered, early = {}, {}  # by rank: the prefill had answered when the rank was called; copied early
    fetch, receive = FastPath.fetch, RankFetch.receive

    def fetch_and_note(self, request, part, **kw):
        answered[part.rank] = prefill_calls[-1].answered()
        return fetch(self, request, part, **kw)

    def receive_and_note(self, *args):
        early[self.part.rank] = self.early is not None  # its copies were made before its first message
        return receive(self, *args)

    prefill_calls = []
    init, finish = PrefillCall.__init__, PrefillCall._finish

    def init_and_keep(self, *args, **kw):
        init(self, *args, **kw)
        prefill_calls.append(self)

    def finish_late(self, reply):
        time.sleep(0.5)  # the answer comes well after the first message: a fetch has begun by then
        finish(self, reply)

    monkeypatch.setattr(PrefillCall, "__init__", init_and_keep)
    monkeypatch.setattr(PrefillCall, "_finish", finish_late)
    monkeypatch.setattr(FastPath, "fetch", fetch_and_note)
    monkeypatch.setattr(RankFetch, "receive", receive_and_note)
    with running_pair(_engine(checkpoint), pool_pages=64) as (_, decode):
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            call = stub.Generate(generate_request(PROMPT, NEW_TOKENS), timeout=60)
            assert [t for reply in call for t in reply.token_ids] == expected
            meta = dict(call.trailing_metadata())
    assert answered == early == {0: True, 1: True}
    assert meta["lanekv-transfer-chunks"] == "2"  # one range from each rank
    assert meta["lanekv-transfer-paths"] == "0:shm,1:shm"


@pytest.mark.timeout(180)
def test_a_digest_that_never_matches_falls_back_to_grpc(checkpoint, monkeypatch):
    with running_pair(_engine(checkpoint), pool_pages=64, transport="grpc") as (_, decode):
        expected = _tokens(decode.endpoint)
    # The same prompt twice: without the decode side's prefix cache every page moves again.
    with running_pair(_engine(checkpoint), pool_pages=64, prefix_cache=False) as (prefill, decode):
        assert _tokens(decode.endpoint) == expected  # the fast path, digests matching
        assert {decode.fastpath.transport(e) for e in prefill.topology.endpoints} == {"shm"}
        monkeypatch.setattr("lanekv.transfer.fastpath.rangecopy.PageDigest.total", lambda self, first=None, last=None: torch.tensor(0))
        failures = decode.metrics.failures.labels(cause="fastpath_digest")
        before = failures.value
        assert _tokens(decode.endpoint, request_id="mismatch") == expected
        assert failures.value - before == 2  # both ranks, fetched again over gRPC
        assert wait_until(lambda: prefill.leases.held() == {})


@requires_gpu
@pytest.mark.timeout(300)
def test_cuda_ipc_fast_path_generates_what_grpc_does(checkpoint):
    cp = min(2, torch.cuda.device_count())
    prefill = PrefillDaemon(EngineConfig(str(checkpoint), cp_size=cp, page_size=PAGE_SIZE, pages_per_lane=64,
                                         device="cuda", start_timeout_s=300), DaemonConfig(lease_s=600))
    decoders = []
    try:
        for transport in ("grpc", "auto"):
            decoders.append(DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=PAGE_SIZE,
                                                      device="cuda", pool_pages=64, transport=transport)))
        over_grpc, fast = decoders
        assert _tokens(fast.endpoint) == _tokens(over_grpc.endpoint)
        assert {fast.fastpath.transport(e) for e in prefill.topology.endpoints} == {"cuda_ipc"}
        # Every rank's copies matched their digests: nothing was fetched again over gRPC.
        assert fast.metrics.failures.labels(cause="fastpath_digest").value == 0
        assert wait_until(lambda: prefill.leases.held() == {})
    finally:
        for decoder in decoders:
            decoder.stop(grace_s=1.0)
        prefill.stop()
