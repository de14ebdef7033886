"""Staged sender relays, the rank's side: the rank reads its pages into a relay's staging file.

A mapped relay (``relay.py``) reads the rank's pool itself, so on a GPU each relay
is a CUDA context of its own whose gather and digest kernels time-slice the GPU
with the rank's prefill. A staged relay never touches CUDA: it asks its rank
(``KVTransfer.StageKV``) to read a sealed range's chunk into a slot of a /dev/shm
file the rank made for that relay, and then frames the bytes, checks them against
the rank's seal of the chunk and sends them, on the CPU (``relay_staged.py``). Per
byte the rank does a gather on one of its read streams, the chunk's seal there
(``protocol.chunkseal``) and a device-to-host DMA into the slot (pinned with
``cudaHostRegister``), holding no GIL while the bytes move.

- ``RankStaging`` makes one file per relay (``SLOTS`` slots of ``SLOT_BYTES``),
  named like the rank's pool file (``runtime.shmfiles.pool_file_name``: owner pid,
  so a SIGKILLed rank's files are reclaimed by the next daemon), with a random
  ``secret`` that only the relay is told (in its pickled ``RelaySpec``);
  ``close`` unregisters and unlinks them.
- ``StageKV`` (``service.py``) stages only for a known secret (which a staged relay's
  FetchKV also presents, ``RELAY_METADATA_KEY``, in place of an AttachPool), only pages of the
  request the rank still holds (checked again after the read, as FetchKV does),
  and answers once the bytes are in the slot, with their seal.
- ``staged_mode``: staged for a GPU pool, mapped for a CPU pool (already in /dev/shm,
  no CUDA involved); ``LANEKV_RELAY_STAGED=1``/``0`` forces either (tests stage a CPU pool).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import NamedTuple

import grpc
import torch
from lanekv.runtime.shmfiles import pool_file_name
from lanekv.runtime.status import DEFAULT_CHUNK_BYTES, Refusal
from lanekv.transfer.protocol.descriptors import SHM_DIR, remove_shared_pool, shm_room

Code = grpc.StatusCode
log = logging.getLogger("lanekv.transfer")
STAGED_ENV = "LANEKV_RELAY_STAGED"
# A staged relay's FetchKV (descriptors=true) carries its secret here instead of an AttachPool
# first: it maps no pool, and the rank knows it as its own relay.
RELAY_METADATA_KEY = "lanekv-relay"
# Test hook: the rank flips one bit of every slot it stages for the request this names,
# after the read and its seal (the relay must catch it before any byte of the chunk leaves);
# "<request id>@<k>" flips only the k-th (from 0) staging of that request on this rank.
DAMAGE_ENV = "LANEKV_TEST_DAMAGE_STAGING"
# Slots per relay: a relay's FetchKV call takes two (the rank fills one while the relay
# sends the other), so two calls of one relay stage at once; a third waits.
SLOTS = 4
# A chunk is at most the caller's max_chunk_bytes (DEFAULT_CHUNK_BYTES unless it asks);
# a relay refuses a call whose chunks would not fit (the caller then fetches from the rank).
SLOT_BYTES = 2 * DEFAULT_CHUNK_BYTES


def staged_mode(pool_is_cuda: bool) -> bool:
    """Whether a rank's relays are staged: by default for a GPU pool only; ``STAGED_ENV``
    set to "1" or "0" forces staged or mapped relays. ValueError naming a bad value."""
    value = os.environ.get(STAGED_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{STAGED_ENV} must be 0, 1 or unset, got {STAGED_ENV}={value!r}")
    return pool_is_cuda if value == "" else value == "1"


class StagingArea(NamedTuple):
    """One relay's staging file, as the relay is told it (in its ``RelaySpec``)."""

    path: str
    slots: int
    slot_bytes: int
    secret: str  # what the relay's StageKV calls present

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes


