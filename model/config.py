"""The model configuration, read from a Hugging Face ``config.json``.

The Llama family (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral) shares one decoder
(RMSNorm, RoPE, GQA attention, SwiGLU MLP) and differs in a few switches (Qwen3:
per-head q/k RMSNorm before RoPE; Qwen3-MoE: routed experts in place of every
MLP, carried as ``moe``); DeepSeek-V2/V3 add MLA and MoE (``model.mla_config``,
carried here as ``mla`` and ``moe``). Every
field that would change the math in a way the decoder does not implement (a
sliding window that is actually in effect, another RoPE type, another
activation, MLP biases, a quantization other than block FP8) is refused with a ``ValueError``
naming the field and its value, rather than served with silently wrong output.

Missing optional fields take the defaults ``transformers`` gives the same
architecture, so that both read one ``config.json`` the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lanekv.model.dsa import DSAConfig
from lanekv.model.mla_config import (
    DEEPSEEK_ARCHITECTURES,
    DEEPSEEK_MODEL_TYPES,
    MLAConfig,
    MoEConfig,
    deepseek_fields,
)
from lanekv.model.quant.config import WeightQuant

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MistralForCausalLM", *DEEPSEEK_ARCHITECTURES)
_QWEN3 = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    **DEEPSEEK_MODEL_TYPES,
}
# transformers' defaults per architecture for fields a config.json may omit.
_DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
    "Qwen3MoeForCausalLM": 32768,
    "MistralForCausalLM": 131072,
    "DeepseekV2ForCausalLM": 2048,
    "DeepseekV3ForCausalLM": 4096,
    "DeepseekV32ForCausalLM": 163840,
}
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6
# Mistral's window is on unless the config says null; Qwen2's only with
# use_sliding_window, and then only for layers >= max_window_layers.
_DEFAULT_SLIDING_WINDOW = 4096
_DEFAULT_QWEN2_MAX_WINDOW_LAYERS = 28

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Keys of a RoPE dict that are read below; any other key changes the math in a
# way this decoder does not know, so it is refused.
_ROPE_KNOWN_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor", *_LLAMA3_KEYS})


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder and the transfer contract need to know about a model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; llama3 scaling as sorted (key, value) pairs so the
    # dataclass stays hashable. See ``rope_scaling_dict``.
    rope_scaling: tuple[tuple[str, Any], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q, k and v projections carry a bias
    o_proj_bias: bool  # Llama's attention_bias also puts one on o_proj
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE
    # DeepSeek: MLA (then num_kv_heads is 1 and head_dim the latent row width)
    # and MoE; Qwen3-MoE: MoE alone; None for the rest of the Llama family.
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    # DeepSeek-V3.2: the sparse-attention indexer; None for every other architecture.
    dsa: DSAConfig | None = None
    # Block-FP8 checkpoints (``quantization_config``); None: weights as stored, unquantized.
    weight_quant: WeightQuant | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture={self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embedding")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} must be > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r} must be > 0")
        has_moe = self.architecture in (*DEEPSEEK_ARCHITECTURES, "Qwen3MoeForCausalLM")
        if (self.mla is None) != (self.architecture not in DEEPSEEK_ARCHITECTURES) or (
            self.moe is None) == has_moe:
            raise ValueError(f"architecture={self.architecture!r} needs mla exactly when it is a "
                             "DeepSeek architecture, and moe exactly when it is DeepSeek or "
                             "Qwen3MoeForCausalLM")
        if (self.dsa is None) != (self.architecture != "DeepseekV32ForCausalLM"):
            raise ValueError(f"architecture={self.architecture!r} needs dsa exactly when it is "
                             "DeepseekV32ForCausalLM")
        if self.mla is not None and (self.num_kv_heads, self.head_dim) != (1, self.mla.latent_dim):
            raise ValueError(f"an MLA model has num_kv_heads=1 and head_dim={self.mla.latent_dim}, "
                             f"got {self.num_kv_heads} and {self.head_dim}")

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.mla is None else self.mla.softmax_scale

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads a ``config.json`` dict; refuses what the decoder cannot run."""
        architecture = _architecture(hf)
        if architecture in DEEPSEEK_ARCHITECTURES:
            return cls._from_deepseek(hf, architecture)
        _refuse_unsupported_math(hf, architecture)
        num_heads = _required_int(hf, "num_attention_heads")
        hidden_size = _required_int(hf, "hidden_size")
        head_dim = hf.get("head_dim")
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(
                    f"head_dim is absent and hidden_size={hidden_size} is not a multiple of "
                    f"num_attention_heads={num_heads}"
                )
            # transformers: Qwen3Config's head_dim defaults to 128, Qwen3MoeConfig has none
            head_dim = 128 if architecture == "Qwen3ForCausalLM" else hidden_size // num_heads
        num_kv_heads = hf.get("num_key_value_heads")
        max_positions = hf.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[architecture])
        rope_theta, rope_scaling = _rope(hf, max_positions)
        if architecture == "Qwen2ForCausalLM":
            attention_bias, o_proj_bias = True, False
        elif architecture == "LlamaForCausalLM":
            attention_bias = o_proj_bias = bool(hf.get("attention_bias", False))
        elif architecture in _QWEN3:
            attention_bias = o_proj_bias = bool(hf.get("attention_bias", False))
        else:
            attention_bias = o_proj_bias = False
        return cls(
            architecture=architecture,
            vocab_size=_required_int(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required_int(hf, "intermediate_size"),
            num_layers=_required_int(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            eos_token_ids=_token_ids(hf.get("eos_token_id"), "eos_token_id"),
            bos_token_id=hf.get("bos_token_id"),
            qk_norm=architecture in _QWEN3,
            moe=_qwen3_moe(hf) if architecture == "Qwen3MoeForCausalLM" else None,
            weight_quant=_weight_quant(hf),
        )

    @classmethod
    def _from_deepseek(cls, hf: dict[str, Any], architecture: str) -> ModelConfig:
        return cls(
            architecture=architecture,
            vocab_size=_required_int(hf, "vocab_size"),
            hidden_size=_required_int(hf, "hidden_size"),
            intermediate_size=_required_int(hf, "intermediate_size"),
            num_layers=_required_int(hf, "num_hidden_layers"),
            rms_norm_eps=float(hf.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=_token_ids(hf.get("eos_token_id"), "eos_token_id"),
            bos_token_id=hf.get("bos_token_id"),
            **deepseek_fields(hf, architecture),
            dsa=DSAConfig.from_hf(hf) if architecture == "DeepseekV32ForCausalLM" else None,
            weight_quant=_weight_quant(hf),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Reads ``config.json``; end-of-sequence ids of ``generation_config.json``
        are added, since that is what ``generate`` stops on."""
        path = Path(path)
        config = cls.from_hf(json.loads((path / "config.json").read_text()))
        generation_path = path / "generation_config.json"
        if not generation_path.exists():
            return config
        generation = json.loads(generation_path.read_text())
        extra = _token_ids(generation.get("eos_token_id"), "generation_config.eos_token_id")
        eos = tuple(dict.fromkeys(config.eos_token_ids + extra))
        return replace(config, eos_token_ids=eos)

    def contract_fields(self, attention: dict[str, Any] | None = None) -> dict[str, Any]:
        """Plain, msgpack-able fields the transfer contract is built from; ``attention``:
        the attention kind's own (``model.attention``: ``kind.contract_fields`` gives all)."""
        return {
            "architecture": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope": {
                "theta": self.rope_theta,
                "scaling": self.rope_scaling_dict,
                "max_position_embeddings": self.max_position_embeddings,
            },
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            **({"qk_norm": True} if self.qk_norm else {}),
            **(attention or {}),
            **({} if self.moe is None else {"moe": dict(sorted(vars(self.moe).items()))}),
            **({} if self.weight_quant is None else {
                "weight_quant": self.weight_quant.contract_fields()}),
        }


def _architecture(hf: dict[str, Any]) -> str:
    architectures = hf.get("architectures")
    if architectures:
        if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architectures={architectures!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return architectures[0]
    model_type = hf.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not supported and architectures is absent "
            f"(supported model types: {', '.join(_MODEL_TYPES)})"
        )
    return _MODEL_TYPES[model_type]


def _qwen3_moe(hf: dict[str, Any]) -> MoEConfig:
    """Qwen3-MoE's experts: softmax top-k over all experts (renormalised with
    norm_topk_prob), no shared experts, every layer sparse."""
    step = hf.get("decoder_sparse_step", 1)
    if step != 1:
        raise ValueError(f"decoder_sparse_step={step!r} is not supported (only 1: every layer MoE)")
    dense = hf.get("mlp_only_layers") or []
    if dense:
        raise ValueError(f"mlp_only_layers={dense!r} is not supported (only [])")
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    return MoEConfig(num_experts=experts, top_k=hf.get("num_experts_per_tok", 8),
                     num_shared_experts=0,
                     moe_intermediate_size=hf.get("moe_intermediate_size", 768),
                     first_k_dense_replace=0, scoring="softmax", n_group=1, topk_group=1,
                     routed_scaling_factor=1.0, norm_topk_prob=bool(hf.get("norm_topk_prob",
                                                                           False)))


def _weight_quant(hf: dict[str, Any]) -> WeightQuant | None:
    config = hf.get("quantization_config")
    return None if config is None else WeightQuant.from_hf(config)


def _required_int(hf: dict[str, Any], name: str) -> int:
    if name not in hf:
        raise ValueError(f"{name} is missing from config.json")
    return hf[name]


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list | tuple) else [value]
    for token in values:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"{name}={value!r} must be a token id or a list of token ids")
    return tuple(values)


def _refuse_unsupported_math(hf: dict[str, Any], architecture: str) -> None:
    hidden_act = hf.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act={hidden_act!r} is not supported (only 'silu')")
    if hf.get("mlp_bias", False):
        raise ValueError(f"mlp_bias={hf['mlp_bias']!r} is not supported (only false)")
    partial = hf.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported (only 1.0)")
    _refuse_sliding_window(hf, architecture)


def _refuse_sliding_window(hf: dict[str, Any], architecture: str) -> None:
    """A window at least max_position_embeddings long never hides a key of a
    servable sequence, so it is the same as full attention."""
    max_positions = hf.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[architecture])
    if architecture == "MistralForCausalLM":
        window = hf.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
        if window is not None and window < max_positions:
            raise ValueError(
                f"sliding_window={window} < max_position_embeddings={max_positions} "
                "is not supported (sliding-window attention)"
            )
    elif architecture in ("Qwen2ForCausalLM", *_QWEN3):
        window = hf.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
        if not hf.get("use_sliding_window", False) or window is None or window >= max_positions:
            return
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first = hf.get("max_window_layers", _DEFAULT_QWEN2_MAX_WINDOW_LAYERS)
            in_effect = _required_int(hf, "num_hidden_layers") > first
        else:
            in_effect = "sliding_attention" in layer_types
        if in_effect:
            raise ValueError(
                f"use_sliding_window=true with sliding_window={window} < "
                f"max_position_embeddings={max_positions} is not supported"
            )


