"""cp_prefill_attention vs torch SDPA (FlashAttention and cuDNN) on Llama-3-8B shapes.

Shapes: 32 q heads, 8 kv heads, head_dim 128, bf16, sequences of 4k, 16k and
32k tokens. cp=1 is the whole sequence as one segment; cp=2 and cp=4 are the
rank-0 queries of the zigzag split into 2*cp chunks (chunks 0 and 2*cp-1: a
short prefix and nearly the whole sequence) against the full K/V.

FLOPs count only the causal work: 4 * head_dim * Hq * sum over query rows of
(pos + 1). SDPA runs ``is_causal=True`` on the whole sequence at each length
(its rate is the yardstick for every cp row of that length); where torch's
lower-right causal bias takes the flash path, SDPA-flash is also timed on the
rank's own two segments ("flash/rank").

Correctness first: the kernel's rows must match SDPA-flash on fresh random
bf16 inputs (relative Frobenius error < 1e-2) before anything is timed.

    python bench/kernels_attention.py --json bench/results/kernels_attention_h200.json
    python bench/kernels_attention.py --sweep --shapes 16384:1 4096:4 --configs 128,128,8,3 64,64,4,2
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F
import triton
from lanekv.kernels.prefill.attention import (
    cp_prefill_attention_triton,
    launch_cp_prefill_attention,
)
from lanekv.kernels.prefill.config import AttnLaunchConfig, default_config
from lanekv.kernels.prefill.reference import AttnSegments
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

HQ, HKV, HEAD_DIM = 32, 8, 128
SEQ_LENS = (4096, 16384, 32768)
CP_SIZES = (1, 2, 4)
MAX_REL_ERR = 1e-2
SCALE = HEAD_DIM**-0.5


def rank0_segments(seq_len: int, cp: int) -> list[tuple[int, int]]:
    """(q_pos, q_len) of rank 0's query segments under the zigzag split."""
    if cp == 1:
        return [(0, seq_len)]
    chunk = seq_len // (2 * cp)
    return [(0, chunk), (seq_len - chunk, chunk)]


def causal_flops(segments: list[tuple[int, int]]) -> float:
    # sum_{p=a}^{a+n-1} (p + 1) = n * a + n * (n + 1) / 2
    keys = sum(n * a + n * (n + 1) // 2 for a, n in segments)
    return 4.0 * HEAD_DIM * HQ * keys


def _time_ms(fn) -> float:
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _sdpa_call(backend: SDPBackend, q4, k4, v4, k4x, v4x):
    """A zero-arg SDPA call under ``backend``: native GQA if it takes it, else expanded K/V."""
    def gqa():
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=SCALE, enable_gqa=True)

    def expanded():
        return F.scaled_dot_product_attention(q4, k4x, v4x, is_causal=True, scale=SCALE)

    for mode, fn in (("gqa", gqa), ("expanded", expanded)):
        try:
            with sdpa_kernel(backend):
                out = fn()
            return mode, fn, out
        except RuntimeError:
            continue
    return "unavailable", None, None


def _sdpa_rank_flash(q4, k4x, v4x, segments):
    """SDPA-flash on a rank's segments with lower-right causal masks, or None."""
    from torch.nn.attention.bias import causal_lower_right

    calls = []
    for a, n in segments:
        qs = q4[:, :, a : a + n]
        ks, vs = k4x[:, :, : a + n], v4x[:, :, : a + n]
        bias = causal_lower_right(n, a + n)
        calls.append((qs, ks, vs, bias))

    def run():
        return [F.scaled_dot_product_attention(qs, ks, vs, attn_mask=b, scale=SCALE) for qs, ks, vs, b in calls]

    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            run()
    except RuntimeError:
        return None
    return run


def _segments_tensor(segments: list[tuple[int, int]]) -> AttnSegments:
    q_start, row = [], 0
    for _, n in segments:
        q_start.append(row)
        row += n
    cols = (q_start, [n for _, n in segments], [a for a, _ in segments], [0] * len(segments))
    return AttnSegments(*(torch.tensor(c, dtype=torch.int32, device="cuda") for c in cols))


