"""The row counts at which a rank's prefill kernels change their tiles.

A Triton kernel compiles once per set of compile-time values, and the tile
sizes are among them. Two launchers pick their tiles by how much work a call
has: the attention (``kernels.prefill.config.default_config``: 64-row
query blocks while the chip would be short of programs, 128-row ones after)
and the MoE experts (``kernels.moe.experts.default_moe_tiles``: thin row
blocks for a few tokens per expert). The prefill warm-up (``prefill.warmup``)
prefills on both sides of each row count here, so no prompt length compiles a
kernel while a request waits. On the CPU nothing compiles: the set is empty.
"""

from __future__ import annotations

import torch
from lanekv.kernels.moe.experts import prefill_tile_min_pairs
from lanekv.kernels.prefill.config import big_tile_min_rows
from lanekv.model.attention import kind_of
from lanekv.model.config import ModelConfig


def tile_switch_rows(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """The fewest rows of a rank's prefill batch at which a kernel's tiles change, sorted."""
    if device.type != "cuda":
        return ()
    qk_dim = kind_of(config).prefill_qk_dim(config)
    rows = {big_tile_min_rows(config.num_heads, qk_dim, dtype, device)}
    if config.moe is not None:  # every row picks top_k experts
        rows.add(-(-prefill_tile_min_pairs(config.moe.num_experts) // config.moe.top_k))
    return tuple(sorted(r for r in rows if r is not None))
