"""Tracebacks never reach a client or a command's error line.

A rank that failed sent its whole traceback to the parent, which put it in
the error: ``lanekv prefill`` on a checkpoint it cannot load printed a rank
traceback instead of one line, and a Generate client whose prefill met a
dead rank got a 3.8 KB UNAVAILABLE message with rank 0's traceback, absolute
paths and the peer's address. A rank now logs its traceback and reports one
line (``type: message``); status messages are one line
(``runtime.status.Refusal``), at most ``MAX_DETAILS_CHARS`` characters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from lanekv.runtime.status import MAX_DETAILS_CHARS, Refusal, refusals

from tests.checkpoints import write_llama

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[2]


def _prefill(checkpoint: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lanekv.cli", "prefill", "--model", str(checkpoint), "--cp-size", "2",
         "--page-size", "4", "--pool-pages", "16", "--device", "cpu", "--ready-file", str(tmp_path / "ready")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=200)


def _one_error_line(done: subprocess.CompletedProcess, code: int = 1,
                    prefix: str = "lanekv prefill: could not start:") -> str:
    """The command's own error line: the last line of stderr (log lines come before it)."""
    assert done.returncode == code, (done.returncode, done.stderr[-3000:])
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(prefix), done.stderr[-3000:]
    assert "Traceback" not in last and 'File "' not in last and len(last) < 600, last
    return last


def test_an_unloadable_checkpoint_is_one_line(tmp_path):
    # Weights that are not a safetensors file: only a rank finds out, loading them.
    checkpoint = write_llama(tmp_path / "llama")
    for weights in checkpoint.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    last = _one_error_line(_prefill(checkpoint, tmp_path))
    assert "rank" in last, last


def test_an_unsupported_checkpoint_is_one_line(tmp_path):
    checkpoint = write_llama(tmp_path / "llama")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    # Refused by the command before any rank starts (exit 2: the checkpoint is an argument).
    last = _one_error_line(_prefill(checkpoint, tmp_path), 2, "lanekv prefill:")
    assert "hidden_act='gelu' is not supported" in last, last


def test_a_status_message_is_one_bounded_line():
    refusal = Refusal(grpc.StatusCode.UNAVAILABLE, "rank 0 failed:\nTraceback (most recent call last):\n"
                      + '  File "/x.py", line 1\n' * 500)
    assert "\n" not in refusal.message and len(refusal.message) <= MAX_DETAILS_CHARS

    class Context:
        def abort(self, code, message):
            raise RuntimeError(code, message)

    with pytest.raises(RuntimeError) as aborted, refusals(Context()):
        raise refusal
    assert aborted.value.args[1] == refusal.message
