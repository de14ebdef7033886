"""The same-host fast path: a decode daemon reads a prefill rank's pool in place.

gRPC stays the control plane. A decode daemon on the same host as a prefill
rank asks it (``KVTransfer.AttachPool``, with its host id and the transports
it can open) for a handle to the rank's pool:

- ``cuda_ipc``: the pool lives on a GPU; the handle is the CUDA IPC handle of
  its storage (``UntypedStorage._share_cuda_``) plus the GPU's UUID, so the
  decode side maps the same memory and copies pages with device-to-device
  copies (NVLink between two GPUs, a local copy on one);
- ``shm``: the pool lives on the CPU in a file under /dev/shm
  (``shared_cpu_pool``); the handle is the file's path.

A FetchKV that asks for ``descriptors`` then streams, for the layers written
since its last one (every layer of a finished prefill, else one at a time), a
``Descriptor`` instead of the bytes: the logical pages and where they are in
the rank's pool, twice. The first (announced, no digest) comes once those
layers are written on the device; the decode side may start copying. The
second (sealed) adds the digest of their bytes, checked by the rank while
it held the pages. The decode side compares the digest of what it copied,
so a page read too early, too late (recycled) or from the wrong place is
caught (DATA_LOSS, then a fetch over gRPC). Each layer is digested at its
place among all the pool's layers (``page_digest(..., first_layer=0)``), so
a range's digest is the sum of its layers': a rank takes the digest of a
large request's layers as the prefill writes them
(``TensorPageSource.digest_written``) and seals a finished prefill's range
with a sum, without GPU work of its own under the decode side's copies. The
layout contract applies unchanged: AttachPool and FetchKV both carry its
fingerprint.

Decisions: the digest is a position-weighted 64-bit sum of the chunk's words
(``kernels.page_digest``: one pass over the pages where they lie, equal bit
for bit on either side and either device), because a host hash would move
every byte over PCIe and undo the fast path; like XXH3 on the gRPC path it finds accidents, not forgers. A host id is
the host name and the kernel's boot id; a peer that cannot open the handle
anyway (another IPC namespace, no CUDA) falls back to gRPC.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch
from lanekv.transfer.protocol.wire import (
    MAX_LAYERS,
    MAX_PAGE_ID,
    MAX_PAGES_PER_CHUNK,
    MAX_RANKS,
    MAX_REQUEST_ID_LEN,
    MAX_SEQ,
    check_int,
    check_ints,
    check_keys,
    check_str,
    dtype_name,
    kv_dtype,
    unpack_map,
    untrusted,
)

CUDA_IPC = "cuda_ipc"
SHM = "shm"
TRANSPORTS = (CUDA_IPC, SHM)
MAX_TRANSPORTS = 8  # entries of an AttachRequest a server reads
SHM_DIR = Path("/dev/shm")
_U64 = (1 << 64) - 1


def host_id() -> str:
    """This host, as both sides of the fast path name it: host name and boot id."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def as_u64(digest: torch.Tensor) -> int:
    """A digest from ``page_digest`` (a signed int64 tensor) as the unsigned number descriptors carry."""
    return int(digest.item()) & _U64


# -- the pool handle --------------------------------------------------------------------


def shared_cpu_pool(path: Path, shape: Sequence[int], dtype: torch.dtype, fill: float) -> torch.Tensor:
    """A CPU pool backed by a new file under /dev/shm (removed by ``remove_shared_pool``)."""
    numel = 1
    for n in shape:
        numel *= int(n)
    if path.exists():
        raise FileExistsError(f"{path} exists already: another pool uses that name")
    pool = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(*shape)
    pool.fill_(fill)
    return pool


