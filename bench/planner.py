"""Time to plan a batch and build one rank's index maps (CPU; done once per batch).

    python bench/planner.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lanekv.prefill.allocator import LaneAllocator  # noqa: E402
from lanekv.prefill.index import build_rank_index  # noqa: E402
from lanekv.prefill.plan import plan_batch  # noqa: E402


def _median_ms(fn, repeat: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def run(results: list[dict]) -> None:
    for batch, tokens, cp, ps in [(64, 4096, 8, 64), (64, 4096, 8, 1), (1, 131072, 8, 64)]:
        extend = [tokens - 17 * (i % 3) for i in range(batch)]
        plan_ms = _median_ms(lambda e=extend, c=cp, p=ps: plan_batch(e, cp_size=c, page_size=p))
        plan = plan_batch(extend, cp_size=cp, page_size=ps)
        alloc = LaneAllocator(cp, batch * tokens // ps // cp + 2 * batch)
        pages = alloc.allocate_batch(plan)
        index_ms = _median_ms(
            lambda p=plan, x=pages: build_rank_index(p, 0, extend_pages=x), repeat=10
        )
        results.append(
            dict(batch=batch, tokens=tokens, cp_size=cp, page_size=ps, plan_ms=plan_ms, index_ms=index_ms)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results: list[dict] = []
    run(results)
    print(f"{'batch':>5} {'tokens':>7} {'cp':>3} {'page':>5} {'plan ms':>8} {'index ms':>9}")
    for r in results:
        print(
            f"{r['batch']:>5} {r['tokens']:>7} {r['cp_size']:>3} {r['page_size']:>5} "
            f"{r['plan_ms']:>8.3f} {r['index_ms']:>9.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(dict(machine=platform.machine(), results=results), indent=2))


if __name__ == "__main__":
    main()
