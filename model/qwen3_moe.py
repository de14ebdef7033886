"""Qwen3-MoE: the Qwen3 decoder (``model.llama`` with per-head q/k RMSNorm) whose
every MLP is a mixture of experts.

The router (``mlp.gate``, float32 here) takes the softmax over all experts and
keeps the top ``num_experts_per_tok``, renormalised when ``norm_topk_prob``;
the chosen experts run through ``kernels.moe.moe_experts`` like DeepSeek's
routed experts (``model.deepseek.MoE`` with no shared experts), so checkpoint
names (``mlp.experts.{e}.gate_proj.weight`` ...) and the CUDA-graph decode step
are the same. Attention, caches and the transfer contract are the GQA ones.
"""

from __future__ import annotations

import torch
from lanekv.model.config import ModelConfig
from lanekv.model.deepseek import MoE
from lanekv.model.llama import CausalLM


class Qwen3MoeCausalLM(CausalLM):
    """``CausalLM`` whose layers' MLPs are ``MoE`` blocks."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if config.moe is None or config.mla is not None:
            raise ValueError(f"architecture={config.architecture!r} is not a Qwen3-MoE model")
        super().__init__(config, dtype=dtype, device=device)
        for layer in self.model.layers:
            layer.mlp = MoE(config, dtype, device)
