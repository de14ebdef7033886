"""How a paged MLA decode cuts each request's keys into splits: the launch knobs.

Stage 1 (``kernels/mla/paged_decode.py``) runs one program per (block of heads,
request, split of the keys). Its grid depends only on shapes and ``num_splits``, so
a CUDA graph can fix them; a captured step's ``num_splits`` is sized for the longest
context its page table allows (264 splits at batch 1 on an H200), so each request
uses only as many of them as its own length fills with ``split_keys`` keys each
(``busy_splits_ref``, computed alike on the device by stage 1, the merge and the
merging expansion: ``_busy_splits``). ``choose_split_keys`` picks ``split_keys`` from
shapes: one 32-key block at small batches, ``min_split_keys`` otherwise; a 1k-token
request at batch 1 runs 33 programs of 32 keys, the other programs exit at once and
write nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl


class MLADecodeConfig(NamedTuple):
    """Launch knobs of stage 1 (bench/kernels_mla.py sweeps them)."""

    block_h: int = 16  # query heads per program (tl.dot needs >= 16 rows)
    block_n: int = 32  # latent rows per loop step
    num_warps: int = 4
    num_stages: int = 2
    # Auto split count: aim for this many stage-1 programs per SM, but never
    # give a split fewer than min_split_keys keys (merging costs a pass); on the
    # device a request uses only the splits its own length fills this much.
    programs_per_sm: int = 2
    min_split_keys: int = 64
    # Keys per split where (head block, request) programs are few (``choose_split_keys``);
    # 0: min_split_keys at every batch.
    few_programs_split_keys: int = 32


def default_mla_config(heads: int) -> MLADecodeConfig:
    """Tiles by head count: with many heads, bigger head blocks reread the latent less."""
    if heads >= 64:
        # H200, 128 heads, batch 16 x 4k: 64-head blocks x 8 warps 1.4x the 16-head default
        # (BENCHMARKS.md).
        return MLADecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=2)
    return MLADecodeConfig()


def choose_split_keys(programs: int, num_sms: int, config: MLADecodeConfig) -> int:
    """Fewest keys a busy split takes, from shapes alone, rounded up to whole key blocks.
    Few (head block, request) programs (at most ``num_sms / 16``: batch 1 to 8 at 16 heads
    on an H200) take ``few_programs_split_keys`` (one 32-key block), so that a short
    context still spreads over many SMs (a 1k-token request at batch 1: 33 programs, not
    17; the merge costs no launch where the expansion does it); more programs take
    ``min_split_keys``, which keeps about ``programs_per_sm`` per SM at 1k tokens."""
    few = config.few_programs_split_keys > 0 and 0 < programs * 16 <= num_sms
    keys = config.few_programs_split_keys if few else config.min_split_keys
    return triton.cdiv(max(1, keys), config.block_n) * config.block_n


def choose_mla_splits(programs: int, max_kv_len: int, num_sms: int, config: MLADecodeConfig, *,
                      split_keys: int | None = None) -> int:
    """Splits per (head block, request) so that stage 1 has enough programs; a split never
    gets fewer than ``split_keys`` keys (``config.min_split_keys`` when None)."""
    if programs == 0 or max_kv_len <= 0:
        return 1
    keys = config.min_split_keys if split_keys is None else split_keys
    wanted = triton.cdiv(num_sms * config.programs_per_sm, programs)
    return max(1, min(wanted, triton.cdiv(max_kv_len, keys)))


def busy_splits_ref(seq_len: int, num_splits: int, split_keys: int, block_n: int) -> tuple[int, int]:
    """``(busy splits, keys per split)`` of a request of ``seq_len`` keys (host twin of
    ``_busy_splits``): at most ``num_splits``, ``ceil(seq_len / split_keys)`` of them where
    that is fewer (about ``split_keys`` keys each), whole ``block_n`` blocks; split ``i < busy`` holds keys
    ``[i * per_split, min((i + 1) * per_split, seq_len))``, never none."""
    used = min(max(triton.cdiv(seq_len, split_keys), 1), num_splits)
    per_split = max(triton.cdiv(triton.cdiv(seq_len, used), block_n), 1) * block_n
    return triton.cdiv(seq_len, per_split), per_split


@triton.jit
def _busy_splits(seq_len, num_splits, split_keys, BLOCK_N: tl.constexpr):
    """(busy splits, keys per split) of one request: ``busy_splits_ref`` on the device."""
    used = tl.minimum(tl.maximum(tl.cdiv(seq_len, split_keys), 1), num_splits)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, used), BLOCK_N), 1) * BLOCK_N
    return tl.cdiv(seq_len, per_split), per_split
