"""bench/gemv_in_step.py without a GPU: the neighbours a config is tried against, the
table a candidate is timed with, the recording of what a step asks for, and a placement
that the kernels' own lookups see and that is undone at the end."""

from __future__ import annotations

import json
import os

import pytest
import torch
from lanekv.kernels.fp8 import gemm_configs
from lanekv.kernels.fp8.gemm_configs import TABLE_ENV, GemmConfig, load_table, lookup
from lanekv.kernels.fp8.gemm_gemv import dense_linear

from bench.gemv_in_step import (
    GEMV_SEEDS,
    Linear,
    candidates,
    neighbours,
    placement,
    record_dense,
    table_with,
)

H200 = "NVIDIA H200"


def test_neighbours_change_one_field_within_the_gemv_ranges():
    cfg = GemmConfig(16, 32, 128, 1, 8, 8, 1, gemv=True)
    got = neighbours(cfg)
    assert {(c.split_k, c.num_warps, c.block_n, c.num_stages) for c in got} == {
        (4, 8, 32, 1), (16, 8, 32, 1), (8, 4, 32, 1), (8, 8, 16, 1), (8, 8, 64, 1), (8, 8, 32, 2)}
    for c in got:
        assert c.gemv and sum(a != b for a, b in zip(c, cfg)) == 1
    # at the ranges' ends, and a half-group k step (no register prefetch): fewer
    edge = GemmConfig(16, 128, 64, 1, 16, 2, 1, gemv=True)
    assert {(c.split_k, c.num_warps, c.block_n, c.num_stages) for c in neighbours(edge)} == {
        (8, 2, 128, 1), (16, 4, 128, 1), (16, 2, 64, 1)}
    with pytest.raises(ValueError, match="is not a GEMV config"):
        neighbours(GemmConfig(16, 64, 128, 8, 4, 4, 3, w8a16=True))


def test_candidates_add_cublas_for_16_bit_linears_and_seeds_where_no_gemv_runs():
    dense = Linear(1, 4096, 4096, ("dense", 4096, 4096, False))
    fp8 = Linear(1, 4096, 4096, ("fp8", 4096, 4096, (128, 128)))
    gemv = GemmConfig(16, 32, 128, 1, 8, 8, 1, gemv=True)
    assert candidates(dense, gemv) == [None, *neighbours(gemv)]
    assert candidates(dense, None) == list(GEMV_SEEDS)  # cuBLAS is what runs: not tried again
    assert candidates(fp8, gemv) == neighbours(gemv)
    tiles = GemmConfig(16, 64, 128, 8, 4, 4, 3, w8a16=True)
    assert candidates(fp8, tiles) == list(GEMV_SEEDS)


def test_table_with_replaces_one_entry_and_the_kernel_lookup_reads_it(tmp_path):
    old = GemmConfig(16, 32, 128, 1, 8, 8, 1, gemv=True)
    new = GemmConfig(16, 64, 128, 1, 4, 4, 2, gemv=True)
    other = GemmConfig(64, 128, 128, 8, 1, 4, 3)
    entries = table_with([], 1, 4096, 4096, (128, 128), old)["entries"]
    entries = table_with(entries, 2048, 4096, 4096, (128, 128), other)["entries"]
    table = table_with(entries, 1, 4096, 4096, (128, 128), new)
    assert len(table["entries"]) == 2
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    loaded = load_table(str(path))
    assert lookup(loaded, 1, 4096, 4096, (128, 128)) == new
    assert lookup(loaded, 2048, 4096, 4096, (128, 128)) == other


def test_record_dense_names_the_shapes_dense_linear_asks_for_at_the_rows():
    w_o, w_down = torch.randn(48, 32), torch.randn(32, 40)

    def step() -> None:
        dense_linear(torch.randn(1, 32), w_o)
        dense_linear(torch.randn(1, 80), w_down, silu=True)
        dense_linear(torch.randn(3, 32), w_o)  # another row count: not this table's
        dense_linear(torch.randn(1, 32), w_o)  # asked twice, recorded once

    got = record_dense(step, 1)
    assert [(lin.n, lin.k, lin.key) for lin in got] == [
        (48, 32, ("dense", 48, 32, False)), (32, 40, ("dense", 32, 40, True))]
    assert [lin.label() for lin in got] == ["bf16 n48 k32", "bf16 n32 k40 silu"]
    from lanekv.kernels.fp8 import gemm_gemv
    assert gemm_gemv.dense_gemv_config is gemm_configs.dense_gemv_config  # put back


def test_a_placement_reaches_both_lookups_and_is_undone(monkeypatch):
    monkeypatch.delenv(TABLE_ENV, raising=False)
    fp8 = Linear(1, 4096, 4096, ("fp8", 4096, 4096, (128, 128)))
    dense = Linear(1, 4096, 4096, ("dense", 4096, 4096, False))
    committed_fp8 = gemm_configs.config_for_device(1, 4096, 4096, (128, 128), H200, 132)
    committed_dense = gemm_configs.DENSE_GEMV_TABLE[H200][(4096, 4096, False)]
    committed_qkv = gemm_configs.config_for_device(1, 6144, 4096, (128, 128), H200, 132)
    cand = GemmConfig(16, 128, 128, 1, 2, 2, 2, gemv=True)
    assert cand not in (committed_fp8, committed_dense)
    with placement(H200, 132) as place:
        assert place.current(fp8) == committed_fp8 and place.current(dense) == committed_dense
        place.put(fp8, cand)
        place.put(dense, None)  # cuBLAS
        assert gemm_configs.config_for_device(1, 4096, 4096, (128, 128), H200, 132) == cand
        assert (4096, 4096, False) not in gemm_configs.DENSE_GEMV_TABLE[H200]
        # every other committed FP8 entry is still served
        assert place.current(Linear(1, 6144, 4096, ("fp8", 6144, 4096, (128, 128)))) == committed_qkv
        place.put(dense, cand)
        assert place.current(dense) == cand
    assert TABLE_ENV not in os.environ
    assert gemm_configs.config_for_device(1, 4096, 4096, (128, 128), H200, 132) == committed_fp8
    assert gemm_configs.DENSE_GEMV_TABLE[H200][(4096, 4096, False)] == committed_dense


def test_record_fp8_names_the_shapes_the_fp8_linear_asks_a_config_for(monkeypatch):
    from lanekv.kernels.fp8 import gemm
    from lanekv.kernels.fp8.gemm import fp8_linear
    from lanekv.kernels.fp8.weights import quantize_weight_blocks

    from bench.gemv_in_step import record_fp8

    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")  # the interpreter: the launcher's own lookup
    w, scale = quantize_weight_blocks(torch.randn(32, 128), (128, 128))

    def step() -> None:
        fp8_linear(torch.randn(1, 128), w, scale, (128, 128))
        fp8_linear(torch.randn(8, 128), w, scale, (128, 128))  # beyond the GEMV's rows

    got = record_fp8(step, 1)
    assert [(lin.rows, lin.key) for lin in got] == [(1, ("fp8", 32, 128, (128, 128)))]
    assert got[0].label() == "fp8 n32 k128"
    assert gemm.select_config is gemm_configs.select_config  # put back
