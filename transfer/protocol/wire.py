"""The KV wire codec: chunk headers, payloads, checksums and the chunk plan.

A chunk is one (layer range, logical page list) slice of a request's KV. Its
payload is exactly what ``kernels.page_copy.gather_pages`` returns for those
pages, as raw bytes: ``[num_layers, planes, num_pages * page_size, kv_heads,
head_dim]`` in the pool dtype (layer, then K/V, or the one MLA latent plane,
then the pages in the header's order). The header travels as msgpack next to the payload and is decoded as
hostile input: every field is type- and range-checked and ``nbytes`` must
equal the size the other fields imply, so a receiver never sizes a buffer
from an unchecked number.

Checksum: XXH3-64 (``xxhash``; the fastest of those compared, BENCHMARKS.md;
wire version 1 used CRC-32). It detects accidental corruption (bit flips,
torn or reordered chunks) with a 64-bit digest; it is not a defence against
a forger, which TLS is for.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch
import xxhash

# Bumped on any change of the header fields or the payload layout; part of the
# layout agreement, so peers of two wire versions refuse each other at handshake.
WIRE_VERSION = 2  # 2: XXH3-64 chunk checksums (1: CRC-32)

KV_DTYPES = MappingProxyType(
    {
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float32": torch.float32,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
        "uint8": torch.uint8,
    }
)

# Bounds on decoded values: generous for any real model, small enough that a
# hostile header cannot make a receiver allocate or loop without end.
MAX_CHUNK_BYTES = 1 << 30
MAX_HEADER_BYTES = 1 << 20
MAX_PAGES_PER_CHUNK = 1 << 20
MAX_PAGE_ID = 1 << 48
MAX_LAYERS = 1 << 12
MAX_PAGE_SIZE = 1 << 16
MAX_KV_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 14
MAX_RANKS = 1 << 16
MAX_SEQ = 1 << 32
MAX_REQUEST_ID_LEN = 256


def check_int(name: str, value: Any, low: int, high: int) -> int:
    """Return ``value`` if it is an int (not a bool) in ``[low, high]``, else raise naming ``name``."""
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_ints(name: str, values: Sequence[Any], low: int, high: int) -> tuple[int, ...]:
    """``values`` as a tuple if every one is an int (not a bool) in ``[low, high]``,
    else raise naming ``name`` and the first bad one (checked in C: 512 ids in ~10 us)."""
    values = tuple(values)
    if values and (set(map(type, values)) != {int} or min(values) < low or max(values) > high):
        for value in values:
            check_int(name, value, low, high)
    return values


def check_str(name: str, value: Any, max_len: int, *, allow_empty: bool = False) -> str:
    if type(value) is not str:
        raise TypeError(f"{name} must be a str, got {type(value).__name__} {value!r:.80}")
    if not allow_empty and not value:
        raise ValueError(f"{name} must not be empty")
    if len(value) > max_len:
        raise ValueError(f"{name} is {len(value)} characters long, more than {max_len}")
    return value


def kv_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name; ValueError for an unknown name."""
    if name not in KV_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(KV_DTYPES)}, got {name!r}")
    return KV_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for name, known in KV_DTYPES.items():
        if known == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no wire name; known: {sorted(KV_DTYPES)}")


