"""Block-FP8 checkpoints (``quant_method: fp8``): loaded as stored and run like the
same model with the weights dequantized (transformers on a dequantized copy is the
oracle; on CPU the quantized linears run their dequantizing references), refused
in one line when malformed or of another method, and named in the contract."""

from __future__ import annotations

import json

import pytest
import torch
from lanekv.kernels.fp8.weights import FP8_DTYPE
from lanekv.model.checkpoint import load_dummy_model, load_model
from lanekv.model.config import ModelConfig
from lanekv.model.deepseek import DeepseekCausalLM, mla_causal_attention
from lanekv.model.deepseek_v32 import DeepseekV32CausalLM, dsa_causal_attention
from lanekv.model.llama import causal_attention
from lanekv.model.quant.config import WeightQuant
from lanekv.model.quant.linear import Fp8Linear
from safetensors.torch import load_file, save_file

from tests.checkpoints import (
    VOCAB_SIZE,
    write_deepseek_v2,
    write_deepseek_v3,
    write_deepseek_v32,
    write_llama,
    write_qwen2,
    write_qwen3_moe,
)
from tests.fp8_checkpoints import dequantized_copy, quantize_checkpoint

WRITERS = {"llama": write_llama, "qwen2": write_qwen2, "qwen3_moe": write_qwen3_moe,
           "deepseek_v2": write_deepseek_v2, "deepseek_v3": write_deepseek_v3,
           "deepseek_v32": write_deepseek_v32}


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-src")
    return {name: writer(root / name) for name, writer in WRITERS.items()}


def _ours(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.numel())
    with torch.inference_mode():
        if isinstance(model, DeepseekV32CausalLM):
            attention = dsa_causal_attention(model)
        elif isinstance(model, DeepseekCausalLM):
            attention = mla_causal_attention(model)
        else:
            scale = model.config.softmax_scale

            def attention(layer, q, k, v):
                return causal_attention(q, k, v, scale)
        return model.compute_logits(model(ids, positions, attention))


