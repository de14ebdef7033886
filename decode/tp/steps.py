"""What rank 0 broadcasts for each decode step, and how a rank reads it back.

One step is two broadcasts from rank 0 over the group: a header
``[op, batch, width]`` (int64) and, for ``op == STEP``, one int64 tensor packing
the step's inputs: ``[B]`` input ids, positions, locs and seq lens, then the
``[B, width]`` page table. Sampling stays on rank 0 (it alone computes the
logits), so no sampling parameter crosses: every rank needs only what its
attention and its all-reduces need, and they are these.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

STOP = 0  # the group ends: ranks leave their loop
STEP = 1  # a decode step follows


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    locs: torch.Tensor  # [B] int64 rows of the new tokens' K/V (the same pages on every rank)
    page_table: torch.Tensor  # [B, width] int32
    seq_lens: torch.Tensor  # [B] int32, the new token included


def send_step(inputs: StepInputs, group: Any) -> None:
    """Rank 0: broadcast one step's inputs (CPU tensors for gloo, device ones for NCCL)."""
    batch, width = inputs.page_table.shape
    device = inputs.input_ids.device
    header = torch.tensor([STEP, batch, width], dtype=torch.int64, device=device)
    payload = torch.cat([inputs.input_ids, inputs.positions, inputs.locs,
                         inputs.seq_lens.to(torch.int64), inputs.page_table.reshape(-1).to(torch.int64)])
    dist.broadcast(header, 0, group=group)
    dist.broadcast(payload, 0, group=group)


def send_stop(group: Any, device: torch.device) -> None:
    dist.broadcast(torch.tensor([STOP, 0, 0], dtype=torch.int64, device=device), 0, group=group)


def receive_step(group: Any, device: torch.device) -> StepInputs | None:
    """A rank other than 0: the next step's inputs, or None when the group stops."""
    header = torch.empty(3, dtype=torch.int64, device=device)
    dist.broadcast(header, 0, group=group)
    op, batch, width = header.tolist()
    if op == STOP:
        return None
    if op != STEP:
        raise ValueError(f"step header op={op} is not STEP or STOP")
    payload = torch.empty(4 * batch + batch * width, dtype=torch.int64, device=device)
    dist.broadcast(payload, 0, group=group)
    ids, positions, locs, lens, table = payload.split([batch, batch, batch, batch, batch * width])
    return StepInputs(ids, positions, locs, table.view(batch, width).to(torch.int32), lens.to(torch.int32))
