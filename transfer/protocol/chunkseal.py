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
ROW_BYTES = 8 * ROW_WORDS
_WEIGHT = DIGEST_WEIGHT & U64
_COLUMNS = np.arange(ROW_WORDS, dtype=np.uint64)


class SealSum:
    """The seal of ``nbytes`` bytes taken block by block, in order: each block a whole number of
    rows (``ROW_BYTES``) but the last. A relay sums each block of a chunk right after copying it
    into the message, while it is in the CPU's cache, instead of reading the message twice more."""

    def __init__(self, nbytes: int) -> None:
        rows = nbytes // ROW_BYTES
        self.nbytes, self.seen = nbytes, 0
        self._columns = np.zeros(ROW_WORDS, dtype=np.uint64)
        self._block_columns = np.empty(ROW_WORDS, dtype=np.uint64)
        self._row_sums = np.empty(rows, dtype=np.uint64)
        self._tail = 0  # sum_j j * q[j] + the even places' words, of the words after the last whole row

    def add(self, block: bytes | memoryview | np.ndarray) -> None:
        raw = np.frombuffer(block, dtype=np.uint8) if not isinstance(block, np.ndarray) else block.reshape(-1).view(np.uint8)
        if self.seen % ROW_BYTES or self.seen + raw.size > self.nbytes:
            raise ValueError(f"a block of {raw.size} bytes at {self.seen} does not follow whole rows within "
                             f"{self.nbytes} bytes")
        rows = raw.size // ROW_BYTES
        if rows:
            first = self.seen // ROW_BYTES
            body = raw[:rows * ROW_BYTES].view(np.uint64).reshape(rows, ROW_WORDS)
            body.sum(0, out=self._block_columns)
            self._columns += self._block_columns
            body.sum(1, out=self._row_sums[first:first + rows])
        rest = raw[rows * ROW_BYTES:]
        if rest.size:  # the last words: few, summed one by one
            whole = rest.size - rest.size % 8
            words = [int(w) for w in rest[:whole].view(np.uint64)]
            if whole < rest.size:  # the last partial word, zero-padded
                words.append(int.from_bytes(rest[whole:].tobytes(), "little"))
            at = (self.seen + rows * ROW_BYTES) // 8
            self._tail += sum(((at + i) * _WEIGHT | 1) * w for i, w in enumerate(words))
        self.seen += raw.size

    def value(self) -> int:
        """The seal, once all ``nbytes`` were added (ValueError otherwise)."""
        if self.seen != self.nbytes:
            raise ValueError(f"{self.seen} of {self.nbytes} bytes were added")
        rows = self._row_sums.size
        # sum_j j * q[j] over the whole rows, j = r * ROW_WORDS + c; their even places' words
        weighted = ROW_WORDS * int(self._row_sums @ np.arange(rows, dtype=np.uint64)) + int(self._columns @ _COLUMNS)
        even = int(self._columns[0::2].sum(dtype=np.uint64))
        return (_WEIGHT * weighted + even + self._tail) & U64


def seal_bytes(data: bytes | memoryview | np.ndarray) -> int:
    """The seal of a byte buffer (see the module docstring), on the CPU."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    total = SealSum(raw.size)
    total.add(raw)
    return total.value()


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


__all__ = ["ROW_BYTES", "SealSum", "seal", "seal_bytes", "seal_tensor"]
