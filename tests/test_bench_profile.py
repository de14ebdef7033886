"""bench/deepseek_profile.py's FP8 report: each block-FP8 linear a Llama layer runs once,
with the config and the quantization (inside the GEMM or first) it launches with at the
step's rows, and a layer's device kernels in launch order from a profiler trace."""

from __future__ import annotations

import json

import torch
from lanekv.kernels.fp8.gemm_configs import TABLE_ENV, GemmConfig, table_entry
from lanekv.model.checkpoint import load_dummy_model

from bench.deepseek_profile import CONFIGS, fp8_plans, kernel_sequence
from bench.fp8 import FP8_CONFIG

TINY = dict(CONFIGS["llama3_8b"], hidden_size=256, intermediate_size=512, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
            quantization_config=FP8_CONFIG)


def test_fp8_plans_list_each_linear_once_with_its_config_and_quantization(tmp_path,
                                                                          monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    layer = load_dummy_model(tmp_path, dtype=torch.float32).model.model.layers[0]
    table = tmp_path / "table.json"
    thin, wide = GemmConfig(16, 32, 128), GemmConfig(64, 64, 128)
    table.write_text(json.dumps({"entries": [
        table_entry(rows, n, k, (128, 128), cfg) for n, k in ((512, 256), (256, 512))
        for rows, cfg in ((16, thin), (64, wide))]}))
    monkeypatch.setenv(TABLE_ENV, str(table))
    cpu = torch.device("cpu")
    at16 = {p["linear"]: p for p in fp8_plans(layer, 16, cpu)}
    assert sorted(at16) == ["mlp.down_proj", "mlp.gate_up", "self_attn.o_proj", "self_attn.qkv"]
    assert (at16["self_attn.qkv"]["n"], at16["self_attn.qkv"]["k"]) == (512, 256)
    assert at16["self_attn.qkv"]["config"] == thin.name() and at16["self_attn.qkv"]["fused_quant"]
    # the down projection's input is quantized first (silu_mul_quant_fp8), whatever its tile
    assert at16["mlp.down_proj"]["config"] == thin.name()
    assert not at16["mlp.down_proj"]["fused_quant"]
    at64 = {p["linear"]: p for p in fp8_plans(layer, 64, cpu)}
    assert at64["self_attn.qkv"]["config"] == wide.name()
    assert not at64["self_attn.qkv"]["fused_quant"]  # a 64-row tile quantizes first


def test_kernel_sequence_keeps_launch_order_and_the_launch_shape():
    def launch(ts, corr):
        return dict(ph="X", cat="cuda_runtime", ts=ts, dur=1, tid=7, name="cudaLaunchKernel",
                    args={"correlation": corr})

    def kernel(ts, corr, name, grid):
        return dict(ph="X", cat="kernel", ts=ts, dur=ts / 10, tid=99, name=name,
                    args={"correlation": corr, "grid": grid, "shared memory": 4096})

    trace = {"traceEvents": [
        dict(ph="X", name="lanekv.layer.0", ts=0, dur=100, tid=7),
        dict(ph="X", name="lanekv.layer.1", ts=200, dur=100, tid=7),
        launch(10, 1), launch(20, 2), launch(210, 3), launch(150, 4),
        kernel(400, 2, "_block_fp8_matmul_kernel", [96, 1, 1]),
        kernel(300, 1, "_per_token_group_quant_kernel", [4, 32, 1]),
        kernel(500, 3, "_block_fp8_matmul_kernel", [64, 1, 1]),
        kernel(450, 4, "argmax", [1, 1, 1]),
    ]}
    seq = kernel_sequence(trace, "layer 0")
    assert [e["name"] for e in seq] == ["_per_token_group_quant_kernel",
                                        "_block_fp8_matmul_kernel"]
    assert seq[1]["grid"] == [96, 1, 1] and seq[1]["device_us"] == 40.0
    assert seq[1]["shared memory"] == 4096
    assert [e["grid"] for e in kernel_sequence(trace, "layer 1")] == [[64, 1, 1]]
    assert [e["name"] for e in kernel_sequence(trace, "outside")] == ["argmax"]


def test_fp8_plans_leave_out_a_shared_expert_the_decode_experts_run(tmp_path):
    """A block-FP8 MoE layer at a decode batch runs its shared expert inside the experts'
    kernels: no linear of it is listed; past the decode batches it runs apart, listed."""
    cfg = dict(CONFIGS["v2_lite"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
               n_shared_experts=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=128,
               vocab_size=300, quantization_config=FP8_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    layer = load_dummy_model(tmp_path, dtype=torch.float32).model.model.layers[1]
    assert layer.mlp._fp8_shared() is not None
    cpu = torch.device("cpu")
    at16 = [p["linear"] for p in fp8_plans(layer, 16, cpu)]
    assert "self_attn.o_proj" in at16 and not [n for n in at16 if "shared_experts" in n]
    at64 = [p["linear"] for p in fp8_plans(layer, 64, cpu)]
    assert sorted(n for n in at64 if "shared_experts" in n) == [
        "mlp.shared_experts.down_proj", "mlp.shared_experts.gate_up"]
