"""Every server ``make_server`` builds answers gRPC reflection for its services, behind the token."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from lanekv.runtime.security import SecurityConfig, bind, make_server, open_channel
from lanekv.runtime.status import HealthServicer
from lanekv.transfer.rank.server import add_transfer_service
from lanekv.transfer.rank.service import KVTransferService
from lanekv.transfer.rank.sources import ContractOnlySource

from tests.reflection import list_services

pytestmark = pytest.mark.timeout(60)
TOKEN = "reflection-token"


@pytest.fixture
def server():
    security = SecurityConfig(token=TOKEN)
    server = make_server(security, 4)
    add_transfer_service(server, KVTransferService(ContractOnlySource(None, "no pages here")))
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    port = bind(server, "127.0.0.1", 0, security)
    server.start()
    yield f"127.0.0.1:{port}", server
    server.stop(None)


def test_reflection_lists_the_services_added(server):
    endpoint, built = server
    assert built.services == ("lanekv.v1.KVTransfer", "grpc.health.v1.Health")
    services = list_services(endpoint, SecurityConfig(token=TOKEN))
    assert services == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                        "lanekv.v1.KVTransfer"]
    with open_channel(endpoint, SecurityConfig(token=TOKEN)) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        # What grpcurl needs to call a method: the file that defines the service.
        assert db.FindFileContainingSymbol("lanekv.v1.KVTransfer").name == "proto/lanekv.proto"


def test_reflection_needs_the_token(server):
    endpoint, _ = server
    for security in (SecurityConfig(), SecurityConfig(token="wrong")):
        with pytest.raises(grpc.RpcError) as err:
            list_services(endpoint, security)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
