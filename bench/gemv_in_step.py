"""The decode step's GEMV configs, tuned in the step: each candidate timed as a whole
captured step, never as a kernel alone.

Standalone GEMV times have not predicted the step (BENCHMARKS.md, thirteenth and
fourteenth sessions: a GEMV faster alone was slower in the step, and the other way
round), so this bench times what the target counts. One model is built once (dummy
weights, ``--weights fp8``: quantized blockwise; ``bf16``: as they are); one eager step
records the linears the step asks a config for at ``--batch`` rows (FP8: the block-FP8
GEMM's ``select_config``; bf16: the 16-bit GEMV's ``dense_gemv_config``). Then, linear
by linear (coordinate descent), each neighbour of the current config (``neighbours``:
split-K, warps and columns per program halved and doubled, the other stage count; for
bf16 also cuBLAS, and for a shape cuBLAS runs now, a few GEMV seeds) is timed as the
engine's captured step (``bench.fp8.decode_step_ms``) in an A/B pair with the current
one. A neighbour that is faster by more than ``--min-gain`` in two pairs replaces it.

How a candidate reaches the step: FP8, a table file in the committed format (the
committed table with that entry replaced, ``table_with``) named by
``LANEKV_FP8_GEMM_CONFIGS``; bf16, ``DENSE_GEMV_TABLE``'s entry for the device, replaced
in place (restored at the end). The JSON holds every timed pair and the winners; with
``--write-table PATH`` (FP8) the winning table is written there in the committed format,
for a later commit to ``kernels/fp8/gemm_tables/`` once the step figures say so.

    python3 bench/gemv_in_step.py --model llama3_8b --weights fp8 --batch 1 --json out.json
    python3 bench/gemv_in_step.py --model llama3_8b --weights bf16 --batch 1 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import lanekv  # noqa: F401  (the package first: the repository's lanekv/ folder alone is not it)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.kernels.fp8 import gemm, gemm_configs, gemm_gemv  # noqa: E402
from lanekv.kernels.fp8.gemm_configs import (  # noqa: E402
    GEMV_MAX_ROWS,
    TABLE_ENV,
    GemmConfig,
    check_config,
    table_entry,
)

# The GEMV's ranges (gemm_configs.gemv_candidates): columns per program, split-K, warps.
BLOCK_N = (16, 128)
SPLIT_K = (1, 16)
WARPS = (2, 8)
# Where a shape runs no GEMV now (cuBLAS, or a tensor-core config): GEMV configs to start
# from (winners of the dense table's sweep).
GEMV_SEEDS = (GemmConfig(16, 32, 128, 1, 4, 8, 1, gemv=True),
               GemmConfig(16, 64, 128, 1, 2, 8, 1, gemv=True),
               GemmConfig(16, 32, 128, 1, 8, 4, 1, gemv=True))


class Linear:
    """One shape the step asks a config for; ``key``: ("fp8", n, k, block) or
    ("dense", n, k, silu), the kind and what its table is keyed by."""

    def __init__(self, rows: int, n: int, k: int, key: tuple) -> None:
        self.rows, self.n, self.k, self.key = rows, n, k, key

    def label(self) -> str:
        if self.key[0] == "fp8":
            return f"fp8 n{self.n} k{self.k}"
        return f"bf16 n{self.n} k{self.k}" + (" silu" if self.key[3] else "")


def neighbours(cfg: GemmConfig) -> list[GemmConfig]:
    """The GEMV configs one step from ``cfg``: split-K, warps and columns per program
    halved and doubled within the GEMV's ranges, and the other stage count (two stages
    prefetch the next scale group, so only with a whole group a k step)."""
    if not cfg.gemv:
        raise ValueError(f"{cfg.name()} is not a GEMV config (gemv=False)")
    out = []
    for field, (low, high) in (("split_k", SPLIT_K), ("num_warps", WARPS), ("block_n", BLOCK_N)):
        value = getattr(cfg, field)
        for new in (value // 2, value * 2):
            if low <= new <= high and new != value:
                out.append(cfg._replace(**{field: new}))
    if cfg.block_k == 128:
        out.append(cfg._replace(num_stages=2 if cfg.num_stages == 1 else 1))
    return [check_config(c) for c in dict.fromkeys(out)]


def candidates(lin: Linear, current: GemmConfig | None) -> list[GemmConfig | None]:
    """What is tried against ``current`` for ``lin``: its GEMV neighbours, or the seeds
    where it is no GEMV; for a 16-bit linear also cuBLAS (None)."""
    out: list[GemmConfig | None] = [None] if lin.key[0] == "dense" else []
    out += neighbours(current) if current is not None and current.gemv else list(GEMV_SEEDS)
    return [c for c in dict.fromkeys(out) if c != current]


def table_with(entries: list[dict], rows: int, n: int, k: int, block: tuple[int, int],
               cfg: GemmConfig) -> dict:
    """A table (the committed format) of ``entries`` with the entry of (rows, n, k, block)
    replaced by ``cfg``, or added."""
    kept = [e for e in entries
            if (e["rows"], e["n"], e["k"], tuple(e["block"])) != (rows, n, k, tuple(block))]
    return {"entries": kept + [table_entry(rows, n, k, block, cfg)]}


def _record(module, name: str, engine_step, linear_of) -> list[Linear]:
    """The linears ``engine_step`` asks ``module.name`` (a config lookup) for, in first-asked
    order: ``linear_of(*args)`` names the linear of a call, or None to pass it over."""
    seen: dict[tuple, Linear] = {}
    original = getattr(module, name)

    def recording(*args):
        lin = linear_of(*args)
        if lin is not None:
            seen.setdefault(lin.key, lin)
        return original(*args)

    setattr(module, name, recording)
    try:
        engine_step()
    finally:
        setattr(module, name, original)
    return list(seen.values())


def record_fp8(engine_step, rows: int) -> list[Linear]:
    """The block-FP8 shapes one eager step asks ``select_config`` for at ``rows`` rows."""
    def linear_of(rows_, n, k, block, device):
        return Linear(rows, n, k, ("fp8", n, k, tuple(block))) if rows_ == rows <= GEMV_MAX_ROWS else None
    return _record(gemm, "select_config", engine_step, linear_of)


def record_dense(engine_step, rows: int) -> list[Linear]:
    """The 16-bit shapes one eager step asks ``dense_gemv_config`` for at ``rows`` rows."""
    def linear_of(rows_, n, k, silu, dtype, device):
        return Linear(rows, n, k, ("dense", n, k, silu)) if rows_ == rows else None
    return _record(gemm_gemv, "dense_gemv_config", engine_step, linear_of)


class Placement:
    """Puts a config (None: cuBLAS, bf16 only) of a linear into what the step reads."""

    def __init__(self, device_name: str, sms: int, workdir: Path) -> None:
        self.name, self.sms = device_name, sms
        self.workdir, self.count = workdir, 0
        committed = gemm_configs._committed_table(self.name)
        self.entries: list[dict] = json.loads(Path(committed).read_text())["entries"] if committed else []
        self.dense_before = dict(gemm_configs.DENSE_GEMV_TABLE.get(self.name, {}))
        self.env_before = os.environ.get(TABLE_ENV)

    def current(self, lin: Linear) -> GemmConfig | None:
        if lin.key[0] == "dense":
            return gemm_configs.DENSE_GEMV_TABLE.get(self.name, {}).get(lin.key[1:])
        return gemm_configs.config_for_device(lin.rows, lin.n, lin.k, lin.key[3], self.name, self.sms)

    def put(self, lin: Linear, cfg: GemmConfig | None) -> None:
        if lin.key[0] == "dense":
            table = gemm_configs.DENSE_GEMV_TABLE.setdefault(self.name, {})
            if cfg is None:
                table.pop(lin.key[1:], None)
            else:
                table[lin.key[1:]] = cfg
            return
        self.entries = table_with(self.entries, lin.rows, lin.n, lin.k, lin.key[3], cfg)["entries"]
        self.count += 1  # a new path each time: load_table memoizes a path's contents
        path = self.workdir / f"table{self.count}.json"
        path.write_text(json.dumps({"entries": self.entries}))
        os.environ[TABLE_ENV] = str(path)

    def restore(self) -> None:
        gemm_configs.DENSE_GEMV_TABLE[self.name] = self.dense_before
        if self.env_before is None:
            os.environ.pop(TABLE_ENV, None)
        else:
            os.environ[TABLE_ENV] = self.env_before


@contextlib.contextmanager
def placement(device_name: str, sms: int) -> Iterator[Placement]:
    """A ``Placement`` whose changes are undone at the end (its table files removed)."""
    with tempfile.TemporaryDirectory() as d:
        place = Placement(device_name, sms, Path(d))
        try:
            yield place
        finally:
            place.restore()


def name_of(cfg: GemmConfig | None) -> str:
    return "cuBLAS" if cfg is None else cfg.name()


def main() -> None:
    from lanekv.decode.engine import DecodeEngine
    from lanekv.decode.pool import PagePool, PageTable
    from lanekv.model.checkpoint import load_dummy_model
    from lanekv.model.sampling import SamplingParams

    from bench.fp8 import MODELS, decode_step_ms, model_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="llama3_8b")
    ap.add_argument("--weights", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100, help="steps per timing")
    ap.add_argument("--min-gain", type=float, default=0.005,
                    help="a neighbour replaces the current config when its step is this much "
                         "faster in two A/B pairs (default 0.5%%)")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the linears")
    ap.add_argument("--time-budget-s", type=float, default=400.0)
    ap.add_argument("--write-table", type=Path, default=None, help="FP8: the winning table's path")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    if args.json.exists():
        ap.error(f"--json {args.json} exists: one file per run")
    if not 1 <= args.batch <= GEMV_MAX_ROWS:
        ap.error(f"--batch must be 1 to {GEMV_MAX_ROWS} (the GEMV's rows), got {args.batch}")
    if args.weights == "bf16" and args.batch != gemm_configs.DENSE_GEMV_ROWS:
        ap.error(f"--weights bf16 takes --batch {gemm_configs.DENSE_GEMV_ROWS} (the 16-bit GEMV's "
                 f"table holds that row count only), got {args.batch}")
    if not torch.cuda.is_available():
        sys.exit("bench/gemv_in_step.py needs a CUDA GPU")
    started = time.perf_counter()
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(model_config(args.model, args.weights)))
        loaded = load_dummy_model(d, dtype=torch.bfloat16, device=device)
    page_size = 64
    pages = args.batch * -(-(args.context + args.steps * 3 + 16) // page_size) + 8
    pool = PagePool.for_model(loaded.config, pages, page_size, torch.bfloat16, device)
    pool.tensor.normal_()

    def eager_step() -> None:
        engine = DecodeEngine(loaded.model, pool, max_batch_size=args.batch, eos_token_ids=(),
                              graph_sizes=())
        for i in range(args.batch):
            engine.add(f"r{i}", PageTable.allocate(pool, args.context), 11 + i, SamplingParams(), 2)
        while engine.has_work:
            engine.step()

    def step_ms() -> float:
        ms = decode_step_ms(loaded, pool, args.batch, args.context, args.steps, device)
        gc.collect()  # the step's engine and its graphs go before the next one is captured
        return ms

    record = record_fp8 if args.weights == "fp8" else record_dense
    linears = record(eager_step, args.batch)
    rows: list[dict] = []
    result = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__,
                  model=args.model, weights=args.weights, batch=args.batch, context=args.context,
                  steps=args.steps, min_gain=args.min_gain, linears=[lin.label() for lin in linears],
                  pairs=rows)

    def save() -> None:
        args.json.write_text(json.dumps(result, indent=1))

    with placement(torch.cuda.get_device_name(device),
                   torch.cuda.get_device_properties(device).multi_processor_count) as place:
        start_cfgs = {lin.key: place.current(lin) for lin in linears}
        result["start"] = {lin.label(): name_of(start_cfgs[lin.key]) for lin in linears}
        result["start_step_ms"] = step_ms()
        print(f"{args.model} {args.weights} batch {args.batch}: step {result['start_step_ms']:.3f} ms "
              f"with the configs as committed", flush=True)
        out_of_time = False
        for _ in range(args.rounds):
            for lin in linears:
                best = place.current(lin)
                for cand in candidates(lin, best):
                    if time.perf_counter() - started > args.time_budget_s:
                        out_of_time = True
                        break
                    gains = []
                    for _pair in range(2):
                        place.put(lin, best)
                        base = step_ms()
                        place.put(lin, cand)
                        ms = step_ms()
                        gains.append(1 - ms / base)
                        rows.append(dict(linear=lin.label(), current=name_of(best), candidate=name_of(cand),
                                         current_ms=base, candidate_ms=ms, gain=gains[-1]))
                        print(f"  {lin.label():>22}: {name_of(best):>24} {base:.3f} ms, "
                              f"{name_of(cand):>24} {ms:.3f} ms ({gains[-1]:+.2%})", flush=True)
                        if gains[-1] <= args.min_gain:
                            break
                    if len(gains) == 2 and min(gains) > args.min_gain:
                        best = cand
                    place.put(lin, best)
                    save()
                if out_of_time:
                    break
            if out_of_time:
                break
        result["out_of_time"] = out_of_time
        result["final"] = {lin.label(): name_of(place.current(lin)) for lin in linears}
        result["final_step_ms"] = step_ms()
        if args.write_table is not None and args.weights == "fp8":
            args.write_table.write_text(json.dumps(
                {"device": result["device"], "note": f"bench/gemv_in_step.py {args.model} batch "
                 f"{args.batch}: the committed table with the step's winners", "entries": place.entries},
                indent=1))
    save()
    print(f"\n{'linear':>24} | {'committed':>24} | {'in-step winner':>24}")
    for lin in linears:
        print(f"{lin.label():>24} | {result['start'][lin.label()]:>24} | {result['final'][lin.label()]:>24}")
    print(f"step: {result['start_step_ms']:.3f} ms committed, {result['final_step_ms']:.3f} ms with the "
          f"winners ({1 - result['final_step_ms'] / result['start_step_ms']:+.2%})")


if __name__ == "__main__":
    main()
