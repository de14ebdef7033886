"""One rank of a tensor-parallel decode group: its spec, state, messages and process main.

Ranks 1..T-1 run ``follower_main`` in processes rank 0 spawned
(``decode.tp.group``): join the group (gloo on the CPU, NCCL on CUDA, one GPU
per rank), load their shard (``model.parallel.tp.load_shard``), build their pool (the
same pages as rank 0's, their KV heads' slice of each row), say ``Ready``, then
run every step rank 0 broadcasts (``decode.tp.steps``) until it says STOP. Tasks
(``RankTask``: work on the rank's pool, such as placing its heads' KV of a
request) arrive on a queue and run in threads of their own beside the steps,
as the single-process daemon places KV while its loop decodes. A rank whose
parent dies exits (no orphan holds a GPU).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from lanekv.decode.cuda.step import step_hidden
from lanekv.decode.cuda.warmup import warm_up_kernels
from lanekv.decode.pool import PagePool
from lanekv.decode.tp.steps import receive_step
from lanekv.model.attention.rows import DEFAULT_INDEX_CACHE_DTYPE
from lanekv.model.checkpoint import LoadedModel, checkpoint_digest
from lanekv.model.parallel.rendezvous import join_store
from lanekv.model.parallel.tp import TPRank, attach_all_reduce, load_shard, weight_bytes
from lanekv.runtime.gcpause import exit_at_once

log = logging.getLogger("lanekv.decode.tp")
_PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class TPSpec:
    """What every rank of a decode group builds (picklable: it goes to each process)."""

    model_path: str
    tp_size: int
    dtype: torch.dtype
    device: str  # "cpu" or "cuda" (rank r takes GPU r)
    num_pages: int
    page_size: int
    port: int = 0  # the group's rendezvous on 127.0.0.1, held by rank 0 (0: one the OS gives)
    timeout_s: float = 24 * 3600.0  # a collective's limit: an idle group waits this long for a step
    cpu_threads: int = 0  # 0: the host's cores over the ranks
    # Every rank on cuda:0 over gloo: the multi-rank code on one GPU (NCCL refuses two
    # ranks on one device). Tests only: it measures nothing about NCCL.
    share_gpu: bool = False
    kv_cache_dtype: str = "auto"  # the daemon's: FP8 rows keep each head's scale beside its bytes
    index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE  # DSA: the index-K row beside the whole latent

    def device_of(self, rank: int) -> torch.device:
        if self.device != "cuda":
            return torch.device("cpu")
        return torch.device("cuda", 0 if self.share_gpu else rank)

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" and not self.share_gpu else "gloo"


@dataclass
class RankState:
    """What a task runs on: one rank's shard and pool."""

    tp: TPRank
    loaded: LoadedModel  # config: the whole model's; model: the shard
    pool: PagePool
    extras: dict[str, Any] = field(default_factory=dict)  # what tasks keep in the process (a fetcher)


class RankTask(Protocol):
    """Work rank 0 asks of every rank (a picklable object); ``run`` returns a picklable result."""

    def run(self, state: RankState) -> Any: ...


class Ready(NamedTuple):
    rank: int
    pid: int
    weight_bytes: int  # the shard's parameters
    pool_bytes: int
    bytes_read: int  # from the checkpoint


class Failed(NamedTuple):
    rank: int
    reason: str  # one line


class TaskDone(NamedTuple):
    rank: int
    seq: int
    result: Any = None
    error: str | None = None  # one line when the task raised


