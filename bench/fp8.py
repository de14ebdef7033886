"""Block-FP8 weights on one GPU: the GEMMs and the decode step against their peers and floors.

- ``gemm``: on Llama-3-8B's and DeepSeek-V2-Lite's linear shapes, at decode and
  prefill row counts: our block-FP8 GEMM (``gemm_ms``: the w8a8 kernel alone;
  ``linear_ms``: with the activations' per-token-group quantization), against
  ``torch._scaled_mm`` with row-wise scales (the best torch FP8 GEMM on this
  device's torch; ``scaled_mm_ms``, ``None`` with the reason when it cannot run)
  and the bf16 GEMM (``bf16_ms``).
- ``decode``: the decode engine's captured step at batch 1/16/64 with a
  ``--context`` token context, the model's dummy weights bf16 and then quantized
  blockwise (``quantization_config``), against the FP8 weight-read floor: the
  bytes one step reads (every decoder weight once, scales included; for MoE the
  experts a step's tokens touch in expectation under uniform routing; the
  lm_head; the embedding rows of the batch, not the table) at the device's
  copy rate.

    python bench/fp8.py --json bench/results/fp8/h200_run1.json
    python bench/fp8.py --only gemm --rows 1 16 --json /tmp/gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import lanekv  # noqa: E402,F401  (the package first: the repository's lanekv/ folder alone is not it)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.decode.engine import DecodeEngine  # noqa: E402
from lanekv.decode.pool import PagePool, PageTable  # noqa: E402
from lanekv.kernels.fp8.gemm import block_fp8_matmul_triton, fp8_linear_triton  # noqa: E402
from lanekv.kernels.fp8.quant import per_token_group_quant_fp8_triton  # noqa: E402
from lanekv.kernels.fp8.weights import quantize_weight_blocks  # noqa: E402
from lanekv.model.checkpoint import load_dummy_model  # noqa: E402
from lanekv.model.sampling import SamplingParams  # noqa: E402

from bench.deepseek import V2_LITE  # noqa: E402
from bench.prefill import LLAMA3_8B  # noqa: E402

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}
# (name, N, K) of each model's linears (q/k/v and gate/up fused)
SHAPES = {
    "llama3_8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                  ("down", 4096, 14336)],
    "v2_lite": [("q", 3072, 2048), ("kv_a", 576, 2048), ("kv_b", 4096, 512), ("o", 2048, 2048),
                ("dense_gate_up", 21888, 2048), ("dense_down", 2048, 10944),
                ("shared_gate_up", 5632, 2048), ("shared_down", 2048, 2816)],
}
MODELS = {"llama3_8b": LLAMA3_8B, "v2_lite": V2_LITE}


def _ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40)


def bench_gemm(rows_list: list[int], device: torch.device) -> list[dict]:
    out = []
    for model, shapes in SHAPES.items():
        for name, n, k in shapes:
            w_bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
            w, w_scale = quantize_weight_blocks(w_bf16, (128, 128))
            w_t = w.t()  # column-major, as _scaled_mm takes its second operand
            w_row_scale = w_bf16.float().abs().amax(1, keepdim=True).t().clamp(min=1e-10) / 448
            for rows in rows_list:
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                a, a_scale = per_token_group_quant_fp8_triton(x, 128)
                row = dict(model=model, linear=name, n=n, k=k, rows=rows)
                row["gemm_ms"] = _ms(partial(block_fp8_matmul_triton, a, a_scale, w, w_scale,
                                             (128, 128), torch.bfloat16))
                row["linear_ms"] = _ms(partial(fp8_linear_triton, x, w, w_scale, (128, 128)))
                row["bf16_ms"] = _ms(partial(torch.matmul, x, w_bf16.t()))
                a_row = (x.float().abs().amax(1, keepdim=True).clamp(min=1e-10) / 448)
                a8 = (x.float() / a_row).to(torch.float8_e4m3fn)
                try:
                    row["scaled_mm_ms"] = _ms(partial(
                        torch._scaled_mm, a8, w_t, scale_a=a_row, scale_b=w_row_scale,
                        out_dtype=torch.bfloat16))
                except (RuntimeError, TypeError) as err:
                    row["scaled_mm_ms"], row["scaled_mm_skipped"] = None, str(err)[:160]
                row["tflops"] = 2 * rows * n * k / row["gemm_ms"] / 1e9
                row["vs_scaled_mm"] = (row["scaled_mm_ms"] / row["gemm_ms"]
                                       if row["scaled_mm_ms"] else None)
                out.append(row)
                print(f"{model:>9} {name:>14} {rows:>6} gemm {row['gemm_ms']:.4f} linear "
                      f"{row['linear_ms']:.4f} scaled_mm {row['scaled_mm_ms'] or float('nan'):.4f} "
                      f"bf16 {row['bf16_ms']:.4f} ms  {row['tflops']:.0f} TFLOP/s", flush=True)
    return out


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


def bench_decode(models: list[str], batches: list[int], context: int, steps: int,
                 device: torch.device) -> list[dict]:
    rate = _copy_rate(device)
    out = []
    for name in models:
        for quant in ("bf16", "fp8"):
            cfg = dict(MODELS[name])
            if quant == "fp8":
                cfg["quantization_config"] = FP8_CONFIG
            with tempfile.TemporaryDirectory() as d:
                (Path(d) / "config.json").write_text(json.dumps(cfg))
                loaded = load_dummy_model(d, dtype=torch.bfloat16, device=device)
            page_size = 64
            per_req = -(-(context + steps + 8) // page_size)
            pool = PagePool.for_model(loaded.config, max(batches) * per_req + 8, page_size,
                                      torch.bfloat16, device)
            pool.tensor.normal_()
            for batch in batches:
                engine = DecodeEngine(loaded.model, pool, max_batch_size=batch, eos_token_ids=(),
                                      graph_sizes=(batch,))
                engine.capture_graphs()
                for i in range(batch):
                    engine.add(f"r{i}", PageTable.allocate(pool, context), 11 + i,
                               SamplingParams(), steps + 4)
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
                floor_ms = step_bytes(loaded.model, batch) / rate * 1e3
                row = dict(model=name, weights=quant, batch=batch, context=context,
                           step_ms=step_ms, weight_read_floor_ms=floor_ms,
                           vs_floor=step_ms / floor_ms)
                out.append(row)
                print(f"{name:>9} {quant:>4} batch {batch:>3}: step {step_ms:.3f} ms, floor "
                      f"{floor_ms:.3f} ms ({step_ms / floor_ms:.2f}x)", flush=True)
                del engine
            del pool, loaded
            torch.cuda.empty_cache()
    for row in out:
        if row["weights"] == "fp8":
            bf16 = next(r for r in out if r["model"] == row["model"] and r["weights"] == "bf16"
                        and r["batch"] == row["batch"])
            row["vs_bf16_step"] = row["step_ms"] / bf16["step_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("gemm", "decode"), default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 2048, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/fp8.py needs a CUDA GPU (the FP8 kernels and _scaled_mm)")
    device = torch.device("cuda")
    result = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__)
    if args.only in (None, "gemm"):
        result["gemm"] = bench_gemm(args.rows, device)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    if args.only in (None, "decode"):
        result["decode"] = bench_decode(args.models, args.batches, args.context, args.steps,
                                        device)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