def _rope(hf: dict[str, Any], max_positions: int) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """Reads RoPE from ``rope_parameters`` (newer transformers) or from
    ``rope_theta`` + ``rope_scaling`` (older); returns (theta, llama3 scaling)."""
    params = hf.get("rope_parameters")
    source = "rope_parameters"
    if params is None:
        params, source = hf.get("rope_scaling"), "rope_scaling"
    params = dict(params or {})
    unknown = sorted(set(params) - _ROPE_KNOWN_KEYS)
    if unknown:
        raise ValueError(f"{source} has unsupported keys {unknown} (value {params!r})")
    theta = float(params.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA)))
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"{source}.partial_rotary_factor={partial!r} is not supported (only 1.0)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"{source}.rope_type={rope_type!r} is not supported (default, llama3)")
    scaling: dict[str, Any] = {"rope_type": "llama3"}
    for key in _LLAMA3_KEYS:
        if key in params:
            scaling[key] = params[key]
        elif key == "original_max_position_embeddings":
            scaling[key] = max_positions  # transformers falls back the same way
        else:
            raise ValueError(f"{source}.{key} is missing for rope_type='llama3'")
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        scaling[key] = float(scaling[key])
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(
            f"{source}.high_freq_factor={scaling['high_freq_factor']} must exceed "
            f"low_freq_factor={scaling['low_freq_factor']}"
        )
    return theta, tuple(sorted(scaling.items()))