def join_group(spec: TPSpec, rank: int, store: dist.Store | None = None) -> torch.device:
    """Set this process's device and threads and join the group's default process group
    (through ``store``, rank 0's own, or as a client of the one rank 0 holds on ``spec.port``)."""
    device = spec.device_of(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(spec.cpu_threads or max(1, (os.cpu_count() or 1) // spec.tp_size))
    store = store if store is not None else join_store(spec.port)
    dist.init_process_group(spec.backend, store=store, rank=rank,
                            world_size=spec.tp_size, timeout=timedelta(seconds=spec.timeout_s))
    return device


def build_rank(spec: TPSpec, rank: int, device: torch.device) -> tuple[RankState, Ready]:
    """Load the rank's shard and build its pool. Only rank 0 handshakes, so only it has
    the weights digest (computed once, or found in its cache: ``model.parallel.weights_digest``)."""
    weights = (lambda: checkpoint_digest(spec.model_path)) if rank == 0 else None
    shard = load_shard(spec.model_path, TPRank(rank, spec.tp_size), spec.dtype, device, weights=weights)
    model = shard.loaded.model
    attach_all_reduce(model, dist.group.WORLD)
    pool = PagePool.for_model(model.config, spec.num_pages, spec.page_size, spec.dtype, device,
                              index_cache_dtype=spec.index_cache_dtype, kv_cache_dtype=spec.kv_cache_dtype)
    ready = Ready(rank, os.getpid(), weight_bytes(model), pool.tensor.nbytes, shard.bytes_read)
    log.info("decode rank %d of %d holds %d bytes of weights (%d read from the checkpoint) and a "
             "%d-byte KV pool (%d pages, %d of %d KV heads)", rank, spec.tp_size, ready.weight_bytes,
             ready.bytes_read, ready.pool_bytes, spec.num_pages, model.config.num_kv_heads,
             shard.loaded.config.num_kv_heads)
    return RankState(TPRank(rank, spec.tp_size), shard.loaded, pool), ready


def run_task(state: RankState, seq: int, task: RankTask) -> TaskDone:
    try:
        return TaskDone(state.tp.rank, seq, task.run(state))
    except Exception as err:  # noqa: BLE001 - a task's failure goes back to rank 0 as its answer
        log.exception("task %d failed on rank %d", seq, state.tp.rank)
        return TaskDone(state.tp.rank, seq, error=f"{type(err).__name__}: {err}".splitlines()[0])


def follower_main(rank: int, spec: TPSpec, tasks: Any, results: Any) -> None:
    """A rank other than 0, in its own process: join, load, serve steps and tasks."""
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="lanekv-tp-parent").start()
    try:
        device = join_group(spec, rank)
        state, ready = build_rank(spec, rank, device)
        warm_up_kernels(state.pool, state.loaded.model.config)  # CUDA: as rank 0 does in the daemon
    except Exception as err:  # noqa: BLE001 - reported to rank 0, which refuses to start
        results.put(Failed(rank, f"{type(err).__name__}: {err}".splitlines()[0]))
        return
    results.put(ready)

    def serve_tasks() -> None:
        while (item := tasks.get()) is not None:
            seq, task = item
            threading.Thread(target=_answer, args=(state, seq, task, results), daemon=True,
                             name=f"lanekv-tp-task{seq}").start()

    threading.Thread(target=serve_tasks, daemon=True, name="lanekv-tp-tasks").start()
    group = dist.group.WORLD
    with torch.inference_mode():
        while (inputs := receive_step(group, device)) is not None:
            step_hidden(state.loaded.model, state.pool, *inputs)
    tasks.put(None)
    fetcher = state.extras.get("fetcher")
    nixl = None if fetcher is None else fetcher.transport("nixl")
    if nixl is not None:
        nixl.close()  # this rank's pool registration and every peer agent
    dist.destroy_process_group()
    # No interpreter finalization (runtime.gcpause); both queues this rank put to are flushed
    # first: a process gone mid-write holds the queue's write lock, and rank 0's own put
    # to ``tasks`` (its STOP) would then wait for it for ever.
    exit_at_once(results, tasks)


def _answer(state: RankState, seq: int, task: RankTask, results: Any) -> None:
    results.put(run_task(state, seq, task))


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        threading.Event().wait(_PARENT_POLL_S)
    os._exit(1)
