"""Block-FP8 kernels against their torch references over odd sizes: the quantization
bit for bit (interpreted here, compiled in the gpu tests), the GEMMs within float32
summation-order tolerance, the grouped expert GEMMs captured in a CUDA graph on the GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lanekv.kernels.fp8 import gemm as gemm_module
from lanekv.kernels.fp8.experts import moe_experts_fp8_ref, moe_experts_fp8_triton
from lanekv.kernels.fp8.gemm import (
    block_fp8_matmul_ref,
    block_fp8_matmul_triton,
    fp8_linear_ref,
    fp8_linear_triton,
    linear_plan,
    silu_mul_fp8_linear_ref,
    silu_mul_fp8_linear_triton,
)
from lanekv.kernels.fp8.gemm_configs import (
    FAMILIES,
    GEMV_MAX_ROWS,
    MIN_DOT,
    TABLE_ENV,
    GemmConfig,
    candidate_configs,
    config_family,
    config_for_device,
    default_config,
    interpreter_config,
    load_table,
    lookup,
    select_config,
    table_entry,
)
from lanekv.kernels.fp8.quant import (
    per_token_group_quant_fp8_ref,
    per_token_group_quant_fp8_triton,
    silu_mul_quant_fp8_ref,
    silu_mul_quant_fp8_triton,
)
from lanekv.kernels.fp8.weights import (
    FP8_DTYPE,
    dequantize_weight_blocks,
    quantize_weight_blocks,
)

from tests.markers import GPU_CASE, requires_gpu

ROOT = Path(__file__).resolve().parents[2]


def _wide(rows, cols, seed, dtype=torch.float32, device="cpu"):
    """Values over six decades, so groups' scales differ and subnormal e4m3 values occur."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, cols)[torch.randperm(
        cols, generator=gen)]
    if rows:
        x[0, : min(cols, 40)] = 0.0  # an all-zero group
    return x.to(dtype).to(device)


def _bits(q):
    return q.view(torch.uint8)


QUANT_CASES = [(1, 16, 16, torch.float32), (5, 100, 32, torch.float32), (7, 300, 128, torch.float16),
               (3, 129, 64, torch.float32), (0, 64, 32, torch.float32), (17, 1000, 128, torch.float16)]


