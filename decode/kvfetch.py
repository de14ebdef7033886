"""Step 4 of ``DecodeService.Generate`` (``decode.service``): check the prefill's
manifest, then fetch every layer of every page of it into the call's pages.

Ranks on this host that share their pool are read in place (``FastFetches``,
each copied range checked against the rank's digest; a mismatch fetches that
rank again over gRPC); the others stream over gRPC (``KVClient.fetch``), each
verified chunk placed straight into our pages from one thread per rank. A
chunk naming a page its rank does not own, or one that does not fit, is
DATA_LOSS; so is a fetch that ends without every layer of every page.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import torch

from decode.daemon import DecodeDaemon
from decode.placement import place_chunk
from decode.remote import ATTACH_TIMEOUT_S, FastFetches, transfer_refusal
from proto import lanekv_pb2
from runtime.status import Refusal
from transfer.grpcfetch.client import FetchStats, RankStats, TransferError
from transfer.protocol.manifest import Manifest

Code = grpc.StatusCode


def check_manifest(d: DecodeDaemon, reply: lanekv_pb2.PrefillReply, spec: Any) -> Manifest:
    """The manifest of a PrefillStream's first message, checked against our contract,
    the request and the prefill topology."""
    if reply.contract_fingerprint != d.agreement.fingerprint:
        raise Refusal(
            Code.FAILED_PRECONDITION,
            f"prefill answered with contract {reply.contract_fingerprint[:16]!r}, ours is "
            f"{d.agreement.fingerprint[:16]!r}; restart this daemon to handshake again",
        )
    try:
        manifest = Manifest.decode(reply.manifest)
    except ValueError as err:
        raise Refusal(Code.INTERNAL, f"prefill daemon sent a bad manifest: {err}") from err
    if manifest.page_size != d.config.page_size:
        raise Refusal(
            Code.FAILED_PRECONDITION,
            f"manifest page_size={manifest.page_size}, ours is {d.config.page_size}",
        )
    if manifest.request_id != spec.request_id or manifest.num_tokens != len(spec.token_ids):
        raise Refusal(
            Code.INTERNAL,
            f"manifest is for {manifest.request_id!r} with {manifest.num_tokens} tokens, asked for "
            f"{spec.request_id!r} with {len(spec.token_ids)}",
        )
    topology = d.prefill_contract.topology
    try:
        if len(reply.endpoints) != topology.cp_size:
            raise ValueError(f"{len(reply.endpoints)} endpoints for cp_size {topology.cp_size}")
        topology.check((p.page, p.owner) for p in manifest.pages)
    except ValueError as err:
        raise Refusal(Code.FAILED_PRECONDITION, f"prefill topology: {err}") from err
    return manifest


def fetch_kv(d: DecodeDaemon, call: Any, manifest: Manifest, endpoints: list[str], deadline: float,
             *, written: bool = False) -> FetchStats:
    """Every layer of every page of the manifest into our pages: over the fast
    path from the ranks that share their pool with us, over gRPC from the others.
    ``written``: the prefill has answered (``FastFetches``).

    ``call`` is the Generate call (``decode.service``): its page table, the
    prefill's contract fingerprint and epoch, and where each rank's KV came from
    (``paths``, set here).
    """
    pool, table, page_size, num_layers = d.pool, call.table, d.config.page_size, d.agreement.num_layers
    owner_of = {p.page: p.owner for p in manifest.pages}
    # Layers placed per page, one bit each: a retry never places a layer twice,
    # and if it did, the bytes would be the same verified ones.
    layers_of = dict.fromkeys(owner_of, 0)
    lock = threading.Lock()  # chunks are placed, and fast-path ranges copied, by several threads

    def placed(pages, layer_start: int, layer_end: int) -> None:
        bits = (1 << layer_end) - (1 << layer_start)
        with lock:
            for page in pages:
                layers_of[page] |= bits

    def place(header, payload: torch.Tensor) -> None:
        for page in header.pages:
            if owner_of.get(page) != header.rank:
                raise Refusal(Code.DATA_LOSS, f"rank {header.rank} sent page {page}, not one of its pages")
        try:
            place_chunk(pool.tensor, table.physical_pages_for(header.pages), payload, page_size,
                        header.layer_start, header.layer_end)
        except ValueError as err:
            raise Refusal(Code.DATA_LOSS, f"rank {header.rank} sent a chunk that does not fit: {err}") from err
        placed(header.pages, header.layer_start, header.layer_end)

    owners = sorted({p.owner for p in manifest.pages})
    pages = {rank: manifest.pages_of_owner(rank) for rank in owners}
    shared = _shared_pools(d, call, owners, endpoints, deadline)
    start = time.perf_counter()
    fast = FastFetches(d, call, shared, endpoints, pages, placed, deadline, written=written)
    over_grpc = [rank for rank in owners if rank not in shared]
    call.paths = {rank: "grpc" if rank in over_grpc else d.fastpath.transport(endpoints[rank]) for rank in owners}
    per_rank: dict[int, RankStats] = {}
    retries = 0
    try:
        if over_grpc:
            stats = _grpc_fetch(d, call, {r: endpoints[r] for r in over_grpc}, pages, place, deadline)
            per_rank.update(stats.per_rank)
            retries += stats.retries
        failed = fast.join(deadline)
    finally:
        fast.stop()
    if failed:  # a digest that did not match: fetch those ranks again, over gRPC
        call.paths.update(dict.fromkeys(failed, "grpc"))
        retries += len(failed)
        stats = _grpc_fetch(d, call, {r: endpoints[r] for r in failed}, pages, place, deadline)
        per_rank.update(stats.per_rank)
    per_rank.update(fast.stats)
    whole = (1 << num_layers) - 1
    missing = [page for page, layers in layers_of.items() if layers != whole]
    if missing:
        raise Refusal(Code.DATA_LOSS, f"KV transfer ended without every layer of pages {missing[:16]}")
    return FetchStats(sum(s.bytes for s in per_rank.values()), sum(s.chunks for s in per_rank.values()),
                      time.perf_counter() - start, per_rank, retries)


def _shared_pools(d: DecodeDaemon, call: Any, owners: list[int], endpoints: list[str],
                  deadline: float) -> dict[int, torch.Tensor]:
    """The pools of the owner ranks that the fast path reaches, by rank."""
    fastpath = d.fastpath
    if fastpath is None:
        return {}
    pools = {rank: fastpath.pool(endpoints[rank], call.epoch, min(ATTACH_TIMEOUT_S, time_left(deadline)))
             for rank in owners}
    return {rank: pool for rank, pool in pools.items() if pool is not None}


def _grpc_fetch(d: DecodeDaemon, call: Any, endpoints: dict[int, str], pages: dict[int, list[int]], place,
                deadline: float) -> FetchStats:
    try:
        return d.kv.fetch(
            endpoints, call.spec.request_id, call.fingerprint, place,
            max_inflight_bytes=d.config.max_inflight_bytes, max_chunk_bytes=d.config.fetch_chunk_bytes,
            timeout=time_left(deadline), layer_end=d.agreement.num_layers, epoch=call.epoch,
            pages={rank: pages[rank] for rank in endpoints},
        )
    except TransferError as err:
        raise transfer_refusal(err, deadline) from err


def time_left(deadline: float) -> float:
    """Seconds until ``deadline``; DEADLINE_EXCEEDED once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise Refusal(Code.DEADLINE_EXCEEDED, "the request ran out of time before decoding")
    return left
