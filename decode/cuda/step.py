"""The model run of one decode step, shared by the eager engine and the captured steps.

``step_hidden`` feeds one token per request at its position and returns the
final hidden rows. Attention, built by the model's attention kind
(``model.attention``: ``paged_decode``), stores the new token's row at ``locs``
first (a negative loc stores nothing: padding rows) and then reads each
request's ``seq_lens[b]`` cached tokens through ``page_table``.

Every op is a device op whose shapes depend only on the batch size, so the
same function runs eagerly or inside a CUDA-graph capture (``decode.cuda.graphs``).
"""

from __future__ import annotations

import torch
from lanekv.decode.pool import PagePool
from lanekv.model.attention import AnyCausalLM, DecodeStep, kind_of


def step_hidden(model: AnyCausalLM, pool: PagePool, input_ids: torch.Tensor,
                positions: torch.Tensor, locs: torch.Tensor, page_table: torch.Tensor,
                seq_lens: torch.Tensor) -> torch.Tensor:
    """``[B]`` ids, positions, locs (int64), ``[B, pages]`` page table and ``[B]``
    seq lens (int32, the new token included) -> hidden ``[B, hidden]``."""
    kind = kind_of(model.config)
    attention = kind.paged_decode(model, pool, DecodeStep(locs, page_table, seq_lens))
    return kind.forward(model, input_ids, positions, attention)