@pytest.mark.parametrize("rows,cols,group,dtype", QUANT_CASES)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_per_token_group_quant_is_bit_exact(rows, cols, group, dtype, ue8m0):
    x = _wide(rows, cols, rows + cols, dtype)
    q, s = per_token_group_quant_fp8_triton(x, group, scale_ue8m0=ue8m0)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x, group, scale_ue8m0=ue8m0)
    assert q.dtype == FP8_DTYPE and s.shape == (rows, -(-cols // group))
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)
    if ue8m0 and rows:
        assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    if rows:  # the quantized row restores the input to e4m3 precision
        back = q.float() * s.repeat_interleave(group, 1)[:, :cols]
        torch.testing.assert_close(back, x.float(), rtol=2 ** -3, atol=s.max().item() * 2 ** -9)


@pytest.mark.parametrize("rows,inter,group,dtype", [(1, 16, 16, torch.float32),
                                                    (6, 100, 32, torch.float16),
                                                    (9, 130, 128, torch.float32)])
def test_silu_mul_quant_equals_quantizing_the_product(rows, inter, group, dtype):
    gate_up = (_wide(rows, 2 * inter, inter, torch.float32) / 100).to(dtype)
    q, s = silu_mul_quant_fp8_triton(gate_up, group)
    q_ref, s_ref = silu_mul_quant_fp8_ref(gate_up, group)
    # the kernel's exp may differ from torch's by an ulp before the rounding to e4m3
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    differ = _bits(q) != _bits(q_ref)
    assert differ.float().mean() < 0.01
    torch.testing.assert_close(q.float()[differ], q_ref.float()[differ], rtol=2 ** -2, atol=2 ** -9)


def test_weight_blocks_round_trip_with_partial_blocks():
    # seeded: the global generator's state depends on which tests ran before in the worker,
    # and a draw tiny against its block's largest value rounds to zero in e4m3
    w = torch.randn(3, 70, 45, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, 45)
    q, s = quantize_weight_blocks(w, (32, 16))
    assert q.dtype == FP8_DTYPE and s.shape == (3, 3, 3)
    back = dequantize_weight_blocks(q, s, (32, 16))
    torch.testing.assert_close(back, w, rtol=2 ** -3, atol=1e-6 * w.abs().max().item())
    zero_q, zero_s = quantize_weight_blocks(torch.zeros(16, 16), (16, 16))
    assert torch.equal(zero_s, torch.ones(1, 1)) and not zero_q.float().any()


GEMM_CASES = [(1, 40, 100, (32, 32)), (19, 130, 257, (128, 128)), (5, 64, 64, (16, 64)),
              (33, 48, 96, (16, 32)), (0, 32, 32, (16, 16))]


def _gemm_inputs(rows, cols, depth, block, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    w, w_scale = quantize_weight_blocks(torch.randn(cols, depth, generator=gen) * depth ** -0.5,
                                        block)
    x = torch.randn(rows, depth, generator=gen)
    bias = torch.randn(cols, generator=gen)
    return [t.to(device) for t in (x, w, w_scale, bias)]


@pytest.mark.parametrize("rows,cols,depth,block", GEMM_CASES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_block_fp8_matmul_equals_reference(rows, cols, depth, block, out_dtype, with_bias):
    x, w, w_scale, bias = _gemm_inputs(rows, cols, depth, block, seed=rows + cols)
    a, a_scale = per_token_group_quant_fp8_ref(x, block[1])
    bias = bias.to(out_dtype) if with_bias else None
    out = block_fp8_matmul_triton(a, a_scale, w, w_scale, block, out_dtype, bias)
    ref = block_fp8_matmul_ref(a, a_scale, w, w_scale, block, out_dtype, bias)
    tol = 1e-5 if out_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_configs_with_a_k_step_inside_the_scale_group_agree():
    x, w, w_scale, _ = _gemm_inputs(9, 70, 200, (64, 64), seed=3)
    a, a_scale = per_token_group_quant_fp8_ref(x, 64)
    out = block_fp8_matmul_triton(a, a_scale, w, w_scale, (64, 64), torch.float32,
                                  config=GemmConfig(16, 16, 16, 4, 1, 4, 1))
    torch.testing.assert_close(out, block_fp8_matmul_ref(a, a_scale, w, w_scale, (64, 64),
                                                         torch.float32), rtol=1e-5, atol=1e-5)


# llama_fp8 of tests/decode/test_tp.py at TP 2: 16x16 scale blocks, each rank's linears
# [N, K]: qkv and down [64, 64], o [64, 32], gate_up [128, 64]; decode's rows and a prompt's
TP_SHARD_LINEARS = [(64, 64), (64, 32), (128, 64)]
TINY_BLOCKS = [(16, 16), (16, 32), (32, 16), (128, 128)]


@pytest.mark.parametrize("block", TINY_BLOCKS)
def test_chosen_configs_keep_the_fp8_dot_at_its_minimum_tile(block, monkeypatch):
    """Whatever picks the config of a tiny shape (the H200's table or heuristic, the
    interpreter's tiles, the sweep's candidates), its dot is at least 16 x 16 x 32
    (Triton refuses an fp8 dot with K < 32 on sm_90) and its k step one scale group
    or inside one: a 16-wide group pads the dot, it never shrinks it."""
    monkeypatch.delenv(TABLE_ENV, raising=False)
    assert MIN_DOT == (16, 16, 32)
    for rows in (1, 2, 5, 16, 17, 19, 32, 33, 40):
        cands = candidate_configs(rows, block)
        for cols in (8, 16, 24, 32, 48, 64):
            for depth in (16, 24, 32, 48, 64, 96, 128):
                for cfg in (config_for_device(rows, cols, depth, block, "NVIDIA H200", 132),
                            default_config(rows, cols, depth, block),
                            select_config(rows, cols, depth, block, torch.device("cpu")), *cands):
                    if cfg.gemv:  # the CUDA-core GEMV: no dot; its k step inside a group
                        assert block[1] % cfg.block_k == 0 and cfg.dot_k == cfg.block_k, cfg
                        continue
                    dot = (cfg.block_m, cfg.block_n, cfg.dot_k)
                    # a w8a16 dot is 16-bit: 16 deep suffices, no padding
                    low_k = 16 if cfg.w8a16 else MIN_DOT[2]
                    assert all(d >= low for d, low in zip(dot, (*MIN_DOT[:2], low_k))), (
                        cfg.name(), dot)
                    assert block[1] % cfg.block_k == 0 and cfg.dot_k in (cfg.block_k, 32), cfg
    assert GemmConfig(16, 64, 16).dot_k == 32 and GemmConfig(16, 64, 64).dot_k == 64


@pytest.mark.parametrize("rows", [2, 19])
def test_16_wide_scale_groups_pad_the_dot_and_equal_the_reference(rows):
    """The TP shard linears of the 16x16-block test checkpoint with the config an H200
    picks (k step 16, its dot padded to 32 with zero columns), and a ragged K: the GEMM
    equals the reference, the fused linear equals quantizing first bit for bit."""
    block = (16, 16)
    for cols, depth in [*TP_SHARD_LINEARS, (40, 40)]:
        cfg = config_for_device(rows, cols, depth, block, "NVIDIA H200", 132)
        x, w, w_scale, bias = _gemm_inputs(rows, cols, depth, block, seed=rows + depth)
        assert cfg.w8a16 is (rows <= 16), cfg  # decode's few rows: the heuristic's w8a16
        if cfg.w8a16:  # a 16-deep 16-bit dot; then its w8a8 twin (a table could name it)
            assert cfg.dot_k == 16, cfg
            torch.testing.assert_close(fp8_linear_triton(x, w, w_scale, block, bias, config=cfg),
                                       fp8_linear_ref(x, w, w_scale, block, bias),
                                       rtol=1e-5, atol=1e-5)
            cfg = cfg._replace(w8a16=False)
        assert cfg.block_k == 16 and cfg.dot_k == 32, cfg
        a, a_scale = per_token_group_quant_fp8_ref(x, block[1])
        out = block_fp8_matmul_triton(a, a_scale, w, w_scale, block, torch.float32, bias,
                                      config=cfg)
        ref = block_fp8_matmul_ref(a, a_scale, w, w_scale, block, torch.float32, bias)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        fused = fp8_linear_triton(x, w, w_scale, block, bias, fuse_quant=True, config=cfg)
        assert torch.equal(fused, out)


# one small config of each family (tiles, TMA, persistent, split-K, lagged scaling, w8a16,
# gemv)
FAMILY_CONFIGS = {
    "tiles": GemmConfig(16, 64, 128, 2, 1, 4, 1),
    "tma": GemmConfig(16, 256, 128, 2, 1, 4, 1, tma=True),  # two weight scale blocks
    "persistent": GemmConfig(16, 32, 128, 2, 1, 4, 1, tma=True, persistent=True),
    "splitk": GemmConfig(16, 64, 128, 2, 3, 4, 1),
    "lag": GemmConfig(16, 64, 128, 2, 1, 4, 1, lag=True),
    "w8a16": GemmConfig(16, 64, 128, 2, 1, 4, 1, w8a16=True),
    "gemv": GemmConfig(16, 64, 128, 1, 2, 4, 1, gemv=True),
}
# every family but w8a16 and gemv, which quantize nothing (tests/kernels/test_fp8_w8a16.py,
# test_fp8_gemv.py)
W8A8_FAMILIES = [f for f in FAMILIES if f not in ("w8a16", "gemv")]
ODD_SHAPES = [(1, 128, 256), (5, 384, 384), (33, 128, 384), (33, 384, 256)]


def test_every_family_has_a_test_config():
    assert set(FAMILY_CONFIGS) == set(FAMILIES)
    assert all(config_family(cfg) == fam for fam, cfg in FAMILY_CONFIGS.items())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rows,cols,depth", ODD_SHAPES)
def test_each_config_family_equals_reference_on_odd_sizes(family, rows, cols, depth):
    """Float32 inputs quantized (activations per token group, weights per 128x128 block)."""
    x, w, w_scale, bias = _gemm_inputs(rows, cols, depth, (128, 128), seed=rows * cols + depth)
    out, ref = _family_and_reference(FAMILY_CONFIGS[family], x, w, w_scale, (128, 128),
                                     bias if rows % 2 else None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _family_and_reference(cfg, x, w, w_scale, block, bias=None):
    """A w8a8 config: the GEMM of the quantized activations and its reference; a w8a16
    or gemv config: the linear of the unquantized ones and ``fp8_linear_ref`` (float32;
    gemv on the first ``GEMV_MAX_ROWS`` rows, all it takes)."""
    if cfg.gemv:
        x = x[:GEMV_MAX_ROWS]
    if cfg.w8a16 or cfg.gemv:
        return (fp8_linear_triton(x, w, w_scale, block, bias, config=cfg),
                fp8_linear_ref(x, w, w_scale, block, bias))
    a, a_scale = per_token_group_quant_fp8_ref(x, block[1])
    return (block_fp8_matmul_triton(a, a_scale, w, w_scale, block, torch.float32, bias,
                                    config=cfg),
            block_fp8_matmul_ref(a, a_scale, w, w_scale, block, torch.float32, bias))


def test_split_k_over_more_splits_than_k_steps_and_a_ragged_k():
    x, w, w_scale, bias = _gemm_inputs(3, 96, 200, (32, 32), seed=11)
    a, a_scale = per_token_group_quant_fp8_ref(x, 32)
    ref = block_fp8_matmul_ref(a, a_scale, w, w_scale, (32, 32), torch.float16, bias.half())
    for split in (2, 5, 16):  # 7 k steps: 16 is clamped, the last splits of 5 may be empty
        out = block_fp8_matmul_triton(a, a_scale, w, w_scale, (32, 32), torch.float16, bias.half(),
                                      config=GemmConfig(16, 32, 32, 8, split, 4, 1))
        torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_sweep_candidates_are_valid_and_cover_the_families(rows):
    cands = candidate_configs(rows, (128, 128))
    assert len(set(cands)) == len(cands)
    families = {config_family(c) for c in cands}
    assert {"tiles", "tma", "lag"} <= families
    assert ("splitk" if rows <= 64 else "persistent") in families
    assert ("w8a16" in families) is (rows <= 16)
    assert ("gemv" in families) is (rows <= GEMV_MAX_ROWS)
    for cfg in cands:
        assert GemmConfig.from_dict(cfg.to_dict()) == cfg
        smem = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k
        assert smem <= 200 * 1024, cfg.name()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_sweep_candidate_of_each_family_runs_interpreted(family):
    """The first candidate of the family, at the row count it is tuned for, on a tiny shape."""
    rows = {"splitk": 1, "w8a16": 1, "gemv": 1, "persistent": 2048}.get(family, 64)
    cfg = next(c for c in candidate_configs(rows, (128, 128)) if config_family(c) == family)
    x, w, w_scale, _ = _gemm_inputs(5, 384, 384, (128, 128), seed=5)
    out, ref = _family_and_reference(cfg, x, w, w_scale, (128, 128))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_default_config_splits_k_only_for_few_row_tiles():
    assert default_config(1, 4096, 4096, (128, 128)).split_k == 2  # 64 tiles on 132 SMs
    assert default_config(1, 576, 2048, (128, 128)).split_k == 4  # 9 tiles, 16 k steps
    assert default_config(1, 28672, 4096, (128, 128)).split_k == 1  # 448 tiles
    assert default_config(8192, 4096, 4096, (128, 128)).split_k == 1
    assert default_config(8192, 4096, 4096, (64, 64)).block_k == 64


def test_config_table_round_trip_and_nearest_rows(tmp_path, monkeypatch):
    small, big = GemmConfig(16, 64, 128, 8, 4, 4, 5), GemmConfig(128, 256, 128, 8, 1, 8, 3,
                                                                   tma=True)
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"entries": [
        table_entry(1, 4096, 4096, (128, 128), small, ms=0.01),
        table_entry(8192, 4096, 4096, (128, 128), big)]}))
    table = load_table(str(path))
    assert lookup(table, 1, 4096, 4096, (128, 128)) == small
    assert lookup(table, 4, 4096, 4096, (128, 128)) == small
    assert lookup(table, 2048, 4096, 4096, (128, 128)) == big
    # more than 4x from every tuned row count: the default decides, not a far tuned entry
    assert lookup(table, 50, 4096, 4096, (128, 128)) is None
    assert lookup(table, 1024, 4096, 4096, (128, 128)) is None
    assert lookup(table, 1, 4096, 2048, (128, 128)) is None  # shape not tuned
    monkeypatch.setenv(TABLE_ENV, str(path))
    assert select_config(1, 4096, 4096, (128, 128), torch.device("cpu")) == small
    assert select_config(1, 64, 64, (32, 32), torch.device("cpu")).block_k == 32  # not tuned


@pytest.mark.parametrize("entry,message", [
    ({"rows": 1, "n": 8, "k": 8, "block": [128, 128], "config": {"block_m": 24, "block_n": 64}},
     "block_m must be a power of two"),
    ({"rows": 1, "n": 8, "k": 8, "block": [128, 128], "config": {"block_m": 16, "block_n": 64,
                                                                 "warps": 4}},
     "unknown GEMM config field"),
    ({"rows": 1, "n": 8, "block": [128, 128], "config": {"block_m": 16, "block_n": 64}},
     "entry 0 is malformed"),
    ({"rows": 1, "n": 8, "k": 8, "block": [64, 64], "config": {"block_m": 16, "block_n": 64}},
     "does not divide the scale block 64"),
])
def test_malformed_config_tables_are_refused_naming_the_field(tmp_path, entry, message):
    path = tmp_path / f"t{abs(hash(message))}.json"
    path.write_text(json.dumps({"entries": [entry]}))
    with pytest.raises(ValueError, match=message):
        load_table(str(path))


def test_config_switches_a_shape_cannot_take_are_refused():
    x, w, w_scale, _ = _gemm_inputs(2, 64, 64, (32, 32))
    a, a_scale = per_token_group_quant_fp8_ref(x, 32)
    with pytest.raises(ValueError, match="config.lag needs config.block_n=64 to divide"):
        block_fp8_matmul_triton(a, a_scale, w, w_scale, (32, 32), torch.float32,
                                config=GemmConfig(16, 64, 32, lag=True))
    with pytest.raises(ValueError, match="config.block_k=64 must divide block_k=32"):
        block_fp8_matmul_triton(a, a_scale, w, w_scale, (32, 32), torch.float32,
                                config=GemmConfig(16, 32, 64))
    w8a16 = GemmConfig(16, 32, 32, w8a16=True)
    with pytest.raises(ValueError, match=r"config.w8a16=True \(m16n32k32g8s1w4st3W\) reads"):
        block_fp8_matmul_triton(a, a_scale, w, w_scale, (32, 32), torch.float32, config=w8a16)
    with pytest.raises(ValueError, match="fuse_quant=True asks for quantized activations"):
        fp8_linear_triton(x, w, w_scale, (32, 32), fuse_quant=True, config=w8a16)
    with pytest.raises(ValueError, match="config.block_k=64 must divide block_k=32"):
        fp8_linear_triton(x, w, w_scale, (32, 32), config=w8a16._replace(block_k=64))
    for switch in ("tma", "persistent", "lag"):
        with pytest.raises(ValueError, match=f"{switch}=True is a w8a8 switch"):
            GemmConfig.from_dict(dict(w8a16.to_dict(), **{switch: True}))


@pytest.mark.parametrize("family", W8A8_FAMILIES)
@pytest.mark.parametrize("rows,cols,depth,block,ue8m0", [
    (1, 128, 256, (128, 128), False), (5, 384, 384, (128, 128), True),
    (33, 96, 200, (32, 32), False), (3, 70, 100, (32, 32), True)])
def test_quantizing_inside_the_gemm_equals_quantizing_first(family, rows, cols, depth, block,
                                                            ue8m0):
    """The fused path of a decode linear: bit for bit the quantize-then-GEMM result."""
    x, w, w_scale, bias = _gemm_inputs(rows, cols, depth, block, seed=rows + depth)
    x = _wide(rows, depth, rows, torch.float32) / 100  # groups with different scales
    cfg = FAMILY_CONFIGS[family]._replace(block_k=block[1])
    if cfg.lag and block[0] % cfg.block_n:
        cfg = cfg._replace(block_n=block[0])
    fused = fp8_linear_triton(x, w, w_scale, block, bias, scale_ue8m0=ue8m0, fuse_quant=True,
                              config=cfg)
    a, a_scale = per_token_group_quant_fp8_ref(x, block[1], scale_ue8m0=ue8m0)
    first = block_fp8_matmul_triton(a, a_scale, w, w_scale, block, torch.float32, bias,
                                    config=cfg)
    assert torch.equal(fused, first)
    unfused = fp8_linear_triton(x, w, w_scale, block, bias, scale_ue8m0=ue8m0, fuse_quant=False,
                                config=cfg)
    assert torch.equal(unfused, first)


def test_fused_quantization_needs_the_k_step_to_be_the_group():
    x, w, w_scale, _ = _gemm_inputs(2, 64, 64, (32, 32))
    with pytest.raises(ValueError, match="config.block_k=16 to equal block_k=32"):
        fp8_linear_triton(x, w, w_scale, (32, 32), fuse_quant=True,
                          config=GemmConfig(16, 32, 16))


LLAMA3_8B_LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096)}


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_decode_linears_on_an_h200_quantize_as_the_sweep_timed_fastest(rows, monkeypatch):
    """The H200 table's Llama-3-8B picks: at 1 and 16 rows 16-row tiles, each linear as
    the decode sweep timed it fastest: the CUDA-core gemv or w8a16 (nothing quantized),
    the quantization kernel first (``quant_first``) or inside the GEMM; at 64 rows 64-row
    tiles quantize first (fused, every one of the 96-224 column tiles repeated the rows'
    quantization: BENCHMARKS.md, issue 33). At 1 row every linear takes the gemv (the
    tenth session's sweep timed it fastest at each)."""
    monkeypatch.delenv(TABLE_ENV, raising=False)
    kinds = {}
    for name, (n, k) in LLAMA3_8B_LINEARS.items():
        cfg = config_for_device(rows, n, k, (128, 128), "NVIDIA H200", 132)
        plan = linear_plan(rows, n, k, (128, 128), torch.device("cpu"), config=cfg)
        assert plan.config == cfg, (name, cfg.name())
        assert (cfg.block_m == 16) is (rows <= 16), (name, cfg.name())
        assert plan.fuse_quant is (rows <= 16 and not (cfg.w8a16 or cfg.gemv or cfg.quant_first)), (
            name, cfg.name())
        kinds[name] = ("gemv" if cfg.gemv else "w8a16" if cfg.w8a16 else
                       "first" if not plan.fuse_quant else "fused")
    if rows == 1:
        assert kinds == {"qkv": "gemv", "o": "gemv", "gate_up": "gemv"}, kinds
    # the heuristic's 64-row tile (no table) quantizes first too
    assert not linear_plan(64, 4096, 4096, (128, 128), torch.device("cpu"),
                           config=default_config(64, 4096, 4096, (128, 128))).fuse_quant


