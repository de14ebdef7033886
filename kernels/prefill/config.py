"""The prefill attention kernel's launch configs: tiles and variant switches.

A launch config (``AttnLaunchConfig``) picks the tile and variant switches; MLA prefill
runs ``MLA_PREFILL_DEFAULT`` (the one place a measured winner is promoted to), the sweep
``bench/mla_prefill_sweep.py`` times ``MLA_PREFILL_SWEEP`` against SDPA, and
``bench/mla_prefill_compile.py`` compiles any config for sm_90 offline. The
``warp_specialize`` variant is FlashAttention-3's layout through Triton 3.6's Hopper
warp specialization (a TMA producer warpgroup, two 64-row consumer warpgroups).
``default_config`` picks a tile by shape, ``check_launch_config`` refuses one the kernel
cannot run on given tensors, and ``runnable_config`` falls back where it cannot.
``head_dim_split`` is how the kernel tiles head dims that are not powers of two.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

# The boolean fields of AttnLaunchConfig, in label order.
LAUNCH_SWITCHES = ("tma", "overlap", "heads_fast", "warp_specialize", "exp_bf16")


class AttnLaunchConfig(NamedTuple):
    """A tile and the kernel's variant switches (all off: the plain FlashAttention-2 loop).

    - ``tma``: the unmasked key blocks read K and V through TMA tensor descriptors
      (Hopper and later; contiguous K/V whose qk dim splits exactly into the head and
      tail parts and whose v dim is a power of two, 16-byte aligned rows). The diagonal
      blocks keep the pointer loads, which clamp past-the-end keys to the last one.
    - ``overlap``: the unmasked loop is software-pipelined by hand, so the next block's
      QK^T is issued before this block's softmax runs (FlashAttention-3's intra-warpgroup
      overlap, left to the compiler to make asynchronous).
    - ``heads_fast``: heads on the grid's fast axis (every head's longest query block
      first) instead of one head's query blocks, longest first, then the next head's.
    - ``warp_specialize``: one loop over every visible key block, each masked, q and K/V
      through TMA, asking Triton for warp specialization (``tl.range(...,
      warp_specialize=True)``, ``_ws_key_loop``); needs ``tma`` and not ``overlap``, and
      q's rows aligned as K's. Triton 3.6's Hopper pass takes only this form (one loop, no
      branch in it, no scan before it); at ``num_warps=4`` and ``block_m=128`` it makes a
      TMA producer warpgroup and two consumer warpgroups of 64 rows (384 threads,
      ``num_warps`` per group), at 8 warps it leaves the loop as it is. q's descriptors
      are made in the kernel (Triton's scratch allocator; the launcher sets a torch one
      where none is set). The last block reads up to ``block_n - 1`` rows of k/v past the
      request's visible keys (TMA's zeros past the tensor's end): p weights them by exact
      zeros, so those rows must hold finite values.
    - ``exp_bf16``: the softmax's powers of two in bfloat16, two per special-function
      instruction (``ex2.approx.ftz.bf16x2``, sm_90 and later) instead of one float32 each;
      p feeds a bfloat16 product anyway, and the row sums add the same rounded p (float32
      sums). The exponent is rounded to bfloat16 first: an absolute error in p of at most
      about 7e-4 (largest near p = 0.37), below p's own bfloat16 rounding at p near 1.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    overlap: bool = False
    heads_fast: bool = False
    warp_specialize: bool = False
    exp_bf16: bool = False

    @property
    def label(self) -> str:
        flags = [name for name in LAUNCH_SWITCHES if getattr(self, name)]
        return ",".join(str(x) for x in self[:4]) + ("+" + "+".join(flags) if flags else "")


# MLA prefill (qk 192 = 128 + 64, v 128, bf16, 64+ heads) runs MLA_PREFILL_DEFAULT: the one
# place a sweep's winner is promoted to. Where these tensors cannot take the default's
# switches (tma or warp_specialize on paged or unaligned K/V), MLA_PREFILL_FALLBACK runs.
MLA_PREFILL_DEFAULT = AttnLaunchConfig(128, 128, 8, 2)
MLA_PREFILL_FALLBACK = AttnLaunchConfig(128, 128, 8, 2)

