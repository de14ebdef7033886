"""A request's KV is readable only with its capability; descriptors only after AttachPool.

Anyone who reached a rank and knew a request id (clients may choose their
own) could read that request's KV and release it. A prefilled request now has
an unguessable capability (returned with its manifest); FetchKV, Release and
descriptor fetches must present it in ``lanekv-epoch: <epoch>:<capability>``
metadata, else PERMISSION_DENIED and no byte. A descriptors fetch from a peer
that never called AttachPool is refused (FAILED_PRECONDITION).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

from proto import lanekv_pb2 as pb
from proto import lanekv_pb2_grpc
from tests.reliability.kv_cluster import Servers, placer, rows_of, same_bits, start_servers
from transfer.grpcfetch.client import KVClient, RemoteError
from transfer.rank.service import EPOCH_METADATA_KEY, access_ticket, new_capability

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


def test_fetch_and_release_need_the_capability(servers):
    endpoint = servers.endpoints[1]
    request = pb.FetchRequest(request_id="req", fingerprint=servers.fingerprint)
    with grpc.insecure_channel(endpoint) as channel:
        kv = lanekv_pb2_grpc.KVTransferStub(channel)
        for metadata, what in [(None, "no"), (((EPOCH_METADATA_KEY, "start1"),), "no"),
                               (((EPOCH_METADATA_KEY, access_ticket("start1", "guess")),), "a wrong"),
                               (((EPOCH_METADATA_KEY, access_ticket("start1", CAPABILITY[:-1])),), "a wrong")]:
            chunks: list = []
            code, details = _status(lambda md=metadata, out=chunks: out.extend(
                kv.FetchKV(request, timeout=10, metadata=md)))
            assert (code, chunks) == (Code.PERMISSION_DENIED, []), (metadata, code, details)
            assert f"{what} capability" in details
            release = pb.ReleaseRequest(request_id="req", fingerprint=servers.fingerprint)
            code, _ = _status(lambda md=metadata, r=release: kv.Release(r, timeout=10, metadata=md))
            assert code == Code.PERMISSION_DENIED
        assert servers.pages_of(1)  # nothing was released
        # An unknown id is NOT_FOUND whatever is presented (no capability to hold it to).
        unknown = pb.FetchRequest(request_id="other", fingerprint=servers.fingerprint)
        assert _status(lambda: list(kv.FetchKV(unknown, timeout=10)))[0] == Code.NOT_FOUND


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
        assert code == Code.PERMISSION_DENIED