def test_linear_plan_rule_and_explicit_choice():
    cpu, block = torch.device("cpu"), (128, 128)
    tile16, tile32 = GemmConfig(16, 64), GemmConfig(32, 64)
    assert linear_plan(16, 256, 256, block, cpu, config=tile16).fuse_quant
    assert linear_plan(64, 256, 256, block, cpu, config=tile16).fuse_quant
    assert not linear_plan(65, 256, 256, block, cpu, config=tile16).fuse_quant  # prefill rows
    assert not linear_plan(16, 256, 256, block, cpu, config=tile32).fuse_quant
    assert not linear_plan(16, 256, 256, block, cpu, config=tile16._replace(block_k=64)).fuse_quant
    assert linear_plan(16, 256, 256, block, cpu, config=tile32, fuse_quant=True).fuse_quant
    assert not linear_plan(16, 256, 256, block, cpu, config=tile16, fuse_quant=False).fuse_quant
    assert linear_plan(3, 256, 256, block, cpu).config == interpreter_config(block)  # CPU
    w8a16 = GemmConfig(16, 64, w8a16=True)  # quantizes nothing: no fusion to plan
    assert linear_plan(16, 256, 256, block, cpu, config=w8a16) == (w8a16, False)


@pytest.mark.parametrize("block_m,quantizer_runs", [(16, 0), (32, 1)])
def test_fp8_linear_quantizes_first_in_row_tiles_wider_than_16(block_m, quantizer_runs,
                                                                monkeypatch):
    """The default path by the config's row tile: the quantization kernel runs first
    only for a 32-row tile; both results are the quantize-then-GEMM one, bit for bit."""
    block = (32, 32)
    x, w, w_scale, bias = _gemm_inputs(20, 48, 96, block, seed=5)
    runs = []
    real = gemm_module.per_token_group_quant_fp8

    def counting(*args, **kwargs):
        runs.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gemm_module, "per_token_group_quant_fp8", counting)
    cfg = GemmConfig(block_m, 32, 32, 4, 1, 4, 1)
    out = fp8_linear_triton(x, w, w_scale, block, bias, config=cfg)
    assert len(runs) == quantizer_runs
    a, a_scale = per_token_group_quant_fp8_ref(x, block[1])
    assert torch.equal(out, block_fp8_matmul_triton(a, a_scale, w, w_scale, block,
                                                    torch.float32, bias, config=cfg))


