"""The typed messages between the prefill parent and its CP ranks.

Commands go down, one queue per rank, wrapped in a ``Call`` with a sequence
number; a rank runs them in the order sent. Every rank answers on one shared
queue: exactly one ``Answer`` or ``Failed`` per ``Call`` (``Shutdown`` gets
none), one ``Ready`` (or a ``Failed`` without a sequence number) at start-up,
and events at any time. At start-up, before any ``Call``, a rank loading a
checkpoint gets one ``Weights`` (its weights digest, computed once for all ranks). Every message is plain picklable data: no callables,
no tensors on a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lanekv.model.parallel.weights_digest import WeightsDigest
from lanekv.prefill.cp.runner import PrefillBatch
from lanekv.transfer.protocol.contract import Topology

# -- parent -> rank ---------------------------------------------------------


@dataclass(frozen=True)
class Weights:
    """The checkpoint's weights digest, computed once by the parent while the ranks
    load (``model.parallel.weights_digest``): the first item of a rank's queue, no answer."""

    digest: WeightsDigest


@dataclass(frozen=True)
class RunPrefill:
    """Register the batch's pages for FetchKV (then ``Registered``), prefill, answer a ``RankResult``."""

    batch: PrefillBatch


@dataclass(frozen=True)
class SetTopology:
    """The topology the rank's contract names from now on (the ranks' endpoints are known only after start-up)."""

    topology: Topology


@dataclass(frozen=True)
class Forget:
    """Drop what the rank's page source holds for ``request_id`` (its lease expired)."""

    request_id: str


@dataclass(frozen=True)
class ReadPages:
    """Answer a CPU copy of the K/V of these logical pages (all owned by the rank), in order."""

    pages: tuple[int, ...]


@dataclass(frozen=True)
class Snapshot:
    """Answer a CPU copy of the rank's whole pool."""


@dataclass(frozen=True)
class FreezeHeap:
    """Collect, then freeze every object alive (``runtime.gcpause.freeze_start_up``): sent
    once warm-up is done; answers how many objects were frozen."""


@dataclass(frozen=True)
class WarmGemms:
    """Run the model's GEMMs at the row counts of ``prefill.cp.gemm_warmup.row_ladder``
    up to ``max_rows`` (start-up, before serving); answers a ``GemmWarmUp``."""

    max_rows: int


@dataclass(frozen=True)
class TileRows:
    """Answer the row counts at which this rank's prefill kernels change their tiles
    (``prefill.cp.tile_rows``); the warm-up prefills both sides of each."""


@dataclass(frozen=True)
class CaptureGraphs:
    """Capture the rank's prefill pieces as CUDA graphs for up to ``max_rows`` rows
    (``prefill.cp.graphs``; start-up, before serving); answers a ``GraphCapture``."""

    max_rows: int


@dataclass(frozen=True)
class Shutdown:
    """Stop serving and exit; no answer."""


Command = (RunPrefill | SetTopology | Forget | ReadPages | Snapshot | FreezeHeap | WarmGemms | TileRows
           | CaptureGraphs | Shutdown)


def for_each_rank(command: Command | Sequence[Command], cp_size: int) -> list[Command]:
    """Rank ``r``'s command: ``command`` itself, or its ``r``-th item when it is one per rank."""
    if not isinstance(command, (list, tuple)):
        return [command] * cp_size
    if len(command) != cp_size:
        raise ValueError(f"one command per rank needs {cp_size} commands, got len(command)={len(command)}")
    return list(command)


@dataclass(frozen=True)
class Call:
    """What a rank's command queue carries: a command and the number its answer names."""

    seq: int
    command: Command


# -- rank -> parent ---------------------------------------------------------


@dataclass(frozen=True)
class RankInfo:
    """What a started rank tells the parent about itself."""

    model: dict[str, Any]  # ModelConfig.contract_fields()
    weights_digest: str
    pool_shape: tuple[int, ...]  # [layers, 2, rows, kv_heads, head_dim]
    device: str
    endpoint: str | None = None  # its KVTransfer server ("host:port"); None when it serves none
    agreement: bytes | None = None  # its encoded Agreement; None when it serves no transfers
    relays: tuple[str, ...] = ()  # its sender relays' endpoints (transfer.rank.relay)


@dataclass(frozen=True)
class Ready:
    rank: int
    info: RankInfo


@dataclass(frozen=True)
class Answer:
    rank: int
    seq: int
    value: Any  # what the command answers: a RankResult, a CPU tensor, or None


@dataclass(frozen=True)
class Failed:
    rank: int
    seq: int | None  # None: the rank failed to start
    error: str  # the rank's traceback


@dataclass(frozen=True)
class Registered:
    """The rank holds the pages of the ``RunPrefill`` of ``seq`` for FetchKV; it prefills next."""

    rank: int
    seq: int


@dataclass(frozen=True)
class Released:
    """A decode side released ``request_id`` at this rank, freeing these logical pages."""

    rank: int
    request_id: str
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Fetched:
    """A FetchKV stream of ``request_id`` finished: its payload bytes and seconds."""

    rank: int
    request_id: str
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class RpcTotals:
    """The rank's gRPC calls so far, by (service, method, code): running totals, sent when they change."""

    rank: int
    totals: dict[tuple[str, str, str], float]


Event = Released | Fetched | RpcTotals
Report = Ready | Answer | Failed | Registered | Released | Fetched | RpcTotals
