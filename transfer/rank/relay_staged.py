"""Staged sender relays, the relay's side: chunks read by the rank, checked, framed and sent here.

A staged relay (``staging.py`` says why) maps its staging file read-only and never
touches CUDA. For each sealed descriptor it cuts the chunks the rank's own FetchKV
would send (``wire.plan_chunks``) and asks the rank to read each into a slot
(``KVTransfer.StageKV``), two slots per call so that the rank fills one while this
process frames the other. The rank answers with the chunk's seal
(``protocol.chunkseal``: taken of the bytes it read, where it read them, while it held
the pages). Each chunk is framed (``encode_chunk``, ``frame_chunk``: the same seq
numbers and checksums) and leaves only if its payload, as framed, has that seal: a
slot damaged between the rank's read and the framing ends the stream
(``RangeMismatch``) before any byte of that chunk leaves, while the chunks before it,
each checked the same way, are on their way already. The check is native uint64
column and row sums of each 256 KiB block of the payload right after its copy into
the message (``SealSum``, ``frame_chunk(each_block=)``), read from the CPU's cache
(the range's ``kv_digest`` took a widening per word, and could only be checked once
the whole range was framed: a range's first byte waited for its last, and a relay
held the whole range in memory).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import NamedTuple

import grpc
import torch
from lanekv.proto import lanekv_pb2
from lanekv.runtime.status import TRANSFER_SERVICE
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.chunkseal import SealSum
from lanekv.transfer.protocol.descriptors import Descriptor
from lanekv.transfer.protocol.wire import (
    ChunkPlan,
    encode_chunk,
    frame_chunk,
    kv_dtype,
)
from lanekv.transfer.rank.staging import StagingArea

STAGE_METHOD = f"/{TRANSFER_SERVICE}/StageKV"


class RangeMismatch(Exception):
    """The bytes read are not what the rank sealed (the pages changed, or a slot was damaged)."""


class Framed(NamedTuple):
    message: bytes  # a serialized KVChunk
    nbytes: int  # its payload bytes


class Staged(NamedTuple):
    data: torch.Tensor  # the slot's staged bytes (uint8), valid until the slot is staged again
    seal: int  # the rank's seal of them


class StagingSlots:
    """This relay's staging file, mapped read-only, and its free slots (a call takes two)."""

    def __init__(self, area: StagingArea, channel: grpc.Channel) -> None:
        self.area = area
        fd = os.open(area.path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, area.nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # read-only: never written here
        self._free = list(range(area.slots))
        self._cond = threading.Condition()
        self._call = channel.unary_unary(STAGE_METHOD, request_serializer=lanekv_pb2.StageRequest.SerializeToString,
                                         response_deserializer=lanekv_pb2.StageReply.FromString)

    def take(self, timeout_s: float | None) -> tuple[int, int] | None:
        """Two free slots, or None if none came free within ``timeout_s``."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._free) >= 2, timeout_s):
                return None
            return self._free.pop(), self._free.pop()

    def give(self, slots: tuple[int, int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def stage(self, slot: int, request_id: str, plan: ChunkPlan, timeout_s: float | None) -> Staged:
        """Ask the rank to read ``plan`` into ``slot``: the slot's bytes and the rank's seal of them
        (grpc.RpcError: the rank's refusal; RangeMismatch: a reply without a seal)."""
        request = lanekv_pb2.StageRequest(secret=self.area.secret, request_id=request_id, slot=slot,
                                          layer_start=plan.layer_start, layer_end=plan.layer_end,
                                          pages=list(plan.pages))
        reply = self._call(request, timeout=timeout_s)
        if reply.nbytes > self.area.slot_bytes:
            raise ValueError(f"the rank staged {reply.nbytes} bytes in a slot of {self.area.slot_bytes}")
        if not reply.HasField("seal"):
            raise RangeMismatch(f"the rank staged layers [{plan.layer_start}, {plan.layer_end}) of pages "
                                f"{list(plan.pages)[:8]} without a seal: nothing to check them against")
        start = slot * self.area.slot_bytes
        return Staged(self._bytes[start:start + reply.nbytes], reply.seal)


def staged_chunks(slots: StagingSlots, pair: tuple[int, int], descriptor: Descriptor, plans: list[ChunkPlan],
                  seq: int, agreement: Agreement, deadline: float | None,
                  stop: threading.Event | None = None) -> Iterator[Framed]:
    """The framed chunks ``plans`` of the sealed ``descriptor``, numbered from ``seq``, staged by
    the rank through the slots ``pair`` (each StageKV by ``deadline``, ``time.monotonic()``),
    each yielded once its bytes as framed have the rank's seal; RangeMismatch at the first that
    does not (nothing of it is yielded). Ends early when ``stop`` is set (the caller went away)."""
    if not plans:
        return

    def stage(slot: int, plan: ChunkPlan) -> Staged:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return slots.stage(slot, descriptor.request_id, plan, left)

    a = agreement
    dtype = kv_dtype(a.kv_dtype)
    with futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-stage") as ahead:
        pending = ahead.submit(stage, pair[0], plans[0])
        try:
            for i, plan in enumerate(plans):
                staged = pending.result()
                if stop is not None and stop.is_set():
                    return
                if i + 1 < len(plans):  # the rank fills the other slot (its chunk has been copied out)
                    pending = ahead.submit(stage, pair[(i + 1) % 2], plans[i + 1])
                layers, count = plan.layer_end - plan.layer_start, len(plan.pages)
                part = staged.data.view(dtype).view(layers, a.kv_planes, count * a.page_size, a.num_kv_heads,
                                                    a.head_dim)
                chunk, data = encode_chunk(descriptor.request_id, descriptor.rank, seq + i, plan.layer_start,
                                           plan.pages, part)
                # The one copy out of the slot; each block of the payload is summed as copied (in
                # cache), from the message: the bytes exactly as they leave.
                sealed = SealSum(chunk.nbytes)
                message = frame_chunk(chunk.encode(), data, each_block=sealed.add)
                got = sealed.value()
                if got != staged.seal:
                    raise RangeMismatch(
                        f"chunk seq {seq + i} (layers [{plan.layer_start}, {plan.layer_end}) of pages "
                        f"{list(plan.pages)[:8]}) framed as {got:#018x}, the rank sealed it as {staged.seal:#018x}")
                yield Framed(message, chunk.nbytes)
        finally:
            pending.cancel()  # a stage not started yet (the caller stopped): the rank is not asked


__all__ = ["Framed", "RangeMismatch", "Staged", "StagingSlots", "staged_chunks"]