_COMPILE_PLAN = """
import json, sys
sys.path.insert(0, {root!r})
import torch
from bench.fp8_gemm_compile import compile_config
from lanekv.kernels.fp8.gemm import linear_plan
from lanekv.kernels.fp8.gemm_configs import config_for_device
out = []
for rows in (64, 16):
    cfg = config_for_device(rows, 6144, 4096, (128, 128), "NVIDIA H200", 132)
    fused = linear_plan(rows, 6144, 4096, (128, 128), torch.device("cpu"), config=cfg).fuse_quant
    other = compile_config(cfg, quant_a=not fused) if rows == 64 else None
    out.append(dict(rows=rows, fused=fused, run=compile_config(cfg, quant_a=fused), other=other))
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_the_decode_qkv_compiles_the_variant_with_the_shorter_k_loop():
    """Compiled for sm_90 offline, Llama-3-8B's qkv GEMM as an H200 runs it: at 64 rows
    the pre-quantized variant, whose k loop is the shorter (quantizing a 64-row tile in
    every column tile made the fused loop the longer); at 16 rows the fused one; neither
    spills."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", TABLE_ENV)}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_PLAN.format(root=str(ROOT))], env=env,
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    at64, at16 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not at64["fused"] and at16["fused"]
    assert at64["run"]["k_loop"] < at64["other"]["k_loop"], at64
    for rec in (at64["run"], at16["run"]):
        assert rec["local_bytes"] == 0 and rec["k_loop"] > 0, rec