def _inputs(seq_len: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(seq_len, HQ, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(seq_len, HKV, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(seq_len, HKV, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    return q, k, v


def run(results: list[dict], seq_lens=SEQ_LENS, cp_sizes=CP_SIZES) -> None:
    for seq_len in seq_lens:
        _run_seq_len(results, seq_len, cp_sizes)
        torch.cuda.empty_cache()


def _run_seq_len(results: list[dict], seq_len: int, cp_sizes) -> None:
    q, k, v = _inputs(seq_len, seed=seq_len)
    # SDPA wants [B, H, T, D]; contiguous copies keep layout fix-ups out of its time.
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    k4, v4 = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (k, v))
    k4x, v4x = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k4, v4))
    whole_flops = causal_flops([(0, seq_len)])
    sdpa = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        mode, fn, out = _sdpa_call(backend, q4, k4, v4, k4x, v4x)
        if fn is None:
            sdpa[name] = dict(mode=mode, ms=None, tflops=None, out=None)
            continue
        with sdpa_kernel(backend):
            ms = _time_ms(fn)
        sdpa[name] = dict(mode=mode, ms=ms, tflops=whole_flops / ms * 1e-9,
                          out=out[0].transpose(0, 1))  # back to [T, H, D]
    want = sdpa["flash"]["out"]
    if want is None:
        raise RuntimeError("SDPA flash backend unavailable: nothing to check against")
    cudnn_err = None if sdpa["cudnn"]["out"] is None else _rel_err(sdpa["cudnn"]["out"], want)
    for cp in cp_sizes:
        segs = rank0_segments(seq_len, cp)
        rows = torch.cat([torch.arange(a, a + n, device="cuda") for a, n in segs])
        q_rank = q[rows].contiguous()
        segments = _segments_tensor(segs)
        out = torch.full_like(q_rank, float("nan"))
        cp_prefill_attention_triton(q_rank, k, v, segments, SCALE, out=out, validate=True)
        err = _rel_err(out, want[rows])
        ms = _time_ms(partial(cp_prefill_attention_triton, q_rank, k, v, segments, SCALE, out=out))
        flops = causal_flops(segs)
        rank_fn = _sdpa_rank_flash(q4, k4x, v4x, segs) if cp > 1 else None
        rank_ms = _time_ms(rank_fn) if rank_fn is not None else None
        tflops = flops / ms * 1e-9
        row = dict(
            seq_len=seq_len, cp=cp, q_rows=int(rows.numel()), tflop=flops * 1e-12,
            triton_ms=ms, triton_tflops=tflops, rel_err_vs_flash=err, ok=err < MAX_REL_ERR,
            flash_tflops=sdpa["flash"]["tflops"], flash_mode=sdpa["flash"]["mode"],
            cudnn_tflops=sdpa["cudnn"]["tflops"], cudnn_mode=sdpa["cudnn"]["mode"],
            cudnn_rel_err_vs_flash=cudnn_err,
            flash_rank_tflops=None if rank_ms is None else flops / rank_ms * 1e-9,
            config=default_config(q_rank)._asdict(),
        )
        for name in ("flash", "cudnn", "flash_rank"):
            base = row[f"{name}_tflops"]
            row[f"vs_{name}"] = None if base is None else tflops / base
        results.append(row)


SWEEP_CONFIGS = tuple(
    [AttnLaunchConfig(bm, bn, w, s) for bm, bn, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3))]
    + [AttnLaunchConfig(128, 64, 8, 4), AttnLaunchConfig(128, 128, 8, 4), AttnLaunchConfig(128, 32, 8, 3)]
)


