"""A prefill rank's NIXL staging region: where a head range of some pages is packed to be read.

NIXL has no strided descriptors, and in the pool ``[num_layers, planes, rows,
kv_heads, head_dim]`` one KV head of a row is a few hundred bytes between the
other heads': reading a tensor-parallel decode rank's heads in place would take
one descriptor per row and plane (hundreds of thousands per request). So the
rank gathers the asked heads of the asked pages, one gather per sealed range
on the pool's device, into a region of its own registered with its agent once,
laid out ``[layers, planes, pages * page_size, head_count, head bytes]``: the
decode rank's pool holds only those heads, so each layer and plane of a run of
its pages is one block on both sides (``runs.staged_pairs``).

The region is bounded (``StagingArena``) and handed out in leases, one per
FetchKV call, freed when the call ends; a call that does not fit is refused
(``StagingFull``) and the caller takes gRPC instead. Nothing waits for room.
"""

from __future__ import annotations

import threading

import torch

# Offsets of leases are multiples of this (any dtype's view, and the DMA engines' liking).
ALIGN_BYTES = 512
# A rank's staging region when none is given: at most this, and never more than its pool.
DEFAULT_STAGING_BYTES = 256 << 20


class StagingFull(RuntimeError):
    """No lease of the size asked fits in the staging region now."""


class Lease:
    """``nbytes`` of the region at ``offset``, held until ``release`` (idempotent)."""

    def __init__(self, arena: StagingArena, offset: int, nbytes: int) -> None:
        self.offset, self.nbytes = offset, nbytes
        self._arena: StagingArena | None = arena

    def view(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The lease's bytes as a contiguous uint8 tensor of ``shape`` (ValueError if larger)."""
        numel = 1
        for n in shape:
            numel *= n
        arena = self._arena
        if arena is None:
            raise ValueError("the lease is released")
        if numel > self.nbytes:
            raise ValueError(f"shape {shape} needs {numel} bytes, the lease holds {self.nbytes}")
        return arena.buffer[self.offset:self.offset + numel].view(shape)

    def release(self) -> None:
        arena, self._arena = self._arena, None
        if arena is not None:
            arena.free(self.offset)


class StagingArena:
    """A contiguous byte region on ``device`` and a first-fit allocator of leases over it."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if nbytes < ALIGN_BYTES:
            raise ValueError(f"staging nbytes must be >= {ALIGN_BYTES}, got nbytes={nbytes}")
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._held: dict[int, int] = {}  # offset -> bytes (a multiple of ALIGN_BYTES)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def lease(self, nbytes: int) -> Lease:
        """A lease of ``nbytes``; ``StagingFull`` naming the sizes when none fits now."""
        if nbytes < 1:
            raise ValueError(f"a lease needs nbytes >= 1, got nbytes={nbytes}")
        size = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        with self._lock:
            at = 0
            for offset, held in sorted(self._held.items()):
                if offset - at >= size:
                    break
                at = offset + held
            if at + size > self.nbytes:
                free = self.nbytes - sum(self._held.values())
                raise StagingFull(f"NIXL staging is full: {nbytes} bytes asked, {free} of {self.nbytes} free "
                                  f"in {len(self._held)} leases")
            self._held[at] = size
        return Lease(self, at, size)

    def free(self, offset: int) -> None:
        with self._lock:
            self._held.pop(offset, None)