_COMPILE_TP_SHARDS = """
import json, sys
sys.path.insert(0, {root!r})
import torch
from bench.fp8_gemm_compile import compile_config
from lanekv.kernels.fp8.gemm import linear_plan
from lanekv.kernels.fp8.gemm_configs import config_for_device
block, out, seen = (16, 16), [], set()
for rows in (2, 19):
    for n, k in {linears!r}:
        cfg = config_for_device(rows, n, k, block, "NVIDIA H200", 132)
        fused = linear_plan(rows, n, k, block, torch.device("cpu"), config=cfg).fuse_quant
        # as it runs, and the other variant; a w8a16 pick, then its w8a8 twin both ways
        twin = cfg._replace(w8a16=False)
        runs = ([(cfg, False), (twin, True), (twin, False)] if cfg.w8a16 else
                [(cfg, fused), (cfg, not fused)])
        for cfg, quant_a in runs:
            ints = dict(rows=rows, cols=n, depth=k, stride_a=k, stride_w=k, stride_out=n,
                        stride_as=0 if quant_a else k // 16, stride_ws=k // 16)
            key = (cfg, quant_a, tuple(v % 16 == 0 for v in ints.values()))
            if key not in seen:
                seen.add(key)
                rec = compile_config(cfg, quant_a=quant_a, block=block, ints=ints)
                out.append(dict(rec, rows=rows, n=n, k=k, quant_a=quant_a, dot_k=cfg.dot_k,
                                block_k=cfg.block_k, w8a16=cfg.w8a16))
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_the_16_wide_scale_group_tp_shards_compile_for_sm_90():
    """Compiled for sm_90 offline, the GEMMs the 16x16-block test checkpoint's TP-2
    ranks run on an H200 (Triton refused their 16-deep fp8 dots): each w8a8 config's dot
    is padded to 32, fused and pre-quantized variants compile, the w8a16 picks at 2 rows
    compile their 16-deep 16-bit dot, none spills."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", TABLE_ENV)}
    script = _COMPILE_TP_SHARDS.format(root=str(ROOT), linears=TP_SHARD_LINEARS)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["quant_a"] for r in recs} == {True, False} and {r["rows"] for r in recs} == {2, 19}
    assert {r["rows"] for r in recs if r["w8a16"]} == {2}
    for rec in recs:
        assert rec["block_k"] == 16 and rec["dot_k"] == (16 if rec["w8a16"] else 32), rec
        assert rec["local_bytes"] == 0 and rec["k_loop"] > 0, rec


