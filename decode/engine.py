"""The continuous-batching decode engine.

``step`` runs one token for every running request as four verbs: schedule
(admit while the pool can hold a request to its end; a slot for every running
one), prepare, run (``decode.cuda.step``) and postprocess (sample, emit,
finish, free). Invariants: admission reserves by arithmetic, so running
requests never run out of pages among themselves; no kernel writes into a
freed page (a request cancelled or stopped during a step in flight has its
pages freed when that step lands); a step launched ahead of the host uses its
plan only if nothing changed meanwhile. ``add``/``cancel`` come from gRPC
threads, ``step`` from one loop thread; one lock guards the state and the
model runs outside it. docs/structure.md "The decode engine" tells the whole
of it: sampling slots, CUDA graphs and the overlap, grammars, admission.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from lanekv.decode.cuda.graphs import DecodeGraphs, StepOutput, check_ladder, default_ladder
from lanekv.decode.cuda.overlap import GraphBatch, Plan, StepOverlap
from lanekv.decode.cuda.step import step_hidden
from lanekv.decode.pool import PagePool, PageTable, PoolExhausted, batch_tables
from lanekv.model.attention import AnyCausalLM, kind_of
from lanekv.model.grammar import RequestGrammar, bitmask_words, fill_bitmasks
from lanekv.model.sampling import SamplerState, SamplingParams, StepResult, sample_step, uniforms

log = logging.getLogger("lanekv.decode")
FINISH_STOP = "stop"  # a stop token or an end-of-sequence token was sampled
FINISH_LENGTH = "length"  # max_new_tokens reached, or the model's max positions
SLOT_MARGIN = 8  # sampler slots past max_batch_size: requests ended but still in a step in flight


class TokenLogprobs(NamedTuple):
    """The raw logprobs of one sampled token."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # the request's ``logprobs`` most likely tokens


class TokenEvent(NamedTuple):
    """One output of ``step`` for one request."""

    request_id: str
    # None only in the finish event of a request added with nothing left to
    # decode (its last token was already a stop token, or max_new_tokens reached).
    token_id: int | None
    step: int  # generation step of this token; prefill's first token was step 0
    finished: bool
    finish_reason: str | None  # FINISH_STOP / FINISH_LENGTH once finished
    logprobs: TokenLogprobs | None = None  # when the request asked for them


@dataclass(eq=False)
class _Request:
    """Mutable per-request decode state; only touched under the engine lock."""

    request_id: str
    table: PageTable
    last_token: int  # sampled, fed at position table.seq_len on the next step
    sampling: SamplingParams
    step: int  # generation step of the next sampled token
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    final_len: int  # tokens in cache when the request ends at the latest
    prompt_ids: tuple[int, ...] = ()  # read by a repetition penalty
    slot: int | None = None  # its SamplerState slot while running, unless plain
    grammar: RequestGrammar | None = None  # structured output's matcher, at the next token
    cancelled: bool = False  # cancelled while its step ran: dropped, pages freed, after the step
    # The token ids of the rows its steps have written (the prompt, then each token fed),
    # for ``on_finish``; None: its pages are not offered to a prefix cache.
    kv_ids: list[int] | None = None
    on_freed: Callable[[], None] | None = None  # the canceller's, once its pages are back

    @property
    def pages_to_come(self) -> int:
        return self.table.pages_needed(self.final_len)


class DecodeBatch(NamedTuple):
    """The tensors of one eager decode step (B = requests in the step)."""

    requests: list[_Request]
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    locs: torch.Tensor  # [B] int64 physical rows of the new tokens' K/V
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32, the new token included
    slots: torch.Tensor | None = None  # [B] int64 sampler slots, for a full step
    uniform: torch.Tensor | None = None  # [B] float32


class _Step(NamedTuple):
    """The step ``step`` runs: prepared now, or launched ahead by the call before (its
    ``output`` then, or the error its launch raised)."""

    batch: DecodeBatch | GraphBatch
    output: StepOutput | torch.Tensor | BaseException | None = None


