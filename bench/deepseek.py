"""DeepSeek-V2-Lite shapes (MLA, MoE) with dummy weights: prefill, attention, KV bytes, decode, transfer.

``--v32``: DeepSeek-V3.2 shapes (DSA: MLA 128 heads over 512 + 64 latent rows, the
indexer's 64 heads x 128 with fp8 index-K rows, top 2048; MoE 256 experts, top 8
plus 1 shared) with 4 layers, the first dense, so it fits one GPU: the decode
step only, at 32k context by default, captured as the decode daemon captures
it (the graph's page table as wide as the model's 163840 positions allow).

One process, one GPU; the model is built once (dummy bf16 weights, seed 0) and serves:
  1. prefill tok/s at cp=1 (rank threads' engine, the same rank code as the daemon);
  2. attention TFLOP/s of the MLA prefill path (decompressed q/k 192, v 128) against
     torch SDPA on the same tensors, causal, in the same run;
  3. KV bytes per token (the latent row) against Llama-3-8B's K/V;
  4. decode step time at each batch against the weight-read floor (the bytes of the
     parameters one step reads: every non-expert weight, the shared experts and the
     routed experts the step's tokens pick, expected under uniform routing; divided
     by the measured device copy rate); on CUDA the step is a captured CUDA graph
     of that batch size, as the decode daemon runs it (``--eager`` times it eager);
  5. transfer GB/s of latent pages: gather into the wire order on the device, the copy
     to pinned host memory (FetchKV's read side), and a pool-to-pool copy (fast path).

GPU:  python bench/deepseek.py --v2-lite --tokens 8192 32768 --batches 1 16 64 --json out.json
      python bench/deepseek.py --v32 --batches 1 16 64 --context 32768 --json out.json
CPU:  python bench/deepseek.py --tiny --tokens 64 256 --batches 1 4   (checks the script)
      python bench/deepseek.py --tiny-v32 --context 40 --batches 1 4
``--parts decode`` (any of prefill, attention, decode, transfer) runs only those;
``--pdl both`` times each decode batch with the kernels' programmatic dependent launch
off, then on (``kernels.pdl``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.decode.engine import DecodeEngine  # noqa: E402
from lanekv.decode.pool import PagePool, PageTable  # noqa: E402
from lanekv.kernels.dsa.index_cache import store_index_k  # noqa: E402
from lanekv.kernels.page_copy import gather_pages  # noqa: E402
from lanekv.kernels.prefill.reference import AttnSegments  # noqa: E402
from lanekv.model.attention import DSARows, pool_rows  # noqa: E402
from lanekv.model.attention.mla import mla_prefill_attention  # noqa: E402
from lanekv.model.checkpoint import load_dummy_model  # noqa: E402
from lanekv.model.sampling import SamplingParams  # noqa: E402
from lanekv.prefill.cp.launcher import PrefillInput  # noqa: E402
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine  # noqa: E402
from lanekv.prefill.engine_config import EngineConfig  # noqa: E402
from lanekv.transfer.fastpath.poolcopy import copy_pages  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench.pdl_flag import add_pdl_flag, pdl_env, pdl_label, pdl_modes  # noqa: E402
from bench.stats import step_weight_bytes as shared_step_weight_bytes  # noqa: E402
from bench.stats import time_steps  # noqa: E402

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
    "first_k_dense_replace": 1, "topk_method": "greedy", "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 100000,
    "eos_token_id": 100001,
}
TINY = {**V2_LITE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 1}
V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 128,
    "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "head_dim": 64,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "n_group": 8, "topk_group": 4, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40,
        "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
}
TINY_V32 = {**V32, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48,
            "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "head_dim": 16,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "index_topk": 16, "index_head_dim": 32, "index_n_heads": 4,
            "max_position_embeddings": 1024}
CONFIGS = {"v2_lite": V2_LITE, "tiny": TINY, "v32": V32, "tiny_v32": TINY_V32}
LLAMA3_8B_KV_BYTES = 32 * 2 * 8 * 128 * 2  # per token: layers x (K, V) x heads x dim x bf16
PARTS = ("prefill", "attention", "decode", "transfer")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bench_prefill(model_dir: str, loaded, tokens: list[int], args) -> list[dict]:
    rows = []
    for n in tokens:
        cfg = EngineConfig(model_dir, cp_size=1, page_size=args.page_size,
                           pages_per_lane=n // args.page_size + 8, dtype=args.dtype,
                           load_format="dummy")
        engine = ThreadedPrefillEngine(cfg, loaded)
        ids = torch.randint(3, loaded.config.vocab_size, (n,),
                            generator=torch.Generator().manual_seed(n)).tolist()

        def run(engine=engine, ids=ids) -> None:
            engine.free(engine.prefill([PrefillInput(ids)])[0].new_pages)

        seconds = timed(run, args.device, args.repeat)
        rows.append({"tokens": n, "cp": 1, "seconds": seconds, "tokens_per_s": n / seconds})
        del engine
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_attention(config, tokens: list[int], args) -> list[dict]:
    rows = [attention_row(config, n, args) for n in tokens]
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def attention_row(config, n: int, args) -> dict:
    """The MLA prefill attention of one ``n``-token sequence, and SDPA on the same tensors."""
    mla, heads, scale = config.mla, config.num_heads, config.softmax_scale
    gen = torch.Generator(device=args.device).manual_seed(1)
    q, k, v = (torch.randn(n, heads, d, generator=gen, device=args.device, dtype=args.torch_dtype)
               for d in (mla.qk_head_dim, mla.qk_head_dim, mla.v_head_dim))
    i32 = {"dtype": torch.int32, "device": args.device}
    seg = AttnSegments(*(torch.tensor([x], **i32) for x in (0, n, 0, 0)))
    flops = 2 * heads * (mla.qk_head_dim + mla.v_head_dim) * n * (n + 1) / 2
    ours = timed(lambda: mla_prefill_attention(q, k, v, seg, scale), args.device, args.repeat)
    # SDPA's fused kernels want one head dim for q, k and v: v is padded with zeros to the
    # qk dim and the output cut back (otherwise the math path materialises n x n scores).
    v_padded = torch.nn.functional.pad(v, (0, mla.qk_head_dim - mla.v_head_dim))
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v_padded))  # [1, H, n, D]
    fused = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

    def sdpa_call() -> torch.Tensor:
        with sdpa_kernel(fused if qh.is_cuda else [SDPBackend.MATH]):
            out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                                   scale=scale)
        return out[0, :, :, :mla.v_head_dim].transpose(0, 1)

    sdpa = timed(sdpa_call, args.device, args.repeat)
    ref = sdpa_call().float()
    err = ((mla_prefill_attention(q, k, v, seg, scale).float() - ref).norm() / ref.norm()).item()
    return {"tokens": n, "ms": ours * 1e3, "tflops": flops / ours / 1e12, "sdpa_ms": sdpa * 1e3,
            "sdpa_tflops": flops / sdpa / 1e12, "vs_sdpa": sdpa / ours, "rel_err_vs_sdpa": err}


def copy_rate(device: torch.device) -> float:
    """Bytes/s of one large device copy (read + write counted once each: the read rate)."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, 5)
    return 2 * n / seconds


