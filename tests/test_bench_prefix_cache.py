"""bench/prefix_cache.py runs tiny on the CPU and writes the rows the issue names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIELDS = {"prefix_cache", "transport", "ttft_ms_p50", "ttft_ms_p99", "prefill_tokens_computed", "kv_bytes_moved",
          "output_tokens_per_s", "hit_rate"}


@pytest.mark.timeout(400)
def test_tiny_run_writes_cache_on_and_off_rows(tmp_path):
    out = tmp_path / "prefix.json"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "bench" / "prefix_cache.py"), "--tiny", "--conversations", "2",
                    "--turns", "2", "--transports", "grpc", "--json", str(out)], check=True, cwd=root, timeout=380)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prefix_cache"], r["transport"]) for r in rows] == [("on", "grpc"), ("off", "grpc")]
    on, off = rows
    assert all(FIELDS <= set(r) for r in rows)
    assert off["hit_rate"] == 0 and on["hit_rate"] > 0
    # The second turns share the system prompt and the first turn: less computed, less moved.
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert on["kv_bytes_moved"] < off["kv_bytes_moved"]
