"""``DecodeService.Generate`` as a gRPC servicer: proto <-> values and status mapping.

A request is parsed into a ``GenerateSpec`` (INVALID_ARGUMENT, OUT_OF_RANGE
for lengths past the model's positions) and run by ``decode.generate``'s
pipeline; each engine event goes back as one ``GenerateReply`` with its text
piece, and a ``Refusal`` of any step becomes the call's status. The call's end
is counted with the status it ended with (a client that left sets none itself).
"""

from __future__ import annotations

import uuid

import grpc
from lanekv.decode.detokenize import Detokenizer
from lanekv.decode.engine import TokenEvent
from lanekv.decode.generate import GenerateCall, GenerateContext, GeneratePipeline, GenerateSpec
from lanekv.model.grammar import RequestGrammar
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.requests import (
    logprob_to_proto,
    prompt_from_proto,
    prompt_logprobs_from_proto,
    request_id_from_proto,
    sampling_from_proto,
)
from lanekv.runtime.status import Refusal, left_code, refusals

Code = grpc.StatusCode
MAX_STOP_TOKEN_IDS = 1024


def parse_request(request: lanekv_pb2.GenerateRequest, ctx: GenerateContext) -> GenerateSpec:
    ids = prompt_from_proto(request, ctx.tokenizer, ctx.vocab_size, ctx.max_positions)
    sampling = sampling_from_proto(request.sampling)
    request_id = request_id_from_proto(request) or uuid.uuid4().hex
    max_new = request.max_new_tokens
    prompt_logprobs = prompt_logprobs_from_proto(request)
    if max_new < 1 and prompt_logprobs is None:  # 0: the prompt's logprobs alone
        raise Refusal(Code.INVALID_ARGUMENT, f"max_new_tokens must be >= 1 (0 only with has_prompt_logprobs), "
                      f"got {max_new}")
    if len(ids) + max_new > ctx.max_positions:
        raise Refusal(
            Code.OUT_OF_RANGE,
            f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) is more than the model's "
            f"{ctx.max_positions} positions",
        )
    stops = tuple(request.stop_token_ids)
    if len(stops) > MAX_STOP_TOKEN_IDS:
        raise Refusal(Code.INVALID_ARGUMENT, f"stop_token_ids: {len(stops)} ids, at most {MAX_STOP_TOKEN_IDS}")
    bad = [t for t in stops if not 0 <= t < ctx.vocab_size]
    if bad:
        raise Refusal(
            Code.INVALID_ARGUMENT, f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {ctx.vocab_size})"
        )
    try:
        sampling.check_vocab(ctx.vocab_size)
    except ValueError as err:
        raise Refusal(Code.INVALID_ARGUMENT, f"sampling: {err}") from None
    # Prefill's first token honours min_tokens: it needs the stop ids too.
    forwarded = lanekv_pb2.SamplingParams()
    forwarded.CopyFrom(request.sampling)
    forwarded.stop_token_ids.extend(t for t in stops if t not in set(forwarded.stop_token_ids))
    return GenerateSpec(request_id, ids, sampling, forwarded, max_new, stops, prompt_logprobs,
                        _grammar(sampling, ctx))


def _grammar(sampling, ctx: GenerateContext) -> RequestGrammar | None:
    """The request's matcher (compiled against our tokenizer before the prefill is asked),
    or None without a grammar; INVALID_ARGUMENT naming the field when it does not compile."""
    if sampling.grammar is None:
        return None
    if ctx.grammars is None:
        raise Refusal(Code.INVALID_ARGUMENT, "sampling.grammar: structured output needs the model's "
                      "tokenizer.json, which this decode daemon has not")
    try:
        return ctx.grammars.matcher(sampling.grammar)
    except ValueError as err:
        raise Refusal(Code.INVALID_ARGUMENT, f"sampling.{err}") from None


class DecodeServicer(lanekv_pb2_grpc.DecodeServiceServicer):
    def __init__(self, ctx: GenerateContext) -> None:
        self._ctx = ctx
        self._pipeline = GeneratePipeline(ctx)

    def Generate(self, request, context):
        """Stream the output tokens, each reply holding those decoded since the last
        one (one token while the client keeps up); the last says finished and why."""
        call: GenerateCall | None = None
        try:
            with refusals(context):
                spec = parse_request(request, self._ctx)
                call = self._pipeline.open(spec)
                text = Detokenizer(self._ctx.tokenizer)
                events = self._pipeline.run(call, context)
                try:
                    first = True
                    for batch in events:
                        reply = _reply(spec.request_id, batch, text)
                        if first:  # counted once, on the first reply
                            reply.cached_tokens, first = call.cached_tokens, False
                            reply.prefix_cache_tokens = call.prefix_cache_tokens
                            reply.prompt_logprobs.extend(call.prompt_logprobs or ())
                        yield reply
                finally:
                    events.close()  # settles the call now, also when the client went away
        finally:
            outcome = "refused" if call is None else call.outcome
            self._pipeline.close(call, *_ended_with(context, outcome))


    def Status(self, request, context):
        """Whether a Generate can be served now; when not, why (the prefill daemons' problems)."""
        prefills = [lanekv_pb2.PrefillDaemonStatus(endpoint=e, healthy=h, problem="" if h else p or "out of the pick")
                    for e, h, p in self._ctx.prefills.states()]
        problem = ""
        if self._ctx.stopping.is_set():
            problem = "the decode daemon is stopping"
        elif not any(p.healthy for p in prefills):
            problem = "no prefill daemon can take a prompt (" + "; ".join(
                f"prefill {p.endpoint}: {p.problem}" for p in prefills) + ")"
        return lanekv_pb2.DecodeStatusReply(serving=not problem, problem=problem, prefills=prefills)


def _reply(request_id: str, batch: list[TokenEvent], text: Detokenizer) -> lanekv_pb2.GenerateReply:
    ids = [event.token_id for event in batch if event.token_id is not None]
    last = batch[-1]
    logprobs = [logprob_to_proto(e.token_id, e.logprobs.logprob, e.logprobs.top, lanekv_pb2.TokenLogprob)
                for e in batch if e.token_id is not None and e.logprobs is not None]
    return lanekv_pb2.GenerateReply(
        request_id=request_id,
        token_ids=ids,
        text=text.pieces(ids),
        finished=last.finished,
        finish_reason=last.finish_reason or "",
        logprobs=logprobs,
    )


def _ended_with(context: grpc.ServicerContext | None, outcome: str) -> tuple[grpc.StatusCode, str]:
    """The status a call that did not finish ends with; a client that left sets none itself."""
    if context is None or outcome == "finished":
        return Code.OK, ""
    code, details = context.code(), context.details() or ""
    if isinstance(details, bytes):
        details = details.decode("utf-8", "replace")
    if outcome == "cancelled" and code in (None, Code.CANCELLED):
        # gRPC ends a call whose deadline passed as it ends one the client left.
        if left_code(context) == Code.DEADLINE_EXCEEDED:
            return Code.DEADLINE_EXCEEDED, "the client's deadline passed"
        return Code.CANCELLED, details or "the client went away"
    return (Code.UNKNOWN if code is None else code), details