# What bench/mla_prefill_sweep.py times by default (about 150 s of device time at 8k and
# 32k): the default, Triton 3.6's Hopper warp specialization in FlashAttention-3's layout
# (num_warps=4 per group: one TMA producer warpgroup and two 64-row consumer warpgroups,
# 384 threads; consumers get 232 registers by setmaxnreg) at the tiles whose sm_90 compile
# does not spill (bench/mla_prefill_compile.py; 256x64 spills 908 bytes and is left out),
# and the 8-warp TMA loop, never timed before. On the H200 the specialized ones race: NaN
# blocks at random (bench/notes_prefill_attention.md), so none is a default.
MLA_PREFILL_SWEEP = (
    AttnLaunchConfig(128, 128, 8, 2),
    AttnLaunchConfig(128, 128, 4, 2, tma=True, warp_specialize=True),  # 229,776 B shared
    AttnLaunchConfig(128, 128, 4, 2, tma=True, warp_specialize=True, exp_bf16=True),
    AttnLaunchConfig(128, 64, 4, 2, tma=True, warp_specialize=True),
    AttnLaunchConfig(128, 64, 4, 3, tma=True, warp_specialize=True),
    AttnLaunchConfig(128, 64, 4, 4, tma=True, warp_specialize=True),
    AttnLaunchConfig(128, 64, 4, 3, tma=True, warp_specialize=True, exp_bf16=True),
    AttnLaunchConfig(128, 128, 8, 2, tma=True),
)

# Every config the interpreter tests cover: the sweep's and the earlier ones (the last
# device run timed three of them, the default ahead; BENCHMARKS.md). Shared memory per
# pipeline stage is BLOCK_N * (192 + 128) * 2 bytes of K and V, plus BLOCK_M * 192 * 2 of
# q once; 227 KB per block: 128x128 takes 2 * 80 + 48 = 208 KB at 2 stages and would need
# 288 at 3; 128x64 takes 3 * 40 + 48 = 168 at 3 stages and 4 * 40 + 48 = 208 at 4; 64x64
# takes 2 * 40 + 24 = 104 at 2 (two blocks per SM). TMA adds about 1 KB of barriers, the
# warp-specialized loop its producer's buffers (bench/mla_prefill_compile.py).
MLA_PREFILL_VARIANTS = MLA_PREFILL_SWEEP + (
    AttnLaunchConfig(128, 128, 8, 2, tma=True, overlap=True),
    AttnLaunchConfig(128, 128, 8, 2, heads_fast=True),
    AttnLaunchConfig(128, 128, 8, 2, exp_bf16=True),
    AttnLaunchConfig(128, 128, 8, 2, tma=True, exp_bf16=True),
    AttnLaunchConfig(128, 128, 8, 2, tma=True, overlap=True, exp_bf16=True),
    AttnLaunchConfig(128, 64, 8, 3),
    AttnLaunchConfig(128, 64, 8, 4),
    AttnLaunchConfig(128, 64, 8, 4, tma=True),
    AttnLaunchConfig(128, 64, 8, 4, tma=True, overlap=True),
    AttnLaunchConfig(128, 64, 8, 4, exp_bf16=True),
    AttnLaunchConfig(128, 64, 8, 4, tma=True, exp_bf16=True),
    AttnLaunchConfig(128, 64, 8, 4, tma=True, overlap=True, exp_bf16=True),
    # One warpgroup per block at 104 KB: two blocks share an SM and keep out of each
    # other's barriers, so one's softmax can run beside the other's products.
    AttnLaunchConfig(64, 64, 4, 2, tma=True, exp_bf16=True),
    # Unbuffered loads (58 KB), two blocks per SM by registers: each block's loads wait
    # while the other computes.
    AttnLaunchConfig(64, 128, 4, 1, tma=True, exp_bf16=True),
)


# Below this many (128-row query block, head) programs per SM the chip is
# short of parallel work and 64-row blocks finish sooner (bench notes).
_MIN_BIG_TILE_PROGRAMS_PER_SM = 4


def big_tile_min_rows(num_heads: int, qk_dim: int, dtype: torch.dtype, device: torch.device) -> int | None:
    """The fewest query rows for which ``default_config`` picks the 128-row tile; None
    where the tile does not depend on the rows (off CUDA, float32, head dims past 192,
    and MLA's wide heads with 64 or more of them). Each tile is its own compiled kernel,
    so the prefill warm-up (``prefill.warmup``) runs both sides of this."""
    if device.type != "cuda" or qk_dim > 192 or dtype == torch.float32:
        return None
    if qk_dim > 128 and num_heads >= 64:
        return None
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    # cdiv(rows, 128) * num_heads >= programs, for the fewest rows
    return (triton.cdiv(_MIN_BIG_TILE_PROGRAMS_PER_SM * num_sms, num_heads) - 1) * 128 + 1


