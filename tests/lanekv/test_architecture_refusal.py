"""Both daemons refuse a checkpoint of an architecture the model code does not
run in one line naming it (no traceback) and exit non-zero, before loading."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import write_llama

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("command", [
    ["prefill", "--cp-size", "2"],
    ["decode", "--prefill", "127.0.0.1:1"],
])
def test_unsupported_architecture_is_one_line_naming_it(tmp_path, command) -> None:
    path = write_llama(tmp_path / "gpt2")
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "lanekv.cli", command[0], "--model", str(path),
                             *command[1:]], cwd=REPO, capture_output=True, text=True, timeout=150)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "GPT2LMHeadModel" in lines[0] and "not supported" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