def shm_room(directory: Path = SHM_DIR) -> int:
    """Bytes free under ``directory``: a pool larger than that would fault (SIGBUS) when
    written, so it is not put there (containers often give /dev/shm 64 MiB)."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize


def remove_shared_pool(path: Path | None) -> None:
    if path is not None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class PoolHandle:
    """How to open a rank's pool from another process of the same host."""

    transport: str
    shape: tuple[int, ...]
    dtype: str
    path: str = ""  # shm: the file
    device_uuid: str = ""  # cuda_ipc: the GPU, by UUID (device indexes differ between processes)
    ipc: tuple = ()  # cuda_ipc: what UntypedStorage._share_cuda_ returned, device index first
    storage_offset: int = 0  # elements into the storage

    def encode(self) -> bytes:
        return msgpack.packb(
            dict(transport=self.transport, shape=list(self.shape), dtype=self.dtype, path=self.path,
                 device_uuid=self.device_uuid, ipc=list(self.ipc), storage_offset=self.storage_offset),
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: bytes) -> PoolHandle:
        with untrusted("pool handle"):
            raw = unpack_map(data, "pool handle")
            check_keys("pool handle", raw, ("transport", "shape", "dtype", "path", "device_uuid", "ipc",
                                           "storage_offset"))
            transport = check_str("transport", raw["transport"], 16)
            if transport not in TRANSPORTS:
                raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
            shape = raw["shape"]
            if not isinstance(shape, tuple) or len(shape) != 5:
                raise ValueError(f"shape must be 5 integers, got {shape!r:.80}")
            shape = tuple(check_int(f"shape[{i}]", n, 1, 1 << 40) for i, n in enumerate(shape))
            dtype = check_str("dtype", raw["dtype"], 32)
            kv_dtype(dtype)
            path = check_str("path", raw["path"], 4096, allow_empty=True)
            if transport == SHM and (Path(path).parent != SHM_DIR or not Path(path).name.startswith("lanekv-")):
                raise ValueError(f"path must be a lanekv- file in {SHM_DIR}, got {path!r:.200}")
            ipc = raw["ipc"]
            if not isinstance(ipc, tuple) or len(ipc) > 16:
                raise ValueError(f"ipc must be a short list, got {type(ipc).__name__}")
            return cls(transport, shape, dtype, path, check_str("device_uuid", raw["device_uuid"], 64, allow_empty=True),
                       ipc, check_int("storage_offset", raw["storage_offset"], 0, 1 << 48))


def share_pool(pool: torch.Tensor, path: Path | None, transports: Sequence[str]) -> PoolHandle:
    """A handle to ``pool`` over the first of ``transports`` it can be shared by.

    ValueError names why none fits (a CUDA pool wants ``cuda_ipc``, a CPU pool
    ``shm`` and a pool made by ``shared_cpu_pool``).
    """
    shape, dtype = tuple(pool.shape), dtype_name(pool.dtype)
    if pool.is_cuda:
        if CUDA_IPC not in transports:
            raise ValueError(f"this rank's pool is on {pool.device}: the caller must offer {CUDA_IPC!r}, "
                             f"it offered {list(transports)}")
        storage = pool.untyped_storage()
        ipc = storage._share_cuda_()
        uuid = str(torch.cuda.get_device_properties(pool.device).uuid)
        return PoolHandle(CUDA_IPC, shape, dtype, device_uuid=uuid, ipc=tuple(ipc),
                          storage_offset=pool.storage_offset())
    if SHM not in transports:
        raise ValueError(f"this rank's pool is on the CPU: the caller must offer {SHM!r}, it offered {list(transports)}")
    if path is None:
        raise ValueError("this rank's pool is not in shared memory")
    return PoolHandle(SHM, shape, dtype, path=str(path))


