"""The chunk seal: a 64-bit digest a rank takes of a chunk it reads, that a CPU checks cheaply.

A staged relay (``transfer.rank.relay_staged``) sends nothing the rank did not vouch
for. The rank's range digest (``kv_digest`` over 4-byte words) costs a CPU two passes
plus an int32-to-int64 widening per word, so a relay could check a range only once it
had built all of it. The chunk seal is taken by the rank of each chunk it reads (on
the device that holds the pool, while it holds the pages) and checked by the relay on
the chunk's bytes as framed, so each chunk leaves as soon as it matches.

Definition: the bytes, zero-padded to whole 8-byte words, as little-endian unsigned
64-bit words ``q[j]``; ``seal = sum_j q[j] * ((j * W) | 1) mod 2^64`` with ``W``
``kv_digest``'s odd weight. Any one changed word, and words that swapped places,
change it (the weights are odd and depend on the place); integer sums wrap and
commute, so every device and summation order gives the same number. On the CPU it
is two passes of numpy's native uint64 sums (no widening): the words cut into rows
of ``ROW_WORDS``, column sums weigh the place in a row, row sums the row's place.
"""

from __future__ import annotations

import numpy as np
import torch
from lanekv.kernels.page_digest import DIGEST_WEIGHT

U64 = (1 << 64) - 1
ROW_WORDS = 1024  # even: a column's words all sit at places of one parity
_WEIGHT = DIGEST_WEIGHT & U64
_COLUMNS = np.arange(ROW_WORDS, dtype=np.uint64)


def seal_bytes(data: bytes | memoryview | np.ndarray) -> int:
    """The seal of a byte buffer (see the module docstring), on the CPU."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    whole = raw.size - raw.size % 8
    words = raw[:whole].view(np.uint64)
    rows = words.size // ROW_WORDS
    body = words[:rows * ROW_WORDS].reshape(rows, ROW_WORDS)
    tail = words[rows * ROW_WORDS:]
    if whole < raw.size:  # the last partial word, zero-padded
        tail = np.append(tail, np.uint64(int.from_bytes(raw[whole:].tobytes(), "little")))
    columns = body.sum(0, dtype=np.uint64)  # [ROW_WORDS]
    row_sums = body.sum(1, dtype=np.uint64)  # [rows]
    at = np.arange(rows * ROW_WORDS, rows * ROW_WORDS + tail.size, dtype=np.uint64)
    # sum_j j * q[j], j = r * ROW_WORDS + c for the body, then the tail's places
    weighted = (ROW_WORDS * int(row_sums @ np.arange(rows, dtype=np.uint64)) + int(columns @ _COLUMNS)
                + int(tail @ at))
    even = int(columns[0::2].sum(dtype=np.uint64)) + int(tail[0::2].sum(dtype=np.uint64))  # rows*ROW_WORDS is even
    return (_WEIGHT * weighted + even) & U64


def seal_tensor(payload: torch.Tensor) -> torch.Tensor:
    """The seal of a contiguous tensor's bytes as a 0-dim int64 tensor on its device, queued on
    the current stream (a rank takes it of the gathered chunk before its copy to the host)."""
    if not payload.is_contiguous():
        raise ValueError("a chunk seal needs a contiguous tensor")
    flat = payload.reshape(-1).view(torch.uint8)
    if flat.numel() % 8:
        flat = torch.cat([flat, flat.new_zeros(8 - flat.numel() % 8)])
    words = flat.view(torch.int64)  # the same bits as uint64: products and sums wrap alike
    weights = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
    weights.mul_(DIGEST_WEIGHT).bitwise_or_(1)
    return (words * weights).sum()


def seal(payload: torch.Tensor) -> int:
    """The seal of a contiguous tensor's bytes: numpy's sums for a CPU tensor, else ``seal_tensor``."""
    if not payload.is_contiguous():
        raise ValueError("a chunk seal needs a contiguous tensor")
    if payload.device.type == "cpu":
        return seal_bytes(payload.reshape(-1).view(torch.uint8).numpy())
    return int(seal_tensor(payload).item()) & U64


__all__ = ["seal", "seal_bytes", "seal_tensor"]
