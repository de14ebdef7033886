"""The Generate pipeline: prompt -> remote prefill -> KV into our pool -> engine events.

One call, in order (``GeneratePipeline``, handed a ``GenerateContext``); each
step succeeds or ends the call with a ``Refusal``, and whatever the call
holds by then is given back (``settle``):

1. admit: promise every page the request may ever hold (``PageBudget``):
   RESOURCE_EXHAUSTED at once if the pool can never hold it, or after
   ``page_wait_s`` of a full pool. Checked before prefill, so no prefill work
   is wasted on a request that cannot be decoded;
2. prefill on the healthy prefill daemon with the fewest queued prompt tokens
   (``decode.prefill_call.PrefillPool``, xPyD): its first message comes as
   soon as every owner rank holds the request's pages, before the prefill
   runs; from then on the ranks pin them until we release them (or their
   lease expires). A failure of steps 2-3 that another daemon may not have
   (``RETRY_CODES``: down, full, failing) gives back what the try held and
   sends the request to another prefill daemon, each at most once: no token
   has been sent yet;
3. check the manifest, remap its pages onto fresh pages of our pool and fetch
   the KV while the prefill runs (``transfer.connector.fetcher.KVFetcher``:
   the fast path where a rank shares its pool, gRPC for the others and for a
   rank whose copy failed its digest; it raises one ``KVFetchError`` with the
   call's status: DATA_LOSS, UNAVAILABLE, DEADLINE_EXCEEDED or ABORTED, and
   a failed prefill's own status wins). Then the prefill's last message
   brings the first token;
4. release the prefill pages at every rank, in the background (FetchKV and
   Release carry the prefill daemon's epoch from step 2, so a restarted
   prefill daemon refuses them, and the request's capability from the
   prefill reply, without which the ranks refuse them);
5. hand the page table to the engine with prefill's first token and yield the
   engine's events.

A client that goes away is noticed between the steps and, once streaming, at
once (``abandon``, from gRPC's termination callback, cancels the request in
the engine). A call that fails gives its pages back at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import grpc
import torch
from lanekv.decode.budget import PageBudget
from lanekv.decode.config import DecodeConfig
from lanekv.decode.engine import FINISH_LENGTH, DecodeEngine, TokenEvent, TokenLogprobs
from lanekv.decode.pool import PagePool, PageTable, PoolExhausted
from lanekv.decode.prefill_call import (
    LOST_CODES,
    RETRY_CODES,
    PrefillPool,
    PrefillTarget,
    check_manifest,
    relays_of,
)
from lanekv.decode.prefix.cache import DecodePrefixCache
from lanekv.decode.streams import SHUTDOWN, DaemonFailed, Streams
from lanekv.model.grammar import Grammars, RequestGrammar
from lanekv.model.sampling import SamplingParams
from lanekv.model.tokenizer import Tokenizer
from lanekv.proto import lanekv_pb2
from lanekv.runtime.metrics import PrefixMetrics
from lanekv.runtime.status import Refusal
from lanekv.transfer.connector.base import FetchJob, KVFetchError
from lanekv.transfer.connector.fetcher import FetchStats, KVFetcher
from lanekv.transfer.protocol.access import access_ticket
from lanekv.transfer.protocol.agreement import Agreement

log = logging.getLogger("lanekv.decode")
Code = grpc.StatusCode
_ABANDONED = object()  # queued when the RPC ends under a waiting stream


class GenerateSpec(NamedTuple):
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    sampling_proto: lanekv_pb2.SamplingParams  # forwarded to prefill as given
    max_new_tokens: int  # output tokens, prefill's first one included; 0: prompt logprobs alone
    stop_token_ids: tuple[int, ...]
    prompt_logprobs: int | None = None  # top tokens per prompt token's logprob; None: none
    grammar: RequestGrammar | None = None  # the matcher of sampling.grammar, at its start


class Prepared(NamedTuple):
    first_token: int | None  # None: the engine samples it (the prompt was all in our cache)
    prefill_s: float
    fetch: FetchStats
    paths: dict[int, str]  # how each owner rank's KV came: "grpc", "shm", "cuda_ipc" (TP: "grpc+shm" if ranks differ)
    compute_s: float = 0.0  # the slowest prefill rank's own time (its reply's timings)
    first_logprobs: TokenLogprobs | None = None  # computed by prefill, when asked

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata of the stream: what the transfer cost."""
        return (
            ("lanekv-prefill-seconds", f"{self.prefill_s:.6f}"),
            ("lanekv-prefill-compute-seconds", f"{self.compute_s:.6f}"),
            ("lanekv-transfer-bytes", str(self.fetch.bytes)),
            ("lanekv-transfer-chunks", str(self.fetch.chunks)),
            ("lanekv-transfer-seconds", f"{self.fetch.seconds:.6f}"),
            ("lanekv-transfer-paths", ",".join(f"{rank}:{how}" for rank, how in sorted(self.paths.items()))),
        )


