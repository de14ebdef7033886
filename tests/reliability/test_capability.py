"""A request's KV is readable only with its capability; descriptors only after AttachPool.

Anyone who reached a rank and knew a request id (clients may choose their
own) could read that request's KV and release it. A prefilled request now has
an unguessable capability (returned with its manifest); FetchKV, Release and
descriptor fetches must present it in ``lanekv-epoch: <epoch>:<capability>``
metadata, else NOT_FOUND (the very answer an unknown id gets, so a caller without
the capability cannot tell which ids are live) and no byte. A descriptors fetch from a peer
that never called AttachPool is refused (FAILED_PRECONDITION).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import grpc
import pytest
import torch
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2 as pb
from lanekv.proto import lanekv_pb2_grpc
from lanekv.transfer.fastpath.client import FastPath
from lanekv.transfer.grpcfetch.client import KVClient, RemoteError
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY, access_ticket, new_capability
from lanekv.transfer.protocol.manifest import Manifest

from tests.checkpoints import write_llama
from tests.daemons import running_pair
from tests.reliability.kv_cluster import (
    Servers,
    generate_request,
    placer,
    rows_of,
    same_bits,
    start_servers,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)
Code = grpc.StatusCode
CAPABILITY = new_capability()


@pytest.fixture
def servers() -> Iterator[Servers]:
    started = start_servers(2, 6, epoch="start1", capability=CAPABILITY)
    yield started
    started.stop()


def _status(call) -> tuple[Code, str]:
    try:
        call()
    except grpc.RpcError as err:
        return err.code(), err.details()
    return Code.OK, ""


def test_capabilities_are_unguessable():
    drawn = {new_capability() for _ in range(1000)}
    assert len(drawn) == 1000 and min(len(c) for c in drawn) >= 43  # 256 random bits
    assert all(_one_character_off(c) != c and len(_one_character_off(c)) == len(c) for c in drawn)


def test_fetch_and_release_need_the_capability(servers):
    endpoint = servers.endpoints[1]
    request = pb.FetchRequest(request_id="req", fingerprint=servers.fingerprint)
    with grpc.insecure_channel(endpoint) as channel:
        kv = lanekv_pb2_grpc.KVTransferStub(channel)
        unknown = pb.FetchRequest(request_id="oth", fingerprint=servers.fingerprint)  # as long as "req"
        for metadata in [None, ((EPOCH_METADATA_KEY, "start1"),),
                         ((EPOCH_METADATA_KEY, access_ticket("start1", "guess")),),
                         ((EPOCH_METADATA_KEY, access_ticket("start1", CAPABILITY[:-1])),)]:
            chunks: list = []
            code, details = _status(lambda md=metadata, out=chunks: out.extend(
                kv.FetchKV(request, timeout=10, metadata=md)))
            assert (code, chunks) == (Code.NOT_FOUND, []), (metadata, code, details)
            assert "capability" in details and CAPABILITY not in details
            # A live id and an unknown one get the same answer, word for word.
            assert _status(lambda md=metadata: list(kv.FetchKV(unknown, timeout=10, metadata=md))) == (
                Code.NOT_FOUND, details.replace("'req'", "'oth'"))
            release = pb.ReleaseRequest(request_id="req", fingerprint=servers.fingerprint)
            other = pb.ReleaseRequest(request_id="oth", fingerprint=servers.fingerprint)
            released = _status(lambda md=metadata, r=release: kv.Release(r, timeout=10, metadata=md))
            assert released == (Code.NOT_FOUND, details)
            assert _status(lambda md=metadata, r=other: kv.Release(r, timeout=10, metadata=md)) == (
                Code.NOT_FOUND, details.replace("'req'", "'oth'"))
        assert servers.pages_of(1)  # nothing was released


def test_the_capability_reads_the_bytes_and_releases(servers):
    ticket = access_ticket("start1", CAPABILITY)
    dest = torch.zeros_like(servers.full)
    log: list = []
    with KVClient() as kv:
        stats = kv.fetch(servers.endpoints, "req", servers.fingerprint, placer(dest, log), timeout=10, epoch=ticket)
        assert stats.bytes > 0
        pages = range(6)
        assert same_bits(dest[:, :, rows_of(pages)], servers.full[:, :, rows_of(pages)])
        with pytest.raises(RemoteError) as refused:  # the old start's epoch is refused first, as before
            kv.fetch(servers.endpoints, "req", servers.fingerprint, placer(dest, []), timeout=10,
                     epoch=access_ticket("start0", CAPABILITY))
        assert refused.value.code == Code.FAILED_PRECONDITION
        assert kv.release(servers.endpoints, "req", servers.fingerprint, timeout=10, epoch=ticket) == 6
    for source in servers.sources:
        with pytest.raises(KeyError, match="released"):
            source.pages_of("req")


def test_descriptors_need_an_attach_pool_first(servers):
    request = pb.FetchRequest(request_id="req", fingerprint=servers.fingerprint, descriptors=True)
    metadata = ((EPOCH_METADATA_KEY, access_ticket("start1", CAPABILITY)),)
    with grpc.insecure_channel(servers.endpoints[0]) as channel:
        kv = lanekv_pb2_grpc.KVTransferStub(channel)
        chunks: list = []
        code, details = _status(lambda: chunks.extend(kv.FetchKV(request, timeout=10, metadata=metadata)))
        assert (code, chunks) == (Code.FAILED_PRECONDITION, []), (code, details)
        assert "AttachPool" in details
        # Without the capability it is refused for that first.
        code, _ = _status(lambda: list(kv.FetchKV(request, timeout=10)))
        assert code == Code.NOT_FOUND


# -- through the daemons: the prefill daemon issues each request's capability --

PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("capability-llama"))


def _generated(endpoint: str) -> tuple[list[int], str]:
    """A Generate call's tokens and how each rank's KV came ('0:shm,1:grpc', ...)."""
    with grpc.insecure_channel(endpoint) as channel:
        call = lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(generate_request(PROMPT, 5), timeout=60)
        tokens = [t for reply in call for t in reply.token_ids]
        return tokens, dict(call.trailing_metadata() or ()).get("lanekv-transfer-paths", "")


def _one_character_off(capability: str) -> str:
    """``capability`` with its last character changed. (Replacing it with "A" gave the
    capability itself one time in 16: its last character carries 4 bits.)"""
    return capability[:-1] + ("B" if capability[-1] == "A" else "A")


def _fetched(rank_kv, request: pb.FetchRequest, metadata) -> tuple[Code, str, list]:
    chunks: list = []
    code, details = _status(lambda: chunks.extend(rank_kv.FetchKV(request, timeout=10, metadata=metadata)))
    return code, details, chunks


@pytest.mark.timeout(180)
def test_the_prefill_daemon_pins_every_request_with_its_own_capability(checkpoint):
    engine = EngineConfig(str(checkpoint), cp_size=2, page_size=4, pages_per_lane=64, start_timeout_s=120)
    with running_pair(engine, pool_pages=64) as (prefill, fast):
        # Generation still works through both transports, each presenting the capability.
        grpc_decode = DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=4, pool_pages=64,
                                                device="cpu", transport="grpc"))
        try:
            tokens, paths = _generated(fast.endpoint)
            assert paths == "0:shm,1:shm"
            assert _generated(grpc_decode.endpoint) == (tokens, "0:grpc,1:grpc")
        finally:
            grpc_decode.stop(grace_s=1.0)
        assert wait_until(lambda: prefill.leases.held() == {})

        with grpc.insecure_channel(prefill.endpoint) as channel:
            stub = lanekv_pb2_grpc.PrefillServiceStub(channel)
            request = pb.PrefillRequest(token_ids=pb.TokenIds(ids=PROMPT), request_id="capped")
            call = stub.PrefillStream(request, timeout=60)
            replies = [message.reply for message in call]
            epoch = dict(call.initial_metadata())[EPOCH_METADATA_KEY]
            other = stub.Prefill(pb.PrefillRequest(token_ids=pb.TokenIds(ids=PROMPT)), timeout=60)
        capability = replies[0].capability
        assert len(capability) >= 43 and replies[-1].capability == capability  # 256 random bits
        assert other.capability not in ("", capability)  # each request its own
        reply, ticket = replies[-1], access_ticket(epoch, capability)
        manifest = Manifest.decode(reply.manifest)
        fp = reply.contract_fingerprint
        refused = [None, ((EPOCH_METADATA_KEY, epoch),),
                   ((EPOCH_METADATA_KEY, access_ticket(epoch, other.capability)),),  # another request's
                   ((EPOCH_METADATA_KEY, access_ticket(epoch, _one_character_off(capability))),)]
        with KVClient() as kv:
            attach = FastPath(kv, fast.agreement, transports=["shm"])
            for rank, endpoint in enumerate(reply.endpoints):
                assert attach.pool(endpoint, ticket, 10) is not None  # descriptors are offered to us now
                rank_kv = lanekv_pb2_grpc.KVTransferStub(kv.channel(endpoint))
                fetch = pb.FetchRequest(request_id="capped", fingerprint=fp)
                describe = pb.FetchRequest(request_id="capped", fingerprint=fp, descriptors=True)
                for metadata in refused:
                    for what in (fetch, describe):
                        code, details, chunks = _fetched(rank_kv, what, metadata)
                        assert (code, chunks) == (Code.NOT_FOUND, []), (rank, metadata, code, details)
                        assert "\n" not in details and capability not in details and "capped" in details
                    code, details = _status(partial(rank_kv.Release, pb.ReleaseRequest(
                        request_id="capped", fingerprint=fp), timeout=10, metadata=metadata))
                    assert code == Code.NOT_FOUND and capability not in details
                presented = ((EPOCH_METADATA_KEY, ticket),)
                assert list(rank_kv.FetchKV(describe, timeout=10, metadata=presented))  # descriptors
                assert list(rank_kv.FetchKV(fetch, timeout=10, metadata=presented))
            assert prefill.leases.held()["capped"] == len(manifest.pages)  # nothing was released
            # The bytes a capability reads are the request's, bit for bit.
            want = prefill.engine.read_pages([p.page for p in manifest.pages])
            dest = torch.full_like(want, float("nan"))
            slot = {p.page: k for k, p in enumerate(manifest.pages)}

            def place(header, payload):
                for i, page in enumerate(header.pages):
                    dest[header.layer_start:header.layer_end, :, slot[page] * 4:(slot[page] + 1) * 4] = \
                        payload[:, :, i * 4:(i + 1) * 4]

            owners = {r: reply.endpoints[r] for r in sorted({p.owner for p in manifest.pages})}
            kv.fetch(owners, "capped", fp, place, timeout=10, epoch=ticket)
            assert same_bits(dest, want)
            assert kv.release(owners, "capped", fp, timeout=10, epoch=ticket) == len(manifest.pages)
            kv.release(dict(enumerate(other.endpoints)), other.request_id, other.contract_fingerprint,
                       timeout=10, epoch=access_ticket(None, other.capability))
        assert wait_until(lambda: prefill.leases.held() == {})
