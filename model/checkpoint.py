"""Loads a Hugging Face safetensors checkpoint into the model class of its architecture.

``CausalLM`` serves the Llama family (``Qwen3MoeCausalLM`` its MoE member),
``DeepseekCausalLM`` DeepSeek-V2/V3,
``DeepseekV32CausalLM`` DeepSeek-V3.2; any
other architecture is one ``ValueError`` naming it (from ``ModelConfig``).

Each tensor file is read once. The weights digest (``model.parallel.weights_digest``)
comes from the process that computed it for the daemon (a rank's load is handed
it), else from its cache, else from the same bytes ``safetensors.torch.load`` reads;
either way the files' stamps before and after the read are the digest's, so it
describes the weights that were loaded.
``transformers`` is never imported here. A loaded model has its q/k/v and
gate/up projections fused and its MoE experts stacked (``fuse_projections``).
A block-FP8 checkpoint (``quantization_config``) keeps its e4m3 weights and
scales as stored, its quantized linears swapped for ``Fp8Linear``
(``model.quant.linear``); a dummy load of one quantizes every decoder linear of
the random model blockwise (benchmarks of FP8 shapes).
"""

from __future__ import annotations

import hashlib
import json
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from lanekv.kernels.fp8.weights import FP8_DTYPE
from lanekv.model.attention import AnyCausalLM, kind_of
from lanekv.model.config import ModelConfig
from lanekv.model.parallel.weights_digest import (
    WeightsDigest,
    WeightsHasher,
    WeightsSource,
    read_with_digest,
    weights_digest,
)
from lanekv.model.quant.linear import SCALE_SUFFIX, quantize_linears, use_fp8_linears
from lanekv.model.tokenizer import Tokenizer, load_tokenizer
from safetensors.torch import load as load_safetensors

INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters write that are recomputed here, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
def model_class(config: ModelConfig) -> type[AnyCausalLM]:
    """The model class that runs ``config``'s architecture (its attention kind's)."""
    return kind_of(config).model_class(config)


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> AnyCausalLM:
    return model_class(config)(config, dtype=dtype, device=device)


def _is_extra_layer(name: str, num_layers: int) -> bool:
    """DeepSeek-V3 checkpoints carry their multi-token-prediction layers after the
    decoder's (``model.layers.61.*``); like transformers, they are not loaded."""
    parts = name.split(".")
    return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= num_layers)


class LoadedModel(NamedTuple):
    config: ModelConfig
    model: AnyCausalLM
    weights_digest: str  # sha256 hex of the tensor files, see read_state_dict
    tokenizer: Tokenizer | None


def tensor_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, sorted by name: those the index
    names when there is one, else every ``*.safetensors`` in the folder."""
    path = Path(path)
    index_path = path / INDEX_FILE
    if index_path.exists():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index_path} has no weight_map")
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in path.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return [path / name for name in names]


def checkpoint_digest(path: str | Path) -> WeightsDigest:
    """The weights digest of the checkpoint at ``path`` (cached, else every tensor byte read)."""
    return weights_digest(path, tensor_files(path))


def read_state_dict(path: str | Path, dtype: torch.dtype, device: torch.device | str,
                    dtypes: dict[str, torch.dtype] | None = None, *, digest: bool = True,
                    ) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors converted to ``dtype`` (or their entry of ``dtypes``) on
    ``device``, e4m3 weights and their ``weight_scale_inv`` as stored, and the weights digest
    of the bytes read ("" with ``digest=False``): sha256 over the tensor files in sorted
    name order, each as its length (8 bytes, little-endian) then its bytes, so file
    boundaries count too (``model.parallel.weights_digest.WeightsHasher``)."""
    hasher = WeightsHasher() if digest else None
    state: dict[str, torch.Tensor] = {}
    for file in tensor_files(path):
        data = file.read_bytes()
        if hasher is not None:
            hasher.begin_file(len(data))
            hasher.update(data)
        for name, tensor in load_safetensors(data).items():
            if name in state:
                raise ValueError(f"tensor {name!r} appears in more than one file (again in {file.name})")
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            wanted = dtype if dtypes is None else dtypes.get(name, dtype)
            if tensor.dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIX):
                wanted = tensor.dtype  # block-FP8 weights and their scales stay as stored
            state[name] = tensor.to(device=device, dtype=wanted)
        del data  # one file's bytes in memory at a time
    return state, "" if hasher is None else hasher.hexdigest()


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", weights: WeightsSource | None = None) -> LoadedModel:
    """Reads ``config.json``, the safetensors weights and, when present,
    ``tokenizer.json``; the model is in eval mode without gradients. ``weights``: gives
    the digest the daemon computed once for its ranks, asked after the read (checked
    against the files' stamps, never recomputed); None: cached, else hashed from the
    bytes read."""
    path = Path(path)
    config = ModelConfig.from_dir(path)
    model = build_model(config, dtype=dtype, device="meta")
    expected = model.state_dict()
    read = partial(read_state_dict, path, dtype, device, {name: t.dtype for name, t in expected.items()})
    state, weights = read_with_digest(path, tensor_files(path), lambda hash_bytes: read(digest=hash_bytes), weights)
    if model.ignores_extra_layers:
        state = {k: v for k, v in state.items() if not _is_extra_layer(k, config.num_layers)}
    if config.tie_word_embeddings:
        # Some exporters also write the tied head; like transformers, the
        # embedding is what the head uses.
        state.pop("lm_head.weight", None)
    use_fp8_linears(model, state, config.weight_quant, dtype)  # block-FP8 layers, checked
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match {config.architecture}: "
                         f"missing tensors {missing}, unexpected tensors {unexpected}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(expected[name].shape)}")
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)  # the rotary frequencies; the weights are there already
    model.eval()
    model.requires_grad_(False)
    model.fuse_projections()  # q/k/v and gate/up as one GEMM each, MoE experts stacked
    tokenizer = load_tokenizer(path, config.eos_token_ids)
    return LoadedModel(config=config, model=model, weights_digest=weights.digest, tokenizer=tokenizer)


def load_dummy_model(path: str | Path, dtype: torch.dtype = torch.bfloat16,
                     device: torch.device | str = "cpu", seed: int = 0) -> LoadedModel:
    """The architecture of ``path/config.json`` with seeded random weights, made
    on ``device`` (no weight files are read): for benchmarks of large shapes.
    The digest names the seed, so two dummy models pair only when identical."""
    path = Path(path)
    config = ModelConfig.from_dir(path)
    model = build_model(config, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)
    if config.weight_quant is not None:
        quantize_linears(model.model.layers, config.weight_quant)
    model.eval()
    model.requires_grad_(False)
    model.fuse_projections()
    digest = hashlib.sha256(f"dummy-weights:{seed}:{config!r}".encode()).hexdigest()
    return LoadedModel(config=config, model=model, weights_digest=digest,
                       tokenizer=load_tokenizer(path, config.eos_token_ids))


def load_checkpoint(path: str | Path, dtype: torch.dtype, device: torch.device | str,
                    load_format: str = "safetensors", weights: WeightsSource | None = None) -> LoadedModel:
    """``load_model`` (handed ``weights``, see there) or, for ``load_format="dummy"``,
    ``load_dummy_model`` (seed 0, so a prefill and a decode daemon given the same
    config.json pair; no files, no digest to hand)."""
    if load_format == "dummy":
        return load_dummy_model(path, dtype=dtype, device=device)
    if load_format != "safetensors":
        raise ValueError(f"load_format must be safetensors or dummy, got load_format={load_format!r}")
    return load_model(path, dtype=dtype, device=device, weights=weights)
