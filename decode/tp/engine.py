"""The decode engine of a tensor-parallel group's rank 0.

``TPDecodeEngine`` is ``DecodeEngine`` (scheduling, sampling, streams unchanged)
whose step first broadcasts the step's inputs to the other ranks
(``decode.tp.steps``), which run the same model step on their shards; the
all-reduces inside the model keep the ranks in lock-step. Only rank 0 computes
logits and samples. Steps run eager (no CUDA graphs, no overlap: the broadcast
is a host-side step of its own); ``tp_size == 1`` never builds this class, so the
single-GPU path is the plain engine, unchanged. A step that fails because a rank
died raises ``RankFailed`` naming the rank (the watcher's line).
"""

from __future__ import annotations

from typing import Any

from lanekv.decode.engine import DecodeBatch, DecodeEngine
from lanekv.decode.tp.group import RankFailed, TPGroup
from lanekv.decode.tp.steps import StepInputs, send_step

_DEATH_WAIT_S = 2.0  # a collective broken by a rank's death: how long the watcher gets to name it


class TPDecodeEngine(DecodeEngine):
    def __init__(self, *args: Any, group: TPGroup, **kwargs: Any) -> None:
        kwargs["graph_sizes"] = ()
        kwargs["overlap"] = False
        super().__init__(*args, **kwargs)
        self.group = group

    def _run(self, batch: DecodeBatch) -> Any:
        try:
            send_step(StepInputs(batch.input_ids, batch.positions, batch.locs, batch.page_table,
                                 batch.seq_lens), self.group.group)
            return super()._run(batch)
        except Exception as err:
            reason = self.group.wait_failure(_DEATH_WAIT_S)
            if reason is not None:
                raise RankFailed(reason) from err
            raise
