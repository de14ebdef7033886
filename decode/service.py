"""``DecodeService.Generate``: prompt -> remote prefill -> KV into our pool -> streamed tokens.

One call, in order; each step succeeds or ends the call with a status, and
whatever the call holds by then is given back (``_settle``):

1. parse the prompt, sampling, request id, max_new_tokens and stop ids
   (INVALID_ARGUMENT, OUT_OF_RANGE for lengths past the model's positions);
2. admit: promise every page the request may ever hold (``PageBudget``):
   RESOURCE_EXHAUSTED at once if the pool can never hold it, or after
   ``page_wait_s`` of a full pool. Checked before prefill, so no prefill work
   is wasted on a request that cannot be decoded;
3. prefill on the prefill daemon (``PrefillStream``): its first message
   comes as soon as every owner rank holds the request's pages, before the
   prefill runs; from then on the ranks pin them until we release them (or
   their lease expires);
4. remap and fetch, while the prefill runs (``decode.kvfetch``): one fresh
   page here per logical page of the manifest; every owner rank sends each
   layer as soon as it has written it. Ranks on this host that share their
   pool (``transfer.protocol.descriptors``) are read in place, each copied layer
   checked against the rank's digest (a mismatch fetches that rank again
   over gRPC); the others stream over gRPC, each verified chunk placed
   straight into our pages. A rank's stream that breaks, stalls or delivers
   a damaged chunk is asked again for only what is missing
   (``transfer.grpcfetch.fetch``); when tries run out the call ends with DATA_LOSS
   (damaged chunks), UNAVAILABLE (the rank or the path to it is down),
   DEADLINE_EXCEEDED (the call's time is up) or ABORTED (the rank refused,
   e.g. NOT_FOUND after its lease expired, or the prefill failed: then the
   prefill's own status is the call's). No damaged chunk is ever placed.
   Then the prefill's last message brings the first token;
5. release the prefill pages at every rank (ranks without pages of the
   request hold its id too). FetchKV and Release carry the prefill daemon's
   epoch from step 3, so a restarted prefill daemon refuses them;
6. hand the page table to the engine with prefill's first token and stream
   the engine's events.

A client that goes away is noticed between steps 2-6 and, once streaming, at
once (gRPC's termination callback cancels the request in the engine). A call
that fails gives its pages back at once; its Release calls run in the
background (a rank that does not answer must not hold the status back, and
the lease frees its pages anyway).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc

from decode.daemon import SHUTDOWN, DecodeDaemon
from decode.detokenize import Detokenizer
from decode.engine import TokenEvent
from decode.kvfetch import check_manifest, fetch_kv, time_left
from decode.pool import PageTable, PoolExhausted
from decode.remote import PrefillCall
from model.sampling import SamplingParams
from proto import lanekv_pb2, lanekv_pb2_grpc
from runtime.requests import prompt_from_proto, request_id_from_proto, sampling_from_proto
from runtime.status import Refusal, refusals
from transfer.grpcfetch.client import FetchStats, TransferError

log = logging.getLogger("lanekv.decode")
Code = grpc.StatusCode
MAX_STOP_TOKEN_IDS = 1024
_ABANDONED = object()  # queued when the RPC ends under a waiting stream


class GenerateSpec(NamedTuple):
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    sampling_proto: lanekv_pb2.SamplingParams  # forwarded to prefill as given
    max_new_tokens: int  # output tokens, prefill's first one included
    stop_token_ids: tuple[int, ...]


class Prepared(NamedTuple):
    first_token: int
    prefill_s: float
    fetch: FetchStats
    paths: dict[int, str]  # how each owner rank's KV came: "grpc", "shm" or "cuda_ipc"

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata of the stream: what the transfer cost."""
        return (
            ("lanekv-prefill-seconds", f"{self.prefill_s:.6f}"),
            ("lanekv-transfer-bytes", str(self.fetch.bytes)),
            ("lanekv-transfer-chunks", str(self.fetch.chunks)),
            ("lanekv-transfer-seconds", f"{self.fetch.seconds:.6f}"),
            ("lanekv-transfer-paths", ",".join(f"{rank}:{how}" for rank, how in sorted(self.paths.items()))),
        )


