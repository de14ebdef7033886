"""DeepSeek decode kernels one by one on one GPU, each against what it replaces and its floor.

Parts (``--parts``, default all):

- ``moe``: the routed + shared experts of a decode batch, DeepSeek-V2-Lite (64 experts,
  top 6, hidden 2048, width 1408, 2 shared) and V3 (256, top 8, 7168, 2048, 1 shared)
  shapes, at each ``--tokens``: the sort-free decode kernels (``moe_experts_decode``,
  shared fused in) against the grouped GEMMs (``moe_experts``) plus the shared SwiGLU
  as the model ran it before; the floor is the bytes of the experts the batch touches
  plus the shared expert's at ``--bandwidth`` (or the measured copy rate).
  ``--sweep-moe`` also times each ``DecodeTiles`` of a grid.
- ``route``: ``moe_route`` (one launch) against the torch router ops, V2 and V3 routing.
- ``proj``: the absorbed form's projections (``mla_absorb_query``, ``mla_expand_output``)
  against the einsums, 16 heads (V2-Lite) and 128 (V3).
- ``dsa``: the sparse MLA decode (top 2048, 128 heads, 512 + 64 latent) at each split
  count of ``--splits`` (0 = the launcher's choice) and head block, batch 1 and 16,
  against the dense paged MLA decode at 8k, 32k and 128k tokens.
- ``prefill``: MLA prefill attention (qk 192 / v 128, 128 heads) at ``--prefill-tokens``
  for each tile config of ``--prefill-configs`` (block_m,block_n,warps,stages), and
  SDPA (v padded to 192) on the same tensors; a padded-to-256 run of our kernel too.

Small kernels are timed as CUDA graphs of 20 calls (the decode step replays them so),
the median of ``triton.testing.do_bench`` over the replays, divided by 20. Every kernel's
output is checked against what it replaces before it is timed.

    python bench/deepseek_kernels.py --json bench/results/deepseek_kernels_h200.json
    python bench/deepseek_kernels.py --parts moe --sweep-moe --json moe_sweep.json
    python bench/deepseek_kernels.py --parts prefill --prefill-configs 64,64,4,2 128,64,8,3 \
        128,128,8,3 64,128,4,3 128,32,4,2 --json prefill_sweep.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lanekv.kernels.dsa.sparse_mla import SparseDecodeConfig, sparse_mla_decode_triton  # noqa: E402
from lanekv.kernels.mla.absorb import (  # noqa: E402
    mla_absorb_query_ref,
    mla_absorb_query_triton,
    mla_expand_output_ref,
    mla_expand_output_triton,
)
from lanekv.kernels.mla.paged_decode import paged_mla_decode_attention  # noqa: E402
from lanekv.kernels.moe.decode import DecodeTiles, moe_experts_decode_triton  # noqa: E402
from lanekv.kernels.moe.experts import moe_experts_triton  # noqa: E402
from lanekv.kernels.moe.route import moe_route_ref, moe_route_triton  # noqa: E402
from lanekv.kernels.prefill.attention import launch_cp_prefill_attention  # noqa: E402
from lanekv.kernels.prefill.config import AttnLaunchConfig, default_config  # noqa: E402
from lanekv.kernels.prefill.reference import AttnSegments  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench.mla_prefill_sweep import parse_config  # noqa: E402

PARTS = ("moe", "route", "proj", "dsa", "prefill")
MOE_SHAPES = {  # experts, top_k, hidden, width, shared slices
    "v2_lite": (64, 6, 2048, 1408, 2),
    "v3": (256, 8, 7168, 2048, 1),
}
ROUTES = {  # experts, top_k, n_group, topk_group, scoring, norm, scaling
    "v2_lite": (64, 6, 1, 1, "softmax", False, 1.0),
    "v3": (256, 8, 8, 4, "sigmoid", True, 2.5),
}
GRAPH_CALLS = 20


def graph_us(fn) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of GRAPH_CALLS calls."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3 / GRAPH_CALLS


def eager_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=50, return_mode="median") * 1e3


def copy_gbps() -> float:
    """Device copy rate (read + write bytes) of a 1 GiB buffer: the floors' bandwidth."""
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    us = eager_us(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / us / 1e3


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def _moe_inputs(name: str, tokens: int, gen: torch.Generator):
    experts, top_k, hidden, width, shared = MOE_SHAPES[name]
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    w13 = torch.randn(experts, 2 * width, hidden, generator=gen, device="cuda").to(**bf) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, width, generator=gen, device="cuda").to(**bf) * width ** -0.5
    s13 = torch.randn(2 * shared * width, hidden, generator=gen, device="cuda").to(**bf) * hidden ** -0.5
    s2 = torch.randn(hidden, shared * width, generator=gen, device="cuda").to(**bf) * width ** -0.5
    ids = torch.stack([torch.randperm(experts, generator=gen, device="cuda")[:top_k]
                       for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen, device="cuda")
    return x, w13, w2, s13, s2, weights, ids


def _moe_case(name: str, tokens: int, gen: torch.Generator, tiles, rate: float) -> list[dict]:
    x, w13, w2, s13, s2, weights, ids = _moe_inputs(name, tokens, gen)

    def before():
        routed = moe_experts_triton(x, w13, w2, weights, ids)
        gate, up = F.linear(x, s13).chunk(2, dim=-1)
        return routed + F.linear(F.silu(gate) * up, s2)

    want = before()
    touched = int(torch.unique(ids).numel())
    nbytes = (touched * (w13[0].numel() + w2[0].numel()) + s13.numel() + s2.numel()) * 2
    floor_us = nbytes / rate / 1e3
    old_us = graph_us(before)
    rows = []
    for cfg in tiles:
        key = {"shape": name, "tokens": tokens, "tiles": cfg and cfg._asdict()}

        def after(cfg=cfg):
            return moe_experts_decode_triton(x, w13, w2, weights, ids, shared_w13=s13,
                                             shared_w2=s2, config=cfg)
        try:
            err = _rel(after(), want)
            us = graph_us(after)
        except Exception as exc:  # a tile set that does not fit: recorded, not fatal
            rows.append(dict(key, error=type(exc).__name__))
            continue
        rows.append(dict(key, experts_touched=touched, bytes=nbytes, floor_us=floor_us,
                         fused_us=us, grouped_plus_shared_us=old_us, speedup=old_us / us,
                         of_floor=floor_us / us, gbps=nbytes / us / 1e3, rel_err=err,
                         ok=err < 2e-2))
    return rows


def bench_moe(args, rate: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    tiles = [None]
    if args.sweep_moe:
        tiles += [DecodeTiles(16, n, k, w, s) for n, k, w, s in itertools.product(
            (16, 32, 64), (64, 128, 256), (4, 8), (2, 3, 4))]
    return [row for name in MOE_SHAPES for tokens in args.tokens
            for row in _moe_case(name, tokens, gen, tiles, rate)]


def _route_case(name: str, tokens: int, gen: torch.Generator) -> dict:
    experts, top_k, groups, topk_group, scoring, norm, scaling = ROUTES[name]
    logits = torch.randn(tokens, experts, generator=gen, device="cuda")
    bias = torch.randn(experts, generator=gen, device="cuda") * 0.1 if scoring == "sigmoid" else None
    call = (logits, bias, top_k, groups, topk_group, scoring, norm, scaling)
    i_ref, i_new = moe_route_ref(*call)[1], moe_route_triton(*call)[1]
    same = bool(torch.equal(i_ref.sort(-1)[0], i_new.sort(-1)[0]))
    kernel_us = graph_us(lambda: moe_route_triton(*call))
    torch_us = graph_us(lambda: moe_route_ref(*call))
    return {"shape": name, "tokens": tokens, "same_ids": same, "kernel_us": kernel_us,
            "torch_us": torch_us, "speedup": torch_us / kernel_us}


def bench_route(args) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    return [_route_case(name, tokens, gen) for name in ROUTES for tokens in args.tokens]


def _proj_case(op: str, new, old, arg: torch.Tensor, w: torch.Tensor) -> dict:
    err = _rel(new(arg, w), old(arg, w))
    k_us, t_us = graph_us(lambda: new(arg, w)), graph_us(lambda: old(arg, w))
    return {"op": op, "heads": arg.shape[1], "tokens": arg.shape[0], "kernel_us": k_us,
            "einsum_us": t_us, "speedup": t_us / k_us, "weight_gbps": w.numel() * 2 / k_us / 1e3,
            "rel_err": err}


def bench_proj(args) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    for heads in (16, 128):
        kv_b = (torch.randn(heads, 256, 512, generator=gen, device="cuda") * 512 ** -0.5).bfloat16()
        for tokens in args.tokens:
            q = torch.randn(tokens, heads, 192, generator=gen, device="cuda").bfloat16()
            o = torch.randn(tokens, heads, 512, generator=gen, device="cuda").bfloat16()
            rows.append(_proj_case("absorb", mla_absorb_query_triton, mla_absorb_query_ref, q,
                                   kv_b[:, :128]))
            rows.append(_proj_case("expand", mla_expand_output_triton, mla_expand_output_ref, o,
                                   kv_b[:, 128:]))
    return rows


def _dsa_case(batch: int, context: int, splits_list, gen: torch.Generator) -> list[dict]:
    heads, rank, rope, topk, page = 128, 512, 64, 2048, 64
    scale = 192 ** -0.5
    q = torch.randn(batch, heads, rank + rope, generator=gen, device="cuda").bfloat16()
    pages = context // page
    cache = torch.randn(batch * context, rank + rope, generator=gen, device="cuda").bfloat16()
    table = torch.randperm(batch * pages, generator=gen, device="cuda").int().view(batch, pages)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    idx = torch.stack([torch.randperm(context, generator=gen, device="cuda")[:topk]
                       for _ in range(batch)]).int()
    dense_us = graph_us(lambda: paged_mla_decode_attention(q, cache, table, lens, page, scale, rank))
    want = sparse_mla_decode_triton(q, cache, table, idx, page, scale, rank, num_splits=1)
    rows = []
    for splits, block_h in itertools.product(splits_list, (16, 32, 64)):
        cfg, n = SparseDecodeConfig(block_h=block_h), (None if splits == 0 else splits)

        def call(n=n, cfg=cfg):
            return sparse_mla_decode_triton(q, cache, table, idx, page, scale, rank,
                                            num_splits=n, config=cfg)
        err = _rel(call(), want)
        us = graph_us(call)
        rows.append({"batch": batch, "context": context, "splits": splits or "auto",
                     "block_h": block_h, "sparse_us": us, "dense_us": dense_us,
                     "sparse_over_dense": us / dense_us, "rel_err": err})
    return rows


def bench_dsa(args) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = [row for batch in (1, 16) for context in (8192, 32768, 131072)
            for row in _dsa_case(batch, context, args.splits, gen)]
    torch.cuda.empty_cache()
    return rows


def _prefill_config(text: str) -> AttnLaunchConfig:
    """``block_m,block_n,warps,stages[+switch...]``; bench/mla_prefill_sweep.py times every variant."""
    return parse_config(text)


def _prefill_case(n: int, configs) -> list[dict]:
    heads, scale = 128, 192 ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k = (torch.randn(n, heads, 192, generator=gen, device="cuda").bfloat16() for _ in "qk")
    v = torch.randn(n, heads, 128, generator=gen, device="cuda").bfloat16()
    i32 = {"dtype": torch.int32, "device": "cuda"}
    seg = AttnSegments(*(torch.tensor([x], **i32) for x in (0, n, 0, 0)))
    flops = 2 * heads * (192 + 128) * n * (n + 1) / 2
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, F.pad(v, (0, 64))))
    fused = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

    def sdpa():
        with sdpa_kernel(fused):
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)

    want = sdpa()[0, :, :, :128].transpose(0, 1)
    sdpa_ms = eager_us(sdpa) / 1e3
    variants = {"as is": (q, k, v, torch.empty_like(v)),
                "padded 256": (F.pad(q, (0, 64)), F.pad(k, (0, 64)), F.pad(v, (0, 128)),
                               torch.empty(n, heads, 256, dtype=v.dtype, device="cuda"))}
    rows = []
    for cfg in [None, *configs]:
        for variant, (qq, kk, vv, out) in variants.items():
            used = cfg or default_config(qq)
            key = {"tokens": n, "config": ("default " if cfg is None else "") + used.label,
                   "variant": variant}

            def call(qq=qq, kk=kk, vv=vv, out=out, used=used):
                return launch_cp_prefill_attention(qq, kk, vv, seg, scale, None, 0, out, None, used)
            try:
                call()
                torch.cuda.synchronize()
            except Exception as exc:  # a config that does not fit: recorded
                rows.append(dict(key, error=type(exc).__name__))
                continue
            err = _rel(out[..., :128], want)
            ms = eager_us(call) / 1e3
            rows.append(dict(key, ms=ms, tflops=flops / ms / 1e9, sdpa_ms=sdpa_ms,
                             sdpa_tflops=flops / sdpa_ms / 1e9, vs_sdpa=sdpa_ms / ms, rel_err=err,
                             ok=err < 2e-2))
    return rows