class _Ran(NamedTuple):
    """What running a step gave: its output; with the next step queued behind it
    (``queued``), the call that reads its greedy ids."""

    output: StepOutput | torch.Tensor
    tokens: Callable[[], list[int]] | None = None
    queued: GraphBatch | None = None


class DecodeEngine:
    """Continuous batching of decode requests over one ``PagePool``."""

    def __init__(self, model: AnyCausalLM, pool: PagePool, *,
                 max_batch_size: int = 256, eos_token_ids: Iterable[int] | None = None,
                 graph_sizes: Sequence[int] | None = None, overlap: bool = True) -> None:
        config = model.config
        kind = kind_of(config)
        if pool.spec.num_layers != config.num_layers or not kind.fits(config, pool.rows):
            want = kind.rows(config, model.dtype)
            raise ValueError(
                f"pool is {pool.spec.num_layers} layers x {pool.rows} but the {kind.name} model "
                f"architecture={config.architecture!r} has {config.num_layers} layers x {want}"
            )
        if pool.rows.value_dtype != model.dtype:  # FP8 rows: a uint8 pool read in the model dtype
            raise ValueError(f"pool dtype {pool.rows.value_dtype} differs from model dtype {model.dtype}")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or (
            max_batch_size <= 0
        ):
            raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        self.model = model
        self.pool = pool
        self.max_batch_size = max_batch_size
        # The CUDA-graph ladder (None: the default one); captured by capture_graphs.
        self.graph_sizes = (default_ladder(max_batch_size) if graph_sizes is None
                            else check_ladder(graph_sizes, max_batch_size))
        self._graphs: DecodeGraphs | None = None
        self.overlap = overlap
        self.eos_token_ids = frozenset(
            config.eos_token_ids if eos_token_ids is None else eos_token_ids
        )
        self.sampler = SamplerState(max_batch_size + SLOT_MARGIN, config.vocab_size, pool.device,
                                    self.eos_token_ids)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._done_at_add: list[TokenEvent] = []
        self._in_flight: list[_Request] = []  # the requests of the step whose model runs now
        # Graph steps only: the staging sides, the next step staged while one runs, and
        # the step launched ahead by the last ``step`` call, which the next one finishes.
        self._overlap = StepOverlap(self._lock)
        # Called (lock held) with a request's ``kv_ids`` and pages when it ends by stop or
        # length, before its pages are freed: a prefix cache keeps the whole ones (its reply's too).
        self.on_finish: Callable[[Sequence[int], Sequence[int]], object] | None = None

    # ---- requests in and out (any thread) ----

    def add(self, request_id: str, page_table: PageTable, last_token: int,
            sampling: SamplingParams, max_new_tokens: int,
            stop_token_ids: Iterable[int] = (), start_step: int = 1,
            ignore_eos: bool = False, prompt_ids: Iterable[int] = (),
            cache_ids: Sequence[int] | None = None,
            grammar: RequestGrammar | None = None) -> None:
        """Queue a request whose first ``page_table.seq_len`` tokens are in the pool.

        ``max_new_tokens`` counts every output token, prefill's included, and
        ``start_step`` how many there are already (1: prefill's ``last_token``).
        The engine owns ``page_table`` from here on and releases it when the
        request finishes or is cancelled; if ``add`` raises, the caller still owns it.
        ``ignore_eos`` (or ``sampling.ignore_eos``): end-of-sequence tokens do not
        stop it; ``prompt_ids``: the prompt, for a repetition penalty. ``cache_ids``: the
        token ids of the table's first ``seq_len`` rows; given, ``on_finish`` is offered the
        request's rows when it ends by stop or length (not when cancelled).
        ``grammar``: the matcher of ``sampling.grammar`` at its start; with
        ``start_step >= 1`` it accepts ``last_token`` here (prefill sampled it under the same grammar).
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if not isinstance(page_table, PageTable) or page_table.pool is not self.pool:
            raise ValueError(f"page_table of request {request_id!r} must be a PageTable "
                             "of this engine's pool")
        if page_table.seq_len < 1:
            raise ValueError(f"request {request_id!r} has seq_len={page_table.seq_len}; "
                             "its prompt must be in the pool")
        vocab = self.model.config.vocab_size
        if isinstance(last_token, bool) or not isinstance(last_token, int) or not (
            0 <= last_token < vocab
        ):
            raise ValueError(f"last_token={last_token!r} is not a token id (vocab {vocab})")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        for name, value, low in (("max_new_tokens", max_new_tokens, 1),
                                 ("start_step", start_step, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        stops = frozenset(int(t) for t in stop_token_ids) | frozenset(sampling.stop_token_ids)
        ignore_eos = ignore_eos or sampling.ignore_eos
        if not ignore_eos:
            stops |= self.eos_token_ids
        if sampling.min_tokens:  # banned until min_tokens: every token that stops it
            sampling = replace(sampling, stop_token_ids=tuple(sorted(stops)), ignore_eos=ignore_eos)
        try:
            sampling.check_vocab(vocab)
        except ValueError as err:
            raise ValueError(f"request {request_id!r}: {err}") from None
        if (grammar is None) != (sampling.grammar is None):
            raise ValueError(f"request {request_id!r}: grammar and sampling.grammar must come together")
        if grammar is not None and start_step >= 1 and not grammar.accept(last_token):
            raise ValueError(f"request {request_id!r}: its first token {last_token} is not allowed "
                             f"by its grammar ({grammar.spec.kind})")
        max_positions = self.model.config.max_position_embeddings
        final_len = min(page_table.seq_len + max_new_tokens - start_step, max_positions)
        request = _Request(request_id, page_table, last_token, sampling, start_step,
                           max_new_tokens, stops, final_len,
                           prompt_ids=tuple(prompt_ids) if sampling.repetition_penalty != 1 else (),
                           grammar=grammar)
        if cache_ids is not None:
            if len(cache_ids) < page_table.seq_len:
                raise ValueError(f"request {request_id!r}: cache_ids has {len(cache_ids)} ids for "
                                 f"seq_len={page_table.seq_len}")
            request.kv_ids = [int(t) for t in cache_ids[:page_table.seq_len]]
        with self._lock:
            if self._find(request_id) is not None:
                raise ValueError(f"request_id {request_id!r} is already in the engine")
            reason = self._finish_reason(request)
            if reason is not None:
                # Nothing to decode: free now, report on the next step.
                page_table.release()
                self._done_at_add.append(
                    TokenEvent(request_id, None, start_step - 1, True, reason))
            else:
                self._waiting.append(request)
            self._work.notify_all()

    def cancel(self, request_id: str, on_freed: Callable[[], None] | None = None) -> bool:
        """Drop a request and free its pages at once (after the step in flight,
        if any), then call ``on_freed`` (under the engine lock: keep it short).
        Returns whether the engine knew the request; if not, ``on_freed`` is
        not called (its pages were freed when it finished)."""
        with self._lock:
            for i, event in enumerate(self._done_at_add):
                if event.request_id == request_id:
                    del self._done_at_add[i]
                    if on_freed is not None:
                        on_freed()  # freed when it was added
                    return True
            request = self._find(request_id)
            if request is None:
                return False
            if request in self._running:
                self._running.remove(request)
            else:
                self._waiting.remove(request)
            request.on_freed = on_freed
            if any(request is r for r in self._in_flight):
                request.cancelled = True  # the step writes into its pages: freed after it
            else:
                self._free(request)
            return True

    def _free(self, request: _Request) -> None:
        self._release(request)
        if request.on_freed is not None:
            request.on_freed()

    def _release(self, request: _Request) -> None:
        """Its pages and its sampler slot go back (lock held)."""
        request.table.release()
        if request.slot is not None:
            self.sampler.release(request.slot)
            request.slot = None

    def wait_for_work(self, timeout: float) -> bool:
        """Block until a request is queued or ``timeout`` seconds pass; returns has_work."""
        with self._work:
            return self._work.wait_for(self._has_work, timeout=timeout)

    @property
    def has_work(self) -> bool:
        with self._lock:
            return self._has_work()

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._running)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def capture_graphs(self) -> DecodeGraphs | None:
        """On CUDA, capture the decode step for every size of the ladder (compiling
        its kernels on the way); call before serving. None on the CPU, or with an
        empty ladder: every step then runs eager."""
        if self.pool.device.type != "cuda" or not self.graph_sizes:
            return None
        with self._lock:
            graphs = DecodeGraphs(self.model, self.pool, self.graph_sizes, self.sampler)
            graphs.capture()
            self._graphs = graphs
        return graphs

    # ---- the loop (one thread) ----

    def step(self) -> list[TokenEvent]:
        """One decode step for every running request; returns their events.

        The model runs without the engine lock: ``add`` and ``cancel`` from other
        threads wait for the bookkeeping before and after it, not for the step.
        (Holding it throughout, a loop stepping back to back took it again before
        a waiting ``cancel`` woke, so a cancelled request could run to its end.)

        With graphs and ``overlap``, the next step is staged while this one runs
        (``decode.cuda.overlap``) and launched before this call returns: queued
        behind this step before its ids are read when it can be, else right
        after. The caller hands the events to their streams while the GPU runs
        the next step, and the next call starts from it.
        """
        with self._lock:
            events, self._done_at_add = self._done_at_add, []
            step = self._schedule_step()  # schedule and prepare
            if step is None:
                return events
        try:
            ran = self._run_step(step)  # run (and stage the next step meanwhile)
        except BaseException:
            with self._lock:
                launched = self._overlap.launched
                self._land(step.batch.requests, launched.batch.requests if launched else None)
            raise
        with self._lock:
            events += self._postprocess(step.batch, ran)
            ahead = self._ahead(step.batch.requests, ran)  # the staged next step, if it holds
        if ahead is not None:
            self._overlap.launch(ahead, self._run)
        return events

    def _schedule_step(self) -> _Step | None:
        """Schedule and prepare (lock held): the step launched ahead, else the staged one if it
        still holds, else the running requests that get a slot; None when none does."""
        launched = self._overlap.take_launched()
        if launched is not None:
            return _Step(launched.batch, launched.output)
        plan = self._overlap.take_plan()
        if plan is not None and self._plan_holds(plan):
            prepared = self._commit(plan)
        else:
            batch = self._schedule()
            if not batch:
                return None
            prepared = self._prepare(batch)
        self._in_flight = prepared.requests
        return _Step(prepared)

    def _run_step(self, step: _Step) -> _Ran:
        """Run the step (or take the output of its launch ahead). With graphs and ``overlap``,
        stage the next step while the GPU runs this one, and queue it behind when it can be."""
        output = step.output
        if output is None:
            output = self._run(step.batch)
        elif isinstance(output, BaseException):  # the launch ahead failed: this step's failure
            raise output
        if not (self.overlap and isinstance(step.batch, GraphBatch)):
            return _Ran(output)
        with self._lock:  # the GPU runs this step: stage the next meanwhile
            try:
                self._plan_next()
            except Exception:  # noqa: BLE001 (the next step is then prepared as usual)
                log.exception("decode: staging the next step failed")
            queued = self._queue_next(step.batch.requests, output)
        if queued is None:
            return _Ran(output)
        tokens = self._graphs.read_ids(output.greedy, step.batch.side)
        self._overlap.launch(queued, self._run)
        return _Ran(output, tokens, queued)

    def _ahead(self, batch: list[_Request], ran: _Ran) -> GraphBatch | None:
        """The step's model run is over (lock held): land it; the staged next step, committed,
        when it holds and was not queued behind this one already (launched by ``step``)."""
        if ran.queued is not None:
            self._land(batch, ran.queued.requests)
            return None
        self._land(batch)
        plan = self._overlap.plan if self.overlap else None
        return self._commit(plan) if plan is not None and self._plan_holds(plan) else None

    def _queue_next(self, batch: list[_Request], output: StepOutput) -> GraphBatch | None:
        """The staged next step, committed to be queued behind the one in flight before
        its ids are read (lock held): when it runs the same greedy requests in the same
        rows (nobody ends by length, none was cancelled, nobody waiting fits), so its
        input ids are this step's greedy ids on the device. A request this step ends
        by a stop token then runs once more, its row dropped as a cancelled one is.
        None: the next step waits for the ids (launched after them, or prepared)."""
        plan = self._overlap.plan
        if not StepOverlap.queues_behind(plan, batch) or not self._plan_holds(plan):
            return None
        return self._commit(plan)._replace(feed=output.greedy)

    def _plan_next(self) -> None:
        """Stage the step after the one in flight (lock held): admit, secure slots
        and fill the other staging side, for the running requests that do not
        end by length in the step in flight. ``_commit`` uses it if nothing
        changed in between (``_plan_holds``); else it is dropped."""
        requests = []
        for request in self._admit():
            if request.cancelled or request.step + 1 >= request.max_new_tokens or (
                request.table.seq_len >= request.final_len
            ):
                continue  # ends with the step in flight (or was cancelled under it)
            try:
                request.table.reserve(request.table.seq_len + 1)
            except PoolExhausted:
                continue
            requests.append(request)
        full = self._full(requests)
        flying = {id(r) for r in self._in_flight}  # the others were admitted just now
        ahead = [int(id(r) in flying) for r in requests]
        self._overlap.stage(self._graphs, requests, full, *self._sampler_rows(requests, ahead, full))

    def _plan_holds(self, plan: Plan) -> bool:
        """The staged step is still what ``_schedule`` would run: the same
        running requests at the same lengths, and nobody waiting who fits."""
        if len(plan.requests) != len(self._running):
            return False
        running = {id(r) for r in self._running}
        if any(id(r) not in running or r.table.seq_len != p
               for r, p in zip(plan.requests, plan.positions)):
            return False
        if self._waiting and len(self._running) < self.max_batch_size:
            free = self.pool.free_count - sum(r.pages_to_come for r in self._running)
            if self._waiting[0].pages_to_come <= free:
                return False  # admit it now rather than a step late
        return True

    def _commit(self, plan: Plan) -> GraphBatch:
        """``plan`` becomes the step in flight (lock held): no longer staged, its slots taken."""
        self._in_flight = plan.requests
        return self._overlap.commit(plan)

    def _land(self, batch: list[_Request], ahead: list[_Request] | None = None) -> None:
        """The step's model run is over: free the pages of requests cancelled under it
        once its writes into them are done (lock held; in the stepping thread).
        ``ahead``: the requests of a step queued behind it, which is still in
        flight (theirs are freed when it lands)."""
        self._in_flight = ahead or []
        keep = {id(r) for r in self._in_flight}
        cancelled = [request for request in batch if request.cancelled and id(request) not in keep]
        if cancelled and self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()
        for request in cancelled:
            self._free(request)

    def _admit(self) -> list[_Request]:
        """Admit waiting requests that fit to the end; returns the running ones."""
        free = self.pool.free_count - sum(r.pages_to_come for r in self._running)
        while self._waiting and len(self._running) < self.max_batch_size:
            head = self._waiting[0]
            if head.pages_to_come > free:
                break  # FIFO: later requests do not overtake a large one
            if not head.sampling.plain:
                head.slot = self.sampler.acquire()
                if head.slot is None:
                    break  # every slot is held by a step in flight: the next step admits it
                self.sampler.load(head.slot, head.sampling, head.prompt_ids,
                                  [head.last_token] if head.step >= 1 else [])
            free -= head.pages_to_come
            self._running.append(self._waiting.popleft())
        return self._running

    @staticmethod
    def _full(batch: Sequence[_Request]) -> bool:
        """Whether a step of ``batch`` needs the sampler."""
        return any(not r.sampling.plain for r in batch)

    def _sampler_rows(self, batch: Sequence[_Request], ahead: Sequence[int] | None,
                      full: bool) -> tuple[list[int] | None, list[float] | None]:
        """Each request's slot and uniform number for a step ``ahead`` steps from
        now, per request (0 or None: its next; 1: the one after the step in flight)."""
        if not full:
            return None, None
        slots = [self.sampler.scratch if r.slot is None else r.slot for r in batch]
        ahead = ahead or [0] * len(batch)
        return slots, uniforms([r.sampling for r in batch], [r.step + a for r, a in zip(batch, ahead)])

    def _schedule(self) -> list[_Request]:
        """Admit waiting requests that fit to the end; secure one slot per running request."""
        batch = []
        for request in self._admit():
            try:
                request.table.reserve(request.table.seq_len + 1)
            except PoolExhausted:
                continue  # pages taken outside the engine: sit this step out
            batch.append(request)
        return batch

    def _prepare(self, batch: list[_Request]) -> DecodeBatch | GraphBatch:
        positions = [r.table.seq_len for r in batch]
        locs = [r.table.append_slot() for r in batch]  # slots were secured by _schedule
        ids = [r.last_token for r in batch]
        full = self._full(batch)
        slots, uniform = self._sampler_rows(batch, None, full)
        if self._graphs is not None:
            size = self._graphs.size_for(len(batch), max(r.table.num_pages for r in batch))
            if size is not None:
                side = self._overlap.take_side()
                self._graphs.stage(side, [r.table for r in batch], positions, locs,
                                   [r.table.seq_len for r in batch], slots, uniform)
                return GraphBatch(batch, ids, size, side, full=full)
        device = self.pool.device
        tables = batch_tables([r.table for r in batch], device)
        return DecodeBatch(
            requests=batch,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            locs=torch.tensor(locs, dtype=torch.int64, device=device),
            page_table=tables.page_table,
            seq_lens=tables.seq_lens,
            slots=None if slots is None else torch.tensor(slots, dtype=torch.int64, device=device),
            uniform=None if uniform is None else torch.tensor(uniform, dtype=torch.float32, device=device),
        )

    def _run(self, batch: DecodeBatch | GraphBatch) -> StepOutput:
        """The model over the batch and its tokens: a captured step's, or the same
        computed eagerly (the argmax, or the full step with the sampler)."""
        grammars = _grammars(batch.requests)  # each row's next-token mask: step n's token is known
        if isinstance(batch, GraphBatch):
            return self._graphs.replay(batch.side, batch.input_ids, batch.size, batch.feed,
                                       full=batch.full, grammars=grammars)
        with torch.inference_mode():
            hidden = step_hidden(self.model, self.pool, batch.input_ids, batch.positions,
                                 batch.locs, batch.page_table, batch.seq_lens)  # [B, hidden]
            logits = self.model.compute_logits(hidden)
            if batch.slots is None:
                return StepOutput(logits, logits.argmax(dim=-1))
            bitmask = None
            if grammars is not None:
                bitmask = torch.empty((len(grammars), bitmask_words(logits.shape[1])), dtype=torch.int32)
                fill_bitmasks(grammars, bitmask)
                bitmask = bitmask.to(logits.device)
            sampled = sample_step(logits, self.sampler, batch.slots, batch.uniform, bitmask)
            return StepOutput(logits, sampled.tokens, sampled)

    def _postprocess(self, batch: DecodeBatch | GraphBatch, ran: _Ran) -> list[TokenEvent]:
        """Sample (with a step queued behind, its greedy ids read now), emit, finish.
        A request that finishes here while in the step queued behind this one
        (``ran.queued``) is dropped from that step and freed when it lands."""
        requests = batch.requests
        ahead = None if ran.queued is None else ran.queued.requests
        tokens = None if ran.tokens is None else ran.tokens()
        if tokens is None:
            tokens = ran.output.greedy.tolist()  # the step's one device read
        logprobs = _read_logprobs(ran.output.sampled, requests)
        queued = {id(r) for r in ahead or ()}
        events = []
        for request, token, lp in zip(requests, tokens, logprobs):
            if request.cancelled:
                continue  # no event; its pages are freed when the step lands
            if request.kv_ids is not None:
                request.kv_ids.append(request.last_token)  # this step wrote its row
            if request.grammar is not None and not request.grammar.accept(token):
                # The step's mask allows only what the grammar takes: a bug, not the client's.
                log.error("decode: request %s sampled token %d outside its grammar (%s); ended",
                          request.request_id, token, request.grammar.spec.kind)
                events.append(TokenEvent(request.request_id, None, request.step, True, FINISH_STOP))
                self._running.remove(request)
                if id(request) in queued:
                    request.cancelled = True
                else:
                    self._release(request)
                continue
            request.last_token = token
            request.step += 1
            reason = self._finish_reason(request, id(request) in queued)
            events.append(TokenEvent(request.request_id, token, request.step - 1,
                                     reason is not None, reason, lp))
            if reason is not None:
                self._running.remove(request)
                self._offer(request)
                if id(request) in queued:
                    request.cancelled = True  # the queued step writes its slot: freed after it
                else:
                    self._release(request)
        return events

    # ---- helpers (lock held) ----

    def _offer(self, request: _Request) -> None:
        """Hand a finished request's written rows to ``on_finish``. Rows a step still
        queued writes lie past ``kv_ids`` (its slot is the next position), so every whole
        page of ``kv_ids`` is final."""
        if self.on_finish is None or request.kv_ids is None:
            return
        try:
            self.on_finish(request.kv_ids, request.table.pages)
        except Exception:  # noqa: BLE001 - a cache that fails must not stop the decode loop
            log.warning("prefix cache refused request_id=%s's pages", request.request_id, exc_info=True)

    def _finish_reason(self, request: _Request, queued: bool = False) -> str | None:
        """Why ``request`` ends after sampling ``last_token``, or None. ``queued``: the
        next step is queued already (its slot is counted in ``seq_len``)."""
        if request.last_token in request.stop_token_ids or (
                request.grammar is not None and request.grammar.terminated):
            return FINISH_STOP
        # The next step feeds last_token at position seq_len (seq_len - 1 if it is
        # queued): room for it?
        position = request.table.seq_len - queued
        if request.step >= request.max_new_tokens or position >= request.final_len:
            return FINISH_LENGTH
        return None

    def _has_work(self) -> bool:
        return bool(self._waiting or self._running or self._done_at_add or self._overlap.launched is not None)

    def _find(self, request_id: str) -> _Request | None:
        for request in (*self._running, *self._waiting):
            if request.request_id == request_id:
                return request
        return None


def _grammars(requests: Sequence[_Request]) -> list[RequestGrammar | None] | None:
    """Each row's matcher when any row has one, else None (the step applies no mask)."""
    grammars = [r.grammar for r in requests]
    return grammars if any(g is not None for g in grammars) else None


def _read_logprobs(sampled: StepResult | None,
                   requests: Sequence[_Request]) -> list[TokenLogprobs | None]:
    """Each request's logprobs of the step, read from the device when any asked."""
    wanted = [r.sampling.logprobs for r in requests]
    if sampled is None or all(k is None for k in wanted):
        return [None] * len(requests)
    chosen = sampled.logprob.tolist()
    values, ids = sampled.top_logprobs.tolist(), sampled.top_ids.tolist()
    return [None if k is None else TokenLogprobs(chosen[i], tuple(zip(ids[i][:k], values[i][:k])))
            for i, k in enumerate(wanted)]
