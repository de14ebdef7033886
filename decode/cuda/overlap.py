"""Step n+1 prepared while the GPU runs step n: the overlap beside the CUDA graphs it serves.

A captured step (``decode.cuda.graphs``) reads everything but its input ids
from one of two staging sides. While step n runs, the engine stages step n+1
on the other side (``stage``: positions, slots, page-table rows); step n+1
uses that ``Plan`` only if nothing changed meanwhile (the engine judges
that). When step n+1 runs the same greedy requests in the same rows, it is
queued on the GPU behind step n before step n's ids are read
(``queues_behind``; its ids are step n's greedy ids, fed on the device);
otherwise a plan that holds is launched once the ids are read. Either way
the launch (``launch``) keeps its output, or the error it raised, for the
next ``DecodeEngine.step`` to finish (``take_launched``).

State: the side the next step stages into, the plan staged, the step
launched ahead. All of it is touched under the engine's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from lanekv.decode.cuda.graphs import DecodeGraphs, StepOutput


class GraphBatch(NamedTuple):
    """One decode step that replays a captured graph: everything but the input
    ids is in the graphs' staging ``side`` already."""

    requests: list[Any]  # the engine's requests, one per row
    input_ids: list[int]
    size: int  # the captured batch size it runs at (padding rows past len(requests))
    side: int
    feed: torch.Tensor | None = None  # the ids on the device (the step before's tokens)
    full: bool = False  # the step with the sampler


class Plan(NamedTuple):
    """The next step, staged while the GPU runs the current one: its requests,
    each request's position (its ``seq_len`` when planned) and its slot."""

    requests: list[Any]
    positions: list[int]
    locs: list[int]
    size: int
    side: int
    full: bool = False  # the step with the sampler


class Launched(NamedTuple):
    """A step launched ahead: its batch, and its output or the error its launch raised."""

    batch: GraphBatch
    output: StepOutput | BaseException


class StepOverlap:
    """The staging sides, the plan staged and the step launched ahead, for ``graphs``.

    ``lock``: the engine's; ``launch`` takes it to keep what it launched.
    """

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._side = 0  # the graphs' staging side of the next step
        self.plan: Plan | None = None  # the next step, staged ahead
        self.launched: Launched | None = None  # the step launched ahead, for the next call to finish

    def take_side(self) -> int:
        """The staging side of the next step (the two alternate)."""
        side = self._side
        self._side ^= 1
        return side

    def stage(self, graphs: DecodeGraphs, requests: Sequence[Any], full: bool = False,
              slots: Sequence[int] | None = None, uniform: Sequence[float] | None = None) -> Plan | None:
        """Fill the next staging side for ``requests`` (each with a page reserved for its
        next slot) and keep it as ``plan``; None (and no plan) when the graphs do not fit it.
        ``full``: the step with the sampler, its rows' ``slots`` and ``uniform`` numbers."""
        self.plan = None
        if not requests:
            return None
        size = graphs.size_for(len(requests), max(r.table.num_pages for r in requests))
        if size is None:
            return None
        positions = [r.table.seq_len for r in requests]
        locs = [r.table.loc(p) for r, p in zip(requests, positions)]
        side = self.take_side()
        graphs.stage(side, [r.table for r in requests], positions, locs, [p + 1 for p in positions],
                     slots, uniform)
        self.plan = Plan(list(requests), positions, locs, size, side, full)
        return self.plan

    def take_plan(self) -> Plan | None:
        plan, self.plan = self.plan, None
        return plan

    def commit(self, plan: Plan) -> GraphBatch:
        """``plan`` becomes a step to run: no longer staged, its slots taken (their pages
        were reserved when it was staged)."""
        self.plan = None
        for request in plan.requests:
            request.table.append_slot()
        return GraphBatch(plan.requests, [r.last_token for r in plan.requests], plan.size, plan.side,
                          full=plan.full)

    @staticmethod
    def queues_behind(plan: Plan | None, batch: Sequence[Any]) -> bool:
        """Whether ``plan`` runs the same requests in the same rows as ``batch``, none
        reads logprobs back and none has a grammar (its next mask needs ``batch``'s token
        on the host), so its input ids can be ``batch``'s tokens (the argmax, or the full
        step's draw), fed on the device."""
        return plan is not None and len(plan.requests) == len(batch) and all(
            a is b and a.sampling.logprobs is None and a.sampling.grammar is None
            for a, b in zip(plan.requests, batch))

    def launch(self, batch: GraphBatch, run: Callable[[GraphBatch], StepOutput]) -> None:
        """Run ``batch`` now, for the next step to finish. A failure is kept and raised
        by that step (``take_launched``), so the events of this one are not lost."""
        try:
            output: StepOutput | BaseException = run(batch)
        except Exception as err:  # noqa: BLE001 (raised by the next step, which lands the batch)
            output = err
        with self._lock:
            self.launched = Launched(batch, output)

    def take_launched(self) -> Launched | None:
        launched, self.launched = self.launched, None
        return launched
