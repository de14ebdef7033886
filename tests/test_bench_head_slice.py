"""bench/head_slice_copy.py on the CPU, tiny: every figure, its bytes, the JSON (the copies
it times are checked by the bench itself: a wrong copy ends it)."""

from __future__ import annotations

import json

from bench.head_slice_copy import main


def test_the_bench_prints_and_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["--layers", "2", "--kv-heads", "4", "--head-dim", "8", "--tokens", "30", "--page-size", "4",
                 "--tp", "2,4", "--repeat", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    whole = 2 * 2 * 8 * 4 * 4 * 8 * 2  # layers, K and V, 8 pages of 4 rows, 4 heads x 8, float16 on the CPU
    figures = {row["figure"]: row["bytes"] for row in rows}
    assert figures["copy whole rows"] == whole
    for tp in (2, 4):
        for name in ("copy heads tp={}", "copy heads tp={} torch", "digest heads tp={} (rank)",
                     "digest heads tp={} (decode)"):
            assert figures[name.format(tp)] == whole // tp
    assert "copy heads tp=4" in capsys.readouterr().out
