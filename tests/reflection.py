"""A reflection client for tests: the service names a server lists, as grpcurl's ``list`` does."""

from __future__ import annotations

from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from lanekv.runtime.security import SecurityConfig, open_channel


def list_services(endpoint: str, security: SecurityConfig, timeout: float = 10.0) -> list[str]:
    """Raises ``grpc.RpcError`` when the server refuses."""
    with open_channel(endpoint, security) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        for reply in stub.ServerReflectionInfo(iter([request]), timeout=timeout):
            if reply.HasField("error_response"):
                raise RuntimeError(reply.error_response.error_message)
            return sorted(s.name for s in reply.list_services_response.service)
    raise RuntimeError(f"{endpoint} sent no reflection reply")
