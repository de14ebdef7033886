"""The first prefill of a new prompt length against later ones of that length, after warm-up.

In this process (one rank, cp=1, the rank code the daemon runs): the prefill
daemon's own warm-up (``prefill.warmup.warm_up``), its heap freeze and the
prefill that settles it, then for each prompt length not sent before, one
prefill and ``--later`` more of it, one after another. Each row has the
first's time against the later ones' median and the slowest later one's (the
spread a first is judged against), how long the host took to queue the forward
(the prefill is bound by its launches at 1k tokens), the garbage collector's
time, on CUDA the device memory segments the caching allocator had to allocate
during the first, and the Triton kernels that compiled (or came from the disk
cache) during it: none should, after warm-up. Give each run its own
``TRITON_CACHE_DIR`` to see what a compile costs on a fresh machine.
``--no-gemm-ladder`` leaves out the warm-up's GEMM ladder
(``prefill/cp/gemm_warmup.py``) to see what it buys; run with
``CUDA_MODULE_LOADING=EAGER`` to see what lazily loaded kernels cost.

GPU (Llama-3-8B shapes, dummy bf16 weights):
    python bench/first_prefill.py --llama3-8b --json out.json
CPU (a tiny model, to check the script):
    python bench/first_prefill.py --tiny --lengths 40 70 --later 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.kernels.backend import recording_compiles  # noqa: E402
from lanekv.prefill.cp.launcher import PrefillInput  # noqa: E402
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine  # noqa: E402
from lanekv.prefill.engine_config import EngineConfig  # noqa: E402
from lanekv.prefill.warmup import settle_after_freeze, warm_up  # noqa: E402
from lanekv.runtime.gcpause import GcClock, frozen  # noqa: E402

from bench.prefill import LLAMA3_8B, TINY, add_model_args  # noqa: E402

# Row counts no warm-up prefill uses (page 64: 832, 704, 960, 640, 896, 768, ... rows).
DEFAULT_LENGTHS = (769, 643, 901, 583, 843, 717, 1500, 3001, 5000, 7001)


def _segments() -> int:
    return torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0


def _one(engine: ThreadedPrefillEngine, length: int, gen: torch.Generator, vocab: int, clock: GcClock) -> dict:
    ids = torch.randint(10, vocab, (length,), generator=gen).tolist()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    segments, gc_before = _segments(), clock.seconds
    with recording_compiles() as compiles:
        start = time.perf_counter()
        res = engine.prefill([PrefillInput(ids)])[0]
        wall = time.perf_counter() - start
    engine.free(res.new_pages)
    return dict(ms=wall * 1e3, queued_ms=res.timings["queued_s"] * 1e3,
                compute_ms=res.timings["compute_s"] * 1e3, new_segments=_segments() - segments,
                gc_ms=(clock.seconds - gc_before) * 1e3, compiles=list(compiles))


def measure(args, model_dir: str, vocab: int) -> dict:
    cfg = EngineConfig(model_dir, cp_size=1, page_size=args.page_size,
                       pages_per_lane=max(args.max_batch_tokens, max(args.lengths)) // args.page_size + 64,
                       dtype=args.dtype, load_format="dummy", start_timeout_s=900,
                       graph_max_rows=args.graph_max_rows)
    engine = ThreadedPrefillEngine(cfg)
    try:
        if torch.cuda.is_available():
            torch.set_num_threads(1)  # as the daemon's ranks run
        warm = warm_up(engine, vocab, args.max_tokens, args.max_batch_tokens,
                       gemm_ladder=not args.no_gemm_ladder)
        gen = torch.Generator().manual_seed(0)
        rows = []
        with frozen(), GcClock().installed() as clock:  # as the daemon serves (runtime.daemon) ...
            settle_after_freeze(engine, vocab)  # ... once it has settled (prefill.daemon)
            for length in dict.fromkeys(args.lengths):
                first = _one(engine, length, gen, vocab, clock)
                later = [_one(engine, length, gen, vocab, clock) for _ in range(args.later)]
                rows.append(_row(length, first, later))
    finally:
        engine.close()
    ratios = [r["ratio"] for r in rows]
    return dict(rows=rows, warm_up_s=warm.seconds, warm_up_prefills=warm.prefills,
                gemm_calls=warm.gemm_calls, gemm_s=warm.gemm_seconds, graphs=warm.graphs,
                graph_s=warm.graph_seconds, graph_mib=warm.graph_bytes / 2**20,
                ratio_p50=statistics.median(ratios), ratio_max=max(ratios))


def _row(length: int, first: dict, later: list[dict]) -> dict:
    med = {k: statistics.median(x[k] for x in later) for k in ("ms", "queued_ms", "compute_ms", "gc_ms")}
    return dict(prompt_len=length, first_ms=first["ms"], later_ms_p50=med["ms"], ratio=first["ms"] / med["ms"],
                later_spread=max(x["ms"] for x in later) / med["ms"],
                first_queued_ms=first["queued_ms"], later_queued_ms_p50=med["queued_ms"],
                first_compute_ms=first["compute_ms"], later_compute_ms_p50=med["compute_ms"],
                first_gc_ms=first["gc_ms"], later_gc_ms_p50=med["gc_ms"], first_new_segments=first["new_segments"],
                first_compiles=first["compiles"], later_compiles=sum(len(x["compiles"]) for x in later),
                later_ms=[x["ms"] for x in later])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    ap.add_argument("--later", type=int, default=5, help="prefills of each length after the first")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8192, help="the warm-up's longest prompt")
    ap.add_argument("--max-batch-tokens", type=int, default=16384)
    ap.add_argument("--no-gemm-ladder", action="store_true")
    ap.add_argument("--graph-max-rows", type=int, default=EngineConfig.graph_max_rows,
                    help="prefills of up to this many rows replay CUDA graphs (0: eager)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.graph_max_rows < 0:
        ap.error(f"--graph-max-rows must be >= 0, got {args.graph_max_rows}")
    for name in ("later", "page_size", "max_tokens", "max_batch_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    bad = [n for n in args.lengths if not 1 <= n < args.max_tokens]
    if bad:
        ap.error(f"--lengths must be in [1, --max-tokens), got {bad[0]}")
    args.dtype = args.dtype or ("bfloat16" if args.llama3_8b else "float32")
    model = LLAMA3_8B if args.llama3_8b else TINY
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(model))
        out = measure(args, d, model["vocab_size"])
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    out.update(device=device, model="llama3-8b" if args.llama3_8b else "tiny", dtype=args.dtype,
               page_size=args.page_size, gemm_ladder=not args.no_gemm_ladder,
               graph_max_rows=args.graph_max_rows,
               cuda_module_loading=os.environ.get("CUDA_MODULE_LOADING", "default"))
    print(f"\nFirst prefill of a new length, {out['model']}, {args.dtype}, page {args.page_size}, {device}, "
          f"GEMM ladder {'on' if out['gemm_ladder'] else 'off'}, CUDA_MODULE_LOADING={out['cuda_module_loading']}")
    print(f"warm-up: {out['warm_up_prefills']} prefills, {out['gemm_calls']} GEMM calls "
          f"({out['gemm_s']:.2f} s) and {out['graphs']} CUDA graphs up to {args.graph_max_rows} rows "
          f"({out['graph_s']:.2f} s, {out['graph_mib']:.1f} MiB) in {out['warm_up_s']:.2f} s")
    print(f"{'tokens':>7} {'first ms':>9} {'later p50':>10} {'ratio':>6} {'later max/p50':>14} {'queued first/later':>19} "
          f"{'gc ms first/later':>18} {'new segments':>13} {'compiles':>9}")
    for r in out["rows"]:
        print(f"{r['prompt_len']:>7} {r['first_ms']:>9.1f} {r['later_ms_p50']:>10.1f} {r['ratio']:>5.2f}x {r['later_spread']:>13.2f}x "
              f"{r['first_queued_ms']:>9.1f} / {r['later_queued_ms_p50']:<7.1f} "
              f"{r['first_gc_ms']:>8.1f} / {r['later_gc_ms_p50']:<7.1f} {r['first_new_segments']:>13} {len(r['first_compiles']):>9}")
    for r in out["rows"]:
        for kernel in r["first_compiles"]:
            print(f"compiled during the first {r['prompt_len']}-token prefill: {kernel}")
    print(f"ratio p50 {out['ratio_p50']:.2f}x, max {out['ratio_max']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
