"""Start N CP rank processes, send them batches, collect per-request results.

The parent process owns the lane allocator (so it decides which logical pages
a batch writes) and talks to each rank through its own command queue; every
rank answers on a shared result queue (typed messages, ``prefill.cp.messages``);
one command is in flight at a time. Ranks talk to each other only through
torch.distributed (NCCL on CUDA, one GPU per rank; gloo on CPU). A rank that
dies is reported as ``RankDiedError`` naming it, and the engine refuses
further work instead of hanging; once started, the engine watches the rank
processes (``prefill.cp.watch``), so a death is noticed within milliseconds,
breaks every waiting call at once and is reported to ``on_broken``. CPU ranks
fork from a server that imported their module once, CUDA ranks are spawned
(``runtime.workers.start``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, NamedTuple

import torch
from lanekv.model.checkpoint import checkpoint_digest
from lanekv.model.parallel.rendezvous import host_store
from lanekv.model.sampling import SamplingParams
from lanekv.prefill.allocator import LaneAllocator
from lanekv.prefill.cp.gemm_warmup import GemmWarmUp
from lanekv.prefill.cp.graphs import GraphCapture
from lanekv.prefill.cp.messages import (
    Answer,
    Call,
    CaptureGraphs,
    Command,
    Event,
    Failed,
    Forget,
    FreezeHeap,
    RankInfo,
    ReadPages,
    Ready,
    Registered,
    RunPrefill,
    SetTopology,
    Shutdown,
    Snapshot,
    TileRows,
    WarmGemms,
    Weights,
    for_each_rank,
)
from lanekv.prefill.cp.prompt_logprobs import PromptLogprob, merge_prompt_logprobs
from lanekv.prefill.cp.rank_worker import TransferServing, rank_process_main, shared_pool_path
from lanekv.prefill.cp.runner import PrefillBatch, RankResult
from lanekv.prefill.cp.watch import RankWatcher, exit_reason
from lanekv.prefill.engine_config import EngineConfig
from lanekv.prefill.plan import plan_batch
from lanekv.runtime.workers.start import worker_context, worker_process
from lanekv.transfer.protocol.contract import Topology
from lanekv.transfer.protocol.descriptors import remove_shared_pool

log = logging.getLogger("lanekv.prefill")


class RankDiedError(RuntimeError):
    """A CP rank process exited or failed; the engine cannot serve any more."""


class PageInfo(NamedTuple):
    page: int  # logical page id
    owner: int  # CP rank that holds it
    valid_rows: int


class PrefillInput(NamedTuple):
    token_ids: Sequence[int]  # the whole prompt, prefix included
    sampling: SamplingParams = SamplingParams()
    prefix_pages: Sequence[int] = ()  # pinned pages already holding the prompt's first tokens
    request_id: str | None = None
    # The secret the ranks hold the request's pages to (FetchKV and Release must
    # present it: ``transfer.protocol.access.new_capability``); None: anyone with the id.
    capability: str | None = None
    prefix_cache: bool = True  # False: the daemon's prefix cache neither serves nor keeps it (a warm-up)
    # The logprobs of the prompt's tokens after the first, with this many top tokens
    # (``prefill.cp.prompt_logprobs``); None: none. Needs the whole prompt prefilled.
    prompt_logprobs: int | None = None
    # The first token's grammar bitmask (``model.grammar``), when the sampling has a grammar.
    first_mask: bytes | None = None


@dataclass
class PrefillResult:
    request_id: str
    first_token: int
    num_tokens: int
    prefix_len: int
    page_size: int
    pages: list[PageInfo]  # the request's logical pages in order (prefix, then extend)
    logits: torch.Tensor | None = None
    timings: dict[str, float] = field(default_factory=dict)
    capability: str | None = None  # the input's, handed back with the manifest
    # The first token's raw logprob and most likely tokens, when the sampling asks.
    first_logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None
    prefix_cache_pages: int = 0  # leading whole prompt pages the daemon's prefix cache holds after it
    # Prompt tokens 1..num_tokens-1, when the input asked (``PrefillInput.prompt_logprobs``).
    prompt_logprobs: list[PromptLogprob] | None = None

    @property
    def new_pages(self) -> list[int]:
        """Pages allocated by this prefill (the prefix pages belong to someone else)."""
        return [p.page for p in self.pages[self.prefix_len // self.page_size :]]


class PrefillEngine(ABC):
    """The launcher API: ``prefill`` a batch on N ranks, ``free`` pages, ``close``.

    Subclasses say how a command reaches the ranks (``call``): rank processes
    (``CPPrefillEngine``) or rank threads in this process (``ThreadedPrefillEngine``).
    """

    config: EngineConfig
    allocator: LaneAllocator
    info: RankInfo  # rank 0's (model fields, weights digest, pool shape; agreement when serving)

    @abstractmethod
    def call(self, command: Command | Sequence[Command], *, only: int | None = None,
             on_registered: Callable[[], None] | None = None) -> Any:
        """Run ``command`` on every rank (a sequence: its ``r``-th on rank ``r``), or on
        rank ``only`` alone, and return the answers in rank order (``only``: its answer).

        ``on_registered`` (``RunPrefill``): called once every rank holds the
        batch's pages for FetchKV, before the ranks prefill.
        """

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        pass

    def __enter__(self) -> PrefillEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prefill(self, inputs: Sequence[PrefillInput], *, return_logits: bool = False,
                on_started: Callable[[list[PrefillResult]], None] | None = None) -> list[PrefillResult]:
        """Prefill a batch. ``on_started(results)`` comes before the ranks prefill, once
        every rank holds the pages for FetchKV: the results have their pages, and
        first_token -1 (it is filled in before ``prefill`` returns them). From
        then on the caller of ``on_started`` owns the new pages, even if the
        prefill fails; without it, a failed prefill frees them."""
        if not inputs:
            raise ValueError("inputs is empty: a prefill batch needs at least one request")
        ps, n = self.config.page_size, self.config.cp_size
        ids, prefix_lens, prefix_pages, rids = [], [], [], []
        for i, inp in enumerate(inputs):
            tokens = list(inp.token_ids)
            if not tokens:
                raise ValueError(f"inputs[{i}].token_ids is empty: a prompt needs at least one token")
            prefix_len = len(inp.prefix_pages) * ps
            if prefix_len and inp.prompt_logprobs is not None:
                raise ValueError(f"inputs[{i}]: prompt_logprobs needs the whole prompt prefilled, "
                                 f"got {len(inp.prefix_pages)} prefix pages")
            if prefix_len >= len(tokens):
                raise ValueError(
                    f"inputs[{i}]: prefix_pages cover {prefix_len} tokens but the prompt has "
                    f"{len(tokens)}; at least one token must be prefilled"
                )
            ids.append(tuple(tokens[prefix_len:]))
            prefix_lens.append(prefix_len)
            prefix_pages.append(tuple(int(p) for p in inp.prefix_pages))
            rids.append(inp.request_id or uuid.uuid4().hex)
        plan = plan_batch([len(t) for t in ids], prefix_lens, cp_size=n, page_size=ps)
        extend_pages = self.allocator.allocate_batch(plan)  # all-or-nothing
        batch = PrefillBatch(
            request_ids=tuple(rids),
            token_ids=tuple(ids),
            prefix_lens=tuple(prefix_lens),
            prefix_pages=tuple(prefix_pages),
            extend_pages=tuple(tuple(p) for p in extend_pages),
            sampling=tuple(inp.sampling for inp in inputs),
            return_logits=return_logits,
            capabilities=tuple(inp.capability for inp in inputs),
            prompts=tuple(tuple(inp.token_ids) if inp.sampling.repetition_penalty != 1 else ()
                          for inp in inputs),
            prompt_logprobs=(tuple(inp.prompt_logprobs for inp in inputs)
                             if any(inp.prompt_logprobs is not None for inp in inputs) else None),
            first_masks=tuple(inp.first_mask for inp in inputs)
            if any(inp.first_mask is not None for inp in inputs) else None,
        )
        results = []
        for b, rid in enumerate(rids):
            pages = list(prefix_pages[b]) + list(extend_pages[b])
            total = prefix_lens[b] + len(ids[b])
            infos = [PageInfo(p, p % n, min(ps, total - k * ps)) for k, p in enumerate(pages)]
            results.append(PrefillResult(rid, -1, total, prefix_lens[b], ps, infos,
                                         capability=inputs[b].capability))
        handed_over = threading.Event()  # on_started owns the pages from then on

        def started() -> None:
            handed_over.set()
            on_started([dataclasses.replace(r) for r in results])

        try:
            rank_results: list[RankResult] = self.call(
                RunPrefill(batch), on_registered=None if on_started is None else started)
        except BaseException:
            if not handed_over.is_set():
                self.allocator.free([p for pages in extend_pages for p in pages])
            raise
        for rr in rank_results:
            for out in rr.outputs:
                results[out.index].first_token = out.first_token
                results[out.index].logits = out.logits
                results[out.index].first_logprobs = out.logprobs
        for b, inp in enumerate(inputs):
            if inp.prompt_logprobs is not None:
                results[b].prompt_logprobs = merge_prompt_logprobs(
                    inp.token_ids, [part for rr in rank_results for part in rr.prompt_logprobs if part.index == b])
        timings = {}
        for rr in rank_results:
            timings.update({f"rank{rr.rank}_s": rr.seconds, f"rank{rr.rank}_queued_s": rr.queued_seconds,
                            f"rank{rr.rank}_gc_s": rr.gc_seconds})
        slowest = max(rank_results, key=lambda rr: rr.seconds)  # the one the batch waited for
        timings.update(compute_s=slowest.seconds, queued_s=slowest.queued_seconds, gc_s=slowest.gc_seconds,
                       gather_s=max(rr.gather_seconds for rr in rank_results))
        for res in results:
            res.timings = dict(timings)
        return results

    def free(self, pages: Sequence[int]) -> None:
        self.allocator.free(pages)

    def read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """K/V (or MLA latent) rows of logical ``pages`` gathered from their owners:
        ``[num_layers, kv_planes, len(pages) * page_size, kv_heads, head_dim]`` on the CPU."""
        n = self.config.cp_size
        parts = self.call([ReadPages(tuple(p for p in pages if p % n == r)) for r in range(n)])
        ps = self.config.page_size
        shape = parts[0].shape
        out = torch.empty((shape[0], shape[1], len(pages) * ps, *shape[3:]), dtype=parts[0].dtype)
        cursor = [0] * n
        for k, page in enumerate(pages):
            r = page % n
            out[:, :, k * ps : (k + 1) * ps] = parts[r][:, :, cursor[r] * ps : (cursor[r] + 1) * ps]
            cursor[r] += 1
        return out

    def freeze_heap(self) -> list[int]:
        """Every rank collects and freezes what start-up and warm-up left alive (a later
        collection walks only what serving made); the objects frozen, by rank."""
        return self.call(FreezeHeap())

    def warm_gemms(self, max_rows: int) -> list[GemmWarmUp]:
        """Every rank runs its model's GEMMs at the row counts prefills of up to
        ``max_rows`` rows use (``prefill.cp.gemm_warmup``); what each did, by rank."""
        return self.call(WarmGemms(max_rows))

    def capture_graphs(self, max_rows: int) -> list[GraphCapture]:
        """Every rank captures its prefill pieces for up to ``max_rows`` rows
        (``prefill.cp.graphs``); what each captured, by rank."""
        return self.call(CaptureGraphs(max_rows))

    def tile_switch_rows(self) -> tuple[int, ...]:
        """The row counts at which a rank's prefill kernels change their tiles
        (``prefill.cp.tile_rows``), over every rank."""
        return tuple(sorted(set().union(*self.call(TileRows()))))

    def pool_snapshot(self, rank: int) -> torch.Tensor:
        """A CPU copy of rank ``rank``'s whole pool (tests check what it holds)."""
        return self.call(Snapshot(), only=rank)


