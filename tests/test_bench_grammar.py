"""bench/grammar.py runs end to end on a small tokenizer and writes its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_grammar_bench_writes_every_spec_and_batch(tmp_path):
    out = tmp_path / "grammar.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "grammar.py"), "--vocab", "600", "--model-vocab",
                          "640", "--batches", "1", "3", "--steps", "5", "--json", str(out)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["model_vocab"] == 640 and figures["vocab"] <= 600
    assert {(r["spec"], r["batch"]) for r in figures["rows"]} == {
        (s, b) for s in ("json_schema", "json_object", "regex") for b in (1, 3)}
    assert all(r["step_host_ms_n"] == 5 and r["step_host_ms_p50"] > 0 for r in figures["rows"])
    assert "us/row" in run.stdout