@pytest.mark.parametrize("rows,cols,depth,block", GEMM_CASES[:3])
def test_fp8_linear_is_the_gemm_of_the_quantized_activations(rows, cols, depth, block):
    x, w, w_scale, bias = _gemm_inputs(rows, cols, depth, block, seed=7)
    out = fp8_linear_triton(x[None], w, w_scale, block, bias)[0]  # leading dims kept
    a, a_scale = per_token_group_quant_fp8_ref(x, block[1])
    torch.testing.assert_close(out, block_fp8_matmul_ref(a, a_scale, w, w_scale, block,
                                                         torch.float32, bias),
                               rtol=1e-5, atol=1e-5)
    # and within the activations' e4m3 rounding of the dequantized-weight reference
    dense = fp8_linear_ref(x, w, w_scale, block, bias)
    if rows:
        assert (out - dense).norm() <= 0.05 * dense.norm()


def test_silu_mul_fp8_linear_equals_reference():
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(7, 2 * 96, generator=gen)
    w, w_scale = quantize_weight_blocks(torch.randn(50, 96, generator=gen) * 0.1, (32, 32))
    out = silu_mul_fp8_linear_triton(gate_up, w, w_scale, (32, 32))
    a, a_scale = silu_mul_quant_fp8_ref(gate_up, 32)
    torch.testing.assert_close(out, block_fp8_matmul_ref(a, a_scale, w, w_scale, (32, 32),
                                                         torch.float32), rtol=1e-3, atol=1e-3)
    dense = silu_mul_fp8_linear_ref(gate_up, w, w_scale, (32, 32))
    assert (out - dense).norm() <= 0.05 * dense.norm()