@dataclass(eq=False)
class _Call:
    """What one Generate call holds; ``lock`` guards the hand-over of pages to the engine."""

    spec: GenerateSpec
    events: queue.SimpleQueue
    abandoned: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    reserved_pages: int = 0  # promised by the daemon's PageBudget
    pinned_at: dict[int, str] | None = None  # prefill ranks still pinning the request's pages
    paths: dict[int, str] = field(default_factory=dict)  # how each owner rank's KV came
    fingerprint: str = ""
    epoch: str | None = None  # the prefill daemon start that pinned the pages
    table: PageTable | None = None  # our pages, until the engine owns them
    in_engine: bool = False
    settled: bool = False


def parse_request(request: lanekv_pb2.GenerateRequest, d: DecodeDaemon) -> GenerateSpec:
    ids = prompt_from_proto(request, d.tokenizer, d.vocab_size, d.max_positions)
    sampling = sampling_from_proto(request.sampling)
    request_id = request_id_from_proto(request) or uuid.uuid4().hex
    max_new = request.max_new_tokens
    if max_new < 1:
        raise Refusal(Code.INVALID_ARGUMENT, f"max_new_tokens must be >= 1, got {max_new}")
    if len(ids) + max_new > d.max_positions:
        raise Refusal(
            Code.OUT_OF_RANGE,
            f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) is more than the model's "
            f"{d.max_positions} positions",
        )
    stops = tuple(request.stop_token_ids)
    if len(stops) > MAX_STOP_TOKEN_IDS:
        raise Refusal(Code.INVALID_ARGUMENT, f"stop_token_ids: {len(stops)} ids, at most {MAX_STOP_TOKEN_IDS}")
    bad = [t for t in stops if not 0 <= t < d.vocab_size]
    if bad:
        raise Refusal(
            Code.INVALID_ARGUMENT, f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {d.vocab_size})"
        )
    return GenerateSpec(request_id, ids, sampling, request.sampling, max_new, stops)


