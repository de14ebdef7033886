"""Where a rank's KVTransfer service starts: its handlers on a gRPC server, and ``serve``.

``add_transfer_service`` registers a ``KVTransferService`` (``service.py``) with
FetchKV's stream passing bytes through, as ``wire.frame_chunk`` already serialized
each KVChunk; use it, not the generated adder. ``serve`` starts a server of its own
with the gRPC health service beside it (a CP rank process's, the tests' and the
benchmarks'); the daemons add the service to the server they already run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.proto import lanekv_pb2
from lanekv.runtime.security import SecurityConfig, bind, make_server
from lanekv.runtime.status import TRANSFER_SERVICE, HealthServicer
from lanekv.transfer.nixl.export import NixlExport
from lanekv.transfer.rank.service import KVTransferService, OnFetched
from lanekv.transfer.rank.sources import PageSource
from lanekv.transfer.rank.staging import RankStaging


def add_transfer_service(server: grpc.Server, service: KVTransferService) -> None:
    """Register ``service`` on ``server``; use this, not the generated adder.

    FetchKV yields KVChunk messages already serialized by ``wire.frame_chunk``
    (one payload copy instead of three), so its handler passes bytes through.
    """
    handlers = {
        "Handshake": grpc.unary_unary_rpc_method_handler(
            service.Handshake,
            request_deserializer=lanekv_pb2.HandshakeRequest.FromString,
            response_serializer=lanekv_pb2.HandshakeReply.SerializeToString,
        ),
        "FetchKV": grpc.unary_stream_rpc_method_handler(
            service.FetchKV, request_deserializer=lanekv_pb2.FetchRequest.FromString
        ),
        "Release": grpc.unary_unary_rpc_method_handler(
            service.Release,
            request_deserializer=lanekv_pb2.ReleaseRequest.FromString,
            response_serializer=lanekv_pb2.ReleaseReply.SerializeToString,
        ),
        "AttachPool": grpc.unary_unary_rpc_method_handler(
            service.AttachPool,
            request_deserializer=lanekv_pb2.AttachRequest.FromString,
            response_serializer=lanekv_pb2.AttachReply.SerializeToString,
        ),
        "NixlAttach": grpc.unary_unary_rpc_method_handler(
            service.NixlAttach,
            request_deserializer=lanekv_pb2.NixlAttachRequest.FromString,
            response_serializer=lanekv_pb2.NixlAttachReply.SerializeToString,
        ),
        "StageKV": grpc.unary_unary_rpc_method_handler(
            service.StageKV,
            request_deserializer=lanekv_pb2.StageRequest.FromString,
            response_serializer=lanekv_pb2.StageReply.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(TRANSFER_SERVICE, handlers),)
    )


class Served(NamedTuple):
    """A started KVTransfer server, the port it bound and its health service."""

    server: grpc.Server
    port: int
    health: HealthServicer

    def stop(self, grace_s: float) -> None:
        """Say NOT_SERVING, then let open streams finish for ``grace_s`` and stop."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait(grace_s + 1.0)


def serve(
    source: PageSource,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_workers: int = 16,
    security: SecurityConfig | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    on_fetched: OnFetched | None = None,
    epoch: str | None = None,
    nixl: NixlExport | None = None,
    relay_staging: RankStaging | None = None,
) -> Served:
    """Start a KVTransfer server (plus the gRPC health service); port 0 picks a free port.

    Each open FetchKV stream holds one of ``max_workers`` threads. ``security``
    sets TLS and the token (``runtime.security``; None: plaintext, no token); ``interceptors`` go
    outside the token check (metrics); ``epoch`` names this start of the
    prefill daemon (see ``EPOCH_METADATA_KEY``; None: no check); ``relay_staging``: the files of
    the rank's staged relays, which StageKV fills. Raises ``OSError`` naming
    ``host:port`` when the port cannot be bound.
    """
    security = SecurityConfig() if security is None else security
    server = make_server(security, max_workers, interceptors=interceptors)
    add_transfer_service(server, KVTransferService(source, on_fetched=on_fetched, epoch=epoch, nixl=nixl,
                                                   relay_staging=relay_staging))
    checker = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    bound = bind(server, host, port, security)
    server.start()
    for service in ("", TRANSFER_SERVICE):
        checker.set(service, health_pb2.HealthCheckResponse.SERVING)
    return Served(server, bound, checker)
