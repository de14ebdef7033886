"""DSA kernels per layer on DeepSeek-V3.2 attention shapes, one GPU.

Shapes: 64 index heads of 128 dims (fp8 index-K rows of 132 bytes), top 2048,
128 MLA heads over latent rows of 512 + 64 (bf16), page size 64.

- decode: the new token of each of ``batch`` requests at ``context`` keys:
  paged index scores (fp8 dequant inside) + top-k + sparse MLA decode, against
  dense MLA attention on the same shapes: the paged dense MLA decode kernel the
  daemons run for V2/V3 (``kernels/mla/paged_decode.py``, split over the keys), and
  torch (bmm, float32 softmax, bmm) over each request's latent rows laid out
  contiguously.
- prefill: ``queries`` rows at the end of a ``context``-token request (one
  chunk of a CP rank): index scores + top-k + sparse MLA prefill.
- store: quantizing and storing a chunk's index keys (fp8) against copying
  their bf16 bytes.

Each kernel's output is checked against its torch reference on a small case
before anything is timed. Prints a table; ``--json`` writes the rows.

    python3 -m bench.kernels_dsa --json bench/results/kernels_dsa_h200.json

(as a module: run as a file, bench/kernels.py would shadow the kernels package)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
from lanekv.kernels.dsa.index_cache import IndexCacheSpec, store_index_k_ref, store_index_k_triton
from lanekv.kernels.dsa.indexer import (
    index_scores_ref,
    index_scores_triton,
    index_topk,
    paged_index_scores_triton,
)
from lanekv.kernels.dsa.pool_layout import DSARowLayout
from lanekv.kernels.dsa.sparse_mla import sparse_mla_decode_triton, sparse_mla_prefill_triton
from lanekv.kernels.mla.paged_decode import paged_mla_decode_attention
from triton.testing import do_bench

INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048
HEADS, RANK, ROPE = 128, 512, 64
PAGE = 64
SCALE = (128 + 64) ** -0.5


def _ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def _decode_case(batch: int, context: int, gen: torch.Generator) -> dict:
    spec = IndexCacheSpec(head_dim=INDEX_DIM)
    pages_per = context // PAGE
    rows = batch * context
    pool = spec.alloc_pool(rows, "cuda")
    keys = torch.randn(rows, INDEX_DIM, device="cuda", generator=gen).bfloat16()
    store_index_k_triton(keys, pool, torch.arange(rows, device="cuda"), spec)
    latent = torch.randn(rows, RANK + ROPE, device="cuda", generator=gen).bfloat16()
    table = torch.randperm(batch * pages_per, device="cuda", generator=gen).int()
    table = table.view(batch, pages_per)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q_index = torch.randn(batch, INDEX_HEADS, INDEX_DIM, device="cuda", generator=gen).bfloat16()
    weights = torch.randn(batch, INDEX_HEADS, device="cuda", generator=gen)
    q = torch.randn(batch, HEADS, RANK + ROPE, device="cuda", generator=gen).bfloat16()

    def scores():
        return paged_index_scores_triton(q_index, weights, pool, table, lens, PAGE,
                                         INDEX_DIM ** -0.5, spec)

    selected = index_topk(scores(), TOPK)
    t_scores = _ms(scores)
    t_topk = _ms(lambda: index_topk(scores(), TOPK)) - t_scores
    t_sparse = _ms(lambda: sparse_mla_decode_triton(q, latent, table, selected, PAGE, SCALE,
                                                    RANK))
    # Dense torch attention on the same shapes, each request's latent contiguous (no paging).
    lat = latent[:context * batch].view(batch, context, RANK + ROPE)

    def dense_torch():
        probs = (torch.bmm(q, lat.transpose(1, 2)).float() * SCALE).softmax(-1)
        return torch.bmm(probs.to(lat.dtype), lat[..., :RANK])

    t_torch = _ms(dense_torch)
    # The dense MLA decode kernel the daemons run for V2/V3, over the same pages.
    t_dense = _ms(lambda: paged_mla_decode_attention(q, latent, table, lens, PAGE, SCALE, RANK))
    total = t_scores + t_topk + t_sparse
    return {"op": "decode", "batch": batch, "context": context, "index_scores_ms": t_scores,
            "topk_ms": t_topk, "sparse_attn_ms": t_sparse, "dsa_total_ms": total,
            "dense_mla_kernel_ms": t_dense, "dense_torch_ms": t_torch,
            "x_dense_kernel": t_dense / total, "x_dense_torch": t_torch / total}


def _prefill_case(queries: int, context: int, gen: torch.Generator) -> dict:
    q_index = torch.randn(queries, INDEX_HEADS, INDEX_DIM, device="cuda", generator=gen).bfloat16()
    keys = torch.randn(context, INDEX_DIM, device="cuda", generator=gen).bfloat16()
    weights = torch.randn(queries, INDEX_HEADS, device="cuda", generator=gen)
    pos = torch.arange(context - queries, context, device="cuda")
    latent = torch.randn(context, RANK + ROPE, device="cuda", generator=gen).bfloat16()
    q = torch.randn(queries, HEADS, RANK + ROPE, device="cuda", generator=gen).bfloat16()

    def scores():
        return index_scores_triton(q_index, keys, weights, pos, INDEX_DIM ** -0.5)

    selected = index_topk(scores(), TOPK)
    t_scores = _ms(scores)
    t_topk = _ms(lambda: index_topk(scores(), TOPK)) - t_scores
    t_sparse = _ms(lambda: sparse_mla_prefill_triton(q, latent, selected, SCALE, RANK))
    flops = 2.0 * queries * context * INDEX_HEADS * INDEX_DIM  # upper bound: causal cut ignored
    return {"op": "prefill", "queries": queries, "context": context, "index_scores_ms": t_scores,
            "index_tflops": flops / t_scores / 1e9, "topk_ms": t_topk,
            "sparse_attn_ms": t_sparse, "dsa_total_ms": t_scores + t_topk + t_sparse}


def _store_case(tokens: int, gen: torch.Generator) -> dict:
    spec = IndexCacheSpec(head_dim=INDEX_DIM)
    pool = spec.alloc_pool(4 * tokens, "cuda")
    keys = torch.randn(tokens, INDEX_DIM, device="cuda", generator=gen).bfloat16()
    locs = torch.randperm(4 * tokens, device="cuda", generator=gen)[:tokens]
    plain = torch.empty(4 * tokens, INDEX_DIM, dtype=torch.bfloat16, device="cuda")
    t_fp8 = _ms(lambda: store_index_k_triton(keys, pool, locs, spec))
    t_copy = _ms(lambda: plain.index_copy_(0, locs, keys))
    return {"op": "store_index_k fp8", "tokens": tokens, "ms": t_fp8, "bf16_index_copy_ms": t_copy}


def _check(gen: torch.Generator) -> None:
    q = torch.randn(64, INDEX_HEADS, INDEX_DIM, device="cuda", generator=gen).bfloat16()
    k = torch.randn(1024, INDEX_DIM, device="cuda", generator=gen).bfloat16()
    w = torch.randn(64, INDEX_HEADS, device="cuda", generator=gen)
    pos = torch.arange(960, 1024, device="cuda")
    got = index_scores_triton(q, k, w, pos, INDEX_DIM ** -0.5)
    want = index_scores_ref(q, k, w, pos, INDEX_DIM ** -0.5)
    seen = want.isfinite()  # keys after a query's position score -inf on both sides
    if not torch.equal(got.isfinite(), seen):
        raise SystemExit("index_scores: the masked keys differ from the reference's")
    err = (got[seen] - want[seen]).norm() / want[seen].norm()
    if not err < 1e-2:
        raise SystemExit(f"index_scores relative error {err:.3g}")
    spec = IndexCacheSpec(head_dim=INDEX_DIM)
    a, b = spec.alloc_pool(1024, "cuda"), spec.alloc_pool(1024, "cuda")
    locs = torch.arange(1024, device="cuda")
    store_index_k_triton(k, a, locs, spec)
    store_index_k_ref(k, b, locs, spec)
    if not torch.equal(a, b):
        raise SystemExit("store_index_k fp8 bytes differ from torch's")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    _check(gen)
    rows = []
    for context in args.contexts:
        for batch in (1, 16):
            rows.append(_decode_case(batch, context, gen))
        rows.append(_prefill_case(1024, context, gen))
    rows.append(_store_case(32768, gen))
    lay = DSARowLayout(RANK + ROPE, IndexCacheSpec(head_dim=INDEX_DIM))
    rows.append({"op": "bytes per token and layer", "latent": (RANK + ROPE) * 2,
                 "index_fp8": lay.index.row_bytes, "pool_row": lay.head_dim * 2})
    for row in rows:
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(),
                       "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
