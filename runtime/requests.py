"""Proto request fields -> the project's own values, shared by both daemons.

Everything here is untrusted input: a bad field becomes a ``Refusal`` with
INVALID_ARGUMENT (or OUT_OF_RANGE for a prompt longer than the model allows)
naming the field and the value.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError
from lanekv.model.grammar.spec import GrammarSpec
from lanekv.model.sampling import MAX_LOGPROBS, SamplingParams
from lanekv.model.tokenizer import Tokenizer
from lanekv.runtime.limits import same_kind
from lanekv.runtime.status import Refusal
from lanekv.transfer.protocol.wire import MAX_REQUEST_ID_LEN

Code = grpc.StatusCode
# A generous bound on characters per token, to refuse absurd texts before tokenizing.
MAX_CHARS_PER_TOKEN = 64
def sampling_from_proto(msg) -> SamplingParams:
    """``lanekv.v1.SamplingParams`` -> ``SamplingParams`` (all-zero message = greedy)."""
    try:
        return SamplingParams(
            temperature=float(msg.temperature),
            top_k=int(msg.top_k),
            top_p=float(msg.top_p) if msg.top_p else 1.0,
            seed=int(msg.seed) if msg.has_seed else None,
            min_p=float(msg.min_p),
            repetition_penalty=float(msg.repetition_penalty) if msg.repetition_penalty else 1.0,
            presence_penalty=float(msg.presence_penalty),
            frequency_penalty=float(msg.frequency_penalty),
            logit_bias=tuple(sorted((int(k), float(v)) for k, v in msg.logit_bias.items())),
            min_tokens=int(msg.min_tokens),
            ignore_eos=bool(msg.ignore_eos),
            stop_token_ids=tuple(sorted({int(t) for t in msg.stop_token_ids})),
            logprobs=int(msg.logprobs) if msg.has_logprobs else None,
            grammar=GrammarSpec(msg.grammar_kind, msg.grammar) if msg.grammar_kind else None,
        )
    except (TypeError, ValueError) as err:
        raise Refusal(Code.INVALID_ARGUMENT, f"sampling: {err}") from err


def sampling_to_proto(params: SamplingParams, message_class):
    return message_class(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed or 0,
        has_seed=params.seed is not None,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        stop_token_ids=params.stop_token_ids,
        logprobs=params.logprobs or 0,
        has_logprobs=params.logprobs is not None,
        grammar_kind=params.grammar.kind if params.grammar else "",
        grammar=params.grammar.text if params.grammar else "",
    )


def logprob_to_proto(token_id: int, logprob: float, top, message_class):
    """One token's logprobs (``top``: (id, logprob) pairs) as ``lanekv.v1.TokenLogprob``."""
    return message_class(token_id=token_id, logprob=logprob, top_ids=[t for t, _ in top],
                         top_logprobs=[v for _, v in top])


def prompt_logprobs_from_proto(request) -> int | None:
    """``prompt_logprobs`` of a Prefill or Generate request: None unless
    ``has_prompt_logprobs``; else the top tokens per prompt token, 0..MAX_LOGPROBS."""
    if not request.has_prompt_logprobs:
        return None
    if request.prompt_logprobs > MAX_LOGPROBS:
        raise Refusal(Code.INVALID_ARGUMENT,
                      f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {request.prompt_logprobs}")
    return int(request.prompt_logprobs)


def prompt_from_proto(request, tokenizer: Tokenizer | None, vocab_size: int, max_tokens: int) -> list[int]:
    """The prompt's token ids, from ``text`` (needs a tokenizer) or ``token_ids``."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise Refusal(Code.INVALID_ARGUMENT, "prompt: give text or token_ids")
    if which == "text":
        # Refuse before tokenizing: a huge text would cost seconds of CPU first.
        if len(request.text) > max_tokens * MAX_CHARS_PER_TOKEN:
            raise Refusal(
                Code.OUT_OF_RANGE,
                f"prompt.text: {len(request.text)} characters cannot fit the {max_tokens} tokens this daemon accepts",
            )
        if tokenizer is None:
            raise Refusal(
                Code.INVALID_ARGUMENT, "prompt.text: this model has no tokenizer.json; send token_ids"
            )
        ids = tokenizer.encode(request.text)
    else:
        ids = list(request.token_ids.ids)
    if not ids:
        raise Refusal(Code.INVALID_ARGUMENT, "prompt: it has no tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise Refusal(
            Code.INVALID_ARGUMENT, f"prompt.token_ids: {bad[0]} is outside the vocabulary [0, {vocab_size})"
        )
    if len(ids) > max_tokens:
        raise Refusal(
            Code.OUT_OF_RANGE, f"prompt: {len(ids)} tokens, more than the {max_tokens} this daemon accepts"
        )
    return ids


def request_id_from_proto(request) -> str | None:
    if not request.HasField("request_id"):
        return None
    rid = request.request_id
    if not rid or len(rid) > MAX_REQUEST_ID_LEN or not rid.isprintable():
        raise Refusal(
            Code.INVALID_ARGUMENT,
            f"request_id must be 1..{MAX_REQUEST_ID_LEN} printable characters, got {rid!r:.80}",
        )
    return rid


class _Unparsable(NamedTuple):
    """Stands for a request message that did not parse, until the handler refuses it."""

    error: str


class MalformedRequestInterceptor(grpc.ServerInterceptor):
    """Refuse request bytes that are not the method's protobuf message with INVALID_ARGUMENT.

    gRPC itself answers such a call with INTERNAL ('Exception deserializing
    request!'), the code of a server bug. Install it inside any interceptor
    that counts calls, so those see the refusal's code.
    """

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method

        def lenient(data: bytes) -> Any:
            try:
                return parse(data)
            except DecodeError as err:
                return _Unparsable(str(err))

        if handler.response_streaming:
            behavior, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
        else:
            behavior, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler

        def checked(request: Any, context: grpc.ServicerContext, *args: Any, **kwargs: Any) -> Any:
            if isinstance(request, _Unparsable):
                context.abort(Code.INVALID_ARGUMENT, f"{method}: the request does not parse: {request.error}")
            return behavior(request, context, *args, **kwargs)

        return make(same_kind(checked, behavior), request_deserializer=lenient,
                    response_serializer=handler.response_serializer)
