"""The decode side's transports by name, and the one factory of a fetcher over them.

Adding a transport is a file of its own in this package (a ``KVTransport``
with ``from_context``) and one line in ``TRANSPORTS``. The order of
``TRANSPORTS`` is the order of preference; the last one reaches every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from lanekv.transfer.connector.base import KVTransport, TransportContext
from lanekv.transfer.connector.fastpath import FastPathTransport
from lanekv.transfer.connector.fetcher import KVFetcher
from lanekv.transfer.connector.grpc import GrpcTransport
from lanekv.transfer.connector.nixl import NixlTransport

TRANSPORTS: MappingProxyType[str, type[KVTransport]] = MappingProxyType({
    "fastpath": FastPathTransport,  # same-host ranks: their shared pools, copied in place
    "nixl": NixlTransport,  # ranks that offer NIXL (lanekv[nixl]): read over UCX (RDMA, TCP, shared memory)
    "grpc": GrpcTransport,  # every rank: FetchKV streams (also Release, whatever the path)
})


def make_fetcher(names: Sequence[str], ctx: TransportContext) -> KVFetcher:
    """A fetcher over the transports ``names`` (most preferred first), each built from ``ctx``.

    The list must end with ``grpc``: it reaches every rank and releases the pages.
    Raises ``ValueError`` naming an unknown or repeated name, or a list that does not.
    """
    names = list(names)
    unknown = [name for name in names if name not in TRANSPORTS]
    if unknown:
        raise ValueError(f"transports: unknown {unknown}; known: {list(TRANSPORTS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"transports: a name repeats in {names}")
    if not names or names[-1] != "grpc":
        raise ValueError(f"transports must end with 'grpc' (it reaches every rank), got transports={names}")
    transports = [TRANSPORTS[name].from_context(ctx) for name in names]
    return KVFetcher(transports, transports[-1].release, names)
