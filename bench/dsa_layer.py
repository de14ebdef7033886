"""DSA decode attention of one DeepSeek-V3.2 layer on one GPU, part by part, against dense MLA.

Shapes (V3.2): 128 MLA heads over latent rows of 512 + 64, the index keys of 64
index heads of 128 dims stored as fp8 rows (128 e4m3 bytes + a float32 scale) inside
the DSA pool plane (``kernels/dsa/pool_layout.py``: 1296-byte rows with a bf16
latent, 800 with an FP8 one), top 2048, page 64. For each KV dtype of ``--kv``,
context of ``--contexts`` and batch of ``--batches`` (every request at that
context, pages shuffled over the pool), the new token of each request:

- ``score_us``: the paged index scoring over the page table as the decode step
  runs it (``paged_index_keys_triton``: the scores written as ``first_topk``'s int64
  keys); ``float_score_us`` the same kernel writing float32 scores
  (``paged_index_scores_triton``); ``index_floor_us`` the index rows' bytes (132 a
  key) at the device's copy rate and ``index_gbps`` the rate the kernel reads them at;
- ``topk_us``: ``topk_of_keys`` of those keys (what the decode step runs:
  ``torch.topk`` over the int64 keys, then the positions); ``first_topk_us``:
  ``first_topk`` of the float scores (the key kernel, then the same);
  ``torch_topk_us`` / ``torch_topk_unsorted_us``: ``torch.topk`` on the float scores
  alone, sorted and not (what the int64 keys and the sorted output cost);
  ``radix_topk_us`` / ``radix_topk_w8_us``: ``kernels/dsa/topk.py``'s ``radix_topk``
  (the same set in position order, one to three launches of our own) at 16 and 8
  warps, checked equal to its reference first (``radix_same``); ``digit_topk_us``:
  ``kernels/dsa/digit_topk.py``'s ``digit_topk`` (the same output: 8-bit digit passes,
  the row split over ``digit_programs`` programs; ``digit_same``), ``topk_method`` the
  kernel ``exact_topk`` (the decode step's) takes at the shape, ``digit_topk_wide_us``
  (with the rows' lengths) / ``radix_topk_wide_us`` over the wide table's scores (below);
- ``launches_*``: the GPU operations one eager call launches (torch.profiler): the
  keys' top-k, ``radix_topk``, ``digit_topk``, and the two chains;
- ``sparse_us``: the sparse MLA decode over the selected rows (auto splits; its launch
  configs: ``bench/sparse_mla_sweep.py``);
- ``sum_us``: the three parts; ``dsa_us``: ``decode_select`` (the float scores, then
  ``exact_topk``) then the sparse decode captured as one graph (the layer's DSA
  attention as the decode step runs it);
  ``dsa_radix_us``: the same chain with the float scores and ``radix_topk`` in place
  of the keys and ``torch.topk`` (``radix_over_dense`` against the dense kernel);
- ``dense_us``: the paged dense MLA decode kernel over all ``context`` rows;
  ``dsa_over_dense`` = dsa_us / dense_us against the target (at most 1.0 at 8k,
  at most 0.5 at 128k; the contexts between are reported against 1.0).

``*_wide_us``: the dense kernel and both chains over a page table as wide as a
captured decode step's (``--graph-positions``, V3.2's 163840 by default; the rows past
each request's pages are page 0, never read): what the step pays under CUDA graphs,
where the scores run over the table's whole width and ``digit_topk`` reads each row's
own ``seq_lens`` keys (``radix_topk`` the whole width).

``--score-configs`` (block_n,programs_per_sm,warps,stages) times the scoring kernel
under each launch config too (table ``score_sweep``), ``--topk-configs``
(block,min_span,programs_per_sm,max_programs,warps) ``digit_topk`` (table ``topk_sweep``). Every timing is a CUDA graph
of 20 calls replayed (the median of ``triton.testing.do_bench``, divided by 20), as
bench/deepseek_kernels.py times its kernels. Before timing, the scores are checked
against ``paged_index_scores_ref`` (``score_rel_err``), the selection against the
reference's (``topk_overlap``), the keys' selection against ``first_topk`` of the
float scores (``keys_same``) and ``radix_topk`` against its reference (``radix_same``).

    python -m bench.dsa_layer --json bench/results/dsa_layer_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.kernels.dsa.digit_topk import (  # noqa: E402
    DigitTopkConfig,
    digit_topk_config,
    digit_topk_programs,
    digit_topk_triton,
    topk_method,
)
from lanekv.kernels.dsa.index_cache import IndexCacheSpec, store_index_k_triton  # noqa: E402
from lanekv.kernels.dsa.indexer import (  # noqa: E402
    IndexScoreConfig,
    paged_index_keys_triton,
    paged_index_scores_ref,
    paged_index_scores_triton,
)
from lanekv.kernels.dsa.pool_layout import DSARowLayout  # noqa: E402
from lanekv.kernels.dsa.select import decode_select, first_topk, topk_of_keys  # noqa: E402
from lanekv.kernels.dsa.sparse_mla import sparse_mla_decode_triton  # noqa: E402
from lanekv.kernels.dsa.topk import radix_topk_ref, radix_topk_triton  # noqa: E402
from lanekv.kernels.fp8.kv_rows import pack_mla_fp8_rows  # noqa: E402
from lanekv.kernels.mla.paged_decode import paged_mla_decode_attention  # noqa: E402

from bench.deepseek_kernels import GRAPH_CALLS, copy_gbps, graph_us, print_rows  # noqa: E402

HEADS, RANK, ROPE, PAGE, TOPK = 128, 512, 64, 64, 2048
INDEX_HEADS, INDEX_DIM = 64, 128
CHUNK = 1 << 18  # rows filled per step (keeps the temporaries small)
DEV, DT = "cuda", torch.bfloat16  # a CPU smoke run of the code swaps these (and graph_us)


def _config(text: str) -> IndexScoreConfig:
    return IndexScoreConfig(*(int(v) for v in text.split(",")))


def _topk_config(text: str) -> DigitTopkConfig:
    return DigitTopkConfig(*(int(v) for v in text.split(",")))


def _plane(kv: str, rows: int, gen: torch.Generator) -> tuple[DSARowLayout, torch.Tensor]:
    """A DSA pool plane of ``rows`` random tokens: latent rows and fp8 index rows."""
    lay = DSARowLayout(RANK + ROPE, IndexCacheSpec(INDEX_DIM, "fp8_e4m3", DT, min(128, INDEX_DIM)),
                       fp8_rank=RANK if kv == "fp8" else 0)
    plane = torch.zeros(rows, lay.head_dim, dtype=lay.dtype, device=DEV)
    latent, index = lay.latent(plane), lay.index_rows(plane)
    for start in range(0, rows, CHUNK):
        n = min(CHUNK, rows - start)
        vals = torch.randn(n, RANK + ROPE, generator=gen, device=DEV).to(DT)
        latent[start : start + n] = pack_mla_fp8_rows(vals, RANK) if kv == "fp8" else vals
        keys = torch.randn(n, INDEX_DIM, generator=gen, device=DEV).to(DT)
        locs = torch.arange(start, start + n, device=DEV)
        store_index_k_triton(keys, index, locs, lay.index)
    return lay, plane


def kernel_count(fn) -> int:
    """GPU operations (kernels, memsets, copies) one eager call of ``fn`` launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _overlap(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean fraction of the reference's selected positions the kernel path selects too."""
    fracs = []
    for g, w in zip(got.tolist(), want.tolist()):
        ws = {x for x in w if x >= 0}
        fracs.append(len(ws & {x for x in g if x >= 0}) / max(1, len(ws)))
    return sum(fracs) / len(fracs)


def _case(kv: str, batch: int, context: int, rate: float, configs, topk_configs, gen,
          graph_positions: int) -> tuple[dict, list, list]:
    pages = context // PAGE
    lay, plane = _plane(kv, batch * context, gen)
    latent, index = lay.latent(plane), lay.index_rows(plane)
    table = torch.randperm(batch * pages, generator=gen, device=DEV).int().view(batch, pages)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
    qi = torch.randn(batch, INDEX_HEADS, INDEX_DIM, generator=gen, device=DEV).to(DT)
    w = torch.randn(batch, INDEX_HEADS, generator=gen, device=DEV) * INDEX_HEADS ** -0.5
    qa = torch.randn(batch, HEADS, RANK + ROPE, generator=gen, device=DEV).to(DT)
    iscale, ascale = INDEX_DIM ** -0.5, 192 ** -0.5
    spec = lay.index

    def score(cfg=None):
        return paged_index_scores_triton(qi, w, index, table, lens, PAGE, iscale, spec,
                                         config=cfg)

    scores = score()
    want = paged_index_scores_ref(qi, w, index, table, lens, PAGE, iscale, spec)
    rel = ((scores - want).norm() / want.norm()).item()
    chosen = first_topk(scores, TOPK)
    overlap = _overlap(chosen, first_topk(want, TOPK))
    del want

    def dsa():
        sel = decode_select(qi, w, index, table, lens, PAGE, iscale, TOPK, spec)
        return sparse_mla_decode_triton(qa, latent, table, sel, PAGE, ascale, RANK)

    keys = paged_index_keys_triton(qi, w, index, table, lens, PAGE, iscale, spec)
    keys_same = bool(torch.equal(topk_of_keys(keys, TOPK), chosen))
    want_sel = radix_topk_ref(scores, TOPK)
    radix_same = bool(torch.equal(radix_topk_triton(scores, TOPK), want_sel))
    digit_same = bool(torch.equal(digit_topk_triton(scores, TOPK), want_sel))

    def dsa_radix():
        sel = radix_topk_triton(score(), TOPK)
        return sparse_mla_decode_triton(qa, latent, table, sel, PAGE, ascale, RANK)

    nbytes = batch * context * spec.row_bytes
    num_sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    score_us = graph_us(lambda: paged_index_keys_triton(qi, w, index, table, lens, PAGE, iscale,
                                                        spec))
    float_score_us = graph_us(score)
    topk_us = graph_us(lambda: topk_of_keys(keys, TOPK))
    sparse_us = graph_us(lambda: sparse_mla_decode_triton(qa, latent, table, chosen, PAGE,
                                                          ascale, RANK))
    dsa_us = graph_us(dsa)
    dense_us = graph_us(lambda: paged_mla_decode_attention(qa, latent, table, lens, PAGE, ascale,
                                                           RANK))
    dsa_radix_us = graph_us(dsa_radix)
    wide_pages = max(pages, graph_positions // PAGE)
    wide = torch.zeros((batch, wide_pages), dtype=torch.int32, device=DEV)
    wide[:, :pages] = table

    def dsa_wide():
        sel = decode_select(qi, w, index, wide, lens, PAGE, iscale, TOPK, spec)
        return sparse_mla_decode_triton(qa, latent, wide, sel, PAGE, ascale, RANK)

    def dsa_radix_wide():
        scores = paged_index_scores_triton(qi, w, index, wide, lens, PAGE, iscale, spec)
        return sparse_mla_decode_triton(qa, latent, wide, radix_topk_triton(scores, TOPK), PAGE,
                                        ascale, RANK)

    wide_same = bool(torch.equal(dsa_wide(), dsa()))
    wide_scores = paged_index_scores_triton(qi, w, index, wide, lens, PAGE, iscale, spec)
    wide_same = wide_same and bool(torch.equal(digit_topk_triton(wide_scores, TOPK, lens=lens),
                                               want_sel))
    dense_wide_us = graph_us(lambda: paged_mla_decode_attention(qa, latent, wide, lens, PAGE,
                                                                ascale, RANK))
    dsa_wide_us, dsa_radix_wide_us = graph_us(dsa_wide), graph_us(dsa_radix_wide)
    target = 0.5 if context >= 131072 else 1.0
    row = {"kv": kv, "batch": batch, "context": context, "score_us": score_us,
           "index_floor_us": nbytes / rate / 1e3, "index_gbps": nbytes / score_us / 1e3,
           "float_score_us": float_score_us, "topk_us": topk_us,
           "first_topk_us": graph_us(lambda: first_topk(scores, TOPK)),
           "torch_topk_us": graph_us(lambda: scores.topk(TOPK, dim=-1)),
           "torch_topk_unsorted_us": graph_us(lambda: scores.topk(TOPK, dim=-1, sorted=False)),
           "radix_topk_us": graph_us(lambda: radix_topk_triton(scores, TOPK)),
           "radix_topk_w8_us": graph_us(lambda: radix_topk_triton(scores, TOPK, num_warps=8)),
           "digit_topk_us": graph_us(lambda: digit_topk_triton(scores, TOPK)),
           "topk_method": topk_method(batch, context, num_sms),
           "digit_programs": digit_topk_programs(batch, context, num_sms, digit_topk_config(context)),
           "radix_topk_wide_us": graph_us(lambda: radix_topk_triton(wide_scores, TOPK)),
           "digit_topk_wide_us": graph_us(lambda: digit_topk_triton(wide_scores, TOPK, lens=lens)),
           "radix_same": radix_same, "digit_same": digit_same, "keys_same": keys_same,
           "launches_topk": kernel_count(lambda: topk_of_keys(keys, TOPK)),
           "launches_radix": kernel_count(lambda: radix_topk_triton(scores, TOPK)),
           "launches_digit": kernel_count(lambda: digit_topk_triton(scores, TOPK)),
           "launches_dsa": kernel_count(dsa), "launches_dsa_radix": kernel_count(dsa_radix),
           "sparse_us": sparse_us, "sum_us": score_us + topk_us + sparse_us, "dsa_us": dsa_us,
           "dense_us": dense_us, "dsa_over_dense": dsa_us / dense_us, "target": target,
           "meets": dsa_us / dense_us <= target, "dsa_radix_us": dsa_radix_us,
           "radix_over_dense": dsa_radix_us / dense_us, "graph_positions": wide_pages * PAGE,
           "dense_wide_us": dense_wide_us, "dsa_wide_us": dsa_wide_us,
           "dsa_radix_wide_us": dsa_radix_wide_us, "wide_over_dense": dsa_wide_us / dense_wide_us,
           "radix_wide_over_dense": dsa_radix_wide_us / dense_wide_us,
           "wide_same_output": wide_same, "score_rel_err": rel,
           "topk_overlap": overlap}
    sweep = []
    for cfg in configs:
        key = {"kv": kv, "batch": batch, "context": context, "config": ",".join(map(str, cfg))}
        try:
            err = ((score(cfg) - scores).abs().max()).item()
            us = graph_us(lambda cfg=cfg: score(cfg))
        except Exception as exc:  # a config that does not fit: recorded, not fatal
            sweep.append(dict(key, error=type(exc).__name__))
            continue
        sweep.append(dict(key, score_us=us, index_gbps=nbytes / us / 1e3,
                          of_default=us / float_score_us, max_abs_diff=err))
    topk_sweep = []
    for tcfg in topk_configs:
        key = {"kv": kv, "batch": batch, "context": context, "config": ",".join(map(str, tcfg))}
        try:
            same = bool(torch.equal(digit_topk_triton(scores, TOPK, config=tcfg), want_sel))
            same = same and bool(torch.equal(
                digit_topk_triton(wide_scores, TOPK, lens=lens, config=tcfg), want_sel))
            us = graph_us(lambda tcfg=tcfg: digit_topk_triton(scores, TOPK, config=tcfg))
            wide_us = graph_us(lambda tcfg=tcfg: digit_topk_triton(wide_scores, TOPK, lens=lens,
                                                                   config=tcfg))
        except Exception as exc:  # a config that does not fit: recorded, not fatal
            topk_sweep.append(dict(key, error=type(exc).__name__))
            continue
        topk_sweep.append(dict(key, topk_us=us, of_default=us / row["digit_topk_us"],
                               of_radix=us / row["radix_topk_us"], wide_lens_us=wide_us,
                               wide_of_default=wide_us / row["digit_topk_wide_us"], same=same))
    del plane
    torch.cuda.empty_cache()
    return row, sweep, topk_sweep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"],
                    help="latent rows of the pool: bf16 (1296-byte rows) or FP8 (800)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--score-configs", type=_config, nargs="*", default=[
        _config(c) for c in ("64,4,4,3", "32,4,4,3", "64,2,4,3", "128,4,8,3", "64,4,4,2")])
    ap.add_argument("--topk-configs", type=_topk_config, nargs="*", default=[
        _topk_config(c) for c in ("1024,1024,1,32,4", "2048,4096,1,32,8", "2048,2048,2,32,8",
                                  "4096,4096,1,16,16", "2048,2048,1,1,8")])
    ap.add_argument("--bandwidth", type=float, default=0.0,
                    help="GB/s for the index floor (default: the measured copy rate)")
    ap.add_argument("--graph-positions", type=int, default=163840,
                    help="positions of a captured step's page table (the *_wide_us columns)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/dsa_layer.py times compiled kernels and needs a CUDA GPU", file=sys.stderr)
        return 2
    for ctx in args.contexts:
        if ctx <= 0 or ctx % PAGE:
            ap.error(f"--contexts: {ctx} is not a positive multiple of the page size {PAGE}")
    rate = args.bandwidth or copy_gbps()
    gen = torch.Generator(device=DEV).manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "floor_gbps": rate, "graph_calls": GRAPH_CALLS,
              "shapes": {"heads": HEADS, "kv_lora_rank": RANK, "rope": ROPE, "page": PAGE,
                         "topk": TOPK, "index_heads": INDEX_HEADS, "index_dim": INDEX_DIM},
              "layer": [], "score_sweep": [], "topk_sweep": []}
    for kv in args.kv:
        for batch in args.batches:
            for context in args.contexts:
                row, sweep, topk_sweep = _case(kv, batch, context, rate, args.score_configs,
                                               args.topk_configs, gen, args.graph_positions)
                result["layer"].append(row)
                result["score_sweep"] += sweep
                result["topk_sweep"] += topk_sweep
                print(f"{kv} b{batch} {context}: dsa {row['dsa_us']:.1f} us, dense "
                      f"{row['dense_us']:.1f} us ({row['dsa_over_dense']:.2f}x); with radix_topk "
                      f"{row['radix_over_dense']:.2f}x; at the graph's width "
                      f"{row['wide_over_dense']:.2f}x / {row['radix_wide_over_dense']:.2f}x",
                      flush=True)
                if args.json:  # after each case, so a long run keeps what it measured
                    args.json.write_text(json.dumps(result, indent=2))
    print_rows("DSA decode attention per layer", result["layer"])
    print_rows("index scoring launch configs", result["score_sweep"])
    print_rows("digit_topk launch configs", result["topk_sweep"])
    print(f"\nindex floor at {rate:.0f} GB/s; timed as CUDA graphs of {GRAPH_CALLS} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
