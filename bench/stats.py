"""Figures every benchmark reports the same way: percentiles, the weight bytes a decode
step reads, and the time of back-to-back decode steps.

Percentiles interpolate linearly between the two nearest ranks (numpy's default
"linear" method), so a p99 over 20 samples is not simply the maximum; every
percentile is reported beside its sample count (``percentiles``). Step times are
CUDA events around ``steps`` back-to-back calls (``perf_counter`` on a CPU), the
median of ``runs`` such runs: the same clock for our engine and any peer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``, interpolated; None without values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q={q!r} must be in [0, 100]")
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentiles(name: str, values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict:
    """``{name_p50: ..., name_p90: ..., name_p99: ..., name_n: len(values)}``."""
    out = {f"{name}_p{q:g}": percentile(values, q) for q in qs}
    out[f"{name}_n"] = len(values)
    return out


class WeightBytes(NamedTuple):
    dense: float  # bytes every step reads (the embedding: only the rows it looks up)
    experts: float  # routed experts' bytes, all of them (a step reads those its tokens pick)


def step_weight_bytes(model, batch: int) -> WeightBytes:
    """Parameter bytes one decode step of ``batch`` tokens reads. The input embedding is
    a lookup: ``batch`` rows of it, not the table (1.05 of Llama-3-8B's 16.06 GB), unless
    the table is tied to the output head, which reads all of it."""
    shared = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(p.data_ptr(), []).append(name)
    dense = experts = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".experts." in name:
            experts += size
        elif name.endswith("embed_tokens.weight") and len(shared[p.data_ptr()]) == 1:
            dense += min(batch, p.shape[0]) * p.shape[1] * p.element_size()
        else:
            dense += size
    return WeightBytes(dense, experts)


class StepTiming(NamedTuple):
    ms: float  # median over the runs of one step's time
    runs_ms: list[float]  # each run's mean step time
    steps: int  # back-to-back steps per run
    clock: str  # "cuda events" or "perf_counter"


def time_steps(step: Callable[[], object], steps: int, runs: int, device) -> StepTiming:
    """Time ``runs`` runs of ``steps`` back-to-back ``step()`` calls (after one warm-up
    call); the median run's mean. On CUDA: events recorded before the first and after
    the last step of a run, one synchronize per run."""
    import torch

    if steps < 1 or runs < 1:
        raise ValueError(f"steps={steps} and runs={runs} must be >= 1")
    cuda = getattr(device, "type", str(device)) == "cuda"
    step()
    if cuda:
        torch.cuda.synchronize(device)
    out = []
    for _ in range(runs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                step()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            out.append((time.perf_counter() - t0) * 1e3 / steps)
    return StepTiming(statistics.median(out), out, steps, "cuda events" if cuda else "perf_counter")
