"""The decode engine of a tensor-parallel group's rank 0.

``TPDecodeEngine`` is ``DecodeEngine`` (scheduling, sampling, streams unchanged)
whose step first broadcasts the step's inputs to the other ranks
(``decode.tp.steps``), which run the same model step on their shards; the
all-reduces inside the model keep the ranks in lock-step. Only rank 0 computes
logits and samples. Steps run eager (no CUDA graphs, no overlap: the broadcast
is a host-side step of its own); ``tp_size == 1`` never builds this class, so the
single-GPU path is the plain engine, unchanged.
"""

from __future__ import annotations

from typing import Any

from lanekv.decode.engine import DecodeBatch, DecodeEngine
from lanekv.decode.tp.steps import StepInputs, send_step


class TPDecodeEngine(DecodeEngine):
    def __init__(self, *args: Any, group: Any, **kwargs: Any) -> None:
        kwargs["graph_sizes"] = ()
        kwargs["overlap"] = False
        super().__init__(*args, **kwargs)
        self.group = group

    def _run(self, batch: DecodeBatch) -> Any:
        send_step(StepInputs(batch.input_ids, batch.positions, batch.locs, batch.page_table, batch.seq_lens),
                  self.group)
        return super()._run(batch)
