"""bench/ttft.py on the tiny model (CPU), the smoke test of the GPU run: the cross-host
paths in the same run as colocated and the fast path (gRPC with each --fetch-streams count,
NIXL over UCX TCP where lanekv[nixl] is installed), each transfer beside the raw rate of
its transport measured in the same run; bad choices refused by argparse."""

from __future__ import annotations

import json
import sys

import pytest
from lanekv.transfer.nixl.agent import available as nixl_available

from bench import ttft


def _run(monkeypatch, out, *extra: str) -> None:
    monkeypatch.setattr(sys, "argv", ["ttft.py", "--tiny", "--cp", "1", "--tokens", "48", "--repeat", "1",
                                      "--page-size", "16", "--json", str(out), *extra])
    ttft.main()


@pytest.mark.timeout(400)
def test_the_tiny_run_has_every_cross_host_path_beside_its_raw_rate(monkeypatch, tmp_path):
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    out = tmp_path / "ttft.json"
    nixl = ["nixl_tcp"] if nixl_available() else []
    _run(monkeypatch, out, "--paths", "grpc", "fast", *nixl, "--fetch-streams", "1", "2", "--fetch-relays", "2")
    got = json.loads(out.read_text())
    assert got["paths"] == ["grpc", "fast", *nixl] and got["fetch_streams"] == [1, 2]
    assert got["fetch_relays"] == 2
    (row,) = got["ttft"]
    assert row["tokens"] == 48 and row["bytes"] > 0
    for name in ("grpc_s1", "grpc_s2", "grpc_relay_s1", "grpc_relay_s2", "fast", *nixl):
        assert row[f"{name}_s"] > 0 and row[f"{name}_over_colocated"] == row[f"{name}_s"] / row["colocated_s"]
        assert row[f"{name}_transfer_s"] >= 0
    assert "fast_layer_s" not in row  # not asked for: no daemon started
    (alone,) = got["transfer_alone"]
    assert alone["raw_grpc_gbps"] > 0 and alone["grpc_gbps"] > 0
    assert alone["grpc_placed_over_not_placed"] == pytest.approx(alone["grpc_gbps"] / alone["grpc_dropped_gbps"])
    assert set(alone["grpc_streams"]) == {"1", "2"}
    for figures in alone["grpc_streams"].values():
        assert figures["gbps"] > 0 and figures["raw_gbps"] > 0
        assert figures["over_raw"] == pytest.approx(figures["gbps"] / figures["raw_gbps"])
        assert figures["relay_gbps"] > 0  # the same streams through the ranks' relays
    if nixl:
        assert alone["nixl_tcp_gbps"] > 0 and alone["nixl_tcp_raw_gbps"] > 0
        assert alone["nixl_tcp_over_raw"] == pytest.approx(alone["nixl_tcp_gbps"] / alone["nixl_tcp_raw_gbps"])
        assert alone["nixl_tcp_raw_host_gbps"] > 0


@pytest.mark.parametrize("streams", ["0", "9"])
def test_a_stream_count_out_of_range_is_refused(monkeypatch, tmp_path, capsys, streams):
    with pytest.raises(SystemExit):
        _run(monkeypatch, tmp_path / "x.json", "--fetch-streams", streams)
    assert f"--fetch-streams: streams_per_rank must be an integer in [1, 8], got streams_per_rank={streams}" \
        in capsys.readouterr().err


def test_a_relay_count_out_of_range_is_refused(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit):
        _run(monkeypatch, tmp_path / "x.json", "--fetch-relays", "9")
    assert "--fetch-relays: fetch_relays must be an integer in [0, 8], got fetch_relays=9" in capsys.readouterr().err
