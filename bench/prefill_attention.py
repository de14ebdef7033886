"""The prefill with each attention backend, in one process, on one engine.

``LANEKV_PREFILL_ATTENTION`` picks the prefill's attention per call
(``model.attention.base.segment_attention``): ``triton`` (the CP prefill kernel) or
``cudnn`` (``kernels/prefill/sdpa.py``: cuDNN's kernel segment by segment, merged by
log-sum-exp). This bench prefills one prompt of each ``--tokens`` length at each
``--cp`` (default 1; the ranks are threads of this process: ``ThreadedPrefillEngine``, the rank code
the daemon runs; at cp > 1 every rank but the first takes the two-call path of a later
segment) with both backends on the same engine and weights, in A/B pairs whose order
alternates, after one warm-up prefill of each. Per row: each backend's median prefill
time and tokens/s, ``cudnn_speedup`` (Triton's time over cuDNN's: above 1 the cuDNN path
is faster), and the last-token logits of the two compared (``logits_rel_err``,
``same_first_token``), since the backends must agree.

Models: DeepSeek-V2-Lite's shapes (MLA, qk 192 / v 128) and Llama-3-8B's (GQA, 32 query
heads over 8 KV heads), dummy weights (``--weights fp8`` quantizes them blockwise; the
attention is the same), or the tiny ones (``--tiny``, CPU tests).

    python bench/prefill_attention.py --json bench/results/prefill_attention_h200.json
    python bench/prefill_attention.py --tiny --tokens 100 --cp 1 2 --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import lanekv  # noqa: F401  (the package first: the repository's lanekv/ folder alone is not it)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.kernels.prefill.sdpa import PREFILL_ATTENTION_ENV  # noqa: E402
from lanekv.model.checkpoint import load_dummy_model  # noqa: E402
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine  # noqa: E402
from lanekv.prefill.engine_config import EngineConfig  # noqa: E402

from bench import deepseek, prefill  # noqa: E402
from bench.fp8 import FP8_CONFIG, prefill_once  # noqa: E402
from bench.pdl_flag import scoped_env  # noqa: E402

MODELS = {"v2_lite": deepseek.V2_LITE, "llama3_8b": prefill.LLAMA3_8B}
TINY_MODELS = {"v2_lite": deepseek.TINY, "llama3_8b": prefill.TINY}
BACKENDS = ("triton", "cudnn")


def _prefill(engine: ThreadedPrefillEngine, ids: list[int], backend: str,
             device: torch.device) -> tuple[float, torch.Tensor]:
    """Seconds of one prefill of ``ids`` with ``backend`` (pages freed after), and its
    last-token logits."""
    with scoped_env(PREFILL_ATTENTION_ENV, backend):
        return prefill_once(engine, ids, device)


@contextlib.contextmanager
def _ranks_on_this_thread(engine: ThreadedPrefillEngine) -> Iterator[None]:
    """At cp 1, the one rank runs on the calling thread inside (the profiler records the
    host operators of the thread that starts it); at cp > 1 nothing changes (then only the
    device times are whole)."""
    if engine.config.cp_size != 1:
        yield
        return
    engine.group.run = lambda fn: [fn(0)]
    try:
        yield
    finally:
        del engine.group.run


def profile_row(engine: ThreadedPrefillEngine, ids: list[int], device: torch.device,
                path: Path) -> None:
    """One prefill per backend under ``torch.profiler``, after one unprofiled on the same
    thread (cuDNN builds its graphs per thread): its operators by device time and by host
    time, appended to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    keys = ("self_device_time_total",) * (device.type == "cuda") + ("self_cpu_time_total",)
    with _ranks_on_this_thread(engine):
        for b in BACKENDS:
            _prefill(engine, ids, b, device)
            with profile(activities=activities) as prof:
                _prefill(engine, ids, b, device)
            events = prof.key_averages()
            with path.open("a") as f:
                for key in keys:
                    f.write(f"\n== {b}, {len(ids)} tokens, by {key} ==\n")
                    f.write(events.table(sort_by=key, row_limit=25, max_name_column_width=70))


