"""Launch configs of the sparse MLA decode kernel (DSA, DeepSeek-V3.2 shapes) on one GPU.

Shapes: 128 heads over latent rows of 512 + 64 in the DSA pool plane's layout
(``kernels/dsa/pool_layout.py``: 1296-byte rows with a bf16 latent, 800 with an FP8
one of 656 bytes), top 2048 selected positions per request (sorted, as
``radix_topk`` gives them), page 64, pages shuffled over the pool. For each KV dtype
of ``--kv``, batch of ``--batches``, context of ``--contexts`` and launch config of
``--configs`` (``block_h,block_n,num_warps,num_stages,min_split_rows,programs_per_sm``;
``default`` is ``SparseDecodeConfig()``), the kernel with its auto split count:

- ``splits`` / ``programs``: the split count the config picks and the grid's programs;
- ``us``: kernel + merge, a CUDA graph of 20 calls replayed (``graph_us``);
- ``gbps``: the selected rows' bytes (1152 bf16, 656 FP8 a row) over ``us``;
- ``partial_mb``: the float32 partials the splits write and the merge reads;
- ``merge_us``: ``merge_mla_partials`` alone on partials of that shape;
- ``rel_err``: against ``sparse_mla_decode_ref`` (a row with ``rel_err`` over 2e-2
  is marked ``ok=False`` and not ranked).

Prints the table and each case's fastest config; ``--json`` writes the rows.
``--compile`` needs no GPU: each config compiled for sm_90 offline (bf16 and FP8 rows),
with its registers, spilled bytes, shared memory, global loads by width and ``cp.async``
copies by size (16-byte vectors for the rows; an FP8 row's scales 4 a row, not one a value).

    python -m bench.sparse_mla_sweep --json bench/results/sparse_mla_sweep_h200.json
    python -m bench.sparse_mla_sweep --compile
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections import Counter
from pathlib import Path

import torch
import triton
from lanekv.kernels.dsa.index_cache import IndexCacheSpec
from lanekv.kernels.dsa.pool_layout import DSARowLayout
from lanekv.kernels.dsa.sparse_mla import (
    SparseDecodeConfig,
    _sparse_mla_kernel,
    sparse_decode_grid,
    sparse_mla_decode_ref,
    sparse_mla_decode_triton,
)
from lanekv.kernels.fp8.kv_rows import mla_fp8_row_bytes, pack_mla_fp8_rows
from lanekv.kernels.mla.latent_rows import row_stride_args
from lanekv.kernels.mla.merge import merge_mla_partials

HEADS, RANK, ROPE, PAGE, TOPK, INDEX_DIM = 128, 512, 64, 64, 2048, 128
H200_SMS = 132
CHUNK = 1 << 18  # rows filled per step
CONFIGS = (  # default: 32,32,0,2,64,1; 128-head blocks need 256 KiB of shared memory
    "default", "64,32,8,2,64,1", "64,32,8,2,128,1", "64,32,8,2,32,1", "64,32,4,2,64,1",
    "64,64,8,2,64,1", "64,32,8,3,64,1", "32,32,8,2,32,1", "32,32,8,2,128,1", "32,32,4,2,64,1",
    "32,32,8,3,64,1", "16,32,4,2,128,1",
)


def parse_config(text: str) -> SparseDecodeConfig:
    """``default`` or ``block_h,block_n,num_warps,num_stages,min_split_rows,programs_per_sm``."""
    if text == "default":
        return SparseDecodeConfig()
    parts = text.split(",")
    if len(parts) != 6 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"config {text!r}: want default or six positive ints block_h,block_n,num_warps,"
            "num_stages,min_split_rows,programs_per_sm")
    block_h, block_n, warps, stages, min_rows, per_sm = (int(p) for p in parts)
    cfg = SparseDecodeConfig(block_h=block_h, block_n=block_n, num_warps=warps,
                             num_stages=stages, min_split_rows=min_rows, programs_per_sm=per_sm)
    if cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1):
        raise argparse.ArgumentTypeError(f"config {text!r}: block_n must be a power of two >= 16")
    return cfg


def label(cfg: SparseDecodeConfig) -> str:
    """``parse_config``'s form (its field order, not the NamedTuple's)."""
    return ",".join(str(v) for v in (cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages,
                                     cfg.min_split_rows, cfg.programs_per_sm))


def row_bytes(kv: str) -> int:
    """Bytes of a selected row the kernel reads: 1152 bf16, 656 FP8."""
    return mla_fp8_row_bytes(RANK, ROPE) if kv == "fp8" else (RANK + ROPE) * 2


def _latent(kv: str, rows: int, gen: torch.Generator) -> torch.Tensor:
    """The latent view of a DSA pool plane of ``rows`` random tokens (index part zeros)."""
    spec = IndexCacheSpec(INDEX_DIM, "fp8_e4m3", torch.bfloat16, INDEX_DIM)
    lay = DSARowLayout(RANK + ROPE, spec, fp8_rank=RANK if kv == "fp8" else 0)
    latent = lay.latent(torch.zeros(rows, lay.head_dim, dtype=lay.dtype, device="cuda"))
    for start in range(0, rows, CHUNK):
        n = min(CHUNK, rows - start)
        vals = torch.randn(n, RANK + ROPE, generator=gen, device="cuda").bfloat16()
        latent[start:start + n] = pack_mla_fp8_rows(vals, RANK) if kv == "fp8" else vals
    return latent


def _case(kv: str, batch: int, context: int, configs, gen, merge_cache: dict) -> list[dict]:
    from bench.deepseek_kernels import graph_us

    pages = context // PAGE
    latent = _latent(kv, batch * context, gen)
    table = torch.randperm(batch * pages, generator=gen, device="cuda").int().view(batch, pages)
    idx = torch.stack([torch.randperm(context, generator=gen, device="cuda")[:TOPK].sort()[0]
                       for _ in range(batch)]).int()
    q = torch.randn(batch, HEADS, RANK + ROPE, generator=gen, device="cuda").bfloat16()
    scale = 192 ** -0.5
    want = sparse_mla_decode_ref(q, latent, table, idx, PAGE, scale, RANK).float()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for cfg in configs:
        grid = sparse_decode_grid(batch, HEADS, TOPK, sms, cfg)
        key = {"kv": kv, "batch": batch, "context": context, "config": label(cfg),
               "splits": grid.num_splits, "programs": grid.head_blocks * batch * grid.num_splits}

        def call(cfg=cfg):
            return sparse_mla_decode_triton(q, latent, table, idx, PAGE, scale, RANK, config=cfg)
        try:
            err = ((call().float() - want).norm() / want.norm()).item()
            us = graph_us(call)
        except Exception as exc:  # a config that does not fit: recorded, not fatal
            rows.append(dict(key, error=f"{type(exc).__name__}: {exc}"[:120]))
            continue
        splits = grid.num_splits
        if splits > 1 and (batch, splits) not in merge_cache:
            merge_cache[batch, splits] = _merge_us(batch, splits)
        rows.append(dict(key, us=us, gbps=batch * TOPK * row_bytes(kv) / us / 1e3,
                         partial_mb=batch * HEADS * splits * RANK * 4 / 1e6 if splits > 1 else 0.0,
                         merge_us=merge_cache.get((batch, splits), 0.0), rel_err=err,
                         ok=err < 2e-2))
    return rows


def _merge_us(batch: int, splits: int) -> float:
    """``merge_mla_partials`` alone on float32 partials of ``splits`` splits."""
    from bench.deepseek_kernels import graph_us

    part_o = torch.randn(batch, HEADS, splits, RANK, device="cuda")
    part_lse = torch.randn(batch, HEADS, splits, device="cuda")
    out = torch.empty(batch, HEADS, RANK, dtype=torch.bfloat16, device="cuda")
    return graph_us(lambda: merge_mla_partials(part_o, part_lse, out))


def best_rows(rows: list[dict]) -> list[dict]:
    """Each (kv, batch, context)'s fastest correct config, with the default's time beside."""
    best: dict[tuple, dict] = {}
    default: dict[tuple, float] = {}
    for r in rows:
        case = (r["kv"], r["batch"], r["context"])
        if r.get("ok"):
            if case not in best or r["us"] < best[case]["us"]:
                best[case] = r
            if r["config"] == label(SparseDecodeConfig()):
                default[case] = r["us"]
    return [{"kv": k[0], "batch": k[1], "context": k[2], "best": r["config"], "us": r["us"],
             "gbps": r["gbps"], "default_us": default.get(k, float("nan"))}
            for k, r in best.items()]


def compile_sm90(cfg: SparseDecodeConfig, kv: str, num_splits: int = 2, align: bool = True
                 ) -> dict:
    """``cfg`` compiled for sm_90 offline on the V3.2 shapes in the pool plane's layout
    (``align`` False: without the row strides' alignment hints, as before them)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench.mla_chain_compile import resource_usage

    fp8 = kv == "fp8"
    block_h = sparse_decode_grid(1, HEADS, TOPK, H200_SMS, cfg).block_h
    part = num_splits > 1
    sig = dict(q_ptr="*bf16", latent_ptr="*fp8e4nv" if fp8 else "*bf16",
               scale_ptr="*fp32" if fp8 else "*bf16", rope_ptr="*bf16", idx_ptr="*i32",
               table_ptr="*i32", out_ptr="*bf16", part_o_ptr="*fp32" if part else "*bf16",
               part_lse_ptr="*fp32" if part else "*bf16", scale_log2="fp32", num_heads="i32",
               topk="i32", stride_qb="i32", stride_qh="i32", stride_lr="i32", stride_sr="i32",
               stride_pr="i32", stride_ib="i32", stride_tb="i32", stride_ob="i32",
               stride_oh="i32")
    # the plane's row strides in elements: 800-byte FP8 rows, 1296-byte bf16 ones
    strides = dict(stride_lr=800, stride_sr=200, stride_pr=400) if fp8 else dict(
        stride_lr=648, stride_sr=648, stride_pr=648)
    divided, aligns = row_stride_args((strides["stride_lr"], strides["stride_sr"],
                                       strides["stride_pr"]))
    if not align:  # as before the hints: the strides whole, no known factor
        divided, aligns = tuple(strides.values()), {k: 1 for k in aligns}
    ints = dict(num_heads=HEADS, topk=TOPK, stride_qb=HEADS * (RANK + ROPE),
                stride_qh=RANK + ROPE, stride_ib=TOPK, stride_ob=HEADS * RANK, stride_oh=RANK,
                **dict(zip(strides, divided)))
    consts = dict(RANK=RANK, ROPE=ROPE, PAGED=True, PAGE_SIZE=PAGE, BLOCK_H=block_h,
                  BLOCK_R=RANK, BLOCK_P=ROPE, BLOCK_N=cfg.block_n, WRITE_PARTIAL=part,
                  DOT_PRECISION="tf32", GROUP=128 if fp8 else 1, KV_FP8=fp8, **aligns)
    sig.update({name: "constexpr" for name in consts})
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr")] + [n for n, v in ints.items() if v % 16 == 0]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    warps = cfg.num_warps or 8
    kernel = triton.compile(ASTSource(_sparse_mla_kernel, sig, consts, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=cfg.num_stages))
    registers, local_bytes = resource_usage(kernel)
    ptx = kernel.asm["ptx"]
    loads = Counter(re.findall(r"\bld\.global(?:\.\w+)*?(?:\.v\d)?\.[bfus]\d+", ptx))
    # pipelined loads are cp.async into shared memory: by bytes a copy (16 = whole vectors;
    # 4 = one float32, the FP8 scales)
    copies = Counter(int(n, 16) for n in re.findall(
        r"cp\.async\.c[ag]\.shared\.global \[[^\]]*\], \[[^\]]*\], (0x[0-9a-f]+)", ptx))
    return {"kv": kv, "config": label(cfg), "warps": warps, "partials": part,
            "registers": registers, "local_bytes": local_bytes,
            "shared": kernel.metadata.shared,
            "ld_global": " ".join(f"{k[len('ld.global.'):]}:{v}" for k, v in sorted(loads.items())),
            "cp_async_bytes": " ".join(f"{k}B:{v}" for k, v in sorted(copies.items()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--configs", type=parse_config, nargs="+",
                    default=[parse_config(c) for c in CONFIGS])
    ap.add_argument("--compile", action="store_true",
                    help="compile each config for sm_90 offline (no GPU) and print its resources")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    for ctx in args.contexts:
        if ctx < TOPK or ctx % PAGE:
            ap.error(f"--contexts: {ctx} is not a multiple of the page size {PAGE} of at "
                     f"least the top-k {TOPK}")
    from bench.deepseek_kernels import print_rows

    if args.compile:
        rows = [compile_sm90(cfg, kv) for kv in args.kv for cfg in dict.fromkeys(args.configs)]
        print_rows("sparse MLA decode compiled for sm_90", rows)
    else:
        if not torch.cuda.is_available():
            print("bench/sparse_mla_sweep.py times compiled kernels and needs a CUDA GPU "
                  "(--compile does not)", file=sys.stderr)
            return 2
        gen = torch.Generator(device="cuda").manual_seed(0)
        rows, merges = [], {}
        for kv in args.kv:
            for batch in args.batches:
                for context in args.contexts:
                    rows += _case(kv, batch, context, dict.fromkeys(args.configs), gen, merges)
                    torch.cuda.empty_cache()  # the case's pool plane is freed
                    print(f"{kv} b{batch} {context}: done", flush=True)
        print_rows("sparse MLA decode launch configs", rows)
        print_rows("fastest per case", best_rows(rows))
    if args.json:
        args.json.write_text(json.dumps({
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "sm_90 offline",
            "shapes": {"heads": HEADS, "kv_lora_rank": RANK, "rope": ROPE, "page": PAGE,
                       "topk": TOPK}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