def _moe_inputs(tokens, top_k, experts, hidden, inter, block, seed=0, device="cpu",
                dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13, s13 = quantize_weight_blocks(torch.randn(experts, 2 * inter, hidden, generator=gen)
                                      * hidden ** -0.5, block)
    w2, s2 = quantize_weight_blocks(torch.randn(experts, hidden, inter, generator=gen)
                                    * inter ** -0.5, block)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]) if (
        tokens) else torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(tokens, top_k, generator=gen)
    return [t.to(device) for t in (x, w13, s13, w2, s2, weights, ids)]


@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter,block", [
    (1, 2, 8, 64, 32, (16, 32)), (7, 3, 5, 100, 48, (16, 16)), (40, 2, 4, 48, 32, (32, 16)),
    (0, 2, 4, 32, 16, (16, 16))])
def test_moe_experts_fp8_equals_reference(tokens, top_k, experts, hidden, inter, block):
    args = _moe_inputs(tokens, top_k, experts, hidden, inter, block, seed=tokens)
    out = moe_experts_fp8_triton(*args, block)
    ref = moe_experts_fp8_ref(*args, block)
    if tokens:
        assert (out - ref).norm() <= 0.06 * ref.norm()  # e4m3 activations against unquantized
    else:
        assert out.shape == ref.shape == (0, hidden)


@pytest.mark.parametrize("call,message", [
    (lambda: per_token_group_quant_fp8_ref(torch.zeros(2, 8), 24), "group_size must be a power"),
    (lambda: per_token_group_quant_fp8_ref(torch.zeros(8), 16), "x must be a 2-D tensor"),
    (lambda: block_fp8_matmul_ref(torch.zeros(2, 32, dtype=FP8_DTYPE), torch.ones(2, 1),
                                  torch.zeros(16, 32, dtype=FP8_DTYPE), torch.ones(2, 1),
                                  (16, 32), torch.float32), "w_scale must be float32 (1, 1)"),
    (lambda: block_fp8_matmul_ref(torch.zeros(2, 32), torch.ones(2, 1),
                                  torch.zeros(16, 32, dtype=FP8_DTYPE), torch.ones(1, 1),
                                  (16, 32), torch.float32), "a must be a 2-D torch.float8_e4m3fn"),
    (lambda: fp8_linear_ref(torch.zeros(2, 32), torch.zeros(16, 32, dtype=FP8_DTYPE),
                            torch.ones(1, 1), (16, 48)), "block must be two powers of two"),
])
def test_launchers_refuse_bad_layouts_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


# ---- the compiled kernels (GPU) ----

@pytest.mark.parametrize("rows,cols,group,dtype", [
    pytest.param(*case, marks=GPU_CASE) for case in
    [*QUANT_CASES, (64, 4096, 128, torch.bfloat16), (3000, 7168, 128, torch.bfloat16)]])
def test_gpu_quant_is_bit_exact(rows, cols, group, dtype):
    x = _wide(rows, cols, 2, dtype, "cuda")
    for ue8m0 in (False, True):
        q, s = per_token_group_quant_fp8_triton(x, group, scale_ue8m0=ue8m0)
        q_ref, s_ref = per_token_group_quant_fp8_ref(x, group, scale_ue8m0=ue8m0)
        assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)


@requires_gpu
@pytest.mark.parametrize("rows", [1, 7, 16, 40, 200, 1000])
@pytest.mark.parametrize("cols,depth", [(4096, 4096), (6144, 4096), (4096, 14336), (3072, 2048)])
def test_gpu_block_fp8_matmul_equals_reference(rows, cols, depth):
    x, w, w_scale, _ = _gemm_inputs(rows, cols, depth, (128, 128), device="cuda")
    a, a_scale = per_token_group_quant_fp8_ref(x.bfloat16(), 128)
    out = block_fp8_matmul_triton(a, a_scale, w, w_scale, (128, 128), torch.bfloat16)
    ref = block_fp8_matmul_ref(a, a_scale, w, w_scale, (128, 128), torch.float32)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@requires_gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_each_config_family_equals_reference(family):
    """Compiled: the first sweep candidate of the family at each of decode, mid and
    prefill row counts that sweeps it, on a shape with a ragged row and column tile
    (DeepSeek-V2-Lite's kv_a: N 576) and with a K that is not a multiple of 128."""
    ran = 0
    for rows in (1, 40, 1000):
        cands = [c for c in candidate_configs(rows, (128, 128)) if config_family(c) == family]
        for cols, depth in ((576, 2048), (384, 1344)):
            if not cands:
                continue
            x, w, w_scale, bias = _gemm_inputs(rows, cols, depth, (128, 128), device="cuda")
            if cands[0].w8a16 or cands[0].gemv:  # the linear on bf16 activations, bf16 out
                x, bias = x.bfloat16(), bias.bfloat16()
                out = fp8_linear_triton(x, w, w_scale, (128, 128), bias, config=cands[0])
                ref = fp8_linear_ref(x.float(), w, w_scale, (128, 128), bias.float())
                torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
                ran += 1
                continue
            a, a_scale = per_token_group_quant_fp8_ref(x.bfloat16(), 128)
            ref = block_fp8_matmul_ref(a, a_scale, w, w_scale, (128, 128), torch.float32, bias)
            out = block_fp8_matmul_triton(a, a_scale, w, w_scale, (128, 128), torch.float32,
                                          bias, config=cands[0])
            # Hopper's fp8 dot sums each 128-deep step at reduced precision (promoted to
            # float32 between steps): a wrong scale or tile would be off by O(1)
            torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
            ran += 1
    assert ran >= 2


