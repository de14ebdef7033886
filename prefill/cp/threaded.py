"""A CP prefill engine whose ranks are threads of this process.

Same API and the same rank code as the process launcher; only the all-gather
differs (``ThreadGroup``). It loads the model once and gives every rank its
own owner-lane pool. Used by the tests to cover many CP shapes quickly, and
as the colocated single-process path (cp_size 1) of the demo.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lanekv.model.checkpoint import LoadedModel
from lanekv.prefill.allocator import LaneAllocator
from lanekv.prefill.cp.gemm_warmup import GemmWarmUp
from lanekv.prefill.cp.graphs import GraphCapture
from lanekv.prefill.cp.launcher import PrefillEngine
from lanekv.prefill.cp.messages import CaptureGraphs, Command, WarmGemms, for_each_rank
from lanekv.prefill.cp.rank_worker import build_runner, describe, handle
from lanekv.prefill.cp.thread_group import ThreadGroup
from lanekv.prefill.engine_config import EngineConfig, load_for


class ThreadedPrefillEngine(PrefillEngine):
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        if config.ep:
            raise ValueError("ep=True needs rank processes (one model per rank), not the threaded engine")
        self.config = config
        self.allocator = LaneAllocator(config.cp_size, config.pages_per_lane)
        if loaded is None:
            device = "cuda" if config.resolved_device == "cuda" else "cpu"
            loaded = load_for(config, device)
        self.loaded = loaded
        self.group = ThreadGroup(config.cp_size)
        self.runners = [build_runner(loaded, config, r, self.group) for r in range(config.cp_size)]
        self.info = describe(self.runners[0], config)

    def close(self) -> None:
        """End the rank threads."""
        self.group.close()

    def freeze_heap(self) -> list[int]:
        """Nothing: the ranks are threads of a process that is not theirs to freeze."""
        return []

    def warm_gemms(self, max_rows: int) -> list[GemmWarmUp]:
        """Once: the rank threads share one model on one device."""
        return [self.call(WarmGemms(max_rows), only=0)]

    def capture_graphs(self, max_rows: int) -> list[GraphCapture]:
        """Rank by rank: two threads capturing at once would see each other's launches."""
        return [self.call(CaptureGraphs(max_rows), only=r) for r in range(self.config.cp_size)]

    def call(self, command: Command | Sequence[Command], *, only: int | None = None,
             on_registered: Callable[[], None] | None = None) -> Any:
        if on_registered is not None:  # rank threads serve no FetchKV: nothing to wait for
            on_registered()
        per_rank = for_each_rank(command, self.config.cp_size)
        if only is not None:
            return handle(self.runners[only], per_rank[only])
        return self.group.run(lambda rank: handle(self.runners[rank], per_rank[rank]))
