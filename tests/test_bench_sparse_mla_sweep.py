"""bench/sparse_mla_sweep.py without a GPU: config labels, bytes per row, the fastest-per-case
summary (only correct rows ranked)."""

from __future__ import annotations

import argparse

import pytest
from lanekv.kernels.dsa.sparse_mla import SparseDecodeConfig

from bench.sparse_mla_sweep import CONFIGS, best_rows, label, parse_config, row_bytes


def test_parse_config_round_trips_its_field_order():
    cfg = parse_config("32,16,4,3,96,2")
    assert cfg == SparseDecodeConfig(block_h=32, block_n=16, num_warps=4, num_stages=3,
                                     min_split_rows=96, programs_per_sm=2)
    assert label(cfg) == "32,16,4,3,96,2"
    assert parse_config("default") == SparseDecodeConfig()
    for text in CONFIGS:
        assert text == "default" or label(parse_config(text)) == text
    for bad, match in (("64,32,8,2,64", "six positive ints"), ("64,32,8,2,0,1", "six positive"),
                       ("64,24,8,2,64,1", "block_n must be a power of two")):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            parse_config(bad)


def test_row_bytes_are_the_kernels_reads():
    assert row_bytes("bf16") == 1152 and row_bytes("fp8") == 656


def test_best_rows_rank_only_correct_configs_beside_the_default():
    default = label(SparseDecodeConfig())
    case = {"kv": "fp8", "batch": 1, "context": 8192}
    rows = [dict(case, config=default, us=30.0, gbps=45.0, ok=True),
            dict(case, config="32,32,4,2,64,1", us=10.0, gbps=134.0, ok=False),
            dict(case, config="32,32,8,2,32,1", us=20.0, gbps=67.0, ok=True),
            dict(case, config="16,32,4,2,128,1", error="OutOfResources")]
    assert best_rows(rows) == [dict(case, best="32,32,8,2,32,1", us=20.0, gbps=67.0,
                                    default_us=30.0)]
