"""Split reductions finished by their last split (``kernels/arrivals.py``) against the
separate launch, kernel by kernel, on a GPU.

Two kernels a batch-1 decode step splits and then reduces: the block-FP8 GEMV (split-K;
Llama-3-8B's four decode linears at one row, each with the tuned table's config) and the
GQA paged decode attention (split-KV; 32 query and 8 KV heads of 128, page 64, a captured
step's table of 128 pages). Each variant is timed as microseconds per call, replayed from
a CUDA graph of 20 calls with PDL on (as the batch-1 step runs them, ``graph_us``).

GEMV variants: ``apart`` (the reduce launch), ``last`` (the last split adds, registers
capped where ``LAST_REDUCE_REGISTERS`` says), ``last_uncapped``. Attention variants (the
merge is a launch of its own): ``keys_256`` (256 keys a busy split at every batch),
``busy`` (the default: one 64-key block a busy split at small batches), ``busy_m<N>``
(the merge loading at most N float32 values at once).

Kernel by kernel these do not add up to a step: in the batch-1 Llama-3-8B step the
last-split GEMVs were faster than GEMV plus reduce for all four linears (the step's
profile, ``bench/deepseek_profile.py``), while here, 20 launches of one GEMV back to
back, two of them were slower. The step (``bench/fp8.py --only decode``) decides.

    python bench/split_reductions.py --json split_reductions.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.kernels.decode_attention import DecodeConfig, paged_decode_attention_triton  # noqa: E402
from lanekv.kernels.fp8 import gemm_gemv  # noqa: E402
from lanekv.kernels.fp8.gemm_configs import select_config  # noqa: E402
from lanekv.kernels.fp8.weights import quantize_weight_blocks  # noqa: E402

from bench.deepseek_kernels import graph_us  # noqa: E402

LLAMA = [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 28672, 4096, False),
         ("down", 4096, 14336, True)]


ATTENTION_VARIANTS = {
    "keys_256": DecodeConfig(few_programs_split_keys=0),
    "busy": DecodeConfig(),
    "busy_m2048": DecodeConfig(merge_values=2048),
    "busy_m512": DecodeConfig(merge_values=512),
}


def gemv_rows(device: torch.device) -> list[dict]:
    rows = []
    block = (128, 128)
    for name, n, k, silu in LLAMA:
        w, w_scale = quantize_weight_blocks(torch.randn(n, k, device=device) * k ** -0.5, block)
        x = torch.randn(1, 2 * k if silu else k, device=device, dtype=torch.bfloat16)
        cfg = select_config(1, n, k, block, device)
        if not cfg.gemv:
            continue
        ref = gemm_gemv.gemv_linear(x, w, w_scale, block, None, cfg, silu=silu,
                                    last_reduces=False)
        row = dict(linear=name, n=n, k=k, config=cfg.name(), bytes=n * k)
        caps = dict(gemm_gemv.LAST_REDUCE_REGISTERS)
        for variant, last, cap in (("apart", False, caps), ("last", True, caps),
                                   ("last_uncapped", True, {})):
            gemm_gemv.LAST_REDUCE_REGISTERS = cap
            try:
                call = functools.partial(gemm_gemv.gemv_linear, x, w, w_scale, block, None, cfg,
                                         silu=silu, last_reduces=last)
                same = torch.equal(call(), ref)
                row[variant] = dict(us=graph_us(call), equal=same)
            finally:
                gemm_gemv.LAST_REDUCE_REGISTERS = caps
        rows.append(row)
    return rows


def attention_rows(device: torch.device, batches: list[int], contexts: list[int]) -> list[dict]:
    rows = []
    page, width, heads, kv_heads, dim = 64, 128, 32, 8, 128
    for batch in batches:
        for context in contexts:
            pages = batch * width
            k = torch.randn(pages * page, kv_heads, dim, device=device, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            table = torch.randperm(pages, device=device).to(torch.int32).view(batch, width)
            lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            q = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)
            ref = paged_decode_attention_triton(q, k, v, table, lens, page, 0.088)
            row = dict(batch=batch, context=context, kv_bytes=2 * batch * context * kv_heads * dim * 2)
            for variant, cfg in ATTENTION_VARIANTS.items():
                call = functools.partial(paged_decode_attention_triton, q, k, v, table, lens,
                                         page, 0.088, config=cfg)
                got = call()
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                row[variant] = dict(us=graph_us(call), rel_err=err)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/split_reductions.py needs a CUDA device")
    os.environ.setdefault("LANEKV_PDL", "1")
    device = torch.device("cuda")
    torch.manual_seed(0)
    result = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__,
                  pdl=os.environ["LANEKV_PDL"], gemv=gemv_rows(device),
                  attention=attention_rows(device, args.batches, args.contexts))
    print("GEMV, 1 row, us a call (graph of 20, PDL on):")
    print(f"{'linear':>8} {'config':>24} {'apart':>7} {'last':>7} {'uncapped':>9}  equal")
    for r in result["gemv"]:
        print(f"{r['linear']:>8} {r['config']:>24} {r['apart']['us']:7.2f} {r['last']['us']:7.2f} "
              f"{r['last_uncapped']['us']:9.2f}  {r['last']['equal'] and r['last_uncapped']['equal']}")
    names = list(ATTENTION_VARIANTS)
    print("GQA paged decode attention, us a call (table of 128 pages, PDL on):")
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{n:>10}" for n in names) + "  max rel err")
    for r in result["attention"]:
        err = max(r[n]["rel_err"] for n in names)
        print(f"{r['batch']:>5} {r['context']:>7} " + " ".join(f"{r[n]['us']:10.2f}" for n in names)
              + f"  {err:.1e}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
