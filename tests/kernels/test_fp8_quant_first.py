"""``GemmConfig.quant_first``: a w8a8 table entry that makes the linear quantize its
activations with the quantization kernel first instead of inside the GEMM (the decode
sweep timed that faster for some shapes), its refusal beside w8a16, and the sweep's
rule that records it."""

import json

import pytest
import torch
from lanekv.kernels.fp8 import gemm as gemm_module
from lanekv.kernels.fp8.gemm import fp8_linear_ref, fp8_linear_triton, linear_plan
from lanekv.kernels.fp8.gemm_configs import TABLE_ENV, GemmConfig, load_table, table_entry
from lanekv.kernels.fp8.weights import quantize_weight_blocks

from bench import fp8 as bench_fp8


def test_a_quant_first_entry_quantizes_before_the_gemm_and_equals_the_fused_linear(
        tmp_path, monkeypatch):
    block = (32, 32)
    gen = torch.Generator().manual_seed(3)
    w, w_scale = quantize_weight_blocks(torch.randn(96, 160, generator=gen) * 0.1, block)
    x = torch.randn(3, 160, generator=gen)
    fused_cfg = GemmConfig(16, 32, 32, 4, 2, 4, 1)
    entry = table_entry(3, 96, 160, block, fused_cfg._replace(quant_first=True))
    assert json.loads(json.dumps(entry))["config"]["quant_first"] is True
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"entries": [entry]}))
    load_table.cache_clear()
    monkeypatch.setenv(TABLE_ENV, str(path))
    try:
        cpu = torch.device("cpu")
        plan = linear_plan(3, 96, 160, block, cpu)
        assert plan.config.quant_first and plan.config.name().endswith("Q")
        assert plan.fuse_quant is False
        assert linear_plan(3, 96, 160, block, cpu, config=fused_cfg).fuse_quant is True
        runs = []
        real = gemm_module.per_token_group_quant_fp8
        monkeypatch.setattr(gemm_module, "per_token_group_quant_fp8",
                            lambda *a, **k: runs.append(1) or real(*a, **k))
        first = fp8_linear_triton(x, w, w_scale, block)
        assert runs == [1]  # the quantization kernel ran, once, before the GEMM
        inside = fp8_linear_triton(x, w, w_scale, block, config=fused_cfg)
        assert runs == [1]
        torch.testing.assert_close(first, inside, rtol=1e-6, atol=1e-6)
        ref = fp8_linear_ref(x, w, w_scale, block)
        assert (first - ref).norm() <= 5e-2 * ref.norm()  # x rounded to e4m3: ~2% here
    finally:
        load_table.cache_clear()


def test_quant_first_is_a_bool_and_no_w8a16_switch():
    with pytest.raises(ValueError, match="quant_first must be a bool"):
        GemmConfig.from_dict({**GemmConfig(16, 32).to_dict(), "quant_first": 1})
    with pytest.raises(ValueError, match="quant_first=True is a w8a8 switch"):
        GemmConfig.from_dict({**GemmConfig(16, 32).to_dict(), "w8a16": True, "quant_first": True})


def _row(fused, unfused, **config):
    cfg = GemmConfig(16, 64, 128, 8, 4, 4, 4, **config)
    return {"config": cfg.to_dict(), "config_name": cfg.name(), "linear_fused_quant": True,
            "linear_fused_ms": fused, "linear_unfused_ms": unfused, "linear_ms": fused}


def test_the_sweep_records_quant_first_only_where_quantizing_first_was_faster():
    faster = _row(0.040, 0.030)
    assert bench_fp8.record_quant_first(faster)
    assert faster["config"]["quant_first"] and faster["config_name"].endswith("Q")
    assert faster["linear_ms"] == 0.030 and faster["linear_fused_quant"] is False
    slower = _row(0.030, 0.040)
    assert not bench_fp8.record_quant_first(slower)
    assert "quant_first" not in slower["config"] or not slower["config"]["quant_first"]
    assert slower["linear_ms"] == 0.030
    w8a16 = _row(None, None, w8a16=True)
    assert not bench_fp8.record_quant_first(w8a16)
