"""The prefill daemon over real loopback gRPC: concurrent Prefill calls, FetchKV
from every owner rank placed by page equals a single-process reference bit for
bit, Release and lease expiry return every page, bad requests get a status."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from lanekv.prefill.cp.launcher import PrefillInput
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.protocol.access import access_ticket
from lanekv.transfer.protocol.manifest import Manifest

from tests.checkpoints import write_llama

PROMPT_LENS = [5, 64, 130, 17]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_llama(path)
    return path


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 290, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _prefill(stub, ids, **kw):
    req = lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), **kw)
    return stub.Prefill(req, timeout=120)


def _fetch_all(client, reply, page_size, shape):
    """Fetch every page of a reply from its owners, placed by logical page."""
    manifest = Manifest.decode(reply.manifest)
    slot = {p.page: k for k, p in enumerate(manifest.pages)}
    out = torch.full((shape[0], 2, len(manifest.pages) * page_size, *shape[3:]), float("nan"))

    def place(header, payload):
        for i, page in enumerate(header.pages):
            k = slot[page]
            out[header.layer_start : header.layer_end, :, k * page_size : (k + 1) * page_size] = payload[
                :, :, i * page_size : (i + 1) * page_size
            ]

    owners = sorted({p.owner for p in manifest.pages})
    client.fetch({r: reply.endpoints[r] for r in owners}, reply.request_id, reply.contract_fingerprint, place,
                 epoch=access_ticket(None, reply.capability))
    return manifest, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp_size, page_size", [(2, 4), (3, 16)])
def test_daemon_serves_pages_equal_to_reference(checkpoint, cp_size, page_size):
    cfg = EngineConfig(str(checkpoint), cp_size=cp_size, page_size=page_size, pages_per_lane=64, start_timeout_s=120)
    # Single-process reference of the same batch: cp=1, the same pages layout by position.
    ref_engine = ThreadedPrefillEngine(EngineConfig(str(checkpoint), cp_size=1, page_size=page_size, pages_per_lane=256))
    daemon = PrefillDaemon(cfg, DaemonConfig(lease_s=600))
    try:
        start_free = daemon.engine.allocator.free_counts()
        channel = grpc.insecure_channel(daemon.endpoint)
        stub = lanekv_pb2_grpc.PrefillServiceStub(channel)
        replies = [None] * len(PROMPT_LENS)

        def call(i, ids):
            replies[i] = _prefill(stub, ids)

        threads = [threading.Thread(target=call, args=(i, p)) for i, p in enumerate(_prompts())]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        shape = daemon.engine.info.pool_shape
        with KVClient() as client:
            for ids, reply in zip(_prompts(), replies):
                assert reply.contract_fingerprint == daemon.contract.fingerprint
                manifest, kv = _fetch_all(client, reply, page_size, shape)
                assert manifest.num_tokens == len(ids)
                assert all(p.owner == p.page % cp_size for p in manifest.pages)
                want = ref_engine.prefill([PrefillInput(ids)])[0]
                assert reply.first_token == want.first_token
                ref_kv = ref_engine.read_pages([p.page for p in want.pages])
                n = len(ids)
                torch.testing.assert_close(kv[:, :, :n], ref_kv[:, :, :n], rtol=1e-5, atol=1e-5)
                # bit for bit against the daemon's own pools read by loc
                assert torch.equal(kv[:, :, :n], daemon.engine.read_pages([p.page for p in manifest.pages])[:, :, :n])
            # Release at every owner returns every page
            for reply in replies:
                owners = {p.owner for p in Manifest.decode(reply.manifest).pages}
                client.release({r: reply.endpoints[r] for r in owners}, reply.request_id, reply.contract_fingerprint,
                               epoch=access_ticket(None, reply.capability))
        deadline = time.monotonic() + 10
        while daemon.engine.allocator.free_counts() != start_free and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.engine.allocator.free_counts() == start_free
        assert daemon.leases.held() == {}
        channel.close()
    finally:
        daemon.stop()


@pytest.mark.timeout(300)
def test_leases_expire_and_bad_requests_get_a_status(checkpoint):
    cfg = EngineConfig(str(checkpoint), cp_size=2, page_size=4, pages_per_lane=8, start_timeout_s=120)
    daemon = PrefillDaemon(cfg, DaemonConfig(lease_s=1.0))
    try:
        start_free = daemon.engine.allocator.free_counts()
        channel = grpc.insecure_channel(daemon.endpoint)
        stub = lanekv_pb2_grpc.PrefillServiceStub(channel)
        reply = _prefill(stub, [5, 6, 7, 8, 9, 10], request_id="lease-me")
        _prefill(stub, [5, 6, 7], request_id="one-page")  # rank 1 holds none of its pages
        assert daemon.engine.allocator.free_counts() != start_free
        # the same id again while pinned
        with pytest.raises(grpc.RpcError) as err:
            _prefill(stub, [5, 6], request_id="lease-me")
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        bad = [
            (dict(ids=[5, 99999]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
            (dict(ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "no tokens"),
            (dict(ids=[5] * 2000), grpc.StatusCode.OUT_OF_RANGE, "tokens"),
            (dict(ids=[5] * 200), grpc.StatusCode.RESOURCE_EXHAUSTED, "out of KV pages"),
        ]
        for kw, code, text in bad:
            with pytest.raises(grpc.RpcError) as err:
                _prefill(stub, **kw)
            assert err.value.code() == code and text in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(lanekv_pb2.PrefillRequest(text="hello"), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokenizer" in err.value.details()
        # the lease expires: the pages come back and the ranks stop serving them
        deadline = time.monotonic() + 10
        while daemon.engine.allocator.free_counts() != start_free and time.monotonic() < deadline:
            time.sleep(0.1)
        assert daemon.engine.allocator.free_counts() == start_free
        time.sleep(0.5)  # the ranks' forget is ordered behind nothing else
        with KVClient() as client, pytest.raises(Exception, match="released|NOT_FOUND|not found"):
            client.fetch({0: reply.endpoints[0]}, reply.request_id, reply.contract_fingerprint, lambda h, t: None)
        # still serving, and an expired request id can be used again (on every rank,
        # including one that held none of its pages)
        assert _prefill(stub, [7, 8, 9]).first_token >= 0
        again = _prefill(stub, [5, 6, 7], request_id="one-page")
        assert again.request_id == "one-page"
        assert _prefill(stub, [1, 2, 3, 4, 5]).first_token >= 0
        channel.close()
    finally:
        daemon.stop()
