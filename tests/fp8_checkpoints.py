"""Block-FP8 checkpoints for tests, made from the tiny checkpoints of ``tests.checkpoints``.

``quantize_checkpoint`` rewrites a checkpoint the way DeepSeek-V3 and the
``-FP8`` Qwen3/Llama checkpoints are stored: each decoder linear's weight in
e4m3 with a float32 ``weight_scale_inv`` per block (quantized in the test, with
``kernels.fp8.weights``), the embeddings, norms, router gate, DSA head weights
and lm_head as they were, and ``quantization_config`` in ``config.json``.
``dequantized_copy`` writes the same weights dequantized to float32 without the
config: what the oracle (transformers) loads, since the installed transformers
cannot dequantize an FP8 checkpoint on CPU without ``accelerate``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from lanekv.kernels.fp8.weights import FP8_DTYPE, dequantize_weight_blocks, quantize_weight_blocks
from safetensors.torch import load_file, save_file

_UNQUANTIZED = ("mlp.gate.weight", "weights_proj.weight")


def _is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    return (name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2
            and "norm" not in name and not name.endswith(_UNQUANTIZED))


def _read(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def _write(state: dict[str, torch.Tensor], path: Path, shards: int) -> None:
    names = sorted(state)
    if shards == 1:
        save_file(state, str(path / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state[name].contiguous() for name in names[i::shards]}
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _copy_meta(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("generation_config.json", "tokenizer.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return json.loads((src / "config.json").read_text())


def quantize_checkpoint(src: Path, dst: Path, block: tuple[int, int] = (128, 128), *,
                        shards: int = 1, config_extra: dict | None = None) -> Path:
    config = _copy_meta(src, dst)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), **(config_extra or {})}
    (dst / "config.json").write_text(json.dumps(config))
    state = {}
    for name, tensor in _read(src).items():
        if _is_quantized_linear(name, tensor):
            state[name], state[name.removesuffix(".weight") + ".weight_scale_inv"] = (
                quantize_weight_blocks(tensor, block))
        else:
            state[name] = tensor
    _write(state, dst, shards)
    return dst


def dequantized_copy(src: Path, dst: Path) -> Path:
    config = _copy_meta(src, dst)
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    (dst / "config.json").write_text(json.dumps(config))
    state = _read(src)
    out = {}
    for name, tensor in state.items():
        if name.endswith(".weight_scale_inv"):
            continue
        if tensor.dtype == FP8_DTYPE:
            scale = state[name.removesuffix(".weight") + ".weight_scale_inv"]
            tensor = dequantize_weight_blocks(tensor, scale, block, torch.float32)
        out[name] = tensor
    _write(out, dst, 1)
    return dst