def unpack_map(data: Any, what: str, max_bytes: int = MAX_HEADER_BYTES) -> dict:
    """Decode untrusted msgpack that must hold one map; ValueError on anything else."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"{what} must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ValueError(f"{what} is {len(data)} bytes, more than {max_bytes}")
    try:
        value = msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=True, max_ext_len=0)
    except (ValueError, msgpack.UnpackException) as err:
        raise ValueError(f"{what} is not valid msgpack: {err}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a msgpack map, got {type(value).__name__}")
    return value


def check_keys(what: str, value: dict, expected: Sequence[str]) -> None:
    """Exactly the ``expected`` keys; the message names at most 8 unknown ones, each cut short."""
    missing = sorted(set(expected) - set(value))
    extra = set(value) - set(expected)
    if missing or extra:
        named = [f"{key!r:.40}" for key in sorted(extra, key=repr)[:8]]
        more = f" (and {len(extra) - 8} more)" if len(extra) > 8 else ""
        raise ValueError(
            f"{what} has missing keys {missing} and unknown keys [{', '.join(named)}]{more}"
        )


@contextmanager
def untrusted(what: str) -> Iterator[None]:
    """Report every rejection of untrusted input as ValueError (a TypeError names a wrong type).

    msgpack decodes maps nested up to ~1000 deep; code that walks the decoded
    value recursively (freezing a contract, say) runs out of Python's stack far
    sooner, and that too is a rejection of the input, not a failure of ours.
    """
    try:
        yield
    except TypeError as err:
        raise ValueError(f"{what}: {err}") from err
    except RecursionError as err:
        raise ValueError(f"{what}: nested too deeply") from err


def checksum(data: bytes | memoryview) -> int:
    """XXH3-64 of a payload (see the module docstring for why XXH3)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class ChunkHeader:
    request_id: str
    rank: int
    seq: int  # 0, 1, 2, ... per (request, rank) stream
    layer_start: int
    layer_end: int
    pages: tuple[int, ...]  # logical page ids, in payload order
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str
    nbytes: int
    checksum: int
    planes: int = 2  # per layer: 2 (K, V) or 1 (an MLA latent row)

    def __post_init__(self) -> None:
        check_str("request_id", self.request_id, MAX_REQUEST_ID_LEN)
        check_int("planes", self.planes, 1, 2)
        check_int("rank", self.rank, 0, MAX_RANKS - 1)
        check_int("seq", self.seq, 0, MAX_SEQ - 1)
        check_int("layer_start", self.layer_start, 0, MAX_LAYERS - 1)
        check_int("layer_end", self.layer_end, self.layer_start + 1, MAX_LAYERS)
        if not isinstance(self.pages, tuple):
            raise TypeError(f"pages must be a tuple, got {type(self.pages).__name__}")
        check_int("len(pages)", len(self.pages), 1, MAX_PAGES_PER_CHUNK)
        check_ints("page", self.pages, 0, MAX_PAGE_ID)
        check_int("page_size", self.page_size, 1, MAX_PAGE_SIZE)
        check_int("kv_heads", self.kv_heads, 1, MAX_KV_HEADS)
        check_int("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        kv_dtype(check_str("dtype", self.dtype, 32))
        check_int("nbytes", self.nbytes, 1, MAX_CHUNK_BYTES)
        if self.nbytes != self.expected_nbytes:
            raise ValueError(
                f"nbytes is {self.nbytes} but shape {self.shape} of {self.dtype} "
                f"holds {self.expected_nbytes}"
            )
        check_int("checksum", self.checksum, 0, (1 << 64) - 1)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``[num_layers, planes, num_pages * page_size, kv_heads, head_dim]``."""
        rows = len(self.pages) * self.page_size
        return (self.num_layers, self.planes, rows, self.kv_heads, self.head_dim)

    @property
    def expected_nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * kv_dtype(self.dtype).itemsize

    def encode(self) -> bytes:
        # The fields as they are (``asdict`` would deep-copy the page tuple); msgpack writes a tuple as an array.
        return msgpack.packb({f.name: getattr(self, f.name) for f in fields(self)}, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> ChunkHeader:
        """Parse an untrusted header; any defect is a ValueError naming the field."""
        with untrusted("chunk header"):
            value = unpack_map(data, "chunk header")
            check_keys("chunk header", value, [f.name for f in fields(cls)])
            if not isinstance(value["pages"], tuple):
                raise TypeError(f"pages must be an array, got {type(value['pages']).__name__}")
            return cls(**value)


def encode_chunk(
    request_id: str,
    rank: int,
    seq: int,
    layer_start: int,
    pages: Sequence[int],
    payload: torch.Tensor,
) -> tuple[ChunkHeader, memoryview]:
    """Describe a payload from ``gather_pages``: (header, a byte view of the payload)."""
    if payload.dim() != 5 or payload.shape[1] not in (1, 2):
        raise ValueError(
            f"payload must be [layers, planes (2, or 1 for MLA), rows, kv_heads, head_dim], "
            f"got {tuple(payload.shape)}"
        )
    num_layers, planes, rows, kv_heads, head_dim = payload.shape
    if not pages or rows % len(pages):
        raise ValueError(f"payload has {rows} rows, not a whole number of {len(pages)} pages")
    # A flat byte view of the contiguous payload; the message framing copies it once.
    data = memoryview(payload.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    header = ChunkHeader(
        request_id=request_id,
        rank=rank,
        seq=seq,
        layer_start=layer_start,
        layer_end=layer_start + num_layers,
        pages=tuple(pages),
        page_size=rows // len(pages),
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype_name(payload.dtype),
        nbytes=data.nbytes,
        checksum=checksum(data),
        planes=planes,
    )
    return header, data


def payload_to_tensor(header: ChunkHeader, data: bytes | memoryview) -> torch.Tensor:
    """View a received payload as ``header.shape``, without copying when it is aligned.

    The tensor shares memory with ``data``: treat it as read-only and copy it
    into the destination pool.
    """
    if memoryview(data).nbytes != header.nbytes:
        raise ValueError(
            f"payload is {memoryview(data).nbytes} bytes but the header says {header.nbytes}"
        )
    dtype = kv_dtype(header.dtype)
    tensor = torch.frombuffer(data, dtype=dtype).view(header.shape)
    # frame_chunk aligns the payload to 8 bytes in the message; anything else may be misaligned.
    return tensor.clone() if tensor.data_ptr() % dtype.itemsize else tensor


# Received payloads are views of immutable message bytes, read-only by design
# (placement copies them out); torch's warning about such buffers adds nothing.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

# KVChunk of proto/lanekv.proto is {bytes header = 1; bytes data = 2; bytes
# pad = 3}. Its protobuf encoding is written and read here by hand so that the
# payload is copied once into the message and never out of it (the generated
# class copies it into the message, again to serialize, and again out of a
# parsed one). Field order: pad, data, header; pad is sized so that data
# starts at a multiple of 8 bytes into the message. Any protobuf parser reads
# the result as a KVChunk. Tags: field number << 3 | wire type 2 (length-delimited).
_HEADER_TAG, _DATA_TAG, _PAD_TAG = 0x0A, 0x12, 0x1A


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = 0
    for i in range(10):
        if pos + i >= len(view):
            raise ValueError("chunk message ends inside a varint")
        byte = view[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            return value, pos + i + 1
    raise ValueError("chunk message has a varint longer than 10 bytes")


def frame_chunk(header: bytes, data: bytes | memoryview,
                each_block: Callable[[np.ndarray], None] | None = None) -> bytes:
    """The serialized KVChunk message of an encoded header and a payload. ``each_block``: called
    with each block of the payload as copied into the message (``join_bytes``), in order."""
    size = _varint(memoryview(data).nbytes)
    pad = (-(3 + len(size))) % 8  # pad tag + pad length + data tag = 3 bytes
    prefix = bytes([_PAD_TAG, pad]) + bytes(pad) + bytes([_DATA_TAG]) + size
    return join_bytes((prefix, data, bytes([_HEADER_TAG]), _varint(len(header)), header),
                      watch=None if each_block is None else 1, each_block=each_block)


# Parts of at least this many bytes are copied into a joined message by one
# ``ctypes.memmove`` each, which drops the GIL while it copies (ctypes releases
# it around every foreign call); ``bytes.join`` holds the GIL throughout. A
# rank's FetchKV builds its next chunks in threads while gRPC sends the current
# one (gRPC's own copy of the message holds the GIL), and several streams of a
# rank share the process: on H200 hosts the join was the largest cost of a
# stream. memmove, not a torch copy: one C call, no tensors to make and no
# dispatch under the GIL per part (bench/fetch_cpu.py: ``frame``).
_FREE_COPY_BYTES = 64 << 10


def _bytes_api() -> tuple[Any, Any] | None:
    """CPython's PyBytes_FromStringAndSize(NULL, n) (a new, unfilled bytes object) and
    PyBytes_AsString (its buffer), or None where there is no such API."""
    try:
        api = ctypes.pythonapi
    except AttributeError:
        return None
    new, address = api.PyBytes_FromStringAndSize, api.PyBytes_AsString
    new.argtypes, new.restype = [ctypes.c_void_p, ctypes.c_ssize_t], ctypes.py_object
    address.argtypes, address.restype = [ctypes.py_object], ctypes.c_void_p
    return new, address


_BYTES_API = _bytes_api()


def buffer_address(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte, read-only buffers (bytes) too
    (ctypes takes only writable ones; numpy reads the address without a copy)."""
    if not view.c_contiguous:
        raise ValueError("buffer must be contiguous")
    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0] if view.nbytes else 0


