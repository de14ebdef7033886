"""bench/fp8.py's GEMM sweep under a time limit: the budget that decides whether one more
shape fits, the table merged after every shape (swept rows only, the decode rows
of the file kept), the option refused when it is not a positive number, and the
decode rows' candidates timed as the linear (w8a16 and gemv beside w8a8), the down
projections' as ``silu_mul_fp8_linear`` on a gate/up output."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from lanekv.kernels.fp8.gemm_configs import GemmConfig, load_table, lookup
from lanekv.kernels.fp8.quant import (
    per_token_group_quant_fp8_ref,
    silu_mul_quant_fp8_ref,
    silu_mul_triton,
)
from lanekv.kernels.fp8.weights import dequantize_weight_blocks, quantize_weight_blocks

from bench import fp8 as bench_fp8


def test_budget_starts_a_shape_only_while_the_slowest_so_far_still_fits(monkeypatch):
    clock = {"now": 10.0}
    monkeypatch.setattr(bench_fp8.time, "perf_counter", lambda: clock["now"])
    budget = bench_fp8.Budget(100.0, start=0.0)
    assert budget.left() == 90.0 and budget.fits_another() and not budget.expired()
    budget.record_step(30.0)
    budget.record_step(20.0)  # the slowest so far stays 30
    assert budget.longest_step == 30.0
    clock["now"] = 69.0
    assert budget.fits_another()  # 31 s left > 30
    clock["now"] = 71.0
    assert not budget.fits_another() and not budget.expired()  # 29 s left: stop cleanly
    clock["now"] = 101.0
    assert budget.expired()
    unlimited = bench_fp8.Budget(None)
    unlimited.record_step(1e9)
    assert unlimited.fits_another() and not unlimited.expired()


def _row(rows, n, k, cfg, **extra):
    return dict(rows=rows, n=n, k=k, config=cfg.to_dict(), gemm_ms=0.01, vs_best_torch_fp8=1.0,
                **extra)


def test_write_table_merges_each_shape_and_keeps_the_other_rows(tmp_path):
    path = tmp_path / "table.json"
    decode = GemmConfig(16, 64, 128, 8, 4, 4, 4)
    prefill = GemmConfig(64, 128, 128, 8, 1, 4, 3)
    # a run without --sweep writes the configs it used
    bench_fp8.write_table(path, [_row(1, 4096, 4096, decode, config_source="select_config")],
                          "GPU X")
    # a prefill run writes one shape at a time (as bench_gemm's on_row does)
    bench_fp8.write_table(path, [_row(2048, 4096, 4096, prefill, tried=[],
                                      config_source="sweep")], "GPU X")
    # a swept row where no candidate ran correctly: the table learns nothing from it
    bench_fp8.write_table(path, [_row(2048, 6144, 4096, prefill, tried=[],
                                      config_source="select_config")], "GPU X")
    data = json.loads(path.read_text())
    assert data["device"] == "GPU X" and len(data["entries"]) == 2
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then moved into place
    table = load_table.__wrapped__(str(path))
    assert lookup(table, 1, 4096, 4096, (128, 128)) == decode
    assert lookup(table, 2048, 4096, 4096, (128, 128)) == prefill
    assert lookup(table, 2048, 6144, 4096, (128, 128)) is None


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_a_time_budget_that_is_not_positive_is_refused(monkeypatch, capsys, value):
    monkeypatch.setattr(sys, "argv", ["fp8.py", "--sweep", "--time-budget-s", value])
    with pytest.raises(SystemExit) as exc:
        bench_fp8.main()
    assert exc.value.code == 2
    assert f"--time-budget-s must be positive, got {float(value)}" in capsys.readouterr().err


def test_summary_reports_the_sweep_and_the_untuned_pick(capsys):
    rows = [dict(rows=2048, vs_best_torch_fp8=0.9, best_torch_fp8_ms=0.9, selected_ms=1.8),
            dict(rows=2048, vs_best_torch_fp8=0.4, best_torch_fp8_ms=0.4, selected_ms=0.8),
            dict(rows=1, vs_best_torch_fp8=1.5)]
    bench_fp8._summary(rows)
    out = capsys.readouterr().out
    assert "decode rows <= 64: vs best torch FP8 min 1.50 geomean 1.50, 0/1" in out
    assert "prefill rows >= 2048: vs best torch FP8 min 0.40 geomean 0.60, 1/2" in out
    assert "select_config's pick vs best torch FP8 min 0.50 geomean 0.50 (2 shapes)" in out


def test_the_sweep_at_decode_rows_times_each_candidate_as_the_linear(monkeypatch):
    """At decode rows each candidate runs as the step runs it (the linear on unquantized
    x: the w8a8 config quantizing x itself, the w8a16 one not at all), each checked
    against its own reference, the family recorded; without x (a down projection,
    whose input comes quantized) only the w8a8 candidates run, as the GEMM."""
    block, rows, n, k = (32, 32), 3, 48, 96
    cands = [GemmConfig(16, 32, 32, 4, 1, 4, 1), GemmConfig(16, 32, 32, 4, 2, 4, 1, w8a16=True)]
    monkeypatch.setattr(bench_fp8, "candidate_configs", lambda r, b: cands)
    monkeypatch.setattr(bench_fp8.torch.cuda, "synchronize", lambda: None)
    outs = []

    def time_fn(run):  # one run of what is timed; each later candidate "faster"
        outs.append(run())
        return 10.0 - len(outs)

    gen = torch.Generator().manual_seed(0)
    w, s = quantize_weight_blocks(torch.randn(n, k, generator=gen) * k ** -0.5, block)
    x = torch.randn(rows, k, generator=gen)
    a, a_scale = per_token_group_quant_fp8_ref(x, block[1])
    w_deq = dequantize_weight_blocks(w, s, block)
    ref = (a.float() * a_scale.repeat_interleave(block[1], 1)[:, :k]) @ w_deq.t()
    ref_x = x @ w_deq.t()
    tried, best = bench_fp8._sweep_configs(a, a_scale, [(w, s)], rows, ref, time_fn, block,
                                           x=x, ref_x=ref_x)
    assert [(t["family"], t["timed"]) for t in tried] == [("tiles", "linear"),
                                                          ("w8a16", "linear")]
    assert all("ms" in t and t["rel_err"] < 1e-5 for t in tried), tried
    assert best["cfg"] == cands[1] and best["family"] == "w8a16"
    torch.testing.assert_close(outs[1], ref_x, rtol=1e-5, atol=1e-5)  # x unquantized
    tried, best = bench_fp8._sweep_configs(a, a_scale, [(w, s)], rows, ref, time_fn, block)
    assert [(t["config"], t["timed"]) for t in tried] == [(cands[0].name(), "gemm")]
    assert best["cfg"] == cands[0]


def test_the_sweep_times_a_down_projection_as_the_step_runs_it(monkeypatch):
    """A down projection at decode rows: every candidate runs ``silu_mul_fp8_linear`` on
    the gate/up output, w8a8 quantizing the product first (checked against the quantized
    product's reference), w8a16 and gemv fusing the SiLU (checked against ``silu_mul``'s
    product unquantized)."""
    block, rows, n, k = (32, 32), 2, 48, 96
    cands = [GemmConfig(16, 32, 32, 4, 1, 4, 1), GemmConfig(16, 32, 32, 4, 2, 4, 1, w8a16=True),
             GemmConfig(16, 32, 32, 1, 2, 4, 1, gemv=True)]
    monkeypatch.setattr(bench_fp8, "candidate_configs", lambda r, b: cands)
    monkeypatch.setattr(bench_fp8.torch.cuda, "synchronize", lambda: None)
    calls = []
    real = bench_fp8.silu_mul_fp8_linear_triton
    monkeypatch.setattr(bench_fp8, "silu_mul_fp8_linear_triton",
                        lambda *a, **kw: calls.append(kw["config"]) or real(*a, **kw))
    gen = torch.Generator().manual_seed(1)
    w, s = quantize_weight_blocks(torch.randn(n, k, generator=gen) * k ** -0.5, block)
    gate_up = torch.randn(rows, 2 * k, generator=gen)
    a, a_scale = silu_mul_quant_fp8_ref(gate_up, block[1])
    w_deq = dequantize_weight_blocks(w, s, block)
    ref = (a.float() * a_scale.repeat_interleave(block[1], 1)[:, :k]) @ w_deq.t()
    ref_x = silu_mul_triton(gate_up) @ w_deq.t()
    tried, best = bench_fp8._sweep_configs(a, a_scale, [(w, s)], rows, ref, lambda run: 1.0,
                                           block, x=gate_up, ref_x=ref_x, silu=True)
    assert [t["family"] for t in tried] == ["tiles", "w8a16", "gemv"]
    assert all("ms" in t and t["rel_err"] < 1e-5 for t in tried), tried
    assert calls == cands and best["cfg"] == cands[0]
