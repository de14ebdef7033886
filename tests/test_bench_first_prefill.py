"""bench/first_prefill.py on the tiny model (CPU): one row per new length with the
first against the later ones, and the GEMM ladder on or off as asked."""

from __future__ import annotations

import json
import sys

import pytest

from bench import first_prefill


def _run(monkeypatch, tmp_path, *extra: str) -> dict:
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["first_prefill.py", "--tiny", "--lengths", "40", "70", "40",
                                      "--later", "2", "--max-tokens", "512", "--max-batch-tokens",
                                      "1024", "--json", str(out), *extra])
    first_prefill.main()
    return json.loads(out.read_text())


@pytest.mark.timeout(120)
def test_one_row_per_new_length_with_the_ladder_on_or_off(monkeypatch, tmp_path):
    on = _run(monkeypatch, tmp_path)
    assert [r["prompt_len"] for r in on["rows"]] == [40, 70]  # a length sent again is not new
    for r in on["rows"]:
        assert len(r["later_ms"]) == 2 and r["ratio"] == r["first_ms"] / r["later_ms_p50"]
        assert 0 < r["first_queued_ms"] <= r["first_compute_ms"]
        assert r["later_spread"] == max(r["later_ms"]) / r["later_ms_p50"]
        assert r["first_compiles"] == [] and r["later_compiles"] == 0  # nothing compiles on the CPU
        assert r["first_gc_ms"] >= 0 and r["later_gc_ms_p50"] >= 0
    # the ladder to 511 tokens at page 64: 8 rungs x 4 GEMM shapes, plus the head's 64
    assert on["gemm_ladder"] and on["gemm_calls"] == 8 * 4 + 64
    # graphs up to 2048 rows asked for; the CPU captures none (it runs the model eagerly)
    assert on["graph_max_rows"] == 2048 and on["graphs"] == 0 and on["graph_mib"] == 0
    off = _run(monkeypatch, tmp_path, "--no-gemm-ladder")
    assert not off["gemm_ladder"] and off["gemm_calls"] == 0


def test_a_negative_graph_max_rows_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["first_prefill.py", "--tiny", "--graph-max-rows", "-1"])
    with pytest.raises(SystemExit):
        first_prefill.main()
    assert "--graph-max-rows must be >= 0, got -1" in capsys.readouterr().err


def test_a_length_past_the_longest_prompt_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["first_prefill.py", "--tiny", "--lengths", "600",
                                      "--max-tokens", "512"])
    with pytest.raises(SystemExit):
        first_prefill.main()
    assert "--lengths must be in [1, --max-tokens), got 600" in capsys.readouterr().err