# Blocks of a watched part (``join_bytes``): small enough to be in the CPU's L2 cache still
# when ``each_block`` reads them, and a whole number of a chunk seal's rows.
WATCH_BLOCK_BYTES = 256 << 10


def join_bytes(parts: Sequence[bytes | memoryview], *, watch: int | None = None,
               each_block: Callable[[np.ndarray], None] | None = None) -> bytes:
    """``b"".join(parts)``, with large parts copied outside the GIL.

    The result is a new bytes object filled before anyone else sees it (what
    C code does with PyBytes_FromStringAndSize(NULL, n)). ``watch``: the index of
    a part copied in blocks of ``WATCH_BLOCK_BYTES``, each handed to ``each_block``
    (a read-only view of the result) right after its copy, in order.
    """
    views = [memoryview(part).cast("B") for part in parts]
    total = sum(view.nbytes for view in views)
    if _BYTES_API is None or max((view.nbytes for view in views), default=0) < _FREE_COPY_BYTES:
        out = b"".join(views)
        if watch is not None and each_block is not None and views[watch].nbytes:
            start = sum(view.nbytes for view in views[:watch])
            each_block(np.frombuffer(out, dtype=np.uint8, count=views[watch].nbytes, offset=start))
        return out
    new, address_of = _BYTES_API
    out = new(None, total)
    address = address_of(out)
    pos = 0
    for i, view in enumerate(views):
        n = view.nbytes
        if i == watch and each_block is not None and n:
            source = buffer_address(view) if n >= _FREE_COPY_BYTES else None
            for at in range(0, n, WATCH_BLOCK_BYTES):
                size = min(WATCH_BLOCK_BYTES, n - at)
                ctypes.memmove(address + pos + at, view[at:at + size].tobytes() if source is None else source + at, size)
                each_block(np.frombuffer(out, dtype=np.uint8, count=size, offset=pos + at))
        elif n >= _FREE_COPY_BYTES:
            ctypes.memmove(address + pos, buffer_address(view), n)
        elif n:
            ctypes.memmove(address + pos, view.tobytes(), n)
        pos += n
    return out


