"""The Prefill service: gRPC calls in, the daemon's CP batches out.

``PrefillServicer`` turns a ``PrefillRequest`` into a ``PrefillInput`` (the
prompt, sampling, the caller's cached pages, the grammar's first mask), waits
for the daemon's result within the call's deadline, and answers with the
manifest, the capability and the daemon's epoch. Every refusal is counted by
cause and logged with the request id. It needs only what ``PrefillHost`` names,
so the daemon, not this module, decides how a prefill runs.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import Protocol

import grpc
from lanekv.model.grammar import Grammars
from lanekv.model.sampling import SamplingParams
from lanekv.model.tokenizer import Tokenizer
from lanekv.prefill.allocator import OutOfPagesError
from lanekv.prefill.cp.launcher import PrefillInput, PrefillResult, RankDiedError
from lanekv.prefill.prefix_cache import PrefillPrefixCache
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.requests import (
    logprob_to_proto,
    prompt_from_proto,
    prompt_logprobs_from_proto,
    request_id_from_proto,
    sampling_from_proto,
)
from lanekv.runtime.rpc_metrics import LanekvMetrics
from lanekv.runtime.status import Refusal, refusals
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY
from lanekv.transfer.protocol.contract import LayoutContract, Topology
from lanekv.transfer.protocol.manifest import Manifest

log = logging.getLogger("lanekv.prefill")
Code = grpc.StatusCode
# The failure cause of a refused Prefill, by its status; any other refusal is bad input.
_CAUSES = {
    Code.RESOURCE_EXHAUSTED: "out_of_pages",
    Code.UNAVAILABLE: "rank_died",
    Code.DEADLINE_EXCEEDED: "deadline",
}


class _Timeouts(Protocol):
    request_timeout_s: float  # a Prefill without a client deadline waits this long


class PrefillHost(Protocol):
    """What the service needs of the prefill daemon."""

    epoch: str
    contract: LayoutContract
    topology: Topology
    relays: list[tuple[str, ...]]  # each rank's sender relays
    metrics: LanekvMetrics
    tokenizer: Tokenizer | None
    vocab_size: int
    max_tokens: int
    cache: PrefillPrefixCache
    grammars: Grammars | None
    config: _Timeouts  # the daemon's DaemonConfig

    def submit(self, inp: PrefillInput) -> tuple[str, futures.Future, futures.Future]: ...

    def ranks_down(self, reason: str) -> None: ...


class PrefillServicer(lanekv_pb2_grpc.PrefillServiceServicer):
    def __init__(self, daemon: PrefillHost) -> None:
        self.d = daemon

    def Prefill(self, request, context):
        d, request_id = self.d, None
        start = time.perf_counter()
        with refusals(context):
            try:
                request_id = request_id_from_proto(request)
                _, _, done = self._submit(request, request_id)
                res = self._result(done, context.time_remaining())
            except Refusal as refusal:
                self._refused(refusal, request_id)
                raise
            reply = self._reply(res)
        # FetchKV and Release of this request carry it back with the capability
        # (``access_ticket``; the reply message has no field for the epoch).
        context.set_trailing_metadata(((EPOCH_METADATA_KEY, d.epoch),))
        self._done(res, start)
        return reply

    def PrefillStream(self, request, context):
        """First the pages (once every rank can stream them, layer by layer as they
        are written), then the whole reply when the prefill is done."""
        d, request_id = self.d, None
        start = time.perf_counter()
        with refusals(context):
            try:
                request_id = request_id_from_proto(request)
                _, started, done = self._submit(request, request_id)
                remaining = context.time_remaining()
                futures.wait((started, done), remaining or d.config.request_timeout_s, futures.FIRST_COMPLETED)
                # FetchKV and Release of this request carry it back.
                context.send_initial_metadata(((EPOCH_METADATA_KEY, d.epoch),))
                if started.done():
                    yield lanekv_pb2.PrefillProgress(reply=self._reply(started.result()), done=False)
                res = self._result(done, context.time_remaining())
            except Refusal as refusal:
                self._refused(refusal, request_id)
                raise
            reply = self._reply(res)
        self._done(res, start)
        yield lanekv_pb2.PrefillProgress(reply=reply, done=True)

    def _reply(self, res: PrefillResult) -> lanekv_pb2.PrefillReply:
        d = self.d
        manifest = Manifest(res.request_id, res.page_size, res.num_tokens,
                            tuple((p.page, p.owner, p.valid_rows) for p in res.pages))
        return lanekv_pb2.PrefillReply(
            request_id=res.request_id,
            first_token=res.first_token,
            contract_fingerprint=d.contract.fingerprint,
            manifest=manifest.encode(),
            endpoints=list(d.topology.endpoints),
            timings=res.timings,
            capability=res.capability or "",
            cached_tokens=res.prefix_len,
            prefix_cache_pages=res.prefix_cache_pages,
            first_logprob=None if res.first_logprobs is None else logprob_to_proto(
                res.first_token, *res.first_logprobs, lanekv_pb2.TokenLogprob),
            prompt_logprobs=[logprob_to_proto(*lp, lanekv_pb2.TokenLogprob) for lp in res.prompt_logprobs or ()],
            relays=[lanekv_pb2.RankRelays(endpoints=list(r)) for r in d.relays] if any(d.relays) else [],
        )

    def _refused(self, refusal: Refusal, request_id: str | None) -> None:
        cause = _CAUSES.get(refusal.code, "invalid_argument")
        self.d.metrics.failures.labels(cause=cause).inc()
        log.warning("prefill failed request_id=%s cause=%s code=%s: %s", request_id or "-", cause,
                    refusal.code.name, refusal.message, extra={"request_id": request_id})

    def _done(self, res: PrefillResult, start: float) -> None:
        d = self.d
        d.metrics.tokens.labels(kind="prompt").inc(res.num_tokens - res.prefix_len)
        d.metrics.tokens.labels(kind="generated").inc()  # the first token, sampled here
        log.info("prefill done request_id=%s prompt_tokens=%d pages=%d seconds=%.4f", res.request_id,
                 res.num_tokens, len(res.pages), time.perf_counter() - start,
                 extra={"request_id": res.request_id})

    def _submit(self, request, request_id: str | None) -> tuple[str, futures.Future, futures.Future]:
        d = self.d
        ids = prompt_from_proto(request, d.tokenizer, d.vocab_size, d.max_tokens)
        # The caller's cached pages: it fetches only the pages after them. Its last page
        # is always prefilled here (the first token is sampled from its last token).
        usable = d.cache.usable_pages(len(ids))
        if request.cached_pages > usable:
            raise Refusal(Code.INVALID_ARGUMENT, f"cached_pages={request.cached_pages} is more than the "
                          f"{usable} whole pages before the prompt's last token ({len(ids)} tokens)")
        sampling = sampling_from_proto(request.sampling)
        return d.submit(PrefillInput(ids, sampling, (), request_id,
                                     prefix_cache=not request.skip_prefix_cache,
                                     prompt_logprobs=prompt_logprobs_from_proto(request),
                                     first_mask=first_mask(d.grammars, sampling)))

    def _result(self, done: futures.Future, remaining: float | None) -> PrefillResult:
        d = self.d
        try:
            return done.result(timeout=remaining or d.config.request_timeout_s)
        except OutOfPagesError as err:
            raise Refusal(Code.RESOURCE_EXHAUSTED, f"prefill pool: {err}") from err
        except RankDiedError as err:
            d.ranks_down(str(err))
            raise Refusal(Code.UNAVAILABLE, f"prefill ranks are down: {err}") from err
        except futures.TimeoutError as err:
            raise Refusal(Code.DEADLINE_EXCEEDED, "prefill did not finish within the deadline") from err


def first_mask(grammars: Grammars | None, sampling: SamplingParams) -> bytes | None:
    """The first token's bitmask of a request with a grammar (compiled here: a spec that
    does not compile is INVALID_ARGUMENT before any page is taken); None without one."""
    if sampling.grammar is None:
        return None
    if grammars is None:
        raise Refusal(Code.INVALID_ARGUMENT, "sampling.grammar: structured output needs the model's "
                      "tokenizer.json, which this prefill daemon has not")
    try:
        return grammars.first_mask(sampling.grammar)
    except ValueError as err:
        raise Refusal(Code.INVALID_ARGUMENT, f"sampling.{err}") from None
