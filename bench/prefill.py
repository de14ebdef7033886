"""CP prefill throughput: tokens/s at cp=1..N, speedup, all-gather share, per-rank KV bytes.

GPU (one GPU per rank; Llama-3-8B shapes with dummy bf16 weights):
    python bench/prefill.py --llama3-8b --tokens 8192 32768 --cp 1 2 --json out.json
CPU (a tiny model, to check the script):
    python bench/prefill.py --tiny --tokens 256 1024 --cp 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.prefill.cp.launcher import CPPrefillEngine, PrefillInput  # noqa: E402
from lanekv.prefill.engine_config import EngineConfig  # noqa: E402

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
TINY = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def measure(model_dir: str, cp: int, tokens: list[int], args, logits: dict[tuple[int, int], torch.Tensor]) -> list[dict]:
    """Rows of one CP size; ``logits[(cp, tokens)]`` gets each prompt's last-token logits (for the check)."""
    page = args.page_size
    lane_pages = max(tokens) // page // cp + 64
    cfg = EngineConfig(model_dir, cp_size=cp, page_size=page, pages_per_lane=lane_pages,
                       dtype=args.dtype, load_format="dummy", start_timeout_s=900)
    rows = []
    with CPPrefillEngine(cfg) as eng:
        g = torch.Generator().manual_seed(0)
        for n in tokens:
            prompt = torch.randint(10, 500, (n,), generator=g).tolist()
            walls, ranks, gathers = [], [], []
            for i in range(args.warmup + args.repeat):
                t0 = time.perf_counter()
                res = eng.prefill([PrefillInput(prompt)], return_logits=i == 0)[0]
                if i == 0:
                    logits[(cp, n)] = res.logits
                wall = time.perf_counter() - t0
                eng.free(res.new_pages)
                if i >= args.warmup:
                    walls.append(wall)
                    ranks.append(res.timings["compute_s"])
                    gathers.append(res.timings["gather_s"])
            wall, rank_s = statistics.median(walls), statistics.median(ranks)
            shape = eng.info.pool_shape  # [layers, 2, rows, kv_heads, head_dim]
            page_bytes = shape[0] * 2 * page * shape[3] * shape[4] * torch.tensor([], dtype=cfg.torch_dtype).element_size()
            pages_per_rank = [sum(1 for p in res.pages if p.owner == r) for r in range(cp)]
            rows.append(dict(
                cp_size=cp, tokens=n, page_size=page, wall_s=wall, rank_s=rank_s,
                tokens_per_s=n / wall, gather_share=statistics.median(gathers) / rank_s,
                kv_bytes_per_rank=[p * page_bytes for p in pages_per_rank],
                kv_bytes_total=res.num_tokens and sum(pages_per_rank) * page_bytes,
            ))
            print(f"cp={cp} tokens={n}: {n / wall:,.0f} tok/s ({wall * 1e3:.1f} ms)", flush=True)
    return rows


def matmul_ceiling_tflops() -> float | None:
    """bf16 8192^3 matmul rate on GPU 0 (random data), the ceiling beside the prefill."""
    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (start.elapsed_time(end) / 1e3) / 1e12


def prefill_flops(cfg: dict, tokens: int) -> float:
    """Matrix-product FLOPs of the layers plus causal attention (the lm_head runs on one row)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    per_token = 2 * layers * (h * h + 2 * h * kv + h * h + 3 * h * inter)
    attention = 4 * d * cfg["num_attention_heads"] * layers * tokens * (tokens + 1) / 2
    return per_token * tokens + attention


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--llama3-8b or --tiny: the model shape every end-to-end bench runs."""
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--llama3-8b", action="store_true")
    which.add_argument("--tiny", action="store_true")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.llama3_8b else "float32")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(LLAMA3_8B if args.llama3_8b else TINY))
        logits: dict[tuple[int, int], torch.Tensor] = {}  # (cp, tokens) -> last-token logits
        rows = [r for cp in args.cp for r in measure(d, cp, args.tokens, args, logits)]
    base = {r["tokens"]: r["tokens_per_s"] for r in rows if r["cp_size"] == 1}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base[r["tokens"]] if r["tokens"] in base else None
        r["efficiency"] = r["speedup"] / r["cp_size"] if r["speedup"] else None
    model_cfg = LLAMA3_8B if args.llama3_8b else TINY
    ceiling = matmul_ceiling_tflops()
    for r in rows:
        r["tflops"] = prefill_flops(model_cfg, r["tokens"]) / r["wall_s"] / 1e12
        r["matmul_ceiling_tflops"] = ceiling
    for r in rows:  # CP must compute what cp=1 computes (up to bf16 rounding of the sums)
        ref, got = logits.get((1, r["tokens"])), logits[(r["cp_size"], r["tokens"])]
        r["logits_rel_err_vs_cp1"] = None if ref is None else float((got - ref).norm() / ref.norm())
        r["same_first_token_as_cp1"] = None if ref is None else bool(got.argmax() == ref.argmax())
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"\nCP prefill, {'Llama-3-8B shapes' if args.llama3_8b else 'tiny model'}, {args.dtype}, page {args.page_size}, {device}")
    print(f"{'cp':>3} {'tokens':>7} {'tok/s':>10} {'ms':>9} {'speedup':>8} {'eff':>5} {'gather%':>8} {'KV GiB/rank':>12} {'err vs cp1':>10} {'TFLOP/s':>8}")
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] else "-"
        print(f"{r['cp_size']:>3} {r['tokens']:>7} {r['tokens_per_s']:>10,.0f} {r['wall_s'] * 1e3:>9.1f} {sp:>8} {eff:>5} "
              f"{100 * r['gather_share']:>7.1f}% {max(r['kv_bytes_per_rank']) / 2**30:>12.3f} "
              f"{r['logits_rel_err_vs_cp1'] if r['logits_rel_err_vs_cp1'] is not None else float('nan'):>10.2e} "
              f"{r['tflops']:>8.1f}")
    if ceiling:
        print(f"bf16 matmul ceiling on GPU 0 in this run: {ceiling:.0f} TFLOP/s")
    if args.json:
        args.json.write_text(json.dumps(dict(device=device, date=time.strftime("%Y-%m-%d"), rows=rows), indent=2))


if __name__ == "__main__":
    main()