def sweep(results: list[dict], shapes=((16384, 1),), configs=SWEEP_CONFIGS) -> None:
    """Time tile configs on (seq_len, cp) shapes; the launcher's defaults come from this."""
    for seq_len in sorted({n for n, _ in shapes}):
        q, k, v = _inputs(seq_len, seed=7)
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
        k4x, v4x = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k4, v4))
        want = _sdpa_call(SDPBackend.FLASH_ATTENTION, q4, k4, v4, k4x, v4x)[2][0].transpose(0, 1)
        del q4, k4, v4, k4x, v4x
        for cp in sorted(c for n, c in shapes if n == seq_len):
            segs = rank0_segments(seq_len, cp)
            rows = torch.cat([torch.arange(a, a + n, device="cuda") for a, n in segs])
            q_rank, segments, flops = q[rows].contiguous(), _segments_tensor(segs), causal_flops(segs)
            out = torch.empty_like(q_rank)
            for cfg in configs:
                call = partial(launch_cp_prefill_attention, q_rank, k, v, segments, SCALE, None, 0, out, None, cfg)
                key = dict(seq_len=seq_len, cp=cp, **cfg._asdict())
                try:
                    out.fill_(float("nan"))
                    call()
                    torch.cuda.synchronize()
                except (triton.runtime.errors.OutOfResources, RuntimeError) as exc:
                    results.append(dict(key, error=type(exc).__name__))
                    continue
                err = _rel_err(out, want[rows])
                ms = _time_ms(call)
                results.append(dict(key, ms=ms, tflops=flops / ms * 1e-9, rel_err=err, ok=err < MAX_REL_ERR))


def host_overhead_us(repeats: int = 200) -> float:
    """Wall time of one launcher call on a one-row problem: the per-layer host cost."""
    q, k, v = _inputs(16, seed=1)
    segments = _segments_tensor([(0, 16)])
    out = torch.empty_like(q)
    for _ in range(10):
        cp_prefill_attention_triton(q, k, v, segments, SCALE, out=out)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        cp_prefill_attention_triton(q, k, v, segments, SCALE, out=out)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: list[dict]) -> None:
    print(f"{'seq':>6} {'cp':>2} {'rows':>6} {'TFLOP':>6} {'ms':>8} {'TFLOP/s':>8} "
          f"{'flash':>7} {'cudnn':>7} {'x flash':>7} {'x cudnn':>7} {'fl/rank':>7} {'err':>8}")
    for r in results:
        print(f"{r['seq_len']:>6} {r['cp']:>2} {r['q_rows']:>6} {r['tflop']:>6.2f} {r['triton_ms']:>8.3f} "
              f"{r['triton_tflops']:>8.1f} {_fmt(r['flash_tflops'], '7.1f')} {_fmt(r['cudnn_tflops'], '7.1f')} "
              f"{_fmt(r['vs_flash'], '7.2f')} {_fmt(r['vs_cudnn'], '7.2f')} "
              f"{_fmt(r['flash_rank_tflops'], '7.1f')} {r['rel_err_vs_flash']:>8.1e}")


def print_sweep(results: list[dict]) -> None:
    for r in sorted(results, key=lambda r: (r["seq_len"], r["cp"], -(r.get("tflops") or 0))):
        cfg = f"BM={r['block_m']:>3} BN={r['block_n']:>3} w={r['num_warps']} s={r['num_stages']}"
        head = f"{r['seq_len']:>6} cp={r['cp']} {cfg}"
        if "error" in r:
            print(f"{head}  {r['error']}")
        else:
            print(f"{head}  {r['tflops']:7.1f} TFLOP/s  {r['ms']:.3f} ms  err {r['rel_err']:.1e}")


def _shape(text: str) -> tuple[int, int]:
    seq_len, _, cp = text.partition(":")
    return int(seq_len), int(cp or 1)


def _config(text: str) -> AttnLaunchConfig:
    return AttnLaunchConfig(*(int(x) for x in text.split(",")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--sweep", action="store_true", help="time tile configs instead")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    parser.add_argument("--shapes", type=_shape, nargs="+", default=[(16384, 1)],
                        help="--sweep shapes as SEQ_LEN:CP (default 16384:1)")
    parser.add_argument("--configs", type=_config, nargs="+", default=list(SWEEP_CONFIGS),
                        help="--sweep configs as BLOCK_M,BLOCK_N,WARPS,STAGES")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    results: list[dict] = []
    extra: dict = {}
    device = torch.cuda.get_device_name()
    if args.sweep:
        sweep(results, tuple(args.shapes), tuple(args.configs))
        print_sweep(results)
    else:
        run(results, tuple(args.seq_lens))
        overhead = extra["host_us_per_call"] = host_overhead_us()
        print_table(results)
        print(f"host time of one launcher call (16 rows): {overhead:.1f} us")
    if args.json:
        meta = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                    date=datetime.date.today().isoformat(), command=" ".join(sys.argv))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=results, **extra), f, indent=1)
    bad = [r for r in results if r.get("ok") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