def bench_row(engine: ThreadedPrefillEngine, ids: list[int], repeat: int,
              device: torch.device, profile_to: Path | None = None) -> dict:
    """One warm-up prefill per backend, then ``repeat`` A/B pairs, the order alternating
    (and with ``profile_to``, one profiled prefill per backend)."""
    logits = {b: _prefill(engine, ids, b, device)[1] for b in BACKENDS}
    if profile_to is not None:
        profile_row(engine, ids, device, profile_to)
    times: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for i in range(repeat):
        for b in BACKENDS if i % 2 == 0 else BACKENDS[::-1]:
            times[b].append(_prefill(engine, ids, b, device)[0])
    row: dict = {}
    for b in BACKENDS:
        ms = statistics.median(times[b]) * 1e3
        row[f"{b}_ms"] = ms
        row[f"{b}_ms_runs"] = [t * 1e3 for t in times[b]]
        row[f"{b}_tokens_per_s"] = len(ids) / ms * 1e3
    row["cudnn_speedup"] = row["triton_ms"] / row["cudnn_ms"]
    ref, got = logits["triton"], logits["cudnn"]
    row["logits_rel_err"] = float((got - ref).norm() / ref.norm())
    row["same_first_token"] = bool(got.argmax() == ref.argmax())
    return row


def run(models: dict[str, dict], weights: str, tokens: list[int], cps: list[int], repeat: int,
        page_size: int, device: torch.device, profile_to: Path | None = None) -> list[dict]:
    out = []
    for name, base in models.items():
        cfg = dict(base, **({"quantization_config": FP8_CONFIG} if weights == "fp8" else {}))
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(cfg))
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            loaded = load_dummy_model(d, dtype=dtype, device=device)
            for cp in cps:
                for n in tokens:
                    ecfg = EngineConfig(d, cp_size=cp, page_size=page_size,
                                        pages_per_lane=-(-n // (page_size * cp)) + 8,
                                        dtype=str(dtype).removeprefix("torch."),
                                        load_format="dummy", device=device.type)
                    ids = torch.randint(3, cfg["vocab_size"], (n,),
                                        generator=torch.Generator().manual_seed(n)).tolist()
                    row = dict(model=name, weights=weights, cp=cp, tokens=n)
                    engine = ThreadedPrefillEngine(ecfg, loaded)
                    try:
                        row.update(bench_row(engine, ids, repeat, device, profile_to))
                    finally:
                        engine.close()
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    out.append(row)
                    print(f"{name:>9} cp {cp} {n:>6}: triton {row['triton_ms']:8.1f} ms, "
                          f"cudnn {row['cudnn_ms']:8.1f} ms ({row['cudnn_speedup']:.3f}x)",
                          flush=True)
            del loaded
    return out


def _table(rows: list[dict]) -> str:
    lines = [f"{'model':>9} {'cp':>2} {'tokens':>6} {'triton tok/s':>12} {'cudnn tok/s':>11} "
             f"{'speedup':>7} {'logits err':>10} {'same tok':>8}"]
    for r in rows:
        lines.append(f"{r['model']:>9} {r['cp']:>2} {r['tokens']:>6} {r['triton_tokens_per_s']:>12,.0f} "
                     f"{r['cudnn_tokens_per_s']:>11,.0f} {r['cudnn_speedup']:>7.3f} "
                     f"{r['logits_rel_err']:>10.2e} {str(r['same_first_token']):>8}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tiny", action="store_true", help="the tiny shapes (CPU tests)")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--cp", type=int, nargs="+", default=[1],
                    help="CP sizes (on CUDA the engine wants a GPU a rank)")
    ap.add_argument("--repeat", type=int, default=3, help="A/B pairs per row")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path, default=None, help="a new file (refused if it exists)")
    ap.add_argument("--profile", type=Path, default=None, metavar="PATH",
                    help="also profile one prefill per backend and row; the tables go to PATH")
    args = ap.parse_args()
    for flag, values in (("--tokens", args.tokens), ("--cp", args.cp)):
        for v in values:
            if v < 1:
                ap.error(f"{flag} must be positive, got {v}")
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.json is not None and args.json.exists():
        ap.error(f"--json {args.json} exists; results are never overwritten")
    device = torch.device(args.device)
    table = TINY_MODELS if args.tiny else MODELS
    rows = run({m: table[m] for m in args.models}, args.weights, args.tokens, args.cp,
               args.repeat, args.page_size, device, args.profile)
    result = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  date=time.strftime("%Y-%m-%d", time.gmtime()), torch=torch.__version__,
                  command=" ".join(sys.argv), rows=rows)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print("\n" + _table(rows))


if __name__ == "__main__":
    main()
