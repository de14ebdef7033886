"""The split-K GEMV on 16-bit weights (``kernels/fp8/gemm_gemv.py`` with no scales) against
``F.linear`` (cuBLAS), at decode's 1 to 4 rows, on a GPU: which linears it should run.

Shapes: Llama-3-8B's qkv, o, gate/up, down (the SiLU product fused into the down GEMV's
activation load, against ``silu_mul`` then ``F.linear``) and lm_head, DeepSeek-V2-Lite's
fused q/kv_a, o and lm_head, in bf16. Each candidate of ``gemv_candidates`` whose grid
fills the device (programs from the SM count to 64 a SM) is checked against ``F.linear``
on the same bytes (relative error) and timed; so is cuBLAS. Every call cycles through
copies of its weight totalling over twice the L2 cache (a step reads its weights from
memory), replayed from a CUDA graph with PDL on as in a small decode graph
(``LANEKV_PDL=1``), median of the replays. ``floor_us``: the weight's bytes at the device
copy rate measured in the same run (read and write bytes of a 1 GiB copy).

    python bench/dense_gemv.py --rows 1 --json dense_gemv.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from lanekv.kernels.fp8.gemm_configs import gemv_candidates  # noqa: E402
from lanekv.kernels.fp8.gemm_gemv import gemv_linear  # noqa: E402

from bench.deepseek_kernels import copy_gbps  # noqa: E402
from bench.fp8 import _copies, _rotating, _timer  # noqa: E402

SHAPES = [  # (model, linear, N, K, silu)
    ("llama3_8b", "qkv", 6144, 4096, False),
    ("llama3_8b", "o", 4096, 4096, False),
    ("llama3_8b", "gate_up", 28672, 4096, False),
    ("llama3_8b", "down", 4096, 14336, True),
    ("llama3_8b", "lm_head", 128256, 4096, False),
    ("v2_lite", "q_kv_a", 3648, 2048, False),
    ("v2_lite", "o", 2048, 2048, False),
    ("v2_lite", "lm_head", 102400, 2048, False),
]


_graph_ms = _timer("graph", 60)  # the median replay of a CUDA graph of the calls


def _graph_us(fn) -> float:
    return _graph_ms(fn) * 1e3


def candidates(n: int, sms: int) -> list:
    out = []
    for cfg in gemv_candidates(128):
        if cfg.block_k != 128:
            continue
        programs = triton.cdiv(n, cfg.block_n) * cfg.split_k
        if sms <= programs <= 64 * sms:
            out.append(cfg)
    return out


def bench_shape(model: str, name: str, n: int, k: int, silu: bool, rows: int, sms: int,
                copy_rate: float) -> dict:
    device = torch.device("cuda")
    nbytes = n * k * 2
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
               for _ in range(_copies(nbytes))]
    x = torch.randn(rows, 2 * k if silu else k, device=device, dtype=torch.bfloat16)

    def torch_call(w):
        if silu:
            gate, up = x.chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, w)
        return F.linear(x, w)

    ref = torch_call(weights[0]).float()
    row = dict(model=model, linear=name, n=n, k=k, rows=rows, silu=silu, bytes=nbytes,
               floor_us=nbytes / copy_rate * 1e6)
    row["cublas_us"] = _graph_us(_rotating([lambda w=w: torch_call(w) for w in weights]))
    tried = []
    for cfg in candidates(n, sms):
        entry = dict(config=cfg.name())
        try:
            out = gemv_linear(x, weights[0], None, None, None, cfg, silu=silu)
            entry["rel_err"] = float((out.float() - ref).norm() / ref.norm())
            if entry["rel_err"] > 2e-2:
                entry["error"] = "wrong result"
            else:
                entry["us"] = _graph_us(_rotating([
                    lambda w=w, c=cfg: gemv_linear(x, w, None, None, None, c, silu=silu)
                    for w in weights]))
        except Exception as exc:  # noqa: BLE001  (recorded, the sweep goes on)
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        tried.append(entry)
    timed = [e for e in tried if "us" in e]
    best = min(timed, key=lambda e: e["us"]) if timed else None
    row.update(candidates=tried, best=best)
    del weights
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--only", nargs="+", default=None, help="linears by name (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/dense_gemv.py needs a CUDA device")
    os.environ.setdefault("LANEKV_PDL", "1")
    torch.manual_seed(0)
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    copy_rate = copy_gbps() * 1e9
    result = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, triton=triton.__version__,
                  pdl=os.environ["LANEKV_PDL"], copy_gbps=copy_rate / 1e9, shapes=[])
    t0 = time.perf_counter()
    for rows in args.rows:
        for model, name, n, k, silu in SHAPES:
            if args.only and name not in args.only:
                continue
            result["shapes"].append(bench_shape(model, name, n, k, silu, rows, sms, copy_rate))
            r = result["shapes"][-1]
            best = r["best"] or {}
            print(f"[{time.perf_counter() - t0:5.0f} s] {model} {name} rows={rows}: cuBLAS "
                  f"{r['cublas_us']:.1f} us, gemv {best.get('us', float('nan')):.1f} us "
                  f"({best.get('config')})", flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
    print(f"\ncopy rate {copy_rate / 1e9:.0f} GB/s; us a call (graph, PDL {result['pdl']})")
    print(f"{'model':>9} {'linear':>8} {'rows':>4} {'floor':>7} {'cuBLAS':>7} {'gemv':>7} "
          f"{'gemv/cuBLAS':>11}  config")
    for r in result["shapes"]:
        best = r["best"] or {}
        us = best.get("us", float("nan"))
        print(f"{r['model']:>9} {r['linear']:>8} {r['rows']:>4} {r['floor_us']:7.1f} "
              f"{r['cublas_us']:7.1f} {us:7.1f} {us / r['cublas_us']:11.2f}  {best.get('config')}")


if __name__ == "__main__":
    main()
