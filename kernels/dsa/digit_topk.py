"""Exact top-k of index scores by 8-bit digit histograms, a row split over many programs.

``digit_topk_triton(scores [N, T] float32, topk) -> [N, topk] int32`` gives exactly
``radix_topk``'s output (``kernels/dsa/topk.py``): the ``topk`` largest finite scores'
positions (ties at the cut to the lowest positions, ``-0.0`` as ``0.0``, ``-inf``
never selected) in ascending position order, ``-1`` padded. ``exact_topk`` is the
decode selection's entry: it takes this kernel or ``radix_topk`` by shape only.

Why: ``radix_topk`` cuts the row into chunks of 8192 and searches each chunk's
threshold two bits a pass, 16 dependent block reductions in ONE program per chunk,
so a batch-1 step keeps one SM busy. Here the threshold (the ``topk``-th largest
score's monotonic 32-bit pattern ``u``) is found 8 bits a pass, 4 passes: pass ``d``
histograms digit ``d`` of the scores whose higher digits equal the prefix found so
far (``tl.histogram``, 256 bins), and the prefix grows by the highest digit whose
count from the top reaches the keys still to take. A row is split over ``P``
programs (a function of the shapes and the SM count); each pass is one launch in
which every program writes its span's histogram (no atomics: the sums are
deterministic and need no zeroed buffer), and the next launch sums the ``P``
histograms, so every program derives the same prefix (program 0 stores it for the
pass after). The last launch selects: each program takes its span's scores above
the threshold and, of those equal to it, the ones whose rank among the row's ties
is below the ties still to take, written at offsets summed from the earlier spans'
counts: ascending position order, ``first_topk``'s tie rule. Five launches for any
values (one, all passes in one program, when ``P`` is 1), so it can be captured in
a CUDA graph; no host read.

If a row has fewer finite scores than ``topk``, no digit reaches the count and the
search settles on the lowest pattern with more ties to take than there are: every
finite score is selected.

``lens`` (``[N]`` int32 on the device, optional): row ``r``'s scores from ``lens[r]`` on
are not read, as if ``-inf`` (the decode selection's are: keys past ``seq_lens``). A
captured step's score table is as wide as the pool allows, so its split is chosen for
that width; without ``lens`` most programs then histogram ``-inf`` rows (an H200 ran
the 8k batch-1 top-k in 42.6 us at a 160k-wide table against 18.2 at its own width,
BENCHMARKS.md eleventh session). With ``lens`` each row's programs share its own
``lens[r]`` keys (spans a multiple of 64, read on the device), so the graph's
selection costs what the row holds. The output is the same either way.

TensorRT-LLM's indexer top-k (11/11/10-bit digits) and SGLang's fast_topk (an 8-bit
first pass, then candidates in shared memory) search digits the same way in one CTA a
row; a Triton program has no such scratch, so here a row is split instead. The chooser
(``topk_method``, with ``LANEKV_DSA_TOPK=auto``) takes this kernel only where it splits a
row: with one program a row its passes run block after block, no shorter a chain than
``radix_topk``'s. ``auto`` is the default since an H200 timed it faster than
``radix_topk`` at 8k and 128k keys, batch 1 and 16 (BENCHMARKS.md, tenth session). The
launch knobs go by the row's width (``digit_topk_config``), from the same run's sweep:
rows of at most 16k keys split into 1024-key spans of 4 warps; longer rows take 2048-key
spans, two programs an SM over the batch. Rows read to ``lens`` past 16k columns take the
knobs of a second sweep, over a captured step's table (``LENS_FEW`` / ``LENS_MANY``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import env_choice, use_triton
from lanekv.kernels.dsa.topk import _check, radix_topk_ref, radix_topk_triton

DIGITS = tl.constexpr(4)  # 8-bit digits of the 32-bit pattern
HIST_ROWS = tl.constexpr(32)  # programs' histograms summed per step (bounds the registers)


class DigitTopkConfig(NamedTuple):
    """Launch knobs of ``digit_topk_triton``; bench/dsa_layer.py times them."""

    block: int = 2048  # scores a program holds per loop step
    min_span: int = 2048  # fewest scores a program of a split row covers
    programs_per_sm: int = 1  # programs over the whole batch per SM (split rows only)
    max_programs: int = 32  # most programs per row (one load of their histograms)
    num_warps: int = 8

    def check(self) -> None:
        for name in ("block", "min_span", "programs_per_sm", "max_programs", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"DigitTopkConfig.{name} must be a positive int, got {v!r}")
        if self.block & (self.block - 1) or self.block < 16:
            raise ValueError(f"DigitTopkConfig.block must be a power of two >= 16, got {self.block}")


class DigitSplit(NamedTuple):
    """How a row is split: ``programs`` spans of ``span`` scores (whole blocks)."""

    programs: int
    span: int


def digit_topk_split(rows: int, cols: int, num_sms: int, config: DigitTopkConfig) -> DigitSplit:
    """Enough programs over the batch to give each SM ``programs_per_sm``, each covering
    at least ``min_span`` scores and whole blocks, at most ``max_programs`` a row, and
    no program left without a block. A function of the shapes only."""
    want = triton.cdiv(num_sms * config.programs_per_sm, max(rows, 1))
    progs = max(1, min(want, triton.cdiv(cols, config.min_span), config.max_programs))
    blocks = max(1, triton.cdiv(cols, config.block))
    per_program = triton.cdiv(blocks, progs)
    return DigitSplit(triton.cdiv(blocks, per_program), per_program * config.block)


def digit_topk_programs(rows: int, cols: int, num_sms: int, config: DigitTopkConfig) -> int:
    """Programs per row (``digit_topk_split``'s)."""
    return digit_topk_split(rows, cols, num_sms, config).programs


@triton.jit
def _patterns(x):
    """Each score's monotonic 32-bit pattern (as int64 in [0, 2**32)) and finiteness."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # + 0.0 turns -0.0 into 0.0
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed-monotonic in the float
    return order.to(tl.int64) + 2147483648, x != float("-inf")


@triton.jit
def _span_histogram(src_ptr, start, stop, prefix, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """[256] counts of digit ``u >> SHIFT & 255`` over the finite scores of ``[start,
    stop)`` whose higher bits equal ``prefix``, and the count of those above it."""
    i = tl.arange(0, BLOCK)
    hist = tl.zeros([256], tl.int32)
    above = tl.zeros([], tl.int32)
    for s in range(start, stop, BLOCK):
        x = tl.load(src_ptr + s + i, mask=s + i < stop, other=float("-inf"))
        u, valid = _patterns(x)
        high = u >> (SHIFT + 8)
        hist += tl.histogram(((u >> SHIFT) & 255).to(tl.int32), 256,
                             mask=valid & (high == prefix))
        above += tl.sum((valid & (high > prefix)).to(tl.int32), 0)
    return hist, above


@triton.jit
def _next_prefix(hist, prefix, need):
    """The prefix one digit longer and the keys still to take at it: the highest digit
    whose count from the top reaches ``need`` (digit 0 if none does)."""
    j = tl.arange(0, 256)
    from_top = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # count of digits >= j
    digit = tl.maximum(tl.sum((from_top >= need).to(tl.int32), 0) - 1, 0)
    return prefix * 256 + digit, need - tl.sum(tl.where(j > digit, hist, 0), 0)


@triton.jit
def _summed(hist_ptr, n_progs):
    """The sum of ``n_progs`` programs' [256] histograms stored row after row."""
    j = tl.arange(0, 256)
    q = tl.arange(0, HIST_ROWS)
    total = tl.zeros([256], tl.int32)
    for q0 in range(0, n_progs, HIST_ROWS):
        h = tl.load(hist_ptr + (q0 + q)[:, None] * 256 + j[None, :],
                    mask=(q0 + q < n_progs)[:, None], other=0)
        total += tl.sum(h, 0)
    return total


@triton.jit
def _span_select(src_ptr, out_ptr, start, stop, thr, ties, tie_base, slot, BLOCK: tl.constexpr):
    """Writes the selected positions of ``[start, stop)`` from ``slot`` on; returns the
    slot after."""
    i = tl.arange(0, BLOCK)
    for s in range(start, stop, BLOCK):
        x = tl.load(src_ptr + s + i, mask=s + i < stop, other=float("-inf"))
        u, valid = _patterns(x)
        eq = (valid & (u == thr)).to(tl.int32)
        rank = tie_base + tl.cumsum(eq, 0) - eq  # among the row's ties
        sel = ((valid & (u > thr)) | ((eq != 0) & (rank < ties))).to(tl.int32)
        tl.store(out_ptr + slot + tl.cumsum(sel, 0) - sel, s + i, mask=sel != 0)
        tie_base += tl.sum(eq, 0)
        slot += tl.sum(sel, 0)
    return slot


@triton.jit
def _row_cols(lens_ptr, row, n_cols, HAS_LENS: tl.constexpr):
    """The scores row ``row`` holds: ``n_cols``, or ``lens[row]`` clamped to ``[0, n_cols]``."""
    if HAS_LENS:
        return tl.maximum(tl.minimum(tl.load(lens_ptr + row), n_cols), 0)
    return n_cols + tl.zeros([], tl.int32)


@triton.jit
def _program_span(lens_ptr, row, pid, n_progs, n_cols, span, HAS_LENS: tl.constexpr):
    """``[start, stop)`` of program ``pid`` of a split row: the host's ``span`` (whole
    blocks), or (``lens``) the row's own keys over its programs in multiples of 64."""
    cols = _row_cols(lens_ptr, row, n_cols, HAS_LENS)
    if HAS_LENS:
        span = (tl.cdiv(cols, n_progs) + 63) // 64 * 64
    start = pid * span
    return start, tl.minimum(start + span, cols)


@triton.jit
def _pad(out_ptr, first, topk, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    for s in range(0, topk, BLOCK):
        tl.store(out_ptr + s + i, tl.full([BLOCK], -1, tl.int32), mask=(s + i >= first)
                 & (s + i < topk))


@triton.jit(do_not_specialize=["n_cols", "topk", "stride_s", "stride_o"])
def _digit_topk_row_kernel(src_ptr, lens_ptr, out_ptr, n_cols, topk, stride_s, stride_o,
                           HAS_LENS: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: the four passes and the selection in one launch."""
    row = tl.program_id(0).to(tl.int64)
    cols = _row_cols(lens_ptr, row, n_cols, HAS_LENS)
    src = src_ptr + row * stride_s
    prefix = tl.zeros([], tl.int64)
    need = topk + tl.zeros([], tl.int32)
    for d in tl.static_range(DIGITS):
        hist, _ = _span_histogram(src, 0, cols, prefix, 24 - 8 * d, BLOCK)
        prefix, need = _next_prefix(hist, prefix, need)
    out = out_ptr + row * stride_o
    zero = tl.zeros([], tl.int32)
    count = _span_select(src, out, 0, cols, prefix, need, zero, zero, BLOCK)
    _pad(out, count, topk, BLOCK)


@triton.jit(do_not_specialize=["n_cols", "topk", "span", "stride_s", "stride_o"])
def _digit_pass_kernel(src_ptr, lens_ptr, hist_ptr, above_ptr, state_ptr, n_cols, topk, span,
                       stride_s, HAS_LENS: tl.constexpr, DIGIT: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Pass ``DIGIT`` of a split row: the prefix from the last pass's histograms, then
    this span's histogram of the next digit (and, at the last digit, its count above)."""
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    n_progs = tl.num_programs(1)
    rows = tl.num_programs(0)
    if DIGIT == 0:
        prefix = tl.zeros([], tl.int64)
        need = topk + tl.zeros([], tl.int32)
    else:
        state = state_ptr + (row * DIGITS + DIGIT - 1) * 2
        last = _summed(hist_ptr + ((DIGIT - 1) * rows + row) * n_progs * 256, n_progs)
        if DIGIT == 1:
            prefix, need = _next_prefix(last, tl.zeros([], tl.int64), topk + tl.zeros([],
                                                                                     tl.int32))
        else:
            prefix, need = _next_prefix(last, tl.load(state), tl.load(state + 1).to(tl.int32))
        if pid == 0:  # the pass after reads it (a later launch, so it is visible)
            tl.store(state + 2, prefix)
            tl.store(state + 3, need.to(tl.int64))
    start, stop = _program_span(lens_ptr, row, pid, n_progs, n_cols, span, HAS_LENS)
    hist, above = _span_histogram(src_ptr + row * stride_s, start, stop, prefix,
                                  24 - 8 * DIGIT, BLOCK)
    tl.store(hist_ptr + ((DIGIT * rows + row) * n_progs + pid) * 256 + tl.arange(0, 256), hist)
    if DIGIT == DIGITS - 1:
        tl.store(above_ptr + row * n_progs + pid, above)


@triton.jit(do_not_specialize=["n_cols", "topk", "span", "stride_s", "stride_o"])
def _digit_select_kernel(src_ptr, lens_ptr, hist_ptr, above_ptr, state_ptr, out_ptr, n_cols,
                         topk, span, stride_s, stride_o, HAS_LENS: tl.constexpr,
                         BLOCK: tl.constexpr):
    """The selection of a split row: the threshold from the last digit's histograms, this
    span's output offset from the earlier spans' counts above it and ties at it."""
    row = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    n_progs = tl.num_programs(1)
    hists = hist_ptr + ((DIGITS - 1) * tl.num_programs(0) + row) * n_progs * 256
    state = state_ptr + (row * DIGITS + DIGITS - 1) * 2
    thr, ties = _next_prefix(_summed(hists, n_progs), tl.load(state),
                             tl.load(state + 1).to(tl.int32))
    digit = thr & 255
    j = tl.arange(0, 256)
    q = tl.arange(0, HIST_ROWS)
    gt_before = tl.zeros([], tl.int32)
    eq_before = tl.zeros([], tl.int32)
    gt_all = tl.zeros([], tl.int32)
    eq_all = tl.zeros([], tl.int32)
    for q0 in range(0, n_progs, HIST_ROWS):
        ok = q0 + q < n_progs
        h = tl.load(hists + (q0 + q)[:, None] * 256 + j[None, :], mask=ok[:, None], other=0)
        gt = tl.load(above_ptr + row * n_progs + q0 + q, mask=ok, other=0)
        gt += tl.sum(tl.where(j[None, :] > digit, h, 0), 1)
        eq = tl.sum(tl.where(j[None, :] == digit, h, 0), 1)
        gt_before += tl.sum(tl.where(q0 + q < pid, gt, 0), 0)
        eq_before += tl.sum(tl.where(q0 + q < pid, eq, 0), 0)
        gt_all += tl.sum(gt, 0)
        eq_all += tl.sum(eq, 0)
    out = out_ptr + row * stride_o
    start, stop = _program_span(lens_ptr, row, pid, n_progs, n_cols, span, HAS_LENS)
    _span_select(src_ptr + row * stride_s, out, start, stop, thr, ties, eq_before,
                 gt_before + tl.minimum(eq_before, ties), BLOCK)
    if pid == 0:
        _pad(out, gt_all + tl.minimum(eq_all, ties), topk, BLOCK)


def digit_topk_triton(scores: torch.Tensor, topk: int, *, lens: torch.Tensor | None = None,
                      config: DigitTopkConfig | None = None) -> torch.Tensor:
    """Triton launcher: ``radix_topk``'s output (of the scores before ``lens``, if given);
    ``config`` (tests, bench) sets the block, the split and the warps, ``None`` the
    defaults."""
    _check(scores, topk, None)
    _check_lens(scores, lens)
    if config is not None and not isinstance(config, DigitTopkConfig):
        raise ValueError(f"config must be a DigitTopkConfig or None, got {config!r:.80}")
    rows, cols = scores.shape
    cfg = config or digit_topk_config(cols, rows, lens is not None)
    cfg.check()
    out = torch.empty((rows, topk), dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out
    if cols == 0:
        return out.fill_(-1)
    progs, span = digit_topk_split(rows, cols, _num_sms(scores.device), cfg)
    lens_arg = scores if lens is None else lens  # a pointer the kernels never read without lens
    if progs == 1:
        _digit_topk_row_kernel[(rows,)](scores, lens_arg, out, cols, topk, scores.stride(0),
                                        out.stride(0), HAS_LENS=lens is not None,
                                        BLOCK=cfg.block, num_warps=cfg.num_warps)
        return out
    dev = scores.device
    hist = torch.empty((DIGITS.value, rows, progs, 256), dtype=torch.int32, device=dev)
    above = torch.empty((rows, progs), dtype=torch.int32, device=dev)
    state = torch.empty((rows, DIGITS.value, 2), dtype=torch.int64, device=dev)
    for digit in range(DIGITS.value):
        _digit_pass_kernel[(rows, progs)](scores, lens_arg, hist, above, state, cols, topk, span,
                                          scores.stride(0), HAS_LENS=lens is not None,
                                          DIGIT=digit, BLOCK=cfg.block, num_warps=cfg.num_warps)
    _digit_select_kernel[(rows, progs)](scores, lens_arg, hist, above, state, out, cols, topk,
                                        span, scores.stride(0), out.stride(0),
                                        HAS_LENS=lens is not None, BLOCK=cfg.block,
                                        num_warps=cfg.num_warps)
    return out


NARROW_ROW = 16384  # keys: up to here the short spans won the H200 sweep
NARROW = DigitTopkConfig(block=1024, min_span=1024, programs_per_sm=1, max_programs=32, num_warps=4)
WIDE = DigitTopkConfig(block=2048, min_span=2048, programs_per_sm=2, max_programs=32, num_warps=8)
# Wide tables read to each row's ``lens`` (a captured step's): the row's keys are unknown
# on the host, so one knob set must do at every length. The H200 sweep over a 160k-wide
# table (BENCHMARKS.md, eleventh session), us at 8k / 32k / 128k keys:
#   batch 1:  512-key blocks, 32 programs 18.9 / 22.5 / 44.1; WIDE 24.8 / 24.8 / 42.8
#   batch 16: 1024-key blocks, 2 an SM    22.3 / 32.5 / 81.7; WIDE 34.5 / 35.0 / 80.1
LENS_SMALL_BATCH = 4  # rows: up to here LENS_FEW, beyond LENS_MANY
LENS_FEW = DigitTopkConfig(block=512, min_span=512, programs_per_sm=1, max_programs=32, num_warps=4)
LENS_MANY = DigitTopkConfig(block=1024, min_span=1024, programs_per_sm=2, max_programs=32,
                            num_warps=4)


def digit_topk_config(cols: int, rows: int = 1, lens: bool = False) -> DigitTopkConfig:
    """The launch knobs for ``rows`` rows of ``cols`` scores, read to ``lens`` or not (the
    module doc and the table above give the timings)."""
    if cols <= NARROW_ROW:
        return NARROW
    if not lens:
        return WIDE
    return LENS_FEW if rows <= LENS_SMALL_BATCH else LENS_MANY


TOPK_ENV = "LANEKV_DSA_TOPK"  # auto (the default), radix or digit


def topk_method(rows: int, cols: int, num_sms: int, lens: bool = False) -> str:
    """The kernel for ``[rows, cols]`` scores: ``LANEKV_DSA_TOPK``, ``auto`` when unset.
    ``auto`` takes ``"digit"`` where ``digit_topk`` splits a row over several programs
    (small batches: the SMs ``radix_topk`` leaves idle), else ``"radix"``: one program a
    row runs the digit passes one block after another, no shorter a chain than
    ``radix_topk``'s 16 counting passes over a chunk held in registers. ``digit`` and
    ``radix`` force one kernel."""
    choice = env_choice(TOPK_ENV, ("radix", "digit", "auto"), "auto")
    if choice == "auto":
        programs = digit_topk_programs(rows, cols, num_sms, digit_topk_config(cols, rows, lens))
        return "digit" if programs > 1 else "radix"
    return choice


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one
    return torch.cuda.get_device_properties(device).multi_processor_count


def exact_topk_triton(scores: torch.Tensor, topk: int,
                      lens: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel ``topk_method`` picks for ``scores``' shape (``radix_topk`` reads the
    whole width: the scores past ``lens`` must be ``-inf`` for it)."""
    _check(scores, topk, None)
    _check_lens(scores, lens)
    if topk_method(*scores.shape, _num_sms(scores.device), lens is not None) == "radix":
        return radix_topk_triton(scores, topk)
    return digit_topk_triton(scores, topk, lens=lens)


def exact_topk_ref(scores: torch.Tensor, topk: int,
                   lens: torch.Tensor | None = None) -> torch.Tensor:
    """``radix_topk_ref`` of the scores before each row's ``lens`` (the rest as ``-inf``)."""
    _check(scores, topk, None)
    _check_lens(scores, lens)
    if lens is not None:
        past = torch.arange(scores.shape[1], device=scores.device)[None, :] >= lens[:, None]
        scores = scores.masked_fill(past, float("-inf"))
    return radix_topk_ref(scores, topk)


def exact_topk(scores: torch.Tensor, topk: int, lens: torch.Tensor | None = None) -> torch.Tensor:
    """The positions of each row's ``topk`` largest finite scores (of those before
    ``lens[r]``, if given), ascending, ``-1`` padded."""
    return (exact_topk_triton if use_triton(scores) else exact_topk_ref)(scores, topk, lens)


def _check_lens(scores: torch.Tensor, lens: torch.Tensor | None) -> None:
    if lens is None:
        return
    if (not isinstance(lens, torch.Tensor) or lens.dtype != torch.int32
            or tuple(lens.shape) != (scores.shape[0],) or lens.device != scores.device
            or (lens.numel() > 1 and lens.stride(0) != 1)):
        raise ValueError(f"lens must be a dense [{scores.shape[0]}] int32 tensor on "
                         f"{scores.device}, got {lens!r:.80}")
