"""The block-FP8 GEMV's split-K reduction finished by the last split
(``kernels/arrivals.py``) against the separate reduce launch, kernel by kernel, on a GPU.

Llama-3-8B's four decode linears at one row, each with the tuned table's config, timed
as microseconds per call, replayed from a CUDA graph of 20 calls with PDL on (as the
batch-1 step runs them, ``graph_us``). Variants: ``apart`` (the reduce launch), ``last``
(the last split adds, registers capped where ``LAST_REDUCE_REGISTERS`` says),
``last_uncapped``.

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
from lanekv.kernels.fp8 import gemm_gemv  # noqa: E402
from lanekv.kernels.fp8.gemm_configs import select_config  # noqa: E402
from lanekv.kernels.fp8.weights import quantize_weight_blocks  # noqa: E402

from bench.deepseek_kernels import graph_us  # noqa: E402

LLAMA = [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 28672, 4096, False),
         ("down", 4096, 14336, True)]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/split_reductions.py needs a CUDA device")
    os.environ.setdefault("LANEKV_PDL", "1")
    device = torch.device("cuda")
    torch.manual_seed(0)
    result = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__,
                  pdl=os.environ["LANEKV_PDL"], gemv=gemv_rows(device))
    print("GEMV, 1 row, us a call (graph of 20, PDL on):")
    print(f"{'linear':>8} {'config':>24} {'apart':>7} {'last':>7} {'uncapped':>9}  equal")
    for r in result["gemv"]:
        print(f"{r['linear']:>8} {r['config']:>24} {r['apart']['us']:7.2f} {r['last']['us']:7.2f} "
              f"{r['last_uncapped']['us']:9.2f}  {r['last']['equal'] and r['last_uncapped']['equal']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