def default_config(q: torch.Tensor) -> AttnLaunchConfig:
    if not q.is_cuda:
        # The interpreter: small tiles so short test sequences still span
        # several query and key blocks and both loops run.
        return AttnLaunchConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
    if q.shape[2] > 192 or q.dtype == torch.float32:
        return AttnLaunchConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if q.shape[2] > 128:
        if q.shape[1] >= 64:
            # H200, DeepSeek-V3 qk 192 / v 128 with 128 heads at 8k and 32k: 128x128 (8 warps,
            # 2 stages) led eight tile configs, 468/478 TFLOP/s against 64x64's 397 at 32k
            # (bench/deepseek_kernels.py, BENCHMARKS.md); bench/mla_prefill_sweep.py picks
            # among the variants since.
            return MLA_PREFILL_DEFAULT
        # Fewer heads (DeepSeek-V2-Lite's 16): the same 128x128 tile once the chip has enough
        # programs: H200, 16 heads, one causal sequence, 363 / 491 TFLOP/s at 8k / 32k against
        # 64x64's 328 / 401 (bench/mla_prefill_sweep.py --heads 16, 2026-12-04); 64x64 below.
        if q.shape[0] >= big_tile_min_rows(q.shape[1], q.shape[2], q.dtype, q.device):
            return MLA_PREFILL_DEFAULT
        return AttnLaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    if q.shape[0] < big_tile_min_rows(q.shape[1], q.shape[2], q.dtype, q.device):
        return AttnLaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    # H200, Llama-3-8B heads, 16k causal: best of a 19-config sweep (466 TFLOP/s,
    # 128x64 447); later runs put the two within run-to-run spread.
    return AttnLaunchConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


class HeadDimSplit(NamedTuple):
    """How the kernel tiles the head dims (all powers of two, each >= 16 for tl.dot)."""

    qk_head: int  # columns [0, qk_head) of q/k: the largest power of two <= Dqk
    qk_tail: int  # columns [qk_head, qk_head + qk_tail), masked to Dqk; 0 when none
    v_block: int  # columns of v and out, masked to Dv


def head_dim_split(qk_dim: int, v_dim: int) -> HeadDimSplit:
    head = max(16, 1 << (qk_dim.bit_length() - 1))
    rest = qk_dim - head
    tail = max(16, triton.next_power_of_2(rest)) if rest > 0 else 0
    return HeadDimSplit(head, tail, max(16, triton.next_power_of_2(v_dim)))


def _row_view_ok(t: torch.Tensor) -> bool:
    """TMA over the [rows, heads * stride] view: unit last stride, 16-byte aligned base and rows."""
    item = t.element_size()
    return (t.stride(2) == 1 and t.stride(1) >= t.shape[2] and t.data_ptr() % 16 == 0
            and (t.stride(0) * item) % 16 == 0 and (t.stride(1) * item) % 16 == 0)


def check_launch_config(config: AttnLaunchConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        page_table: torch.Tensor | None) -> None:
    """Refuse a config the kernel cannot run on these tensors (one line naming the field)."""
    for name in ("block_m", "block_n"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"config.{name} must be a power of two >= 16, got {value!r}")
    for name in ("num_warps", "num_stages"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be an int >= 1, got {value!r}")
    for name in LAUNCH_SWITCHES:
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"config.{name} must be a bool, got {getattr(config, name)!r}")
    if config.warp_specialize and (config.overlap or not config.tma):
        raise ValueError("config.warp_specialize=True needs tma=True and overlap=False, got "
                         f"tma={config.tma}, overlap={config.overlap}")
    if config.tma:
        split = head_dim_split(q.shape[2], v.shape[2])
        if page_table is not None:
            raise ValueError("config.tma=True reads contiguous K/V only, got a page_table")
        if split.qk_head + split.qk_tail != q.shape[2] or split.v_block != v.shape[2]:
            raise ValueError(f"config.tma=True needs the qk dim to split exactly into powers of two "
                             f"and a power-of-two v dim, got qk {q.shape[2]} "
                             f"({split.qk_head} + {split.qk_tail}) and v {v.shape[2]}")
        for name, t in (("k", k), ("v", v)) + ((("q", q),) if config.warp_specialize else ()):
            if not _row_view_ok(t):
                raise ValueError(f"config.tma=True needs {name} with a unit last stride and 16-byte "
                                 f"aligned base and rows, got strides {tuple(t.stride())}")


def runnable_config(config: AttnLaunchConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    page_table: torch.Tensor | None) -> AttnLaunchConfig:
    """``config``, or MLA_PREFILL_FALLBACK where these tensors cannot take its switches
    (TMA on paged K/V, a qk dim that does not split exactly, unaligned rows)."""
    if not (config.tma or config.warp_specialize):
        return config
    try:
        check_launch_config(config, q, k, v, page_table)
    except ValueError:
        return MLA_PREFILL_FALLBACK
    return config