def split_chunk(message: bytes) -> tuple[memoryview, memoryview]:
    """(header, data) views into a serialized KVChunk; ValueError if it is not one."""
    view = memoryview(message)
    found: dict[int, memoryview] = {}
    pos = 0
    while pos < len(view):
        tag, pos = _read_varint(view, pos)
        if tag not in (_HEADER_TAG, _DATA_TAG, _PAD_TAG) or tag in found:
            raise ValueError(f"chunk message has an unexpected or repeated field tag {tag}")
        size, pos = _read_varint(view, pos)
        if pos + size > len(view):
            raise ValueError(f"chunk message field {tag >> 3} runs past the end of the message")
        found[tag] = view[pos : pos + size]
        pos += size
    return found.get(_HEADER_TAG, view[:0]), found.get(_DATA_TAG, view[:0])


class ChunkPlan(NamedTuple):
    layer_start: int
    layer_end: int
    pages: tuple[int, ...]


def _even_split(count: int, max_part: int) -> list[tuple[int, int]]:
    """Cut ``range(count)`` into the fewest parts of at most ``max_part``, sizes within one."""
    parts = -(-count // max_part)
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def plan_chunks(
    num_layers: int,
    pages: Sequence[int],
    bytes_per_page_layer: int,
    max_chunk_bytes: int,
    *,
    layer_start: int = 0,
) -> list[ChunkPlan]:
    """Cut layers ``[layer_start, layer_start + num_layers)`` x ``pages`` into chunks.

    Layer-major: every chunk of layer l comes before any chunk of layer l+1, so
    a sender that writes KV layer by layer can ship layer l as soon as it is
    done, and a receiver can place each chunk as it arrives. When all pages of
    one layer fit in ``max_chunk_bytes`` whole layers are grouped; otherwise
    each layer's pages are split into near-equal runs.
    ``bytes_per_page_layer`` is K and V of one page of one layer.
    """
    check_int("num_layers", num_layers, 1, MAX_LAYERS)
    check_int("layer_start", layer_start, 0, MAX_LAYERS - num_layers)
    check_int("bytes_per_page_layer", bytes_per_page_layer, 1, MAX_CHUNK_BYTES)
    check_int("max_chunk_bytes", max_chunk_bytes, bytes_per_page_layer, MAX_CHUNK_BYTES)
    pages = tuple(pages)
    if not pages:
        return []
    layer_bytes = len(pages) * bytes_per_page_layer
    if layer_bytes <= max_chunk_bytes:
        spans = _even_split(num_layers, max_chunk_bytes // layer_bytes)
        return [ChunkPlan(layer_start + a, layer_start + b, pages) for a, b in spans]
    runs = _even_split(len(pages), max_chunk_bytes // bytes_per_page_layer)
    return [
        ChunkPlan(layer, layer + 1, pages[a:b])
        for layer in range(layer_start, layer_start + num_layers)
        for a, b in runs
    ]
