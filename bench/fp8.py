"""Block-FP8 weights on one GPU: the GEMMs and the decode step against their peers and floors.

- ``gemm``: on Llama-3-8B's and DeepSeek-V2-Lite's linear shapes, at decode and
  prefill row counts, in one run: our block-FP8 GEMM (``gemm_ms``: the w8a8
  kernel alone with the config ``select_config`` picks, or with ``--sweep`` the
  fastest correct one of ``candidate_configs``; ``linear_ms``: with that config,
  the linear as a model runs it, the activations' per-token-group quantization
  included, inside the GEMM or first as ``linear_plan`` decides
  (``linear_fused_quant``); at <= 64 rows both ways, ``linear_fused_ms`` and
  ``linear_unfused_ms``, and a swept decode row whose winner ran faster quantizing
  first records ``quant_first`` in its config (``record_quant_first``); a w8a16
  config quantizes nothing: ``linear_ms`` alone), against ``torch._scaled_mm`` with row-wise scales (``scaled_mm_row_ms``) and with our
  own block scales (1x128 activations, 128x128 weights: ``scaled_mm_block_ms``,
  through ``torch._scaled_mm`` or ``F.scaled_mm`` with ``ScalingType``, whichever
  this torch runs; ``None`` with the reason otherwise, or when its result
  differs from the reference) and the bf16 GEMM (``bf16_ms``).
  ``vs_best_torch_fp8`` is the faster torch FP8 time over ours (the target is
  >= 0.85). Every GEMM cycles through copies of its weight totalling over
  twice the L2 cache, so a small weight is read from memory as in a model's
  step; ``--timer graph`` (default) replays the calls in a CUDA graph (the GPU's
  time, as the captured decode step sees it), ``--timer events`` times plain
  launches. Each config's output is checked against the float32 reference
  (``rel_err``; a w8a16 config's against the unquantized activations').
  At decode rows (<= ``FUSED_QUANT_MAX_ROWS``) the sweep times each candidate as the
  step runs it: as the linear (``fp8_linear_triton`` with ``linear_plan``'s fusion),
  so a w8a16 config and a w8a8 one quantizing x itself compete on the same cost
  (``gemm_ms`` is then the linear's time, ``sweep_timed`` says which was timed,
  ``family`` which family won); the down projections are timed as the step runs them
  too, ``silu_mul_fp8_linear`` on a gate/up output ``[rows, 2K]`` (``silu_down``): a
  w8a8 config after ``silu_mul_quant_fp8``, a w8a16 or gemv config with SiLU-and-multiply
  fused into its activation load (checked against ``silu_mul``'s product, unquantized).
  From 4 rows down the gemv family (``gemm_gemv.py``, the CUDA-core GEMV) competes too.
- ``decode``: the decode engine's captured step at batch 1/16/64 with a
  ``--context`` token context, the model's dummy weights bf16 and then quantized
  blockwise (``quantization_config``), against the FP8 weight-read floor: the
  bytes one step reads (every decoder weight once, scales included; for MoE the
  experts a step's tokens touch in expectation under uniform routing; the
  lm_head; the embedding rows of the batch, not the table) at the device's
  copy rate.
- ``prefill``: one ``--prefill-tokens`` prompt (8k and 32k by default) prefilled at
  cp=1 by the prefill daemon's engine (``ThreadedPrefillEngine``, the rank code the
  daemon runs), DeepSeek-V2-Lite and Llama-3-8B shapes, the dummy weights bf16 and
  then the same values quantized blockwise, in one run: tokens/s (the median of
  ``--prefill-repeat`` prefills after one warm-up) and ``vs_bf16`` (FP8 tokens/s
  over bf16's); ``logits_rel_err_vs_bf16`` and ``same_first_token_as_bf16`` compare
  the prompt's last-token logits with the bf16 model's (the same seeded weights).

Each run writes a new JSON file (``--json PATH``, refused if it exists, or a
timestamped one in bench/results/fp8/). ``--write-table`` merges the configs a
run used into ``kernels/fp8/gemm_tables/<device>.json``, the table the kernel
reads (or PATH; ``LANEKV_FP8_GEMM_CONFIGS`` points the kernel at another). Both
files are written after every GEMM shape, so a run cut short keeps what it
finished; ``--time-budget-s S`` stops cleanly within S seconds of the start (a
shape starts only while one as slow as the slowest so far still fits; the JSON's
``gemm_complete`` says whether every shape ran). A sweep at prefill rows tries
six configs per shape (``prefill_candidates``), the likeliest first.

    python bench/fp8.py --sweep --rows 1 16 64 --write-table      # tune decode rows
    python bench/fp8.py --sweep --rows 2048 --time-budget-s 200 --write-table  # prefill rows
    python bench/fp8.py --only gemm                               # the tuned GEMM vs torch
    python bench/fp8.py --only decode
    python bench/fp8.py --only decode --pdl both                  # PDL off, then on, per step
    python bench/fp8.py --only prefill                            # FP8 vs bf16 prefill tok/s
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import lanekv  # noqa: E402,F401  (the package first: the repository's lanekv/ folder alone is not it)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from lanekv.decode.engine import DecodeEngine  # noqa: E402
from lanekv.decode.pool import PagePool, PageTable  # noqa: E402
from lanekv.kernels.fp8.gemm import (  # noqa: E402
    FUSED_QUANT_MAX_ROWS,
    block_fp8_matmul_triton,
    fp8_linear_triton,
    linear_plan,
    silu_mul_fp8_linear_triton,
)
from lanekv.kernels.fp8.gemm_configs import (  # noqa: E402
    TABLE_DIR,
    GemmConfig,
    candidate_configs,
    config_family,
    device_slug,
    select_config,
    table_entry,
)
from lanekv.kernels.fp8.quant import (  # noqa: E402
    per_token_group_quant_fp8_triton,
    silu_mul_quant_fp8_triton,
    silu_mul_triton,
)
from lanekv.kernels.fp8.weights import (  # noqa: E402
    dequantize_weight_blocks,
    quantize_weight_blocks,
)
from lanekv.model.checkpoint import load_dummy_model  # noqa: E402
from lanekv.model.sampling import SamplingParams  # noqa: E402
from lanekv.prefill.cp.launcher import PrefillInput  # noqa: E402
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine  # noqa: E402
from lanekv.prefill.engine_config import EngineConfig  # noqa: E402

from bench.deepseek import V2_LITE  # noqa: E402
from bench.pdl_flag import add_pdl_flag, pdl_env, pdl_label, pdl_modes  # noqa: E402
from bench.prefill import LLAMA3_8B  # noqa: E402

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}
# (name, N, K) of each model's linears (q/k/v and gate/up fused; V2-Lite's q and kv_a run
# as one GEMM, q_kv_a: the step's shape, which the tables had no entry of)
SHAPES = {
    "llama3_8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                  ("down", 4096, 14336)],
    "v2_lite": [("q_kv_a", 3648, 2048), ("q", 3072, 2048), ("kv_a", 576, 2048),
                ("kv_b", 4096, 512), ("o", 2048, 2048),
                ("dense_gate_up", 21888, 2048), ("dense_down", 2048, 10944),
                ("shared_gate_up", 5632, 2048), ("shared_down", 2048, 2816)],
}
MODELS = {"llama3_8b": LLAMA3_8B, "v2_lite": V2_LITE}
RESULTS_DIR = Path(__file__).resolve().parent / "results" / "fp8"


def _ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40)


def _timer(kind: str, rep: int):
    """``graph``: the calls captured in a CUDA graph and replayed (the GPU's time,
    as a captured decode step runs them; no launch overhead); ``events``: plain
    launches timed by CUDA events (the host's launch cost shows at few rows)."""
    import triton.testing

    if kind == "graph":
        return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def _rotating(calls: list):
    """One callable that runs ``calls`` in turn: a copy of the weight per call, so a
    weight that fits the L2 cache is still read from memory as in a model's step."""
    state = {"i": 0}

    def run():
        fn = calls[state["i"] % len(calls)]
        state["i"] += 1
        return fn()

    return run


L2_FLUSH_BYTES = 128 << 20  # over twice an H200's 50 MB L2


def _copies(nbytes: int) -> int:
    return max(1, min(64, -(-L2_FLUSH_BYTES // max(nbytes, 1))))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp(min=1e-30))


def _scaled_mm_block_calls(a, a_scale, ws, ref) -> tuple[list, str, float | None]:
    """``torch._scaled_mm`` / ``F.scaled_mm`` with our own scales (1x128 for the
    activations, 128x128 for the weight), in the layouts torch may ask for: the
    calls (one per weight copy) of the first variant that runs and matches the
    reference, its name (or why none did) and its relative error."""
    import torch.nn.functional as F

    rows, groups = a_scale.shape
    l4 = -(-groups // 4) * 4
    sa = a_scale.t().contiguous().t()  # [M, K/128], M-major
    sa_pad = torch.zeros(groups, -(-rows // 4) * 4, dtype=torch.float32, device=a.device)
    sa_pad[:, :rows] = a_scale.t()
    sa_pad = sa_pad.t()[:rows]  # M-major, column stride padded to 16 bytes

    def padded(s):
        pad = torch.zeros(s.shape[0], l4, dtype=torch.float32, device=s.device)
        pad[:, :groups] = s
        return pad.t()  # [L4, N/128], stride [1, L4]

    variants = [(f"_scaled_mm{tag}", lambda w, s, sa_=sa_: partial(
        torch._scaled_mm, a, w.t(), scale_a=sa_, scale_b=s.t(), out_dtype=torch.bfloat16))
        for tag, sa_ in (("", sa), ("_pad_m", sa_pad))]
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        st = F.ScalingType
        for name, scale_b in (("F.scaled_mm", lambda s: s.t()), ("F.scaled_mm_l4", padded)):
            variants.append((name, lambda w, s, scale_b=scale_b: partial(
                F.scaled_mm, a, w.t(), sa, st.BlockWise1x128, scale_b(s), st.BlockWise128x128,
                output_dtype=torch.bfloat16)))
    errors = []
    limit = 4 * _rel_err(ref.to(torch.bfloat16), ref) + 1e-4
    for name, make in variants:
        try:
            calls = [make(w, s) for w, s in ws]
            err = _rel_err(calls[0](), ref)
            torch.cuda.synchronize()
        except (RuntimeError, TypeError, ValueError) as exc:
            errors.append(f"{name}: {str(exc).splitlines()[0][:200] if str(exc) else exc!r}")
            continue
        if err < limit:
            return calls, name, err
        errors.append(f"{name}: relative error {err:.2e} over {limit:.2e}")
    return [], " | ".join(errors), None


def _call(cfg: GemmConfig, as_linear: bool, x, a, a_scale, w, s, block, silu: bool = False):
    """One run of ``cfg`` as the sweep times it: the linear on ``x`` (its plan's
    fusion; a w8a16 or gemv config reads x unquantized; ``silu``: ``x`` is a gate/up
    output and the down projection ``silu_mul_fp8_linear``) or the GEMM on the quantized
    ``a``."""
    if as_linear and silu:
        return partial(silu_mul_fp8_linear_triton, x, w, s, block, config=cfg)
    if as_linear:
        return partial(fp8_linear_triton, x, w, s, block, config=cfg)
    return partial(block_fp8_matmul_triton, a, a_scale, w, s, block, torch.bfloat16, config=cfg)


def _sweep_configs(a, a_scale, ws, rows, ref, time_fn, block, budget: Budget | None = None, *,
                   x=None, ref_x=None, silu: bool = False) -> tuple[list[dict], dict | None]:
    """Every candidate config: compiled, checked against the reference, timed (in the
    candidates' order; past the budget's deadline the rest are skipped, once one ran).
    With ``x`` (decode rows) each is timed as the linear, a w8a16 config checked
    against ``ref_x`` (the unquantized activations'); without, the w8a8 GEMM on ``a``.
    ``silu``: ``x`` is a gate/up output, each timed as ``silu_mul_fp8_linear``."""
    tried, best = [], None
    as_linear = x is not None
    for cfg in candidate_configs(rows, block):
        if (cfg.w8a16 or cfg.gemv) and not as_linear:
            continue  # a GEMM on pre-quantized activations is w8a8
        if budget is not None and best is not None and budget.expired():
            tried.append(dict(config=cfg.name(), skipped="time budget spent"))
            continue
        rec = dict(config=cfg.name(), family=config_family(cfg),
                   timed="linear" if as_linear else "gemm")
        want = ref_x if cfg.w8a16 or cfg.gemv else ref
        limit = 4 * _rel_err(want.to(torch.bfloat16), want) + 1e-4  # 4x the output's rounding
        try:
            out = _call(cfg, as_linear, x, a, a_scale, ws[0][0], ws[0][1], block, silu)()
            torch.cuda.synchronize()
            rec["rel_err"] = _rel_err(out, want)
            if not rec["rel_err"] < limit:
                rec["error"] = f"relative error {rec['rel_err']:.2e} over {limit:.2e}"
            else:
                rec["ms"] = time_fn(_rotating([_call(cfg, as_linear, x, a, a_scale, w, s, block,
                                                     silu) for w, s in ws]))
        except Exception as err:  # noqa: BLE001  (a config that fails to compile is recorded)
            rec["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}" if str(
                err) else type(err).__name__
        tried.append(rec)
        if "ms" in rec and (best is None or rec["ms"] < best["ms"]):
            best = dict(rec, cfg=cfg)
    return tried, best


class Budget:
    """A wall-clock budget for the whole run (``--time-budget-s``): the GEMM loop asks
    before each shape whether one more, as long as the slowest so far, still fits."""

    def __init__(self, seconds: float | None, start: float | None = None):
        self.seconds = seconds
        self.start = time.perf_counter() if start is None else start
        self.longest_step = 0.0

    def left(self) -> float:
        if self.seconds is None:
            return math.inf
        return self.seconds - (time.perf_counter() - self.start)

    def expired(self) -> bool:
        return self.left() <= 0

    def fits_another(self) -> bool:
        return self.left() > self.longest_step

    def record_step(self, seconds: float) -> None:
        self.longest_step = max(self.longest_step, seconds)


def _spec_shapes(models: list[str]) -> list[tuple[int, int]]:
    """One (N, K) of each class the kernels specialize on (16-divisible ints, a
    K that is or is not a multiple of 128, a scale row stride divisible by 16 or not)."""
    seen, out = set(), []
    for model in models:
        for _, n, k in SHAPES[model]:
            groups = -(-k // 128)
            key = (n % 16 == 0, k % 16 == 0, k % 128 == 0, groups % 16 == 0)
            if key not in seen:
                seen.add(key)
                out.append((n, k))
    return out


def _warm_worker(configs: list[dict], shapes: list[tuple[int, int]], rows: int) -> int:
    """Compile ``configs`` on ``shapes`` (a spawned process: several compile at once and
    fill Triton's disk cache, which the timing process then reads)."""
    device = torch.device("cuda")
    done = 0
    for n, k in shapes:
        w, s = quantize_weight_blocks(torch.randn(n, k, device=device) * k ** -0.5, (128, 128))
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        a, a_scale = per_token_group_quant_fp8_triton(x, 128)
        for raw in configs:
            cfg = GemmConfig(**raw)
            try:
                if cfg.w8a16 or cfg.gemv:  # only the linear runs it, and the SiLU down
                    fp8_linear_triton(x, w, s, (128, 128), config=cfg)
                    gate_up = torch.randn(rows, 2 * k, device=device, dtype=torch.bfloat16)
                    silu_mul_fp8_linear_triton(gate_up, w, s, (128, 128), config=cfg)
                    done += 1
                    continue
                block_fp8_matmul_triton(a, a_scale, w, s, (128, 128), torch.bfloat16, config=cfg)
                if rows <= 64 and cfg.block_k == 128:  # the linear's fused quantization
                    fp8_linear_triton(x, w, s, (128, 128), fuse_quant=True, config=cfg)
                done += 1
            except Exception:  # noqa: BLE001,S112  (the timing process records the error)
                continue
    torch.cuda.synchronize()
    return done


def precompile(rows_list: list[int], models: list[str], jobs: int) -> None:
    """Compile every candidate config of the swept row counts in ``jobs`` processes."""
    import concurrent.futures
    import multiprocessing

    if jobs <= 1:
        return
    t0 = time.perf_counter()
    shapes = _spec_shapes(models)
    work = []
    for rows in sorted(set(rows_list)):
        cands = [c.to_dict() for c in candidate_configs(rows, (128, 128))]
        work += [(cands[i::jobs], rows) for i in range(jobs) if cands[i::jobs]]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        done = sum(pool.map(_warm_worker, [w[0] for w in work], [shapes] * len(work),
                            [w[1] for w in work]))
    print(f"precompiled {done} config x shape pairs in {jobs} processes in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)


def bench_gemm(rows_list: list[int], models: list[str], device: torch.device, *,
               sweep: bool, timer: str, budget: Budget | None = None,
               on_row=None) -> list[dict]:
    """``on_row(rows_so_far)`` after each (shape, row count): the caller writes its
    files there, so a run stopped by its time limit still leaves every finished row.
    With a ``budget``, a shape is started only while one more fits."""
    block = (128, 128)
    time_fn = _timer(timer, 20 if sweep else 40)
    out = []
    for model in models:
        for name, n, k in SHAPES[model]:
            if budget is not None and not budget.fits_another():
                print(f"time budget: {budget.left():.0f} s left, the slowest shape took "
                      f"{budget.longest_step:.0f} s; stopping before {model} {name}", flush=True)
                _summary(out)
                return out
            shape_t0 = time.perf_counter()
            w_bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
            copies = _copies(n * k)
            bf16s = [w_bf16] + [w_bf16.clone() for _ in range(copies - 1)]
            ws = [quantize_weight_blocks(w, block) for w in bf16s]
            w_row_scale = w_bf16.float().abs().amax(1, keepdim=True).t().clamp(min=1e-10) / 448
            w_rows = [((w.float() / w_row_scale.t()).to(torch.float8_e4m3fn)) for w in bf16s]
            w_deq = dequantize_weight_blocks(ws[0][0], ws[0][1], block)
            for rows in rows_list:
                # the step runs a decode linear as the linear, a down projection as
                # silu_mul_fp8_linear on the gate/up output (x then is [rows, 2K], x_lin
                # the product the projection multiplies)
                as_linear = rows <= FUSED_QUANT_MAX_ROWS
                silu = as_linear and name.endswith("down")
                if silu:
                    x = torch.randn(rows, 2 * k, device=device, dtype=torch.bfloat16)
                    a, a_scale = silu_mul_quant_fp8_triton(x, 128)
                    x_lin = silu_mul_triton(x)
                else:
                    x = x_lin = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                    a, a_scale = per_token_group_quant_fp8_triton(x, 128)
                ref = (a.float() * a_scale.repeat_interleave(128, 1)[:, :k]) @ w_deq.t()
                ref_x = x_lin.float() @ w_deq.t()  # a w8a16 or gemv config's: unquantized
                row = dict(model=model, linear=name, n=n, k=k, rows=rows, weight_copies=copies,
                           silu_down=silu)
                cfg = select_config(rows, n, k, block, device)
                best = None
                if sweep:
                    row["sweep_timed"] = ("silu_down" if silu else "linear" if as_linear
                                          else "gemm")
                    row["tried"], best = _sweep_configs(a, a_scale, ws, rows, ref, time_fn, block,
                                                        budget, x=x if as_linear else None,
                                                        ref_x=ref_x, silu=silu)
                    # what the kernel picks without this sweep, if it was a candidate
                    row["selected_config"] = cfg.name()
                    row["selected_ms"] = next((t["ms"] for t in row["tried"]
                                               if t["config"] == cfg.name() and "ms" in t), None)
                    if best is not None:
                        cfg = best["cfg"]
                row["config"] = cfg.to_dict()
                row["config_name"] = cfg.name()
                row["config_source"] = "sweep" if best is not None else "select_config"
                row["family"] = config_family(cfg)
                if best is not None:  # timed in the sweep, on the same inputs and timer
                    row["rel_err"], row["gemm_ms"] = best["rel_err"], best["ms"]
                elif cfg.w8a16 or cfg.gemv or silu:  # the linear's time (no GEMM apart)
                    want = ref_x if cfg.w8a16 or cfg.gemv else ref
                    row["rel_err"] = _rel_err(_call(cfg, True, x, a, a_scale, ws[0][0], ws[0][1],
                                                    block, silu)(), want)
                    row["gemm_ms"] = time_fn(_rotating([_call(cfg, True, x, a, a_scale, w, s,
                                                              block, silu) for w, s in ws]))
                else:
                    got = block_fp8_matmul_triton(a, a_scale, ws[0][0], ws[0][1], block,
                                                  torch.bfloat16, config=cfg)
                    row["rel_err"] = _rel_err(got, ref)
                    row["gemm_ms"] = time_fn(_rotating([partial(
                        block_fp8_matmul_triton, a, a_scale, w, s, block, torch.bfloat16,
                        config=cfg) for w, s in ws]))
                # The linear as a model's step runs it with this config (quantizing inside
                # the GEMM or first: linear_plan), and at decode rows both ways.
                row["linear_fused_quant"] = not silu and linear_plan(rows, n, k, block, device,
                                                                     config=cfg).fuse_quant
                unquantized = cfg.w8a16 or cfg.gemv
                ways = (() if unquantized or silu else (True, False)
                        if rows <= FUSED_QUANT_MAX_ROWS and cfg.block_k == block[1]
                        else (row["linear_fused_quant"],))
                for fuse in ways:
                    row["linear_fused_ms" if fuse else "linear_unfused_ms"] = time_fn(_rotating([
                        partial(fp8_linear_triton, x, w, s, block, fuse_quant=fuse, config=cfg)
                        for w, s in ws]))
                if silu:  # the down projection as the step runs it: timed above
                    row["linear_ms"] = row["gemm_ms"]
                elif unquantized:  # nothing quantized, nothing to fuse
                    row["linear_ms"] = time_fn(_rotating([_call(cfg, True, x, a, a_scale, w, s,
                                                                block) for w, s in ws]))
                else:
                    row["linear_ms"] = row["linear_fused_ms" if row["linear_fused_quant"]
                                           else "linear_unfused_ms"]
                if sweep and as_linear and record_quant_first(row):
                    cfg = GemmConfig(**row["config"])
                row["bf16_ms"] = time_fn(_rotating([partial(torch.matmul, x_lin, w.t())
                                                    for w in bf16s]))
                a_row = (x_lin.float().abs().amax(1, keepdim=True).clamp(min=1e-10) / 448)
                a8 = (x_lin.float() / a_row).to(torch.float8_e4m3fn)
                try:
                    row["scaled_mm_row_ms"] = time_fn(_rotating([partial(
                        torch._scaled_mm, a8, w.t(), scale_a=a_row, scale_b=w_row_scale,
                        out_dtype=torch.bfloat16) for w in w_rows]))
                except (RuntimeError, TypeError) as err:
                    row["scaled_mm_row_ms"] = None
                    row["scaled_mm_row_skipped"] = str(err).splitlines()[0][:200]
                calls, how, err = _scaled_mm_block_calls(a, a_scale, ws, ref)
                row["scaled_mm_block_ms"] = None
                if calls:
                    row["scaled_mm_block_api"], row["scaled_mm_block_rel_err"] = how, err
                    row["scaled_mm_block_ms"] = time_fn(_rotating(calls))
                else:
                    row["scaled_mm_block_skipped"] = how
                peers = [v for v in (row["scaled_mm_row_ms"], row["scaled_mm_block_ms"]) if v]
                row["best_torch_fp8_ms"] = min(peers) if peers else None
                row["vs_best_torch_fp8"] = (row["best_torch_fp8_ms"] / row["gemm_ms"]
                                            if peers else None)
                row["vs_bf16"] = row["bf16_ms"] / row["gemm_ms"]
                row["tflops"] = 2 * rows * n * k / row["gemm_ms"] / 1e9
                out.append(row)
                other = (f" sel {_us(row['selected_ms'])}" if sweep else "")  # the un-swept pick
                other += (f" lin {_us(row['linear_ms'])}"
                          f"{' fused' if row['linear_fused_quant'] else ''}")
                print(f"{model:>9} {name:>14} {rows:>5} {cfg.name():>26} gemm {row['gemm_ms']*1e3:8.1f}"
                      f"{other} row {_us(row['scaled_mm_row_ms'])} "
                      f"blk {_us(row['scaled_mm_block_ms'])} bf16 {row['bf16_ms']*1e3:8.1f} us "
                      f"{row['tflops']:5.0f} TF/s  x{row['vs_best_torch_fp8'] or float('nan'):.2f}"
                      f" of torch fp8", flush=True)
                if on_row is not None:
                    on_row(out)
            del ws, bf16s, w_rows, w_deq
            torch.cuda.empty_cache()
            if budget is not None:
                budget.record_step(time.perf_counter() - shape_t0)
    _summary(out)
    return out


def _us(ms: float | None) -> str:
    return f"{ms * 1e3:8.1f}" if ms else "     n/a"


def _summary(rows: list[dict]) -> None:
    for label, pick in (("decode rows <= 64", lambda r: r["rows"] <= 64),
                        ("prefill rows >= 2048", lambda r: r["rows"] >= 2048)):
        ratios = [r["vs_best_torch_fp8"] for r in rows if pick(r) and r["vs_best_torch_fp8"]]
        if ratios:
            geo = math.exp(sum(math.log(v) for v in ratios) / len(ratios))
            below = sum(v < 0.85 for v in ratios)
            print(f"{label}: vs best torch FP8 min {min(ratios):.2f} geomean {geo:.2f}, "
                  f"{below}/{len(ratios)} shapes below 0.85", flush=True)
        sel = [r["best_torch_fp8_ms"] / r["selected_ms"] for r in rows
               if pick(r) and r.get("selected_ms") and r.get("best_torch_fp8_ms")]
        if sel:  # a sweep: the config select_config picks without it, on the same shapes
            geo = math.exp(sum(math.log(v) for v in sel) / len(sel))
            print(f"{label}: select_config's pick vs best torch FP8 min {min(sel):.2f} "
                  f"geomean {geo:.2f} ({len(sel)} shapes)", flush=True)


def record_quant_first(row: dict) -> bool:
    """A swept decode row whose w8a8 winner ran faster quantizing ``x`` first than inside
    the GEMM: its config takes ``quant_first`` (the table then makes the linear quantize
    first) and ``linear_ms`` the faster time. True if it changed the row."""
    fused, unfused = row.get("linear_fused_ms"), row.get("linear_unfused_ms")
    if row["config"].get("w8a16") or fused is None or unfused is None or unfused >= fused:
        return False
    row["config"] = {**row["config"], "quant_first": True}
    row["config_name"] = GemmConfig(**row["config"]).name()
    row["linear_fused_quant"], row["linear_ms"] = False, unfused
    return True


def write_table(path: Path, rows: list[dict], device_name: str) -> None:
    """The best config of each swept (rows, N, K): merged into the table at ``path``
    (entries of other shapes or row counts kept)."""
    entries, note = {}, None
    if path.is_file():
        old = json.loads(path.read_text())
        note = old.get("note")  # where the older entries came from: kept for the reader
        for e in old.get("entries", []):
            entries[(e["rows"], e["n"], e["k"], tuple(e["block"]))] = e
    for r in rows:
        if r.get("tried") is not None and r.get("config_source") != "sweep":
            continue  # a swept row where no candidate ran correctly teaches the table nothing
        entries[(r["rows"], r["n"], r["k"], (128, 128))] = table_entry(
            r["rows"], r["n"], r["k"], (128, 128), GemmConfig(**r["config"]),
            ms=r["gemm_ms"], vs_best_torch_fp8=r["vs_best_torch_fp8"])
    table = dict(device=device_name, torch=torch.__version__,
                 triton=triton.__version__, **({"note": note} if note else {}),
                 entries=sorted(entries.values(), key=lambda e: (e["n"], e["k"], e["rows"])))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(path)  # whole or not at all: a run killed mid-write leaves the last table
    print(f"wrote {len(table['entries'])} table entries to {path}", flush=True)


def _copy_rate(device: torch.device) -> float:
    """Bytes per second one read streams at (half a device copy's traffic)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def step_bytes(model: torch.nn.Module, batch: int) -> int:
    """What one decode step reads of the weights (see the module doc)."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("model.embed_tokens"):
            total += batch * cfg.hidden_size * p.element_size()
            continue
        size = p.numel() * p.element_size()
        if ".mlp.experts." in name:  # touched in expectation under uniform routing
            moe = cfg.moe
            size *= 1 - (1 - moe.top_k / moe.num_experts) ** batch
        total += size
    if model.lm_head is None:  # tied: the head reads the embedding table
        total += cfg.vocab_size * cfg.hidden_size * model.dtype.itemsize
    return int(total)


def model_config(name: str, quant: str) -> dict:
    """config.json of ``name``'s shapes, with ``quantization_config`` for ``quant == "fp8"``."""
    return dict(MODELS[name], **({"quantization_config": FP8_CONFIG} if quant == "fp8" else {}))


def bench_decode(models: list[str], batches: list[int], context: int, steps: int,
                 device: torch.device, pdl: tuple[str, ...] = ("auto",)) -> list[dict]:
    """Each step timed once per setting of ``pdl`` (``bench.pdl_flag``): its engine built,
    captured and timed with the switch so."""
    rate = _copy_rate(device)
    out = []
    for name in models:
        for quant in ("bf16", "fp8"):
            cfg = model_config(name, quant)
            with tempfile.TemporaryDirectory() as d:
                (Path(d) / "config.json").write_text(json.dumps(cfg))
                loaded = load_dummy_model(d, dtype=torch.bfloat16, device=device)
            page_size = 64
            per_req = -(-(context + steps + 8) // page_size)
            pool = PagePool.for_model(loaded.config, max(batches) * per_req + 8, page_size,
                                      torch.bfloat16, device)
            pool.tensor.normal_()
            for batch, pdl_on in ((b, p) for b in batches for p in pdl):
                with pdl_env(pdl_on):
                    step_ms = decode_step_ms(loaded, pool, batch, context, steps, device)
                floor_ms = step_bytes(loaded.model, batch) / rate * 1e3
                row = dict(model=name, weights=quant, batch=batch, context=context,
                           pdl=pdl_on, pdl_status=pdl_label(device, pdl_on, batch),
                           step_ms=step_ms, weight_read_floor_ms=floor_ms,
                           vs_floor=step_ms / floor_ms)
                out.append(row)
                print(f"{name:>9} {quant:>4} batch {batch:>3}: step {step_ms:.3f} ms, floor "
                      f"{floor_ms:.3f} ms ({step_ms / floor_ms:.2f}x); PDL {row['pdl_status']}",
                      flush=True)
            del pool, loaded
            torch.cuda.empty_cache()
    for row in out:
        if row["weights"] == "fp8":
            bf16 = next(r for r in out if r["model"] == row["model"] and r["weights"] == "bf16"
                        and r["batch"] == row["batch"] and r["pdl"] == row["pdl"])
            row["vs_bf16_step"] = row["step_ms"] / bf16["step_ms"]
    return out


def decode_step_ms(loaded, pool: PagePool, batch: int, context: int, steps: int,
                    device: torch.device) -> float:
    """A captured step of ``batch`` requests of ``context`` tokens, ms per step."""
    engine = DecodeEngine(loaded.model, pool, max_batch_size=batch, eos_token_ids=(),
                          graph_sizes=(batch,))
    engine.capture_graphs()
    for i in range(batch):
        engine.add(f"r{i}", PageTable.allocate(pool, context), 11 + i, SamplingParams(), steps + 4)
    engine.step()
    engine.step()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize(device)
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    while engine.has_work:
        engine.step()
    return step_ms


def prefill_once(engine, ids: list[int], device: torch.device) -> tuple[float, torch.Tensor]:
    """Seconds of one prefill of ``ids`` (pages freed after) and its last-token logits."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _device: None)
    sync(device)
    t0 = time.perf_counter()
    res = engine.prefill([PrefillInput(ids)], return_logits=True)[0]
    sync(device)
    seconds = time.perf_counter() - t0
    engine.free(res.new_pages)
    return seconds, res.logits.float().flatten().cpu()


def bench_prefill(models: list[str], tokens: list[int], repeat: int, page_size: int,
                  device: torch.device) -> list[dict]:
    """bf16 then FP8 weights of each model: one prompt of each length, cp=1."""
    out = []
    for name in models:
        logits = {}
        for quant in ("bf16", "fp8"):
            cfg = model_config(name, quant)
            with tempfile.TemporaryDirectory() as d:
                (Path(d) / "config.json").write_text(json.dumps(cfg))
                loaded = load_dummy_model(d, dtype=torch.bfloat16, device=device)
                for n in tokens:
                    row = dict(model=name, weights=quant, tokens=n)
                    ecfg = EngineConfig(d, cp_size=1, page_size=page_size,
                                        pages_per_lane=-(-n // page_size) + 8, dtype="bfloat16",
                                        load_format="dummy", device=device.type)
                    ids = torch.randint(3, cfg["vocab_size"], (n,),
                                        generator=torch.Generator().manual_seed(n)).tolist()
                    engine = None
                    try:
                        engine = ThreadedPrefillEngine(ecfg, loaded)
                        _, logits[(quant, n)] = prefill_once(engine, ids, device)  # warm-up
                        times = [prefill_once(engine, ids, device)[0] for _ in range(repeat)]
                    except Exception as err:  # noqa: BLE001  (recorded; the other rows still run)
                        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}" \
                            if str(err) else type(err).__name__
                        out.append(row)
                        print(f"{name:>9} {quant:>4} prefill {n:>6}: {row['error']}", flush=True)
                        continue
                    finally:
                        if engine is not None:
                            engine.close()
                        engine = None
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    seconds = sorted(times)[len(times) // 2]
                    row.update(ms=seconds * 1e3, tokens_per_s=n / seconds,
                               ms_runs=[t * 1e3 for t in times])
                    if quant == "fp8" and ("bf16", n) in logits:
                        ref, got = logits[("bf16", n)], logits[(quant, n)]
                        row["logits_rel_err_vs_bf16"] = float((got - ref).norm() / ref.norm())
                        row["same_first_token_as_bf16"] = bool(got.argmax() == ref.argmax())
                    out.append(row)
                    print(f"{name:>9} {quant:>4} prefill {n:>6}: {n / seconds:>9,.0f} tok/s "
                          f"({seconds * 1e3:.1f} ms)", flush=True)
            del loaded
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for row in out:
        bf16 = next((r for r in out if r["model"] == row["model"] and r["weights"] == "bf16"
                     and r["tokens"] == row["tokens"] and "tokens_per_s" in r), None)
        if row["weights"] == "fp8" and bf16 is not None and "tokens_per_s" in row:
            row["bf16_tokens_per_s"] = bf16["tokens_per_s"]
            row["vs_bf16"] = row["tokens_per_s"] / bf16["tokens_per_s"]
    print(f"\n{'model':>9} {'tokens':>6} {'bf16 tok/s':>11} {'fp8 tok/s':>10} {'fp8/bf16':>8} "
          f"{'logits err':>10} {'same tok':>8}")
    for row in out:
        if row["weights"] == "fp8":
            print(f"{row['model']:>9} {row['tokens']:>6} "
                  f"{row.get('bf16_tokens_per_s', float('nan')):>11,.0f} "
                  f"{row.get('tokens_per_s', float('nan')):>10,.0f} "
                  f"{row.get('vs_bf16', float('nan')):>8.2f} "
                  f"{row.get('logits_rel_err_vs_bf16', float('nan')):>10.2e} "
                  f"{str(row.get('same_first_token_as_bf16', '-')):>8}", flush=True)
    return out


def _result_path(args, device: torch.device) -> Path:
    """A new file per run: the given path, refused if it exists, or a timestamped one."""
    if args.json is not None:
        if args.json.exists():
            sys.exit(f"--json {args.json} exists; results are never overwritten")
        return args.json
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kind = "gemm_sweep" if args.sweep else (args.only if args.only in ("gemm", "prefill")
                                            else "fp8")
    return RESULTS_DIR / f"{kind}_{device_slug(torch.cuda.get_device_name(device))}_{stamp}.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("gemm", "decode", "prefill"), default=None)
    ap.add_argument("--sweep", action="store_true",
                    help="GEMM only: try every candidate config per shape and row count, "
                         "report and use the fastest correct one")
    ap.add_argument("--write-table", nargs="?", type=Path, const=Path("-"), default=None,
                    metavar="PATH",
                    help="merge the configs used into a tuned table (default path: "
                         "kernels/fp8/gemm_tables/<device>.json, which select_config reads)")
    ap.add_argument("--time-budget-s", type=float, default=None, metavar="S",
                    help="stop cleanly within S seconds of the start: the GEMM loop starts a "
                         "shape only while one as slow as the slowest so far still fits, a sweep "
                         "skips the remaining candidates of a shape once the budget is spent; "
                         "the JSON and the table are written after every shape either way")
    ap.add_argument("--jobs", type=int, default=12,
                    help="with --sweep: processes compiling the candidate configs first")
    ap.add_argument("--timer", choices=("graph", "events"), default="graph",
                    help="GEMM timing: CUDA-graph replay (GPU time) or plain launches")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 2048, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--prefill-repeat", type=int, default=3)
    ap.add_argument("--prefill-models", nargs="+", default=["v2_lite", "llama3_8b"],
                    choices=list(MODELS))
    ap.add_argument("--page-size", type=int, default=64, help="prefill: the KV page size")
    add_pdl_flag(ap)
    ap.add_argument("--json", type=Path, default=None,
                    help="result file (default: a new timestamped file in bench/results/fp8/)")
    args = ap.parse_args()
    started = time.perf_counter()
    if args.sweep and args.only in ("decode", "prefill"):
        ap.error(f"--sweep tunes the GEMM; it cannot go with --only {args.only}")
    if args.prefill_repeat < 1:
        ap.error(f"--prefill-repeat must be at least 1, got {args.prefill_repeat}")
    for n in args.prefill_tokens:
        if n < 1:
            ap.error(f"--prefill-tokens: {n} is not a positive token count")
    if args.time_budget_s is not None and not args.time_budget_s > 0:
        ap.error(f"--time-budget-s must be positive, got {args.time_budget_s}")
    if args.sweep:
        args.only = "gemm"
    if not torch.cuda.is_available():
        sys.exit("bench/fp8.py needs a CUDA GPU (the FP8 kernels and _scaled_mm)")
    device = torch.device("cuda")
    out_path = _result_path(args, device)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__,
                  triton=triton.__version__, timer=args.timer, sweep=args.sweep)
    budget = Budget(args.time_budget_s, start=started)
    if args.time_budget_s is not None:
        result["time_budget_s"] = args.time_budget_s
    if args.sweep:
        precompile(args.rows, args.models, args.jobs)
    if args.only in (None, "gemm"):
        table = None
        if args.write_table is not None:
            table = args.write_table if args.write_table != Path("-") else (
                TABLE_DIR / f"{device_slug(torch.cuda.get_device_name(device))}.json")

        def on_row(rows: list[dict]) -> None:
            result["gemm"] = rows
            out_path.write_text(json.dumps(result, indent=2))
            if table is not None:
                write_table(table, rows[-1:], result["device"])

        result["gemm"] = bench_gemm(args.rows, args.models, device, sweep=args.sweep,
                                    timer=args.timer, budget=budget, on_row=on_row)
        result["gemm_complete"] = len(result["gemm"]) == len(args.rows) * sum(
            len(SHAPES[m]) for m in args.models)
        out_path.write_text(json.dumps(result, indent=2))
    if args.only is None and budget.expired():
        result["skipped"] = "decode and prefill: the time budget was spent on the GEMMs"
        print(result["skipped"], flush=True)
        args.only = "gemm"
    if args.only in (None, "decode"):
        result["decode"] = bench_decode(args.models, args.batches, args.context, args.steps,
                                        device, pdl_modes(args.pdl))
        out_path.write_text(json.dumps(result, indent=2))
    if args.only in (None, "prefill"):
        result["prefill"] = bench_prefill(args.prefill_models, args.prefill_tokens,
                                          args.prefill_repeat, args.page_size, device)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {out_path}", flush=True)


if __name__ == "__main__":
    main()