def step_weight_bytes(model, batch: int) -> float:
    """Parameter bytes one decode step reads (``bench.stats.step_weight_bytes``: the
    embedding rows it looks up), with the experts ``batch`` tokens pick (expected
    distinct ones under uniform routing)."""
    read = shared_step_weight_bytes(model, batch)
    moe = model.config.moe
    hit = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** batch)
    return read.dense + read.experts * hit / moe.num_experts


def step_kv_bytes(pool: PagePool, batch: int, context: int, topk: int) -> int:
    """Pool bytes one decode step reads at ``context`` tokens per request: every
    latent row (MLA), or every index-K row and the ``topk`` selected latent rows (DSA)."""
    layers, item = pool.spec.num_layers, pool.spec.dtype.itemsize
    if not isinstance(pool.rows, DSARows):
        return batch * layers * context * pool.spec.head_dim * item
    latent = pool.rows.index_offset  # the latent's bytes, to the index row's boundary
    return batch * layers * (context * pool.rows.index.row_bytes + min(topk, context) * latent)


def fill_pool(pool: PagePool) -> None:
    """Random latent rows; a DSA pool's index rows hold random keys stored as the
    decode step stores them (fp8 bytes with valid scales, not random bits)."""
    pool.tensor.normal_()
    if not isinstance(pool.rows, DSARows):
        return
    rows = pool.tensor.shape[2]
    gen = torch.Generator(device=pool.device).manual_seed(2)
    for layer in range(pool.spec.num_layers):
        for start in range(0, rows, 1 << 20):
            locs = torch.arange(start, min(rows, start + (1 << 20)), device=pool.device)
            keys = torch.randn(locs.shape[0], pool.rows.index.head_dim, device=pool.device,
                               generator=gen).to(pool.spec.dtype)
            store_index_k(keys, pool.index_cache(layer), locs, pool.rows.index)


