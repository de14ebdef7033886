"""NIXL in bench/ttft.py: a raw loopback read of the same bytes, and the NIXL transport
fetching one prefilled request alone (nothing overlapping it).

The raw rate is two NIXL agents of this process, one reading the other's
registered tensor in 64 MiB descriptors, with the same UCX transports as the
path measured (``UCX_TLS`` while the agents start). The transport's rate is
``NixlTransport`` as the decode daemon runs it: the descriptor stream of each
owner rank, a NIXL read of each sealed range into the decode pool, and the
digest check, on a request whose prefill has answered.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator

import grpc
import torch
from lanekv.decode.pool import PageTable
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.status import grpc_options
from lanekv.transfer.connector.base import Coverage, FetchJob
from lanekv.transfer.nixl.agent import Agent, memory_kind
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY, access_ticket
from lanekv.transfer.protocol.manifest import Manifest

RAW_CHUNK = 64 << 20


@contextlib.contextmanager
def ucx_tls(tls: str | None) -> Iterator[None]:
    """``UCX_TLS`` set to ``tls`` while agents start (UCX reads it then); None: left as it is."""
    if tls is None:
        yield
        return
    before = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = tls
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = before


def raw_nixl_gbps(nbytes: int, device: torch.device, repeat: int, tls: str | None) -> float:
    """Best GB/s of a NIXL READ of ``nbytes`` between two agents of this process on ``device``."""
    with ucx_tls(tls):
        src_agent = Agent(f"raw-src-{uuid.uuid4().hex[:6]}")
        dst_agent = Agent(f"raw-dst-{uuid.uuid4().hex[:6]}")
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        src_agent.register(src)
        dst_agent.register(dst)
        name = dst_agent.add_remote(src_agent.metadata())
        pairs = [(src.data_ptr() + o, dst.data_ptr() + o, min(RAW_CHUNK, nbytes - o)) for o in range(0, nbytes, RAW_CHUNK)]
        mem, index = memory_kind(src), device.index or 0
        best = float("inf")
        for _ in range(repeat + 1):
            start = time.perf_counter()
            dst_agent.read(name, mem, pairs, index, mem, index, time.monotonic() + 600)
            best = min(best, time.perf_counter() - start)
        return nbytes / best / 1e9
    finally:
        dst_agent.close()
        src_agent.close()


def nixl_alone(prefill, decode, ids: list[int], repeat: int) -> dict:
    """The NIXL transport of ``decode`` fetching one request prefilled by ``prefill``: best
    seconds and GB/s over ``repeat`` tries (after one warm-up), the ranks it reached."""
    channel = grpc.insecure_channel(prefill.endpoint, options=grpc_options())
    reply, call = lanekv_pb2_grpc.PrefillServiceStub(channel).Prefill.with_call(lanekv_pb2.PrefillRequest(
        token_ids=lanekv_pb2.TokenIds(ids=ids), request_id=f"nixl-alone-{uuid.uuid4().hex[:8]}"), timeout=900)
    channel.close()
    ticket = access_ticket(dict(call.trailing_metadata() or ()).get(EPOCH_METADATA_KEY), reply.capability)
    manifest = Manifest.decode(reply.manifest)
    owners = sorted({p.owner for p in manifest.pages})
    endpoints = tuple(reply.endpoints)
    table = PageTable.remap(decode.pool, [p.page for p in manifest.pages], manifest.num_tokens)
    pool = decode.pool.tensor
    try:
        job = FetchJob(reply.request_id, reply.contract_fingerprint, ticket, endpoints,
                       {r: manifest.pages_of_owner(r) for r in owners}, pool.shape[0], manifest.page_size, pool,
                       table.physical_pages_for, time.monotonic() + 900)
        transport = decode.nixl
        routes = transport.claim(job, owners)
        sync = torch.cuda.synchronize if pool.is_cuda else (lambda: None)
        best, nbytes = float("inf"), 0
        for _ in range(repeat + 1):
            coverage = Coverage(job.pages, job.num_layers)
            start = time.perf_counter()
            outcome = transport.start(job, routes, coverage).wait()
            sync()
            best = min(best, time.perf_counter() - start)
            if outcome.again or coverage.missing():
                raise RuntimeError(f"NIXL fetch did not verify: again={outcome.again}")
            nbytes = sum(s.bytes for s in outcome.per_rank.values())
        return dict(nixl_seconds=best, nixl_bytes=nbytes, nixl_gbps=nbytes / best / 1e9 if nbytes else 0.0,
                    nixl_ranks=sorted(routes))
    finally:
        decode.kv.release(dict(enumerate(endpoints)), reply.request_id, reply.contract_fingerprint, epoch=ticket)
        table.release()
