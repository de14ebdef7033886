"""What one FetchKV asks of a rank, checked, and how its bytes are cut and built.

``span_of`` reads the layers and pages a fetch names into a ``FetchSpan``, checked
against the pages the rank holds for the request; ``heads_of`` the KV heads a TP
decode rank asks for; ``plan_of`` cuts a fetch of bytes into chunks
(``protocol.wire.plan_chunks``), each with its physical pages; ``one_ahead`` builds
the next chunks while gRPC sends one. A bad field is a ``Refusal`` raised before
the servicer (``service.py``) yields its first chunk, so a refused fetch sends no
byte. Nothing here holds state: the servicer passes in what the rank knows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import NamedTuple, TypeVar

import grpc
import torch
from lanekv.proto import lanekv_pb2
from lanekv.runtime.status import Refusal
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.wire import ChunkPlan, kv_dtype, plan_chunks

Code = grpc.StatusCode
T = TypeVar("T")

# Chunks built ahead of the one gRPC is sending. Reading pages, hashing and
# framing a chunk take about as long as sending it, and the read, the hash and
# the framing copy drop the GIL (gRPC's own copy of the message does not:
# bench/notes_grpc_fetch_cpu.md), so two builders in flight keep the stream fed
# (one held the stream well below a raw one: BENCHMARKS.md, KV transfer over gRPC).
LOOKAHEAD = 3


class FetchSpan(NamedTuple):
    """What one FetchKV asks of this rank: layers ``[layer_start, layer_end)`` of ``pages``."""

    layer_start: int
    layer_end: int
    pages: tuple[int, ...]  # logical, in the caller's order
    physical: tuple[int, ...]  # where each is in this rank's pool

    def nbytes(self, a: Agreement, heads: slice | None = None) -> int:
        """The KV bytes of the span (of KV heads ``heads`` only)."""
        return len(self.pages) * (self.layer_end - self.layer_start) * page_bytes(a, heads)


def span_of(request: lanekv_pb2.FetchRequest, a: Agreement, owned: dict[int, int], rank: int) -> FetchSpan:
    """The layers and pages a fetch asks for, checked against ``owned`` (logical page ->
    physical page, the pages rank ``rank`` holds for the request)."""
    layer_end = request.layer_end if request.HasField("layer_end") else a.num_layers
    if not 0 <= request.layer_start < layer_end <= a.num_layers:
        raise Refusal(
            Code.INVALID_ARGUMENT,
            f"layer range [{request.layer_start}, {layer_end}) is not within [0, {a.num_layers})",
        )
    pages = list(request.pages) or list(owned)
    if len(set(pages)) != len(pages):
        raise Refusal(Code.INVALID_ARGUMENT, f"pages lists a page twice: {pages[:16]}")
    foreign = [page for page in pages if page not in owned]
    if foreign:
        raise Refusal(
            Code.INVALID_ARGUMENT,
            f"pages {foreign[:16]} are not pages of request {request.request_id!r} on rank {rank}",
        )
    return FetchSpan(request.layer_start, layer_end, tuple(pages), tuple(owned[page] for page in pages))


def plan_of(
    request: lanekv_pb2.FetchRequest, a: Agreement, span: FetchSpan, default_chunk_bytes: int, max_chunk_bytes: int
) -> list[tuple[ChunkPlan, list[int]]]:
    """Cut a fetch of bytes into chunks, each with its physical pages."""
    one_page = page_bytes(a)
    chunk_bytes = request.max_chunk_bytes or default_chunk_bytes
    if not one_page <= chunk_bytes <= max_chunk_bytes:
        raise Refusal(
            Code.INVALID_ARGUMENT,
            f"max_chunk_bytes {chunk_bytes} is not within [{one_page} (one page of one layer), {max_chunk_bytes}]",
        )
    plans = plan_chunks(
        span.layer_end - span.layer_start,
        span.pages,
        one_page,
        chunk_bytes,
        layer_start=span.layer_start,
    )
    physical = dict(zip(span.pages, span.physical))
    return [(plan, [physical[page] for page in plan.pages]) for plan in plans]


def heads_of(request: lanekv_pb2.FetchRequest, a: Agreement) -> slice | None:
    """The KV heads a fetch asks for (``head_start``/``head_count``), or None for whole rows."""
    has_start, has_count = request.HasField("head_start"), request.HasField("head_count")
    if not has_start and not has_count:
        return None
    start, count = request.head_start, request.head_count
    if not has_count or count < 1 or start + count > a.num_kv_heads:
        raise Refusal(Code.INVALID_ARGUMENT, f"heads [{start}, {start + count}) (head_start={start}, "
                      f"head_count={count if has_count else 'absent'}) are not within the "
                      f"num_kv_heads={a.num_kv_heads} of a row")
    return slice(start, start + count)


def page_bytes(a: Agreement, heads: slice | None = None) -> int:
    """K and V (or the MLA latent) of one page of one layer (of KV heads ``heads`` only)."""
    count = a.num_kv_heads if heads is None else heads.stop - heads.start
    return a.kv_planes * a.page_size * count * a.head_dim * kv_dtype(a.kv_dtype).itemsize


def check_payload(payload: torch.Tensor, chunk: ChunkPlan, a: Agreement) -> None:
    """The page source's read of ``chunk`` has the chunk's shape and the contract's dtype."""
    shape = (
        chunk.layer_end - chunk.layer_start,
        a.kv_planes,
        len(chunk.pages) * a.page_size,
        a.num_kv_heads,
        a.head_dim,
    )
    if tuple(payload.shape) != shape or payload.dtype != kv_dtype(a.kv_dtype):
        raise Refusal(
            Code.INTERNAL,
            f"page source returned {tuple(payload.shape)} {payload.dtype}, expected {shape} {a.kv_dtype}",
        )


def one_ahead(produce: Callable[[int], T], count: int) -> Iterator[T]:
    """Yield ``produce(0)``, ..., ``produce(count - 1)`` in order, building the next
    ``LOOKAHEAD`` while gRPC sends the current one (a send blocks the handler thread)."""
    if count == 0:
        return
    with futures.ThreadPoolExecutor(max_workers=LOOKAHEAD - 1, thread_name_prefix="fetchkv") as pool:
        pending = deque(pool.submit(produce, seq) for seq in range(min(LOOKAHEAD, count)))
        for seq in range(count):
            message = pending.popleft().result()
            if seq + LOOKAHEAD < count:
                pending.append(pool.submit(produce, seq + LOOKAHEAD))
            yield message
