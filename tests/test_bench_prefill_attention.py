"""bench/prefill_attention.py on the tiny models (CPU): a row per model, cp and length, the
two backends agreeing, the environment left as it was, the profile tables written; and
bench/cudnn_sdpa_host.py refusing to run without a GPU."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from lanekv.kernels.prefill.sdpa import PREFILL_ATTENTION_ENV

from bench import cudnn_sdpa_host, prefill_attention


def _run(monkeypatch, tmp_path, *extra: str) -> dict:
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["prefill_attention.py", "--tiny", "--device", "cpu", "--tokens", "40",
                                      "70", "--repeat", "2", "--json", str(out), *extra])
    prefill_attention.main()
    return json.loads(out.read_text())


@pytest.mark.timeout(240)
def test_a_row_per_model_cp_and_length_with_the_backends_agreeing(monkeypatch, tmp_path):
    monkeypatch.delenv(PREFILL_ATTENTION_ENV, raising=False)
    got = _run(monkeypatch, tmp_path, "--cp", "1", "2")
    rows = got["rows"]
    assert [(r["model"], r["cp"], r["tokens"]) for r in rows] == [
        (m, cp, n) for m in ("v2_lite", "llama3_8b") for cp in (1, 2) for n in (40, 70)]
    for r in rows:
        for b in ("triton", "cudnn"):
            assert len(r[f"{b}_ms_runs"]) == 2 and r[f"{b}_ms"] > 0
            assert r[f"{b}_tokens_per_s"] == pytest.approx(r["tokens"] / r[f"{b}_ms"] * 1e3)
        assert r["cudnn_speedup"] == pytest.approx(r["triton_ms"] / r["cudnn_ms"])
        # both are float32 on the CPU: the split-and-merge path equals the kernel's
        assert r["logits_rel_err"] < 1e-4 and r["same_first_token"]
    assert PREFILL_ATTENTION_ENV not in os.environ  # set per prefill, restored after


@pytest.mark.timeout(240)
def test_the_profile_has_a_table_per_backend_and_the_env_comes_back(monkeypatch, tmp_path):
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "triton")
    prof = tmp_path / "prof.txt"
    _run(monkeypatch, tmp_path, "--models", "v2_lite", "--cp", "1", "--profile", str(prof))
    text = prof.read_text()
    for b in ("triton", "cudnn"):
        for n in (40, 70):
            assert f"== {b}, {n} tokens, by self_cpu_time_total ==" in text
    assert "aten::" in text
    assert os.environ[PREFILL_ATTENTION_ENV] == "triton"


def test_bad_arguments_are_refused(monkeypatch, tmp_path, capsys):
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    for args, message in ((["--cp", "0"], "--cp must be positive, got 0"),
                          (["--repeat", "0"], "--repeat must be at least 1, got 0"),
                          (["--json", str(taken)], "exists; results are never overwritten")):
        monkeypatch.setattr(sys, "argv", ["prefill_attention.py", "--tiny", "--device", "cpu", *args])
        with pytest.raises(SystemExit):
            prefill_attention.main()
        assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_the_cudnn_probe_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cudnn_sdpa_host.py"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        cudnn_sdpa_host.main()
