"""The DeepSeek-V3.2 lightning indexer (DSA), as transformers' DeepseekV32Indexer computes it.

Per token: index queries ``wq_b(q_lora) -> [H, D]`` (``H = index_n_heads``,
``D = index_head_dim``), one index key ``LayerNorm(wk(hidden)) -> [D]`` and a
weight per index head ``weights_proj(hidden) * H ** -0.5`` (float32). RoPE,
in halves (not DeepSeek's interleaved pairs), rotates the first
``qk_rope_head_dim`` dims of queries and key with the MLA attention's cos/sin.
A query at position ``p`` scores keys ``[0, p]`` with ``sum_h w_h * relu(D **
-0.5 * q_h . k)`` and keeps the ``index_topk`` best (all when fewer).

Parameter names are transformers' (``self_attn.indexer.{wq_b,wk,k_norm,
weights_proj}``), so a DeepseekV32ForCausalLM checkpoint loads as it is;
``weights_proj`` stays float32 as transformers keeps it. Ops and matmul shapes
follow transformers, so float32 scores are bit-identical and top-k ties resolve
the same way (``kernels/dsa/indexer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from lanekv.kernels.dsa.indexer import index_scores, index_topk
from lanekv.kernels.rope_store import mla_rope
from torch import nn

_K_NORM_EPS = 1e-6  # transformers' indexer LayerNorm epsilon, whatever the config says
_PREFIX = "model.layers.{layer}.self_attn.indexer."


@dataclass(frozen=True)
class DSAConfig:
    """The indexer's dims, from a DeepseekV32 ``config.json``."""

    hidden_size: int
    q_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    qk_rope_head_dim: int

    def __post_init__(self) -> None:
        for name in ("hidden_size", "q_lora_rank", "index_n_heads", "index_head_dim",
                     "index_topk", "qk_rope_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.qk_rope_head_dim > self.index_head_dim or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even and at most index_head_dim "
                             f"{self.index_head_dim}, got {self.qk_rope_head_dim}")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> DSAConfig:
        """Read a Hugging Face config dict, with DeepseekV32Config's defaults for absent
        fields; DSA needs q_lora (the index queries come from it)."""
        if "q_lora_rank" in config and config["q_lora_rank"] is None:
            raise ValueError("q_lora_rank must be set for a DeepSeek sparse attention model, "
                             "got None")
        defaults = {"q_lora_rank": 1536, "qk_rope_head_dim": 64, "index_n_heads": 64,
                    "index_head_dim": 128, "index_topk": 2048}
        return cls(hidden_size=config.get("hidden_size"),
                   **{name: config.get(name, value) for name, value in defaults.items()})

    @property
    def softmax_scale(self) -> float:
        return self.index_head_dim ** -0.5


class IndexInputs(NamedTuple):
    q: torch.Tensor  # [T, index_n_heads, index_head_dim]
    k: torch.Tensor  # [T, index_head_dim], the row the index-K pool holds
    weights: torch.Tensor  # [T, index_n_heads] float32, H ** -0.5 included


class Indexer(nn.Module):
    def __init__(self, config: DSAConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        kw = {"dtype": dtype, "device": device}
        heads, dim = config.index_n_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, heads * dim, bias=False, **kw)
        self.wk = nn.Linear(config.hidden_size, dim, bias=False, **kw)
        self.k_norm = nn.LayerNorm(dim, eps=_K_NORM_EPS, **kw)
        self.weights_proj = nn.Linear(config.hidden_size, heads, bias=False,
                                      dtype=torch.float32, device=device)

    def project(self, hidden: torch.Tensor, q_lora: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> IndexInputs:
        """``hidden [T, hidden_size]``, ``q_lora [T, q_lora_rank]`` (after
        q_a_layernorm) -> index queries, keys and head weights of the tokens."""
        cfg = self.config
        tokens, rope = hidden.shape[0], cfg.qk_rope_head_dim
        q = self.wq_b(q_lora).view(tokens, cfg.index_n_heads, cfg.index_head_dim)
        k = self.k_norm(self.wk(hidden))  # [T, D]
        # RoPE on the first dims of both (pairs (x[i], x[i + P/2])), in place: one launch on
        # CUDA where the torch ops of rope_halves are about twenty
        mla_rope(q[..., :rope], k[:, :rope], cos, sin, interleave=False)
        weights = self.weights_proj(hidden.to(torch.float32)).float() * cfg.index_n_heads ** -0.5
        return IndexInputs(q, k, weights)

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               q_positions: torch.Tensor) -> torch.Tensor:
        """``[Tq, Tk]`` float32 causal scores of queries at ``q_positions`` against
        the request's keys ``[0, Tk)`` (``-inf`` beyond each query's position)."""
        return index_scores(q, keys.to(q.dtype), weights, q_positions, self.config.softmax_scale)

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               q_positions: torch.Tensor) -> torch.Tensor:
        """``[Tq, index_topk]`` int32 selected key positions per query, ``-1`` padded."""
        return index_topk(self.scores(q, weights, keys, q_positions), self.config.index_topk)


def load_indexer(indexer: Indexer, state: dict[str, torch.Tensor], layer: int) -> None:
    """Copy layer ``layer``'s indexer weights from a checkpoint's state dict
    (transformers' names); a missing or misshapen tensor is one ValueError naming it."""
    prefix = _PREFIX.format(layer=layer)
    own = indexer.state_dict()
    missing = [prefix + name for name in own if prefix + name not in state]
    if missing:
        raise ValueError(f"checkpoint lacks {missing[0]} (and {len(missing) - 1} more "
                         f"indexer tensors)" if len(missing) > 1 else
                         f"checkpoint lacks {missing[0]}")
    with torch.no_grad():
        for name, param in own.items():
            tensor = state[prefix + name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{prefix + name} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(param.shape)}")
            param.copy_(tensor.to(param.dtype))


def indexer_tensor_names(layer: int) -> list[str]:
    """The checkpoint names of one layer's indexer tensors."""
    prefix = _PREFIX.format(layer=layer)
    return [prefix + name for name in ("wq_b.weight", "wk.weight", "k_norm.weight",
                                       "k_norm.bias", "weights_proj.weight")]
