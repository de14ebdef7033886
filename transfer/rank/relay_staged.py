"""Staged sender relays, the relay's side: ranges read by the rank, digested and framed here.

A staged relay (``staging.py`` says why) maps its staging file read-only and never
touches CUDA. For each sealed descriptor it cuts the chunks the rank's own FetchKV
would send (``wire.plan_chunks``) and asks the rank to read each into a slot
(``KVTransfer.StageKV``), two slots per call so that the rank fills one while this
process frames the other. Each chunk is framed (``encode_chunk``, ``frame_chunk``:
the same seq numbers and checksums) and its payload, as framed, is digested here on
the CPU: ``kv_digest`` (in fewer passes, ``StagingSlots.digest``) of each (layer, plane)
run at its place in the range, which sums
to the digest of the whole range (``kv_digest``'s parts add up, on any device). Only
if the sum equals the rank's seal does any framed chunk of the range leave: a slot
damaged between the rank's read and the framing ends the stream (``RangeMismatch``).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent import futures
from typing import NamedTuple

import grpc
import numpy as np
import torch
from lanekv.kernels.page_digest import DIGEST_WEIGHT
from lanekv.proto import lanekv_pb2
from lanekv.runtime.status import TRANSFER_SERVICE
from lanekv.transfer.protocol.contract import Agreement
from lanekv.transfer.protocol.descriptors import Descriptor
from lanekv.transfer.protocol.wire import (
    ChunkPlan,
    encode_chunk,
    frame_chunk,
    kv_dtype,
    split_chunk,
)
from lanekv.transfer.rank.staging import StagingArea

STAGE_METHOD = f"/{TRANSFER_SERVICE}/StageKV"
_U64 = (1 << 64) - 1
_DIGEST_ROW = 1024  # words a row of the digest's two sums (even)
_ROW_PLACES = np.arange(_DIGEST_ROW, dtype=np.int64)


class RangeMismatch(Exception):
    """The bytes read are not what the rank digested (the pages changed, or a slot was damaged)."""


class Framed(NamedTuple):
    message: bytes  # a serialized KVChunk
    nbytes: int  # its payload bytes


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

    @staticmethod
    def digest(run: torch.Tensor, position: int) -> int:
        """``kv_digest(run, position)`` of a contiguous run of whole 4-byte words, in two
        passes over it instead of kv_digest's six, on numpy's int64-accumulating sums
        (torch's CPU integer reductions ran at a tenth of their speed: the digest was what
        bounded a relay). With W odd, ``(p * W) | 1`` is ``p * W + (1 if p is even)``, so
        the digest is ``W * (position * S + sum(i * word[i])) + (the sum of the words at
        even positions)``, S the sum of the words, all mod 2^64. ``sum(i * word[i])`` comes
        from the run cut into rows of ``_DIGEST_ROW`` words: the column sums weigh the
        place in a row, the row sums the row's first position (the test compares the two)."""
        words = run.numpy().view(np.int32)
        rows = words.size // _DIGEST_ROW
        body, tail = words[:rows * _DIGEST_ROW].reshape(rows, _DIGEST_ROW), words[rows * _DIGEST_ROW:]
        columns = body.sum(0, dtype=np.int64)  # [row]: no overflow below 2^32 rows
        firsts = body.sum(1, dtype=np.int64) @ np.arange(0, rows * _DIGEST_ROW, _DIGEST_ROW, dtype=np.int64)
        tail64 = tail.astype(np.int64)
        at = np.arange(rows * _DIGEST_ROW, words.size, dtype=np.int64)
        weighted = int(columns @ _ROW_PLACES) + int(firsts) + int(tail64 @ at)
        total = int(columns.sum()) + int(tail64.sum())
        # Rows have an even length: a column's words, and the tail's i-th word, sit at
        # positions of the parity of position + their index.
        even = int(columns[position % 2::2].sum()) + int(tail64[position % 2::2].sum())
        return (DIGEST_WEIGHT * (position * total + weighted) + even) & _U64

    def stage(self, slot: int, request_id: str, plan: ChunkPlan, timeout_s: float | None) -> torch.Tensor:
        """Ask the rank to read ``plan`` into ``slot``; the slot's bytes once it has
        (grpc.RpcError: the rank's refusal)."""
        request = lanekv_pb2.StageRequest(secret=self.area.secret, request_id=request_id, slot=slot,
                                          layer_start=plan.layer_start, layer_end=plan.layer_end,
                                          pages=list(plan.pages))
        reply = self._call(request, timeout=timeout_s)
        if reply.nbytes > self.area.slot_bytes:
            raise ValueError(f"the rank staged {reply.nbytes} bytes in a slot of {self.area.slot_bytes}")
        start = slot * self.area.slot_bytes
        return self._bytes[start:start + reply.nbytes]