def bench_prefill(args) -> list[dict]:
    rows = []
    for n in args.prefill_tokens:
        rows += _prefill_case(n, args.prefill_configs)
        torch.cuda.empty_cache()
    return rows


def print_rows(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(f"\n== {title} ==")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k, "")
            if isinstance(v, dict):
                v = ",".join(str(x) for x in v.values())
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--sweep-moe", action="store_true")
    ap.add_argument("--splits", type=int, nargs="+", default=[0, 1, 4, 8, 16, 32, 64])
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--prefill-configs", type=_prefill_config, nargs="*",
                    default=[_prefill_config(c) for c in (
                        "64,64,4,2", "64,64,4,3", "128,64,8,2", "128,64,8,3", "64,128,4,2",
                        "128,128,8,2", "64,32,4,3")])
    ap.add_argument("--bandwidth", type=float, default=0.0,
                    help="GB/s for the floors (default: the measured copy rate)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/deepseek_kernels.py times compiled kernels and needs a CUDA GPU",
              file=sys.stderr)
        return 2
    rate = args.bandwidth or copy_gbps()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "floor_gbps": rate, "graph_calls": GRAPH_CALLS}
    runs = {"moe": lambda: bench_moe(args, rate), "route": lambda: bench_route(args),
            "proj": lambda: bench_proj(args), "dsa": lambda: bench_dsa(args),
            "prefill": lambda: bench_prefill(args)}
    for part in PARTS:
        if part in args.parts:
            result[part] = runs[part]()
            print_rows(part, result[part])
            if args.json:  # after each part, so a long run keeps what it measured
                args.json.write_text(json.dumps(result, indent=2))
    print(f"\nfloors at {rate:.0f} GB/s; small kernels timed as CUDA graphs of {GRAPH_CALLS} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