@requires_gpu
@pytest.mark.parametrize("rows", [2, 19])
def test_gpu_16_wide_scale_groups_equal_the_reference(rows):
    """Compiled, the TP shard linears of the 16x16-block test checkpoint with the config
    this GPU picks (k step 16, the dot padded to 32) and a ragged K: the GEMM against
    the reference, the linear fused and unfused."""
    block = (16, 16)
    for cols, depth in [*TP_SHARD_LINEARS, (40, 40)]:
        x, w, w_scale, bias = _gemm_inputs(rows, cols, depth, block, device="cuda")
        a, a_scale = per_token_group_quant_fp8_ref(x, block[1])
        out = block_fp8_matmul_triton(a, a_scale, w, w_scale, block, torch.float32, bias)
        ref = block_fp8_matmul_ref(a, a_scale, w, w_scale, block, torch.float32, bias)
        torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
        fused = fp8_linear_triton(x, w, w_scale, block, bias, fuse_quant=True)
        unfused = fp8_linear_triton(x, w, w_scale, block, bias, fuse_quant=False)
        torch.testing.assert_close(fused, unfused, rtol=1e-2, atol=1e-2)


@requires_gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("cols,depth", [(4096, 4096), (576, 2048), (2048, 10944)])
def test_gpu_fused_quant_linear_equals_quantize_then_gemm(rows, cols, depth):
    x, w, w_scale, _ = _gemm_inputs(rows, cols, depth, (128, 128), device="cuda")
    x = x.bfloat16()
    fused = fp8_linear_triton(x, w, w_scale, (128, 128), fuse_quant=True)
    unfused = fp8_linear_triton(x, w, w_scale, (128, 128), fuse_quant=False)
    torch.testing.assert_close(fused.float(), unfused.float(), rtol=1e-2, atol=1e-2)


@requires_gpu
@pytest.mark.parametrize("tokens", [1, 5, 64, 700])
def test_gpu_moe_experts_fp8_equals_reference_and_captures(tokens):
    # DeepSeek-V2-Lite's experts: 64, top 6, hidden 2048, intermediate 1408 (11 blocks)
    args = _moe_inputs(tokens, 6, 64, 2048, 1408, (128, 128), device="cuda", dtype=torch.bfloat16)
    x, w13, s13, w2, s2, weights, ids = args
    out = moe_experts_fp8_triton(*args, (128, 128))
    ref = moe_experts_fp8_ref(x.float(), w13, s13, w2, s2, weights, ids, (128, 128))
    assert (out.float() - ref).norm() <= 0.06 * ref.norm()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_experts_fp8_triton(*args, (128, 128))
    ids.copy_(ids.roll(1, 0))
    graph.replay()
    torch.testing.assert_close(captured, moe_experts_fp8_triton(*args, (128, 128)))


@pytest.mark.parametrize("tokens,rank,rope", [(1, 512, 64), (5, 128, 16), (3, 256, 24), (0, 128, 8)])
def test_mla_fp8_rows_pack_bit_exact_and_unpack_close(tokens, rank, rope):
    from lanekv.kernels.fp8.kv_rows import (
        mla_fp8_row_bytes,
        pack_mla_fp8_rows_ref,
        pack_mla_fp8_rows_triton,
        unpack_mla_fp8_rows,
    )

    assert mla_fp8_row_bytes(512, 64) == 656
    latent = _wide(tokens, rank + rope, rank, torch.float32) / 1000
    rows = pack_mla_fp8_rows_triton(latent, rank)
    assert rows.shape == (tokens, mla_fp8_row_bytes(rank, rope)) and rows.dtype == torch.uint8
    assert torch.equal(rows, pack_mla_fp8_rows_ref(latent, rank))
    back = unpack_mla_fp8_rows(rows, rank, rope, torch.float32)
    torch.testing.assert_close(back[:, rank:], latent[:, rank:].bfloat16().float())
    if tokens:
        scale = rows[:, rank:rank + 4 * (rank // 128)].contiguous().view(torch.float32)
        torch.testing.assert_close(back[:, :rank], latent[:, :rank], rtol=2 ** -3,
                                   atol=scale.max().item() * 2 ** -9)


@requires_gpu
@pytest.mark.parametrize("tokens", [1, 37, 4096])
def test_gpu_mla_fp8_rows_pack_bit_exact(tokens):
    from lanekv.kernels.fp8.kv_rows import pack_mla_fp8_rows_ref, pack_mla_fp8_rows_triton

    latent = (_wide(tokens, 576, 4, torch.float32) / 1000).bfloat16().cuda()
    assert torch.equal(pack_mla_fp8_rows_triton(latent, 512), pack_mla_fp8_rows_ref(latent, 512))