def staged_range(slots: StagingSlots, pair: tuple[int, int], descriptor: Descriptor, plans: list[ChunkPlan],
                 seq: int, agreement: Agreement, deadline: float | None,
                 stop: threading.Event | None = None) -> list[Framed]:
    """The framed chunks ``plans`` of the sealed ``descriptor``, numbered from ``seq``, staged by
    the rank through the slots ``pair`` (each StageKV by ``deadline``, ``time.monotonic()``);
    RangeMismatch when their bytes, as framed, do not sum to the seal (nothing of the range may
    leave then). Nothing when ``stop`` is set meanwhile (the caller went away)."""
    if not plans:
        return []

    def stage(slot: int, plan: ChunkPlan) -> torch.Tensor:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return slots.stage(slot, descriptor.request_id, plan, left)

    a = agreement
    dtype, rows = kv_dtype(a.kv_dtype), a.page_size * len(descriptor.pages)
    row_bytes = a.num_kv_heads * a.head_dim * dtype.itemsize
    where = {page: i for i, page in enumerate(descriptor.pages)}
    total, out = 0, []
    with futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-stage") as ahead:
        pending = ahead.submit(stage, pair[0], plans[0])
        for i, plan in enumerate(plans):
            staged = pending.result()
            if stop is not None and stop.is_set():
                return []
            if i + 1 < len(plans):  # the rank fills the other slot while this one is framed
                pending = ahead.submit(stage, pair[(i + 1) % 2], plans[i + 1])
            layers, count = plan.layer_end - plan.layer_start, len(plan.pages)
            part = staged.view(dtype).view(layers, a.kv_planes, count * a.page_size, a.num_kv_heads, a.head_dim)
            chunk, data = encode_chunk(descriptor.request_id, descriptor.rank, seq + i, plan.layer_start,
                                       plan.pages, part)
            message = frame_chunk(chunk.encode(), data)
            _, sent = split_chunk(message)  # the payload exactly as it leaves
            # [layers, planes, count * page_size * row_bytes]: each (layer, plane) run sits at its
            # place among the range's rows, the range at its place among all layers.
            runs = torch.frombuffer(sent, dtype=torch.uint8).view(layers, a.kv_planes, -1)
            first = where[plan.pages[0]] * a.page_size
            for layer in range(layers):
                for plane in range(a.kv_planes):
                    index = ((plan.layer_start + layer) * a.kv_planes + plane) * rows + first
                    total += slots.digest(runs[layer, plane], index * row_bytes // 4)
            out.append(Framed(message, chunk.nbytes))
    if total & _U64 != descriptor.digest:
        raise RangeMismatch(
            f"layers [{descriptor.layer_start}, {descriptor.layer_end}) of pages {list(descriptor.pages)[:8]} "
            f"staged as {total & _U64:#018x}, the rank sealed them as {descriptor.digest:#018x}")
    return out


def check_staged_rows(agreement: Agreement) -> None:
    """kv_digest takes 4-byte words: each row of a staged range must be whole words."""
    row_bytes = agreement.num_kv_heads * agreement.head_dim * kv_dtype(agreement.kv_dtype).itemsize
    if row_bytes % 4:
        raise ValueError(f"a staged relay needs rows of whole 4-byte words, a row has {row_bytes} bytes")


__all__ = ["Framed", "RangeMismatch", "StagingSlots", "check_staged_rows", "staged_range"]