class RankStaging:
    """The staging files of a rank's relays, mapped writable (and pinned, for a GPU pool) here."""

    def __init__(self, epoch: str, rank: int, count: int, device: torch.device, *, slots: int = SLOTS,
                 slot_bytes: int = SLOT_BYTES, directory: Path = SHM_DIR) -> None:
        if slots < 2 or slot_bytes < 4096:
            raise ValueError(f"staging needs slots >= 2 and slot_bytes >= 4096, got slots={slots} "
                             f"slot_bytes={slot_bytes}")
        need, room = count * slots * slot_bytes, shm_room(directory)
        if need > room:
            raise OSError(f"staged relays need {need} bytes under {directory}, {room} are free")
        self.areas: list[StagingArea] = []
        self._buffers: dict[str, tuple[StagingArea, torch.Tensor]] = {}  # secret -> its file's bytes, mapped here
        self._pinned: list[int] = []  # data_ptrs registered with CUDA
        self._damage = _damage_spec(os.environ.get(DAMAGE_ENV, ""))  # (request id, k or None): test hook
        self._damage_count = 0  # stagings of that request so far
        self._damage_lock = threading.Lock()
        try:
            for i in range(count):
                path = directory / pool_file_name(epoch, rank, f"stage{i}_{secrets.token_hex(4)}")
                if path.exists():
                    raise FileExistsError(f"{path} exists already")
                buffer = torch.from_file(str(path), shared=True, size=slots * slot_bytes, dtype=torch.uint8)
                area = StagingArea(str(path), slots, slot_bytes, secrets.token_hex(16))
                self.areas.append(area)
                self._buffers[area.secret] = area, buffer
                if device.type == "cuda":
                    _register(buffer)
                    self._pinned.append(buffer.data_ptr())
        except BaseException:
            self.close()
            raise

    def knows(self, secret: str) -> bool:
        """Whether ``secret`` is one of this rank's relays'."""
        return self._find(secret) is not None

    def _find(self, secret: str) -> tuple[StagingArea, torch.Tensor] | None:
        given = secret.encode("utf-8", "surrogateescape")
        return next((v for s, v in self._buffers.items() if hmac.compare_digest(s.encode(), given)), None)

    def slot(self, secret: str, slot: int) -> torch.Tensor:
        """Slot ``slot`` of the relay that ``secret`` names: ``slot_bytes`` uint8; a Refusal
        (PERMISSION_DENIED, INVALID_ARGUMENT) for a secret or slot that is not one."""
        found = self._find(secret)
        if found is None:
            raise Refusal(Code.PERMISSION_DENIED, "StageKV is for this rank's own relays: unknown secret")
        area, buffer = found
        if not 0 <= slot < area.slots:
            raise Refusal(Code.INVALID_ARGUMENT, f"slot {slot} is not within [0, {area.slots})")
        return buffer[slot * area.slot_bytes:(slot + 1) * area.slot_bytes]

    def staged(self, slot: torch.Tensor, nbytes: int, request_id: str) -> None:
        """Called once ``nbytes`` of ``request_id`` are in ``slot`` (``DAMAGE_ENV``: flip a bit)."""
        if self._damage is None or request_id != self._damage[0] or not nbytes:
            return
        with self._damage_lock:
            index, self._damage_count = self._damage_count, self._damage_count + 1
        if self._damage[1] in (None, index):
            slot[nbytes - 1] ^= 0x40

    def close(self) -> None:
        """Unregister and unlink every file (a relay's mapping stays valid until it exits)."""
        for ptr in self._pinned:
            code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
            if code != 0:
                log.warning("cudaHostUnregister of a relay staging file failed: cudaError %d", code)
        self._pinned.clear()
        self._buffers.clear()
        for area in self.areas:
            remove_shared_pool(Path(area.path))


def _damage_spec(value: str) -> tuple[str, int | None] | None:
    """``DAMAGE_ENV``'s value as (request id, the staging to damage or None for all)."""
    if not value:
        return None
    rid, at, k = value.rpartition("@")
    return (rid, int(k)) if at and k.isdigit() else (value, None)


def _register(buffer: torch.Tensor) -> None:
    """Page-lock ``buffer`` for the device-to-host DMA (torch 2.11+: ``cudart().cudaHostRegister``,
    the call ``torch.cuda._pin_memory_utils`` makes); RuntimeError naming the CUDA error."""
    code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of a relay staging file ({buffer.numel()} bytes) failed: "
                           f"cudaError {code}")


__all__ = ["RankStaging", "StagingArea", "staged_mode"]
