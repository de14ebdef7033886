"""DeepSeek-V2/V3 configuration: MLA dims, YaRN RoPE and MoE routing.

Read from a Hugging Face ``config.json`` with the defaults transformers gives
each architecture. ``ModelConfig`` carries these as ``mla`` and ``moe``; for an
MLA model its ``num_kv_heads`` is 1 and its ``head_dim`` is the width of the
cached latent row (``kv_lora_rank + qk_rope_head_dim``), so the KV pool and the
contract see one head of that width. Anything that changes the math in a way
the model code does not implement is refused with a ``ValueError`` naming the
field and its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                          "DeepseekV32ForCausalLM")
DEEPSEEK_MODEL_TYPES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                        "deepseek_v32": "DeepseekV32ForCausalLM"}
# transformers' defaults for fields a config.json may omit.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "DeepseekV2ForCausalLM": {
        "max_position_embeddings": 2048, "first_k_dense_replace": 0, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "n_group": None, "n_routed_experts": 64, "n_shared_experts": 2,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0,
        "topk_group": None, "topk_method": "greedy", "norm_topk_prob": False, "v_head_dim": 128,
        "num_experts_per_tok": None, "moe_intermediate_size": 1407, "rope_interleave": True,
    },
    "DeepseekV3ForCausalLM": {
        "max_position_embeddings": 4096, "first_k_dense_replace": 3, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "routed_scaling_factor": 2.5,
        "topk_group": 4, "topk_method": "noaux_tc", "norm_topk_prob": True, "v_head_dim": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "rope_interleave": True,
    },
}
# DeepSeek-V3.2 is V3 (MLA, sigmoid-routed MoE) plus the DSA indexer (model.dsa).
_DEFAULTS = {**_DEFAULTS, "DeepseekV32ForCausalLM": {
    **_DEFAULTS["DeepseekV3ForCausalLM"], "max_position_embeddings": 163840}}
_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
_YARN_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
                        "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                        "truncate"})


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention: the latent row is ``kv_lora_rank`` normed
    values then ``qk_rope_head_dim`` RoPE'd values."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # RoPE on (even, odd) pairs, as DeepSeek lays them out
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale squared
    # YaRN (None: plain RoPE): factor, original context, betas, attention factor, truncate
    yarn: tuple[tuple[str, Any], ...] | None

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached row: ``kv_lora_rank + qk_rope_head_dim`` (576 for V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def contract_fields(self) -> dict[str, Any]:
        return {"kv_lora_rank": self.kv_lora_rank, "q_lora_rank": self.q_lora_rank,
                "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim}


@dataclass(frozen=True)
class MoEConfig:
    """Routed + shared experts. ``scoring`` is ``softmax`` (V2) or ``sigmoid``
    (V3, with ``e_score_correction_bias`` for the choice only); groups are
    ranked by their best score (V2) or the sum of their best two (V3)."""

    num_experts: int
    top_k: int
    num_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    scoring: str  # "softmax" | "sigmoid"
    n_group: int
    topk_group: int  # n_group when routing is not group-limited
    routed_scaling_factor: float
    norm_topk_prob: bool

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "moe_intermediate_size", "n_group", "topk_group"):
            _positive(name, getattr(self, name))
        for name in ("num_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring={self.scoring!r} must be 'softmax' or 'sigmoid'")
        if self.num_experts % self.n_group:
            raise ValueError(f"n_routed_experts={self.num_experts} is not a multiple of "
                             f"n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        per_group = self.num_experts // self.n_group
        if self.top_k > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the "
                             f"{self.topk_group * per_group} experts of topk_group groups")
        if self.scoring == "sigmoid" and self.n_group > 1 and per_group < 2:
            raise ValueError(f"n_group={self.n_group} leaves fewer than 2 experts per group")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


def deepseek_fields(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The ``ModelConfig`` keyword arguments of a DeepSeek ``config.json``."""
    d = {**_DEFAULTS[architecture], **{k: v for k, v in hf.items() if v is not None or k in (
        "q_lora_rank",)}}
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    for name, allowed in (("moe_layer_freq", 1), ("mlp_bias", False)):
        if hf.get(name, allowed) != allowed:
            raise ValueError(f"{name}={hf[name]!r} is not supported (only {allowed!r})")
    num_heads = _required(hf, "num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or num_heads
    if kv_heads != num_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} must equal num_attention_heads="
                         f"{num_heads} for MLA")
    max_positions = d["max_position_embeddings"]
    theta, yarn, attention_factor, mscale_all = _yarn(hf, max_positions)
    mla_kw = {k: d[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                 "qk_rope_head_dim", "v_head_dim")}
    scale = (d["qk_nope_head_dim"] + d["qk_rope_head_dim"]) ** -0.5
    if yarn is not None and mscale_all:
        m = yarn_mscale(dict(yarn)["factor"], mscale_all)
        scale = scale * m * m
    interleave = bool(d["rope_interleave"]) if architecture == "DeepseekV3ForCausalLM" else True
    mla = MLAConfig(**mla_kw, rope_interleave=interleave, softmax_scale=scale,
                    yarn=None if yarn is None else tuple(sorted(
                        {**dict(yarn), "attention_factor": attention_factor}.items())))
    moe = _moe(d, architecture)
    return {
        "num_heads": num_heads,
        "num_kv_heads": 1,
        "head_dim": mla.latent_dim,
        "max_position_embeddings": max_positions,
        "rope_theta": theta,
        "rope_scaling": mla.yarn,
        "attention_bias": bool(hf.get("attention_bias", False)),
        "o_proj_bias": bool(hf.get("attention_bias", False)),
        "mla": mla,
        "moe": moe,
    }


