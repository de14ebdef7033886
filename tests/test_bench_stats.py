"""bench/stats.py: interpolated percentiles with their sample counts, the weight bytes a
decode step reads (embedding rows, not the table), and the step timer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.stats import percentile, percentiles, step_weight_bytes, time_steps


def test_percentiles_interpolate_as_numpy_does():
    assert percentile([], 50) is None
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([1, 2, 3, 4], 50) == 2.5
    # Over 20 samples p99 is not simply the maximum (nearest rank made it so).
    values = [float(v) for v in range(1, 21)]
    assert percentile(values, 99) == pytest.approx(19.81) and percentile(values, 99) < max(values)
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 20, 101):
        sample = rng.normal(size=n).tolist()
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))
    assert percentiles("ttft_ms", values) == {"ttft_ms_p50": 10.5, "ttft_ms_p90": pytest.approx(18.1),
                                              "ttft_ms_p99": pytest.approx(19.81), "ttft_ms_n": 20}
    with pytest.raises(ValueError):
        percentile(values, 101)


class _Model(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(1000, 8)
        self.proj = torch.nn.Linear(8, 8, bias=False)
        self.mlp = torch.nn.Module()  # routed experts: "mlp.experts.<i>.weight"
        self.mlp.experts = torch.nn.ModuleList([torch.nn.Linear(8, 8, bias=False) for _ in range(4)])
        self.lm_head = torch.nn.Linear(8, 1000, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


def test_a_step_reads_the_embedding_rows_it_looks_up():
    item = 4  # float32
    read = step_weight_bytes(_Model(tied=False), batch=16)
    assert read.dense == (16 * 8 + 8 * 8 + 1000 * 8) * item  # 16 rows, the projection, the head
    assert read.experts == 4 * 8 * 8 * item
    assert step_weight_bytes(_Model(tied=False), batch=5000).dense == (1000 * 8 + 8 * 8 + 1000 * 8) * item
    # Tied to the head, the whole table is read (by the head), once.
    assert step_weight_bytes(_Model(tied=True), batch=16).dense == (8 * 8 + 1000 * 8) * item


def test_time_steps_times_back_to_back_runs():
    calls = []
    timing = time_steps(lambda: calls.append(1), steps=7, runs=3, device=torch.device("cpu"))
    assert len(calls) == 1 + 7 * 3 and len(timing.runs_ms) == 3 and timing.steps == 7
    assert timing.clock == "perf_counter" and timing.ms == sorted(timing.runs_ms)[1]
