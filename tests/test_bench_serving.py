"""bench/serving.py's figures from a fake server: TTFT, ITL (a reply of k
tokens counts k gaps), percentiles, tokens/s, errors and the daemon's split."""

from __future__ import annotations

import time

from bench.serving import Outcome, Request, run_level


def test_run_level_figures_from_known_arrivals():
    def send(req: Request) -> Outcome:
        sent = time.perf_counter() - 1.0  # as if sent a second ago
        if req.output_len == 0:
            return Outcome(sent, [], "UNAVAILABLE: down")
        # first token after 100 ms, then a reply of 1 token after 10 ms and one of 2 after 20 ms
        stages = {"prefill_ms": 80.0 + len(req.prompt), "compute_ms": 70.0}
        return Outcome(sent, [(sent + 0.1, 1), (sent + 0.11, 1), (sent + 0.13, 2)], None, stages)

    reqs = [Request([1, 2, 3], 4)] * 2 + [Request([1, 2], 4)] * 3 + [Request([1], 0)]
    row = run_level(send, reqs, concurrency=2, rate=float("inf"), seed=0)
    assert row["completed"] == 5 and row["errors"] == ["UNAVAILABLE: down"]
    assert row["output_tokens"] == 20
    assert abs(row["ttft_ms_p50"] - 100) < 1e-6
    assert abs(row["itl_ms_p50"] - 10) < 1e-6 and abs(row["itl_ms_p99"] - 10) < 1e-6
    assert abs(row["e2e_ms_p99"] - 130) < 1e-6
    assert (row["ttft_ms_n"], row["itl_ms_n"], row["e2e_ms_n"]) == (5, 15, 5)  # each percentile's samples
    assert row["output_tokens_per_s"] > 0 and row["concurrency"] == 2
    # The daemon's split of the completed requests, by median (the failed one has none).
    assert row["stages_ms_p50"] == {"prefill_ms": 82.0, "compute_ms": 70.0}


def test_new_shapes_ratio_of_the_first_request_per_length():
    import argparse

    from bench.serving import _new_shapes

    seen: set[int] = set()

    def send(req: Request) -> Outcome:  # the first of each length takes 150 ms, later ones 100
        sent = time.perf_counter() - 1.0
        ttft = 0.1 if len(req.prompt) in seen else 0.15
        seen.add(len(req.prompt))
        return Outcome(sent, [(sent + ttft, 1)], None, {"prefill_ms": ttft * 900})

    args = argparse.Namespace(prompt_len=64, output_len=2, range_ratio=0.0, new_shapes=3)
    got = _new_shapes(send, args, vocab=100)
    assert [s["prompt_len"] for s in got["new_shapes"]] == [49, 43, 61]
    assert all(abs(s["ratio"] - 1.5) < 1e-9 and abs(s["later_max_ratio"] - 1) < 1e-9
               for s in got["new_shapes"])
    assert abs(got["new_shape_ratio_p50"] - 1.5) < 1e-9 and len(got["new_shapes"][0]["ttft_ms"]) == 6