class Caller(Protocol):
    """The RPC side of a call, as a ``grpc.ServicerContext`` offers it."""

    def add_callback(self, callback: Callable[[], None]) -> bool: ...
    def time_remaining(self) -> float | None: ...
    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None: ...


class LocalCaller:
    """The ``Caller`` of a call the daemon makes itself (its warm-up): no RPC, a deadline."""

    def __init__(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s
        self.metadata: tuple[tuple[str, str], ...] = ()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return True  # nobody goes away

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.metadata = tuple(metadata)


@dataclass(frozen=True)
class GenerateContext:
    """What the pipeline runs on, built and owned by the daemon (``decode.daemon``)."""

    config: DecodeConfig
    pool: PagePool
    engine: DecodeEngine
    fetcher: KVFetcher
    prefills: PrefillPool  # the prefill daemons whose handshake accepted ours (xPyD)
    budget: PageBudget
    streams: Streams
    agreement: Agreement  # ours
    tokenizer: Tokenizer | None  # the checkpoint's; None: token ids only
    vocab_size: int
    max_positions: int
    stopping: threading.Event  # set when the daemon stops
    prefix_cache: DecodePrefixCache | None = None  # verified prompt pages (decode.prefix.cache)
    prefix_metrics: PrefixMetrics | None = None
    uncached: bool = False  # no prefix cache on either side matches, keeps or remembers its prompts (the warm-up)
    grammars: Grammars | None = None  # structured output's compiler; None: no tokenizer


@dataclass(eq=False)
class GenerateCall:
    """What one Generate call holds; ``lock`` guards the hand-over of pages to the engine."""

    spec: GenerateSpec
    events: queue.SimpleQueue
    abandoned: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    reserved_pages: int = 0  # promised by the PageBudget
    pinned_at: dict[int, str] | None = None  # prefill ranks still pinning the request's pages
    fingerprint: str = ""
    epoch: str | None = None  # access_ticket: the prefill daemon start that pinned the pages, the capability
    table: PageTable | None = None  # our pages, until the engine owns them
    in_engine: bool = False
    settled: bool = False
    finished: bool = False  # its last event was sent
    cached_tokens: int = 0  # prompt tokens whose compute a prefix cache skipped (GenerateReply.cached_tokens)
    prefix_cache_tokens: int = 0  # leading prompt tokens our cache holds once the KV is in (a router's hint)
    prompt_logprobs: list[lanekv_pb2.TokenLogprob] | None = None  # the prefill's, when asked

    @property
    def outcome(self) -> str:
        return "finished" if self.finished else "cancelled" if self.abandoned.is_set() else "refused"


class GeneratePipeline:
    def __init__(self, ctx: GenerateContext) -> None:
        self._ctx = ctx

    def open(self, spec: GenerateSpec, counted: bool = True) -> GenerateCall:
        """A call with a stream of its own; ALREADY_EXISTS while the request id is in use.
        ``counted=False``: outside the daemon's metrics and counts (its warm-up)."""
        if self._ctx.stopping.is_set():
            raise Refusal(Code.UNAVAILABLE, "the decode daemon is stopping")
        events = self._ctx.streams.open(spec.request_id, counted)
        if events is None:
            raise Refusal(Code.ALREADY_EXISTS, f"request_id={spec.request_id!r} is already in use")
        return GenerateCall(spec, events)

    def run(self, call: GenerateCall, caller: Caller,
            target: PrefillTarget | None = None) -> Iterator[list[TokenEvent]]:
        """Steps 1-5: the events of the request in batches (see ``_events``), prefill's
        first token first; settled at the end. ``target``: that prefill daemon only
        (no other is tried); None: the pick's."""
        try:
            if not caller.add_callback(lambda: self._abandon(call)):
                call.abandoned.set()  # the RPC has ended already
            prepared = self._prepare(call, caller.time_remaining(), target)
            spec = call.spec
            self._ctx.streams.transferred(spec.request_id, len(spec.token_ids), prepared.fetch, prepared.prefill_s,
                                          prepared.first_token is not None)
            caller.set_trailing_metadata(prepared.metadata())
            if spec.max_new_tokens == 0:  # the prompt's logprobs alone: nothing is decoded
                yield [TokenEvent(spec.request_id, None, 0, True, FINISH_LENGTH)]
            else:
                if prepared.first_token is not None:
                    yield [TokenEvent(spec.request_id, prepared.first_token, 0, False, None,
                                      prepared.first_logprobs)]
                yield from self._events(call)
            call.finished = True
        finally:
            self._settle(call)

    def close(self, call: GenerateCall | None, code: grpc.StatusCode, details: str) -> None:
        """Account for a call that ended (None: refused before it had a stream) with ``code``."""
        if call is None:
            self._ctx.streams.close(None, "refused", code, details)
        else:
            self._ctx.streams.close(call.spec.request_id, call.outcome, code, details)

    # -- steps 1-5 --------------------------------------------------------------

    def _prepare(self, call: GenerateCall, remaining: float | None,
                 only: PrefillTarget | None = None) -> Prepared:
        ctx, spec = self._ctx, call.spec
        config = ctx.config
        budget_s = config.request_timeout_s if remaining is None else min(remaining, config.request_timeout_s)
        deadline = time.monotonic() + budget_s
        self._admit(call, deadline)
        # Prompt logprobs need the logits of every prompt row: the prefill daemon computes them.
        from_cache = None if spec.prompt_logprobs is not None else self._from_cache(call)
        if from_cache is not None:
            return from_cache
        if only is not None:
            return self._prepare_on(only, call, deadline)
        tried: list[PrefillTarget] = []
        while True:
            target = ctx.prefills.pick(len(spec.token_ids), exclude=tried, token_ids=spec.token_ids)
            try:
                return self._prepare_on(target, call, deadline)
            except Refusal as refusal:
                tried.append(target)
                if not self._retry(call, target, refusal, tried, deadline):
                    raise
            finally:
                ctx.prefills.done(target, len(spec.token_ids))

    def _retry(self, call: GenerateCall, target: PrefillTarget, refusal: Refusal,
               tried: Sequence[PrefillTarget], deadline: float) -> bool:
        """After steps 2-5 failed on ``target`` (no token sent yet): whether another prefill
        daemon takes the request; if so, what this try held is given back first."""
        ctx = self._ctx
        if refusal.code in LOST_CODES:
            ctx.prefills.lost(target, f"{refusal.code.name}: {refusal.message}")
        with call.lock:
            in_engine = call.in_engine
        if refusal.code not in RETRY_CODES or in_engine or call.abandoned.is_set() \
                or time.monotonic() >= deadline or not ctx.prefills.others(tried):
            return False
        with call.lock:
            table, call.table = call.table, None
        if table is not None:
            table.release()  # the fetcher raised: nothing writes into these pages any more
        self._release_prefill(call, wait=False)
        call.epoch, call.fingerprint = None, ""
        ctx.prefills.retried(target)
        log.warning("prefill failed request_id=%s prefill=%s code=%s: %s; retrying on another prefill daemon",
                    call.spec.request_id, target.endpoint, refusal.code.name, refusal.message,
                    extra={"request_id": call.spec.request_id})
        return True

    def _prepare_on(self, target: PrefillTarget, call: GenerateCall, deadline: float) -> Prepared:
        """Steps 2-5 with the prefill daemon ``target``; the KV comes from its ranks."""
        ctx, spec = self._ctx, call.spec
        config = ctx.config
        if spec.max_new_tokens == 0:
            return self._score_on(target, call)
        # Not cut short by the client's deadline: a prefill that ends after we
        # stopped waiting would pin its pages until their lease expires; once it
        # has answered, a client that went away is noticed and the pages released.
        # Our cached pages of the prompt: the prefill daemon is told how many, and only
        # the pages after them move. The page of the last token always comes from it.
        cache, num_tokens = ctx.prefix_cache, len(spec.token_ids)
        hit = [] if cache is None else cache.match(spec.token_ids, (num_tokens - 1) // config.page_size,
                                                   count=False)
        try:
            prefill = target.client.stream(spec.request_id, spec.token_ids, spec.sampling_proto,
                                           config.request_timeout_s, cached_pages=len(hit),
                                           skip_prefix_cache=ctx.uncached,
                                           prompt_logprobs=spec.prompt_logprobs)
        except BaseException:
            ctx.pool.free(hit)
            raise
        try:
            started = prefill.started()
            # What we know of the daemon's layout must be from the start that pinned the pages.
            topology = ctx.prefills.topology_of(target, prefill.epoch)
            # The start and the request's capability, presented to every rank.
            call.epoch = access_ticket(prefill.epoch, started.capability)
            call.fingerprint = started.contract_fingerprint
            call.pinned_at = dict(enumerate(started.endpoints))
            manifest = check_manifest(started, spec.request_id, len(spec.token_ids), ctx.agreement.fingerprint,
                                      config.page_size, topology)
            _check_alive(call)
            try:
                call.table = PageTable.remap(ctx.pool, [p.page for p in manifest.pages], manifest.num_tokens,
                                             cached=hit)
            except PoolExhausted as err:  # the budget should make this impossible
                raise Refusal(Code.RESOURCE_EXHAUSTED, f"decode pool: {err}") from err
            held, hit = len(hit), []  # the table holds them now
            table = call.table
            moving = manifest.pages[held:]
            job = FetchJob(
                spec.request_id, call.fingerprint, call.epoch, tuple(started.endpoints),
                {rank: [p.page for p in moving if p.owner == rank] for rank in sorted({p.owner for p in moving})},
                ctx.agreement.num_layers, config.page_size, ctx.pool.tensor, table.physical_pages_for, deadline,
                physical_of=topology.physical_of, written=None if prefill.answered() else prefill.written,
                relays=relays_of(started),
            )
            # Over gRPC the ranks send each layer as soon as it is written: the fetch overlaps
            # the prefill. The fast path copies once the prefill has answered (its tuning).
            try:
                fetched = ctx.fetcher.fetch(job)
            except KVFetchError:
                prefill.raise_if_failed()  # a failed prefill is the cause to report
                raise
            reply = prefill.done()
        finally:
            prefill.close()
            if hit:  # it failed before the table took them
                ctx.pool.free(hit)
        if reply.first_token < 0 or reply.request_id != spec.request_id:
            raise Refusal(Code.INTERNAL, f"prefill daemon answered first_token={reply.first_token} "
                          f"for {reply.request_id!r}")
        if target.memory is not None and not ctx.uncached:
            # What its cache holds of the prompt now: remembered, and anything remembered
            # past it forgotten (evicted there since), so later picks do not follow it.
            stale = target.memory.observe(spec.token_ids, int(reply.prefix_cache_pages) * config.page_size,
                                          int(reply.cached_tokens))
            ctx.prefills.observed(target, stale)
        if cache is not None:
            # Every chunk verified (checksum or digest) and every layer of every page arrived:
            # only now may the prompt's whole pages serve later requests.
            cache.admit(spec.token_ids, table.pages)
            call.prefix_cache_tokens = cache.peek(spec.token_ids) * config.page_size
        if held and ctx.prefix_metrics is not None:
            ctx.prefix_metrics.bytes_not_moved.inc(held * _page_bytes(ctx.pool))
        call.cached_tokens = min(int(reply.cached_tokens), num_tokens - 1)
        first_logprobs = None
        if spec.sampling.logprobs is not None:
            if not reply.HasField("first_logprob"):
                raise Refusal(Code.INTERNAL, "the prefill daemon sent no logprobs for the first token")
            lp = reply.first_logprob
            first_logprobs = TokenLogprobs(lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs)))
        if spec.prompt_logprobs is not None:
            if len(reply.prompt_logprobs) != num_tokens - 1:
                raise Refusal(Code.INTERNAL, f"the prefill daemon sent {len(reply.prompt_logprobs)} prompt "
                              f"logprobs for a prompt of {num_tokens} tokens")
            call.prompt_logprobs = list(reply.prompt_logprobs)
        self._release_prefill(call, wait=False)  # the KV is ours: the ranks free their pages meanwhile
        with call.lock:
            _check_alive(call)
            try:
                ctx.engine.add(spec.request_id, call.table, reply.first_token, spec.sampling,
                               spec.max_new_tokens, spec.stop_token_ids, start_step=1,
                               prompt_ids=spec.token_ids, cache_ids=_cache_ids(cache, spec),
                               grammar=spec.grammar)
            except ValueError as err:
                raise Refusal(Code.INTERNAL, f"decode engine refused the request: {err}") from err
            call.in_engine, call.table = True, None
        return Prepared(reply.first_token, prefill.seconds, fetched.stats, fetched.paths,
                        reply.timings.get("compute_s", 0.0), first_logprobs)

    def _score_on(self, target: PrefillTarget, call: GenerateCall) -> Prepared:
        """``max_new_tokens`` 0 (prompt logprobs alone): the prefill daemon prefills the
        prompt and scores it; no KV moves and nothing is decoded (its first token is
        dropped), and its pages are released at once."""
        ctx, spec = self._ctx, call.spec
        prefill = target.client.stream(spec.request_id, spec.token_ids, spec.sampling_proto,
                                       ctx.config.request_timeout_s, prompt_logprobs=spec.prompt_logprobs)
        try:
            started = prefill.started()
            call.epoch = access_ticket(prefill.epoch, started.capability)
            call.fingerprint = started.contract_fingerprint
            call.pinned_at = dict(enumerate(started.endpoints))
            reply = prefill.done()
        finally:
            prefill.close()
        if reply.request_id != spec.request_id or len(reply.prompt_logprobs) != len(spec.token_ids) - 1:
            raise Refusal(Code.INTERNAL, f"prefill daemon answered {len(reply.prompt_logprobs)} prompt logprobs "
                          f"for {reply.request_id!r} ({len(spec.token_ids)} prompt tokens)")
        call.prompt_logprobs = list(reply.prompt_logprobs)
        self._release_prefill(call, wait=False)
        return Prepared(None, prefill.seconds, FetchStats(0, 0, 0.0, {}), {}, reply.timings.get("compute_s", 0.0))

    def _from_cache(self, call: GenerateCall) -> Prepared | None:
        """A prompt whose every page is in our cache (whole pages, so it ends on a page
        boundary): nothing moves and no prefill daemon is asked. The engine feeds the
        prompt's last token at its position and samples the first output token in its
        next step: one decode step, the cheapest correct path (the cache keeps K/V, not
        the last token's hidden state). That step rewrites the last token's row, so the
        last page is copied first and the cached one stays as it was verified."""
        ctx, spec = self._ctx, call.spec
        cache, ids, ps = ctx.prefix_cache, spec.token_ids, ctx.config.page_size
        if cache is None:
            return None
        hit = cache.match(ids, len(ids) // ps)
        if ctx.prefix_metrics is not None:
            ctx.prefix_metrics.lookup_tokens.inc(len(ids))
            ctx.prefix_metrics.hit_tokens.inc(len(hit) * ps)
        stops = set(spec.stop_token_ids) | ctx.engine.eos_token_ids
        if len(hit) * ps != len(ids) or ids[-1] in stops:
            ctx.pool.free(hit)
            return None
        pool = ctx.pool
        try:
            [copy] = pool.allocate(1)
        except PoolExhausted as err:  # the budget should make this impossible
            pool.free(hit)
            raise Refusal(Code.RESOURCE_EXHAUSTED, f"decode pool: {err}") from err
        last = hit[-1]
        pool.tensor[:, :, copy * ps : (copy + 1) * ps] = pool.tensor[:, :, last * ps : (last + 1) * ps]
        if pool.tensor.is_cuda:  # the engine's step may run on a stream of its own: the copy lands first
            torch.cuda.current_stream(pool.device).synchronize()
        pool.free([last])
        table = PageTable.adopt(pool, hit[:-1] + [copy], len(ids) - 1)
        with call.lock:
            try:
                _check_alive(call)
                ctx.engine.add(spec.request_id, table, ids[-1], spec.sampling, spec.max_new_tokens,
                               spec.stop_token_ids, start_step=0, prompt_ids=spec.token_ids,
                               cache_ids=_cache_ids(cache, spec), grammar=spec.grammar)
            except ValueError as err:
                table.release()
                raise Refusal(Code.INTERNAL, f"decode engine refused the request: {err}") from err
            except BaseException:
                table.release()
                raise
            call.in_engine = True
        if ctx.prefix_metrics is not None:
            ctx.prefix_metrics.bytes_not_moved.inc(len(hit) * _page_bytes(pool))
        call.cached_tokens = len(ids) - 1
        call.prefix_cache_tokens = len(ids)
        return Prepared(None, 0.0, FetchStats(0, 0, 0.0, {}), {})

    def _admit(self, call: GenerateCall, deadline: float) -> None:
        ctx, spec = self._ctx, call.spec
        page_size, num_pages, page_wait_s = ctx.config.page_size, ctx.pool.num_pages, ctx.config.page_wait_s
        # Cache tokens at the end: the prompt plus every output token but the last.
        pages = -(-(len(spec.token_ids) + spec.max_new_tokens - 1) // page_size)
        if pages > num_pages:
            raise Refusal(
                Code.RESOURCE_EXHAUSTED, f"the request may need {pages} KV pages; the decode pool has {num_pages}"
            )
        wait_s = min(page_wait_s, time_left(deadline))
        if not ctx.budget.acquire(pages, wait_s, call.abandoned):
            _check_alive(call)
            if wait_s < page_wait_s:  # the deadline ended the wait, not the pool's limit
                raise Refusal(
                    Code.DEADLINE_EXCEEDED,
                    f"the deadline passed after {wait_s:.1f}s of waiting for {pages} pages of a full decode pool",
                )
            raise Refusal(
                Code.RESOURCE_EXHAUSTED,
                f"the decode pool stayed full for {wait_s:.1f}s ({pages} of {num_pages} pages wanted)",
            )
        call.reserved_pages = pages

    def _release_prefill(self, call: GenerateCall, *, wait: bool) -> None:
        """Release the request's prefill pages at every rank; in the background unless ``wait``."""
        with call.lock:
            pinned, call.pinned_at = call.pinned_at, None
        if not pinned:
            return
        args = (call.spec.request_id, call.fingerprint, call.epoch, pinned)
        if wait:
            self._release(*args)
        else:
            threading.Thread(target=self._release, args=args, name="lanekv-release", daemon=True).start()

    def _release(self, request_id: str, fingerprint: str, epoch: str | None, pinned: dict[int, str]) -> None:
        for rank, endpoint in pinned.items():
            try:
                self._ctx.fetcher.release({rank: endpoint}, request_id, fingerprint,
                                          timeout=self._ctx.config.release_timeout_s, epoch=epoch)
            except KVFetchError as err:  # the lease frees them in the end
                log.warning("release failed request_id=%s rank=%d: %s", request_id, rank, err,
                            extra={"request_id": request_id})

    # -- streaming and the end of a call -----------------------------------------

    def _events(self, call: GenerateCall) -> Iterator[list[TokenEvent]]:
        """The request's events as they come, each batch holding every event
        queued by the time the last one was taken: one reply per batch, so a
        client slower than the decode step gets fewer, fuller replies."""
        finished = False
        held = None  # an item taken while batching, handled on the next turn
        while not finished:
            if held is not None:
                item, held = held, None
            else:
                try:
                    item = call.events.get(timeout=1.0)
                except queue.Empty:
                    if self._ctx.stopping.is_set():
                        raise Refusal(Code.UNAVAILABLE, "the decode daemon is shutting down") from None
                    continue
            _raise_for(item)
            batch = [item]
            while not batch[-1].finished:
                try:
                    more = call.events.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(more, TokenEvent):
                    held = more  # end the batch; the control item ends the call next turn
                    break
                batch.append(more)
            finished = batch[-1].finished
            yield batch

    def _abandon(self, call: GenerateCall) -> None:
        """gRPC's callback when the RPC ends, for any reason (run in a gRPC thread)."""
        call.abandoned.set()
        call.events.put(_ABANDONED)
        self._ctx.budget.wake()
        with call.lock:
            engine_owned = call.in_engine
        # Earlier, the handler thread holds the pages and settles at its next step;
        # once the engine owns them they can be freed from here, at once.
        if engine_owned:
            self._settle(call)

    def _settle(self, call: GenerateCall) -> None:
        """Give back everything the call holds, once."""
        with call.lock:
            if call.settled:
                return
            call.settled = True
            table, call.table = call.table, None
            in_engine = call.in_engine
        budget, reserved = self._ctx.budget, call.reserved_pages

        def give_back() -> None:
            if reserved:
                budget.release(reserved)

        # The budget goes back once the pages are free: a request cancelled under a
        # running step keeps its pages until the step lands, and a request admitted
        # on its budget before then would find the pool short.
        deferred = in_engine and self._ctx.engine.cancel(call.spec.request_id, on_freed=give_back)
        if table is not None:
            table.release()
        self._release_prefill(call, wait=False)
        if not deferred:  # not in the engine, or it had finished: its pages are free
            give_back()


def _cache_ids(cache: DecodePrefixCache | None, spec: GenerateSpec) -> list[int] | None:
    """The prompt ids the engine keys the request's pages by when it finishes (its reply's
    whole pages join the cache: a conversation that goes on hits them); None: no cache."""
    return spec.token_ids if cache is not None and cache.enabled else None


def _page_bytes(pool: PagePool) -> int:
    """Bytes of one page over every layer (what moving it costs)."""
    return pool.tensor.numel() * pool.tensor.element_size() // pool.num_pages


def time_left(deadline: float) -> float:
    """Seconds until ``deadline``; DEADLINE_EXCEEDED once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise Refusal(Code.DEADLINE_EXCEEDED, "the request ran out of time before decoding")
    return left


def _check_alive(call: GenerateCall) -> None:
    if call.abandoned.is_set():
        raise Refusal(Code.CANCELLED, "the client went away")


def _raise_for(item: object) -> None:
    """End the call for a control item of the stream's queue (an event passes)."""
    if item is _ABANDONED:
        raise Refusal(Code.CANCELLED, "the client went away")
    if item is SHUTDOWN:
        raise Refusal(Code.UNAVAILABLE, "the decode daemon is shutting down")
    if isinstance(item, DaemonFailed):
        raise Refusal(Code.UNAVAILABLE, f"the decode daemon failed and is stopping: {item}")
    if isinstance(item, Exception):
        raise Refusal(Code.INTERNAL, f"decode step failed: {item}")