def open_pool(handle: PoolHandle) -> torch.Tensor:
    """Map the pool a handle names (read by the caller, never written). OSError/RuntimeError when it cannot."""
    dtype = kv_dtype(handle.dtype)
    numel = 1
    for n in handle.shape:
        numel *= n
    if handle.transport == SHM:
        size = os.stat(handle.path).st_size
        if size != numel * dtype.itemsize:
            raise OSError(f"{handle.path} holds {size} bytes, the handle says {numel * dtype.itemsize}")
        return torch.from_file(handle.path, shared=True, size=numel, dtype=dtype).view(*handle.shape)
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here to map a cuda_ipc pool")
    local = _cuda_index(handle.device_uuid)
    ipc = list(handle.ipc)
    if len(ipc) != 8:
        raise ValueError(f"cuda_ipc handle has {len(ipc)} fields, expected 8")
    ipc[0] = local
    with torch.cuda.device(local):
        storage = torch.UntypedStorage._new_shared_cuda(*ipc)
        pool = torch.empty(0, dtype=dtype, device=torch.device("cuda", local))
        pool.set_(storage, handle.storage_offset, handle.shape)
    return pool


def _cuda_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise RuntimeError(f"GPU {uuid} is not visible to this process")


# -- the descriptor ---------------------------------------------------------------------

_DESCRIPTOR_KEYS = ("request_id", "rank", "seq", "layer_start", "layer_end", "pages", "physical", "digest")


@dataclass(frozen=True)
class Descriptor:
    """One layer range of a request's pages in a shared pool: the header of a descriptor chunk."""

    request_id: str
    rank: int
    seq: int
    layer_start: int
    layer_end: int
    pages: tuple[int, ...]  # logical pages, in the order the digest reads them
    physical: tuple[int, ...]  # where each is in the rank's pool
    # page_digest(pool, physical, layer_start, layer_end, first_layer=0) as u64; None: the
    # range is announced (written, may be copied) and its sealed twin follows.
    digest: int | None

    def encode(self) -> bytes:
        return msgpack.packb(
            dict(request_id=self.request_id, rank=self.rank, seq=self.seq, layer_start=self.layer_start,
                 layer_end=self.layer_end, pages=list(self.pages), physical=list(self.physical),
                 digest=self.digest),
            use_bin_type=True,
        )

    def sealed_by(self, data: Any) -> Descriptor | None:
        """This announced range sealed with the digest in ``data``, if ``data`` is
        exactly its sealed twin (the same encoding but for the digest); else None.

        Cheaper than ``decode``: the pages were checked in the announcement.
        """
        try:
            digest = unpack_map(data, "descriptor").get("digest")
        except ValueError:
            return None
        if type(digest) is not int or not 0 <= digest <= _U64:
            return None
        sealed = dataclasses.replace(self, digest=digest)
        return sealed if sealed.encode() == bytes(data) else None

    @classmethod
    def decode(cls, data: Any) -> Descriptor:
        with untrusted("descriptor"):
            raw = unpack_map(data, "descriptor")
            check_keys("descriptor", raw, _DESCRIPTOR_KEYS)
            layer_start = check_int("layer_start", raw["layer_start"], 0, MAX_LAYERS - 1)
            pages, physical = raw["pages"], raw["physical"]
            for name, value in (("pages", pages), ("physical", physical)):
                if not isinstance(value, tuple) or not 1 <= len(value) <= MAX_PAGES_PER_CHUNK:
                    raise ValueError(f"{name} must be a list of 1..{MAX_PAGES_PER_CHUNK} page ids")
            if len(pages) != len(physical):
                raise ValueError(f"{len(pages)} pages but {len(physical)} physical pages")
            return cls(
                check_str("request_id", raw["request_id"], MAX_REQUEST_ID_LEN),
                check_int("rank", raw["rank"], 0, MAX_RANKS - 1),
                check_int("seq", raw["seq"], 0, MAX_SEQ),
                layer_start,
                check_int("layer_end", raw["layer_end"], layer_start + 1, MAX_LAYERS),
                check_ints("pages[]", pages, 0, MAX_PAGE_ID),
                check_ints("physical[]", physical, 0, MAX_PAGE_ID),
                None if raw["digest"] is None else check_int("digest", raw["digest"], 0, _U64),
            )
