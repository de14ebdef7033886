"""DeepSeek-V3.2: the DeepSeek-V3 decoder whose MLA attention reads only the
keys its lightning indexer selects (DSA, ``model/dsa.py``).

The attention callback sees, beside the MLA query and latent row, the tokens'
index inputs (index queries, the index key the index-K pool holds, the head
weights):

    attention(layer, q [T, H, qk_head_dim], latent [T, R + P], index: IndexInputs)
        -> o [T, H, v_head_dim]

The caller stores ``index.k`` beside the latent, scores each query against the
request's index keys ``[0, position]``, keeps the top ``index_topk`` and runs
sparse MLA attention over those rows (``kernels/dsa``). ``dsa_causal_attention``
is that callback for one whole sequence, in the latent space: the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from lanekv.kernels.dsa.sparse_mla import sparse_mla_prefill
from lanekv.model.config import ModelConfig
from lanekv.model.deepseek import DeepseekCausalLM, MLAAttention
from lanekv.model.dsa import Indexer, IndexInputs

DSAAttentionFn = Callable[[int, torch.Tensor, torch.Tensor, IndexInputs], torch.Tensor]


class DSAAttention(MLAAttention):
    """MLA attention with its indexer (``self_attn.indexer``, transformers' name)."""

    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__(config, layer_index, dtype, device)
        self.indexer = Indexer(config.dsa, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: DSAAttentionFn, rope_in_attention: bool = False) -> torch.Tensor:
        if rope_in_attention:
            raise ValueError("a DSA callback takes the latent after RoPE, got "
                             "rope_in_attention=True")
        proj = self.project(x, cos, sin)
        index = self.indexer.project(x, proj.q_lora, cos, sin)
        return self.output(attention(self.layer_index, proj.q, proj.latent, index))


class DeepseekV32CausalLM(DeepseekCausalLM):
    """``DeepseekCausalLM`` whose layers attend through ``DSAAttention``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if config.dsa is None:
            raise ValueError(f"architecture={config.architecture!r} has no DSA indexer")
        if config.mla is None or config.mla.q_lora_rank is None:
            raise ValueError("a DeepSeek-V3.2 model needs q_lora_rank (its index queries)")
        super().__init__(config, dtype=dtype, device=device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = DSAAttention(config, i, dtype, device)

    def mla_layer(self, layer: int) -> DSAAttention:
        return self.model.layers[layer].self_attn


def dsa_causal_attention(model: DeepseekV32CausalLM) -> DSAAttentionFn:
    """The reference callback for one sequence at positions ``0..T-1``: index
    top-k over the sequence's own keys, then sparse attention in the latent space."""
    scale, rank = model.config.softmax_scale, model.config.mla.kv_lora_rank

    def attention(layer: int, q: torch.Tensor, latent: torch.Tensor,
                  index: IndexInputs) -> torch.Tensor:
        attn = model.mla_layer(layer)
        positions = torch.arange(q.shape[0], device=q.device)
        selected = attn.indexer.select(index.q, index.weights, index.k, positions)
        o_latent = sparse_mla_prefill(attn.absorb_query(q), latent, selected, scale, rank)
        return attn.expand_output(o_latent)

    return attention