def bench_decode(loaded, batches: list[int], args) -> list[dict]:
    config, ps = loaded.config, args.page_size
    per_req = -(-(args.context + args.steps * (args.runs + 1) + 8) // ps)
    pool = PagePool.for_model(config, max(batches) * per_req + 8, ps, args.torch_dtype, args.device)
    fill_pool(pool)
    topk = config.dsa.index_topk if config.dsa is not None else 0
    rate = copy_rate(args.device)
    rows = []
    for batch, pdl in ((b, p) for b in batches for p in pdl_modes(args.pdl)):
        with pdl_env(pdl):  # the engine built, captured and timed in this setting
            engine = DecodeEngine(loaded.model, pool, max_batch_size=batch, eos_token_ids=(),
                                  graph_sizes=() if args.eager else (batch,))
            t0 = time.perf_counter()
            graphs = engine.capture_graphs()  # None on the CPU (or eager): eager steps
            capture_s = time.perf_counter() - t0
            for i in range(batch):
                engine.add(f"r{i}", PageTable.allocate(pool, args.context), 11 + i,
                           SamplingParams(), args.steps * (args.runs + 1) + 4)
            engine.step()  # admit
            timing = time_steps(engine.step, args.steps, args.runs, args.device)
            while engine.has_work:
                engine.step()
        step = timing.ms / 1e3
        weights = step_weight_bytes(loaded.model, batch)
        kv = step_kv_bytes(pool, batch, args.context, topk)
        floor, read_floor = weights / rate, (weights + kv) / rate
        rows.append({"batch": batch, "context": args.context, "step_ms": step * 1e3,
                     "tokens_per_s": batch / step, "weight_bytes": weights, "kv_read_bytes": kv,
                     "weight_floor_ms": floor * 1e3, "read_floor_ms": read_floor * 1e3,
                     "of_floor": floor / step, "of_read_floor": read_floor / step,
                     "step_ms_runs": timing.runs_ms, "timing": f"median of {args.runs} runs of "
                     f"{args.steps} back-to-back steps, {timing.clock}",
                     "graph_page_table_width": graphs.max_pages if graphs is not None else 0,
                     "cuda_graph": graphs is not None,
                     "capture_s": capture_s if graphs is not None else 0.0,
                     "pdl": pdl, "pdl_status": pdl_label(args.device, pdl, batch)})
    return rows


def bench_transfer(config, tokens: int, args) -> dict:
    ps = args.page_size
    pages = tokens // ps
    spec_pool = PagePool.for_model(config, pages + 8, ps, args.torch_dtype, args.device)
    src = spec_pool.tensor
    src.normal_()
    other = "cuda:1" if args.device.type == "cuda" and torch.cuda.device_count() > 1 else args.device
    dst = torch.empty_like(src, device=other)
    index = torch.randperm(pages + 8)[:pages].to(args.device)
    layers = config.num_layers
    nbytes = pages * spec_pool.spec.page_bytes
    buf = gather_pages(src, index, ps, 0, layers)
    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=args.device.type == "cuda")
    gather = timed(lambda: gather_pages(src, index, ps, 0, layers, out=buf), args.device, args.repeat)
    to_host = timed(lambda: host.copy_(buf, non_blocking=True), args.device, args.repeat)
    src_pages, dst_pages = list(range(pages)), list(range(8, pages + 8))
    pool_copy = timed(lambda: copy_pages(src, src_pages, dst, dst_pages, ps, 0, layers),
                      args.device, args.repeat)
    return {"tokens": tokens, "bytes": nbytes, "gather_gbps": nbytes / gather / 1e9,
            "device_to_host_gbps": nbytes / to_host / 1e9, "pool_copy_gbps": nbytes / pool_copy / 1e9,
            "pool_copy_to": str(other)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--v2-lite", action="store_true")
    which.add_argument("--tiny", action="store_true")
    which.add_argument("--v32", action="store_true", help="DeepSeek-V3.2 shapes, 4 layers")
    which.add_argument("--tiny-v32", action="store_true")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=None,
                    help="tokens per request in decode (default 1024; 32768 with --v32)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=5, help="timed runs of --steps steps; the median is reported")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=None,
                    help="default: all, or decode only for the V3.2 shapes")
    ap.add_argument("--eager", action="store_true", help="decode steps without CUDA graphs")
    add_pdl_flag(ap)
    args = ap.parse_args()
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = next(n for n in CONFIGS if getattr(args, n))
    dsa = name in ("v32", "tiny_v32")
    if args.context is None:
        args.context = 32768 if args.v32 else 1024
    if args.parts is None:
        args.parts = ["decode"] if dsa else list(PARTS)
    args.dtype = "bfloat16" if name in ("v2_lite", "v32") else "float32"
    args.torch_dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(CONFIGS[name]))
        loaded = load_dummy_model(model_dir, dtype=args.torch_dtype, device=args.device)
        config = loaded.config
        row = pool_rows(config, args.torch_dtype).head_dim  # a DSA row: latent, then index key
        kv_bytes = config.num_layers * row * args.torch_dtype.itemsize
        result = {
            "device": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "model": name, "layers": config.num_layers,
            "dtype": args.dtype, "page_size": args.page_size,
            "kv_bytes_per_token": kv_bytes, "llama3_8b_kv_bytes_per_token": LLAMA3_8B_KV_BYTES,
            "parameters": sum(p.numel() for p in loaded.model.parameters()),
        }
        runs = {"prefill": lambda: bench_prefill(model_dir, loaded, args.tokens, args),
                "attention": lambda: bench_attention(config, args.tokens, args),
                "decode": lambda: bench_decode(loaded, args.batches, args),
                "transfer": lambda: bench_transfer(config, max(args.tokens), args)}
        for part in PARTS:
            if part in args.parts:
                result[part] = runs[part]()
    print(f"parameters {result['parameters'] / 1e9:.2f} B; KV bytes per token {kv_bytes} "
          f"({config.num_layers} x {row} x {args.torch_dtype.itemsize}) against "
          f"Llama-3-8B's {LLAMA3_8B_KV_BYTES} ({LLAMA3_8B_KV_BYTES / kv_bytes:.1f}x)")
    for p in result.get("prefill", []):
        print(f"prefill {p['tokens']} tokens (cp=1): {p['tokens_per_s']:.0f} tok/s")
    if "attention" in result:
        print("| tokens | attn ms | attn TFLOP/s | SDPA TFLOP/s | x SDPA | rel err |")
        print("|---:|---:|---:|---:|---:|---:|")
        for a in result["attention"]:
            print(f"| {a['tokens']} | {a['ms']:.2f} | {a['tflops']:.1f} | "
                  f"{a['sdpa_tflops']:.1f} | {a['vs_sdpa']:.2f} | {a['rel_err_vs_sdpa']:.1e} |")
    if "decode" in result:
        print(f"decode at {args.context} tokens per request ({config.num_layers} layers)")
        print("| batch | step ms | tok/s | weight GB | KV read GB | weight-read floor ms | "
              "+ KV floor ms | floor / step | graph | pdl |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
        for d in result["decode"]:
            print(f"| {d['batch']} | {d['step_ms']:.2f} | {d['tokens_per_s']:.0f} | "
                  f"{d['weight_bytes'] / 1e9:.2f} | {d['kv_read_bytes'] / 1e9:.3f} | "
                  f"{d['weight_floor_ms']:.2f} | {d['read_floor_ms']:.2f} | "
                  f"{d['of_read_floor']:.2f} | {d['cuda_graph']} | {d['pdl']} |")
        for status in dict.fromkeys(d["pdl_status"] for d in result["decode"]):
            print(f"PDL {status}")
        if result["decode"]:
            print(f"step ms: {result['decode'][0]['timing']}; weight bytes count the embedding rows "
                  "a step looks up, not the table")
    if "transfer" in result:
        t = result["transfer"]
        print(f"latent pages of {t['tokens']} tokens ({t['bytes'] / 1e6:.1f} MB): gather "
              f"{t['gather_gbps']:.1f} GB/s, device->host {t['device_to_host_gbps']:.1f} GB/s, "
              f"pool copy to {t['pool_copy_to']} {t['pool_copy_gbps']:.1f} GB/s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if "attention" in result:
        assert math.isfinite(result["attention"][0]["rel_err_vs_sdpa"])


if __name__ == "__main__":
    main()