class DecodeServicer(lanekv_pb2_grpc.DecodeServiceServicer):
    def __init__(self, daemon: DecodeDaemon) -> None:
        self.d = daemon

    def Generate(self, request, context):
        """Stream one reply per output token; the last one says finished and why."""
        d, call, finished = self.d, None, False
        try:
            with refusals(context):
                spec = parse_request(request, d)
                events = d.open_stream(spec.request_id)
                if events is None:
                    raise Refusal(Code.ALREADY_EXISTS, f"request_id={spec.request_id!r} is already in use")
                call = _Call(spec, events)
                if not context.add_callback(lambda: self._abandon(call)):
                    call.abandoned.set()  # the RPC has ended already
                prepared = self._prepare(call, context)
                d.transferred(spec, prepared)
                context.set_trailing_metadata(prepared.metadata())
                text = Detokenizer(d.tokenizer)
                yield _reply(spec.request_id, TokenEvent(spec.request_id, prepared.first_token, 0, False, None), text)
                for event in self._events(call):
                    yield _reply(spec.request_id, event, text)
                finished = True
        finally:
            if call is not None:
                self._settle(call)
                outcome = "finished" if finished else "cancelled" if call.abandoned.is_set() else "refused"
                d.close_stream(call.spec.request_id, outcome, context)
            else:
                d.close_stream(None, "refused", context)

    # -- steps 2-6 --------------------------------------------------------------

    def _prepare(self, call: _Call, context) -> Prepared:
        d, spec = self.d, call.spec
        remaining = context.time_remaining()
        budget_s = d.config.request_timeout_s if remaining is None else min(remaining, d.config.request_timeout_s)
        deadline = time.monotonic() + budget_s
        # Cache tokens at the end: the prompt plus every output token but the last.
        pages = -(-(len(spec.token_ids) + spec.max_new_tokens - 1) // d.config.page_size)
        if pages > d.pool.num_pages:
            raise Refusal(
                Code.RESOURCE_EXHAUSTED,
                f"the request may need {pages} KV pages; the decode pool has {d.pool.num_pages}",
            )
        wait_s = min(d.config.page_wait_s, time_left(deadline))
        if not d.budget.acquire(pages, wait_s, call.abandoned):
            _check_alive(call)
            if wait_s < d.config.page_wait_s:  # the deadline ended the wait, not the pool's limit
                raise Refusal(
                    Code.DEADLINE_EXCEEDED,
                    f"the deadline passed after {wait_s:.1f}s of waiting for {pages} pages of a full decode pool",
                )
            raise Refusal(
                Code.RESOURCE_EXHAUSTED,
                f"the decode pool stayed full for {wait_s:.1f}s ({pages} of {d.pool.num_pages} pages wanted)",
            )
        call.reserved_pages = pages

        # Not cut short by the client's deadline: a prefill that ends after we
        # stopped waiting would pin its pages until their lease expires; once it
        # has answered, a client that went away is noticed and the pages released.
        prefill = PrefillCall(d, spec, d.config.request_timeout_s)
        try:
            started = prefill.started()
            call.epoch = prefill.epoch
            call.fingerprint = started.contract_fingerprint
            call.pinned_at = dict(enumerate(started.endpoints))
            manifest = check_manifest(d, started, spec)
            _check_alive(call)
            try:
                call.table = PageTable.remap(d.pool, [p.page for p in manifest.pages], manifest.num_tokens)
            except PoolExhausted as err:  # the budget should make this impossible
                raise Refusal(Code.RESOURCE_EXHAUSTED, f"decode pool: {err}") from err
            # The ranks send each layer as soon as it is written: the fetch overlaps the prefill.
            try:
                fetched = fetch_kv(d, call, manifest, list(started.endpoints), deadline,
                                   written=prefill.answered())
            except Refusal:
                prefill.raise_if_failed()  # a failed prefill is the cause to report
                raise
            reply = prefill.done()
        finally:
            prefill.close()
        if reply.first_token < 0 or reply.request_id != spec.request_id:
            raise Refusal(Code.INTERNAL, f"prefill daemon answered first_token={reply.first_token} "
                          f"for {reply.request_id!r}")
        self._release_prefill(call, wait=False)  # the KV is ours: the ranks free their pages meanwhile
        with call.lock:
            _check_alive(call)
            try:
                d.engine.add(spec.request_id, call.table, reply.first_token, spec.sampling,
                             spec.max_new_tokens, spec.stop_token_ids, start_step=1)
            except ValueError as err:
                raise Refusal(Code.INTERNAL, f"decode engine refused the request: {err}") from err
            call.in_engine, call.table = True, None
        return Prepared(reply.first_token, prefill.seconds, fetched, call.paths)

    def _release_prefill(self, call: _Call, *, wait: bool) -> None:
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
                self.d.kv.release({rank: endpoint}, request_id, fingerprint,
                                  timeout=self.d.config.release_timeout_s, epoch=epoch)
            except TransferError as err:  # the lease frees them in the end
                log.warning("release failed request_id=%s rank=%d: %s", request_id, rank, err,
                            extra={"request_id": request_id})

    # -- streaming and the end of a call -----------------------------------------

    def _events(self, call: _Call) -> Iterator[TokenEvent]:
        finished = False
        while not finished:
            try:
                item = call.events.get(timeout=1.0)
            except queue.Empty:
                if self.d.stopping:
                    raise Refusal(Code.UNAVAILABLE, "the decode daemon is shutting down") from None
                continue
            if item is _ABANDONED:
                raise Refusal(Code.CANCELLED, "the client went away")
            if item is SHUTDOWN:
                raise Refusal(Code.UNAVAILABLE, "the decode daemon is shutting down")
            if isinstance(item, Exception):
                raise Refusal(Code.INTERNAL, f"decode step failed: {item}")
            finished = item.finished
            yield item

    def _abandon(self, call: _Call) -> None:
        """gRPC's callback when the RPC ends, for any reason (run in a gRPC thread)."""
        call.abandoned.set()
        call.events.put(_ABANDONED)
        self.d.budget.wake()
        with call.lock:
            engine_owned = call.in_engine
        # Earlier, the handler thread holds the pages and settles at its next step;
        # once the engine owns them they can be freed from here, at once.
        if engine_owned:
            self._settle(call)

    def _settle(self, call: _Call) -> None:
        """Give back everything the call holds, once."""
        with call.lock:
            if call.settled:
                return
            call.settled = True
            table, call.table = call.table, None
            in_engine = call.in_engine
        if in_engine:
            self.d.engine.cancel(call.spec.request_id)  # after a finish event: a no-op
        if table is not None:
            table.release()
        self._release_prefill(call, wait=False)
        if call.reserved_pages:
            self.d.budget.release(call.reserved_pages)


def _reply(request_id: str, event: TokenEvent, text: Detokenizer) -> lanekv_pb2.GenerateReply:
    return lanekv_pb2.GenerateReply(
        request_id=request_id,
        token_ids=[] if event.token_id is None else [event.token_id],
        text=text.piece(event.token_id),
        finished=event.finished,
        finish_reason=event.finish_reason or "",
    )


def _check_alive(call: _Call) -> None:
    if call.abandoned.is_set():
        raise Refusal(Code.CANCELLED, "the client went away")