class _Waiter:
    """Answers to one command, rank by rank."""

    def __init__(self, ranks: list[int], on_registered: Callable[[], None] | None = None) -> None:
        self.ranks = ranks
        self.got: dict[int, Any] = {}
        self.on_registered = on_registered
        self.registered: set[int] = set()


class CPPrefillEngine(PrefillEngine):
    """N rank processes (NCCL on CUDA, gloo on CPU) fed through queues.

    A reader thread routes what the ranks send: answers to the command that
    asked (by sequence number) and events (``on_event(event)``, e.g. a
    rank's transfer service released a request's pages). A rank that exits or
    fails makes the engine unusable, and every waiting call raises
    ``RankDiedError`` naming it. ``on_broken(reason)`` is called once (from
    the watcher's thread) when a rank process exits after start-up without
    being told to: ``reason`` is one line naming the rank.
    """

    def __init__(self, config: EngineConfig, *, serve_transfer: TransferServing | tuple[str, int] | None = None,
                 on_event: Callable[[Event], None] | None = None,
                 on_broken: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.allocator = LaneAllocator(config.cp_size, config.pages_per_lane)
        self.on_event = on_event
        self.on_broken = on_broken
        self._watcher: RankWatcher | None = None
        # CPU ranks fork from a server that imported their module once (runtime/workers/start.py).
        ctx = worker_context(config.resolved_device, rank_process_main.__module__)
        self._results: Any = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(config.cp_size)]
        # The ranks' rendezvous: held here on a port the OS gives (or the configured one),
        # so no other process can take it between picking and binding (model/parallel/rendezvous.py).
        self._store = host_store(config.dist_port, config.start_timeout_s) if config.cp_size > 1 else None
        port = self._store.port if self._store is not None else 0
        # The ranks' /dev/shm pools (CPU ranks serving transfers), named here so that
        # the file of a rank that died (SIGKILL) is removed by us (``_remove_pools``).
        self._shared_paths = [shared_pool_path(config, serve_transfer, rank) for rank in range(config.cp_size)]
        self._procs = [
            worker_process(
                ctx, rank_process_main,
                (rank, config, port, self._commands[rank], self._results, serve_transfer,
                 self._shared_paths[rank]),
                name=f"lanekv-cp-rank{rank}",
            )
            for rank in range(config.cp_size)
        ]
        self._seq = itertools.count()
        self._broken: str | None = None
        self._cond = threading.Condition()
        self._call_lock = threading.Lock()  # one command in flight: the ranks run them in order
        self._waiters: dict[int | None, _Waiter] = {None: _Waiter(list(range(config.cp_size)))}
        self._stop = threading.Event()
        for proc in self._procs:
            proc.start()
        self._reader = threading.Thread(target=self._read_loop, name="lanekv-cp-reader", daemon=True)
        self._reader.start()
        try:
            if config.load_format == "safetensors":
                # Once for every rank, while they load (each rank's load is handed it and
                # reads nothing for it): model.parallel.weights_digest.
                weights = Weights(checkpoint_digest(config.model_path))
                for commands in self._commands:
                    commands.put(weights)
            ready = self._wait(None, config.start_timeout_s, "start-up")
        except BaseException:
            # The other ranks end first (a failing one logs its traceback as it goes), so the
            # caller's one error line comes after every rank's output, never amid it.
            self.close(timeout_s=5.0)
            raise
        self.info: RankInfo = ready[0]
        self.endpoints = [r.endpoint for r in ready]
        self.relays = [tuple(r.relays) for r in ready]  # each rank's sender relays
        # From here on a rank that exits is a death (before, its Failed says why it could not start).
        self._watcher = RankWatcher(self._procs, self._rank_died)
        log.info("CP ranks started: %s", ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(self._procs)))

    def _rank_died(self, rank: int, reason: str) -> None:
        log.error("CP %s", reason)
        self._fail(reason)
        self._remove_pools()
        if self.on_broken is not None:
            self.on_broken(reason)

    @property
    def processes(self) -> tuple[mp.process.BaseProcess, ...]:
        """The rank processes, rank by rank (alive or not)."""
        return tuple(self._procs)

    @property
    def shared_paths(self) -> tuple[Path | None, ...]:
        """Each rank's /dev/shm pool file (None: none, or removed once the rank was gone)."""
        return tuple(self._shared_paths)

    def close(self, timeout_s: float = 10.0) -> None:
        if self._watcher is not None:  # the ranks exit now because they are told to
            self._watcher.stop()
        for q in self._commands:
            try:
                q.put(Call(next(self._seq), Shutdown()))
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        ends = [exit_reason(rank, proc) for rank, proc in enumerate(self._procs)]
        if all(proc.exitcode == 0 for proc in self._procs):
            log.info("CP ranks stopped: %s", "; ".join(ends))
        else:  # told to stop, yet one did not end on its own (killed here or by a signal)
            log.warning("CP ranks stopped: %s", "; ".join(ends))
        self._stop.set()
        with self._cond:
            self._broken = self._broken or "engine closed"
            self._cond.notify_all()
        self._reader.join(2.0)
        self._remove_pools()

    def _remove_pools(self) -> None:
        """Remove the /dev/shm pools of ranks that are gone (a rank removes its own when
        it stops cleanly; a decode daemon's mapping of one stays valid)."""
        for rank, (proc, path) in enumerate(zip(self._procs, self._shared_paths)):
            # Its sentinel, not is_alive(): while another thread reaps the process,
            # is_alive() here can still say True (seen under load: the file stayed). A
            # fork-server worker's sentinel carries its exit code, which a join reads off
            # before the server closes it: a known exit code counts as gone too.
            if path is not None and (wait([proc.sentinel], timeout=0) or proc.exitcode is not None):
                remove_shared_pool(path)
                self._shared_paths[rank] = None

    def send(self, command: Command, ranks: Sequence[int]) -> None:
        """Fire-and-forget ``command`` to ``ranks`` (ordered after earlier commands)."""
        seq = next(self._seq)
        for r in ranks:
            self._commands[r].put(Call(seq, command))

    def set_topology(self, topology: Topology) -> None:
        """Every rank's transfer service names ``topology`` in its contract from now on."""
        self.call(SetTopology(topology))

    def forget(self, request_id: str) -> None:
        """Every rank's transfer service drops ``request_id`` (a rank may hold none of its
        pages); fire-and-forget, in order with later commands."""
        self.send(Forget(request_id), range(self.config.cp_size))

    def call(self, command: Command | Sequence[Command], *, only: int | None = None,
             on_registered: Callable[[], None] | None = None) -> Any:
        ranks = list(range(self.config.cp_size)) if only is None else [only]
        per_rank = for_each_rank(command, self.config.cp_size)
        with self._call_lock:
            with self._cond:
                if self._broken:
                    raise RankDiedError(f"CP prefill engine is unusable: {self._broken}")
                seq = next(self._seq)
                self._waiters[seq] = _Waiter(ranks, on_registered)
            for r in ranks:
                self._commands[r].put(Call(seq, per_rank[r]))
            out = self._wait(seq, self.config.request_timeout_s, type(per_rank[ranks[0]]).__name__)
        return out[0] if only is not None else out

    def _wait(self, seq: int | None, timeout_s: float, what: str) -> list:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            waiter = self._waiters[seq]
            try:
                while len(waiter.got) < len(waiter.ranks):
                    if self._broken:
                        raise RankDiedError(self._broken)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = sorted(set(waiter.ranks) - set(waiter.got))
                        self._broken = f"no answer to {what!r} within {timeout_s:.0f}s from ranks {missing}"
                        raise RankDiedError(self._broken)
                    self._cond.wait(min(left, 0.5))
            finally:
                self._waiters.pop(seq, None)
            return [waiter.got[r] for r in waiter.ranks]

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            try:
                report = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead and not self._stop.is_set() and self._watcher is None:  # at start-up
                    self._fail(exit_reason(dead[0], self._procs[dead[0]]))
                    self._remove_pools()
                continue
            except (EOFError, OSError):
                return
            if isinstance(report, Registered):
                self._registered(report.rank, report.seq)
                continue
            if isinstance(report, Failed):
                # A rank whose peer died fails inside the collective: name the dead one first.
                time.sleep(0.5)
                dead = [exit_reason(r, p) for r, p in enumerate(self._procs) if not p.is_alive()]
                self._fail("; ".join(dead + [f"rank {report.rank} failed: {report.error}"]))
                continue
            if isinstance(report, (Ready, Answer)):
                seq, value = (None, report.info) if isinstance(report, Ready) else (report.seq, report.value)
                with self._cond:
                    waiter = self._waiters.get(seq)
                    if waiter is not None:
                        waiter.got[report.rank] = value
                        self._cond.notify_all()
                continue
            if self.on_event is not None:
                self.on_event(report)

    def _registered(self, rank: int, seq: int) -> None:
        """Rank ``rank`` holds the pages of batch ``seq``; once every rank does, say so."""
        with self._cond:
            waiter = self._waiters.get(seq)
            if waiter is None or waiter.on_registered is None:
                return
            waiter.registered.add(rank)
            if len(waiter.registered) < len(waiter.ranks):
                return
            callback, waiter.on_registered = waiter.on_registered, None
        try:
            callback()
        except Exception:  # the batch goes on; its callers hear of it when it ends
            log.exception("on_registered callback failed")

    def _fail(self, reason: str) -> None:
        with self._cond:
            if not self._broken:
                self._broken = reason
            self._cond.notify_all()