def _theirs(path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


@pytest.mark.parametrize("name,block,shards", [
    ("llama", (16, 16), 2), ("llama", (128, 128), 1), ("qwen3_moe", (16, 16), 1),
    ("qwen3_moe", (128, 128), 2), ("deepseek_v3", (16, 16), 2), ("deepseek_v3", (128, 128), 1),
    ("deepseek_v32", (16, 32), 1), ("qwen2", (32, 16), 2), ("deepseek_v2", (16, 16), 1),
])
def test_fp8_checkpoint_logits_equal_transformers_on_the_dequantized_weights(
        originals, tmp_path, name, block, shards):
    fp8 = quantize_checkpoint(originals[name], tmp_path / "fp8", block, shards=shards)
    loaded = load_model(fp8)
    model = loaded.model
    quantized = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert quantized and all(m.weight.dtype == FP8_DTYPE for m in quantized)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # left as stored
    assert loaded.config.weight_quant == WeightQuant(block=block)
    ids = torch.randint(3, VOCAB_SIZE, (13,), generator=torch.Generator().manual_seed(5))
    ours = _ours(model, ids)
    theirs = _theirs(dequantized_copy(fp8, tmp_path / "dequantized"), ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    # the quantization changed the weights (a loader ignoring the scales would not match)
    assert not torch.allclose(ours, _theirs(originals[name], ids), atol=1e-4)


def test_fused_projections_keep_the_blocks_whole(originals, tmp_path):
    """Block 16: q/k/v and gate/up fuse into one e4m3 GEMM each, experts stack with
    their scales; block 128: parts ending inside a block stay unfused."""
    small = load_model(quantize_checkpoint(originals["qwen3_moe"], tmp_path / "b16", (16, 16)))
    layer = small.model.model.layers[0]
    assert layer.self_attn.qkv.fused and layer.self_attn.qkv.weight.dtype == FP8_DTYPE
    assert layer.self_attn.q_proj.weight.data_ptr() == layer.self_attn.qkv.weight.data_ptr()
    assert layer.mlp.fp8 is not None and layer.mlp.fp8.s13.shape == (8, 4, 4)
    big = load_model(quantize_checkpoint(originals["llama"], tmp_path / "b128", (128, 128)))
    assert not big.model.model.layers[0].self_attn.qkv.fused


def _rewrite(path, edit) -> None:
    file = path / "model.safetensors"
    state = load_file(file)
    edit(state)
    save_file(state, str(file))


@pytest.mark.parametrize("damage,message", [
    (lambda s: s.pop("model.layers.0.mlp.down_proj.weight_scale_inv"),
     "tensor 'model.layers.0.mlp.down_proj.weight' is torch.float8_e4m3fn but "
     "'model.layers.0.mlp.down_proj.weight_scale_inv' is missing"),
    (lambda s: s.update({"model.layers.1.self_attn.o_proj.weight_scale_inv": torch.ones(2, 2)}),
     "tensor 'model.layers.1.self_attn.o_proj.weight_scale_inv' is torch.float32 (2, 2), "
     "expected float32 (4, 4)"),
    (lambda s: s.update({"model.layers.0.self_attn.q_proj.weight":
                         s["model.layers.0.self_attn.q_proj.weight"].float()}),
     "tensor 'model.layers.0.self_attn.q_proj.weight_scale_inv' has no torch.float8_e4m3fn "
     "weight beside it"),
    (lambda s: s.update({"model.norm.weight_scale_inv": torch.ones(1, 1)}),
     "tensor 'model.norm.weight_scale_inv' scales 'model.norm', which lanekv does not run"),
])
def test_malformed_checkpoints_are_refused_naming_the_tensor(originals, tmp_path, damage, message):
    fp8 = quantize_checkpoint(originals["llama"], tmp_path / "fp8", (16, 16))
    _rewrite(fp8, damage)
    with pytest.raises(ValueError) as err:
        load_model(fp8)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_quantized_tensors_without_quantization_config_are_refused(originals, tmp_path):
    fp8 = quantize_checkpoint(originals["llama"], tmp_path / "fp8", (16, 16))
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is quantized but config.json has no quantization_config"):
        load_model(fp8)


@pytest.mark.parametrize("field,value,message", [
    ("quant_method", "awq", "quantization_config.quant_method='awq' is not supported"),
    ("fmt", "e5m2", "quantization_config.fmt='e5m2' is not supported"),
    ("activation_scheme", "static", "quantization_config.activation_scheme='static'"),
    ("weight_block_size", [128, 96], "quantization_config.weight_block_size=[128, 96]"),
    ("weight_block_size", None, "quantization_config.weight_block_size=None"),
    ("scale_fmt", "e8m0x", "quantization_config.scale_fmt='e8m0x'"),
    ("group_size", 64, "quantization_config has unsupported keys ['group_size']"),
])
@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_other_quantizations_are_refused_in_one_line(originals, name, field, value, message):
    hf = json.loads((originals[name] / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                 "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                                 field: value}
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf(hf)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_contract_fields_name_the_weight_quantization(originals):
    hf = json.loads((originals["deepseek_v3"] / "config.json").read_text())
    plain = ModelConfig.from_hf(hf).contract_fields()
    assert "weight_quant" not in plain  # unquantized models keep their fields
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                 "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    fields = ModelConfig.from_hf(hf).contract_fields()
    assert fields["weight_quant"] == {"method": "fp8", "fmt": "e4m3", "block": [128, 128],
                                      "activation_scheme": "dynamic", "scale_fmt": "ue8m0"}
    hf["quantization_config"]["weight_block_size"] = [64, 128]
    assert ModelConfig.from_hf(hf).contract_fields()["weight_quant"]["block"] == [64, 128]


def test_a_dummy_load_of_an_fp8_config_quantizes_the_decoder_linears(originals, tmp_path):
    fp8 = quantize_checkpoint(originals["qwen3_moe"], tmp_path / "fp8", (16, 16))
    model = load_dummy_model(fp8, dtype=torch.float32).model
    layer = model.model.layers[1]
    assert isinstance(layer.self_attn.o_proj, Fp8Linear) and layer.mlp.fp8 is not None
    ids = torch.arange(3, 10)
    assert torch.isfinite(_ours(model, ids)).all()