def _moe(d: dict[str, Any], architecture: str) -> MoEConfig:
    if architecture == "DeepseekV2ForCausalLM":
        method = d["topk_method"]
        if method not in _V2_TOPK_METHODS:
            raise ValueError(f"topk_method={method!r} is not supported for DeepseekV2 "
                             f"({', '.join(_V2_TOPK_METHODS)})")
        scoring = d.get("scoring_func", "softmax")
        grouped = method == "group_limited_greedy"
        if d["norm_topk_prob"]:
            # DeepSeek's own V2 code renormalizes, transformers' does not: refused
            # rather than served one way or the other (V2 checkpoints have false).
            raise ValueError("norm_topk_prob=True is not supported for DeepseekV2 (only false)")
    else:
        scoring = d.get("scoring_func", "sigmoid")
        grouped = True
    expected = "softmax" if architecture == "DeepseekV2ForCausalLM" else "sigmoid"
    if scoring != expected:
        raise ValueError(f"scoring_func={scoring!r} is not supported for {architecture} "
                         f"(only {expected!r})")
    top_k = d["num_experts_per_tok"]
    if top_k is None:
        raise ValueError("num_experts_per_tok is missing from config.json")
    n_group = d["n_group"] if grouped and d["n_group"] is not None else 1
    topk_group = d["topk_group"] if grouped and d["topk_group"] is not None else n_group
    return MoEConfig(
        num_experts=d["n_routed_experts"], top_k=top_k, num_shared_experts=d["n_shared_experts"],
        moe_intermediate_size=d["moe_intermediate_size"],
        first_k_dense_replace=d["first_k_dense_replace"], scoring=scoring, n_group=n_group,
        topk_group=topk_group, routed_scaling_factor=float(d["routed_scaling_factor"]),
        norm_topk_prob=bool(d["norm_topk_prob"]),
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(hf: dict[str, Any], max_positions: int):
    """(theta, YaRN params or None, attention factor, mscale_all_dim)."""
    params = hf.get("rope_parameters")
    source = "rope_parameters"
    if params is None:
        params, source = hf.get("rope_scaling"), "rope_scaling"
    params = dict(params or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None, 1.0, 0
    if rope_type != "yarn":
        raise ValueError(f"{source}.rope_type={rope_type!r} is not supported (default, yarn)")
    unknown = sorted(set(params) - _YARN_KEYS)
    if unknown:
        raise ValueError(f"{source} has unsupported keys {unknown} (value {params!r})")
    original = params.get("original_max_position_embeddings", max_positions)
    factor = params.get("factor")
    factor = float(max_positions / original if factor is None else factor)
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention_factor = yarn_mscale(factor)
    yarn = {
        "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
        "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(
            params.get("beta_slow") or 1), "truncate": bool(params.get("truncate", True)),
        "mscale_all_dim": float(mscale_all or 0.0),
    }
    return theta, tuple(sorted(yarn.items())), float(attention_factor), mscale_all or 0


def yarn_inv_freq(dim: int, theta: float, yarn: dict[str, Any] | None,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """``[dim // 2]`` float32 inverse frequencies and the cos/sin scale, with the
    float32 ops transformers uses for YaRN (plain RoPE when ``yarn`` is None)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn["beta_fast"]), correction_dim(yarn["beta_slow"])
    if yarn["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low)
                       / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(yarn["attention_factor"])


def _required(hf: dict[str, Any], name: str) -> Any:
    if name not in hf:
        raise ValueError(f"{name} is missing from config.json")
    return hf[name]


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
