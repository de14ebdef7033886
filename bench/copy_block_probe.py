"""Which host call of a fast-path copy waits while another GPU's copy into our GPU runs?

Two GPUs. A fetch from two ranks copies rank 1's pages GPU 1 -> GPU 0 (about
5 ms for 2 GiB over NVLink) and rank 0's GPU 0 -> GPU 0. When rank 0's copies
are queued after rank 1's, rank 0's fetch took until rank 1's copies ended
(``bench/fastpath_probe.py``: issued 6 ms late). This times each host step of
rank 0's copy step (plan, the 2-D copies, a digest launch, a small allocation)
alone, then again right after rank 1's copies are queued, and prints a table:

    python bench/copy_block_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.kernels.page_digest import PageDigest  # noqa: E402
from lanekv.transfer.fastpath.poolcopy import PlannedCopy  # noqa: E402
from lanekv.transfer.fastpath.sidestreams import StreamSet, streams_for  # noqa: E402

LAYERS, PAGE, HEADS, DIM = 32, 64, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=256, help="pages per rank (256: 2 GiB of Llama-3-8B KV)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    n = args.pages
    g0, g1 = torch.device("cuda", 0), torch.device("cuda", 1)
    shape = (LAYERS, 2, n * PAGE, HEADS, DIM)
    src1 = torch.randn(shape, device=g1).to(torch.bfloat16)
    src0 = torch.randn(shape, device=g0).to(torch.bfloat16)
    dst = torch.empty((LAYERS, 2, 2 * n * PAGE, HEADS, DIM), dtype=torch.bfloat16, device=g0)
    sets = {1: StreamSet.make(g1, g0), 0: StreamSet.make(g0, g0)}
    index = torch.arange(n, 2 * n, device=g0)

    def rank1_copies() -> None:
        with streams_for(g1, g0, sets[1]):
            PlannedCopy.plan(src1, range(n), dst, range(n), PAGE, 0, LAYERS).issue(0, LAYERS)

    def rank0_steps() -> dict[str, float]:
        took = {}
        with streams_for(g0, g0, sets[0]) as streams:
            t = time.perf_counter()
            planned = PlannedCopy.plan(src0, range(n), dst, range(n, 2 * n), PAGE, 0, LAYERS)
            took["plan"] = time.perf_counter() - t
            t = time.perf_counter()
            planned.issue(0, LAYERS)
            took["2-D copies"] = time.perf_counter() - t
            with streams.digesting():
                t = time.perf_counter()
                digest = PageDigest(dst, index, PAGE, 0, LAYERS, first_layer=0)
                took["digest made"] = time.perf_counter() - t
                t = time.perf_counter()
                digest.add(0, LAYERS)
                took["digest launch"] = time.perf_counter() - t
            t = time.perf_counter()
            torch.empty(1 << 20, device=g0)
            took["alloc 1 MiB"] = time.perf_counter() - t
            t = time.perf_counter()
            torch.tensor(list(range(n)), dtype=torch.int64).pin_memory().to(g0, non_blocking=True)
            took["pinned index H2D"] = time.perf_counter() - t
        took["total"] = sum(took.values())
        return took

    rows: dict[str, dict[str, float]] = {}
    for name, before in (("alone", None), ("after rank 1's copies", rank1_copies)):
        best: dict[str, float] = {}
        for _ in range(4):
            torch.cuda.synchronize(g0)
            torch.cuda.synchronize(g1)
            if before is not None:
                before()
            for key, value in rank0_steps().items():
                best[key] = min(best.get(key, value), value)
        torch.cuda.synchronize(g0)
        torch.cuda.synchronize(g1)
        rows[name] = best
    t = time.perf_counter()
    rank1_copies()
    torch.cuda.synchronize(g1)
    torch.cuda.synchronize(g0)
    rows["rank 1's copies, wall"] = {"total": time.perf_counter() - t}
    print(f"\nhost ms of rank 0's copy steps, {n} pages per rank ({n * 8 / 1024:.1f} GiB), best of 4")
    keys = list(rows["alone"])
    print(f"{'step':>18} " + " ".join(f"{name:>24}" for name in rows))
    for key in keys:
        print(f"{key:>18} " + " ".join(f"{row.get(key, float('nan')) * 1e3:>24.3f}" for row in rows.values()))
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(0), pages=n, ms=rows), indent=2))


if __name__ == "__main__":
    main()
