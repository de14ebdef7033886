"""One request's generation: a Generate call on a decode daemon, as text deltas.

``Generation.start`` picks a daemon and waits for its first reply, so every
refusal before the first token (bad request, full pool, daemon gone) is an
HTTP status rather than an error inside a stream. A daemon that answers
UNAVAILABLE before any token is left out and the next one is tried; after the
first token a failure ends the request with the daemon's status.

Stop strings are matched on the detokenized text as it grows: text that could
still begin a stop string is held back, the stop string and all after it are
never returned, and the Generate call is cancelled at the match. Cancelling
(``cancel``, or the task being cancelled) cancels the gRPC call, which the
daemon notices at once and frees the request's pages.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import NamedTuple

import grpc

from lanekv.http.backends import Backend, Backends
from lanekv.http.errors import APIError, from_grpc
from lanekv.http.protocol import Sampling
from lanekv.proto import lanekv_pb2

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class Plan:
    """What to generate, checked against the model already."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int | None = None  # top tokens of each prompt token's logprob (echo); None: none

    def proto(self) -> lanekv_pb2.GenerateRequest:
        s = self.sampling
        sampling = lanekv_pb2.SamplingParams(
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed or 0,
            has_seed=s.seed is not None, min_p=s.min_p, repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens, ignore_eos=s.ignore_eos,
            logprobs=s.logprobs or 0, has_logprobs=s.logprobs is not None,
            grammar_kind=s.grammar.kind if s.grammar else "", grammar=s.grammar.text if s.grammar else "")
        return lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=self.prompt_ids),
                                          sampling=sampling, max_new_tokens=self.max_tokens,
                                          stop_token_ids=self.stop_token_ids, request_id=self.request_id,
                                          prompt_logprobs=self.prompt_logprobs or 0,
                                          has_prompt_logprobs=self.prompt_logprobs is not None)


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float | None  # None: the first prompt token's (echo), which nothing precedes
    top: tuple[tuple[int, float], ...] | None  # (token id, logprob), most likely first


class Delta(NamedTuple):
    text: str
    finish_reason: str | None  # set on the last delta only
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens whose text this delta carries


class StopMatcher:
    """Text in, text safe to send out; ``hit`` once a stop string appeared.

    ``armed_at``: a stop string counts only if it ends past this character (None: none
    counts yet; ``arm`` sets it). With ``min_tokens``, vLLM's semantics: the text of the
    first ``min_tokens - 1`` tokens cannot complete a stop string, and text that could
    begin one is held back all the same, so none is returned before it is known.
    """

    def __init__(self, stops: tuple[str, ...], armed_at: int | None = 0) -> None:
        self._stops = stops
        self._text = ""
        self._sent = 0
        self.armed_at = armed_at
        self.hit = False
        self.stop_end = 0  # once hit: the character just past the stop string that was found

    @property
    def length(self) -> int:
        """Characters fed so far."""
        return len(self._text)

    def arm(self, at: int) -> None:
        """Stop strings ending past character ``at`` count from now on."""
        self.armed_at = at

    def _find(self, stop: str) -> int:
        """Where the first occurrence of ``stop`` that counts begins, or -1."""
        if self.armed_at is None:
            return -1
        return self._text.find(stop, max(self._sent, self.armed_at - len(stop) + 1))

    def feed(self, piece: str) -> str:
        self._text += piece
        if not self._stops:
            return self._take(len(self._text))
        found = [(i, i + len(s)) for s in self._stops if (i := self._find(s)) >= 0]
        if found:
            self.hit = True
            at, self.stop_end = min(found)
            return self._take(at)
        return self._take(len(self._text) - self._held())

    def flush(self) -> str:
        return "" if self.hit else self._take(len(self._text))

    def _held(self) -> int:
        """Characters at the end that could be the start of a stop string."""
        tail = len(self._text) - self._sent
        for k in range(min(tail, max(len(s) for s in self._stops) - 1), 0, -1):
            end = self._text[-k:]
            if any(s.startswith(end) for s in self._stops):
                return k
        return 0

    def _take(self, upto: int) -> str:
        out = self._text[self._sent:upto] if upto > self._sent else ""
        self._sent = max(self._sent, upto)
        return out


class Generation:
    def __init__(self, backends: Backends, plan: Plan, timeout_s: float,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self._backends, self.plan, self._timeout_s = backends, plan, timeout_s
        # Turns token ids into text, to count only the tokens up to a stop string when one
        # reply carried several (the daemon batches replies for a slow reader).
        self._decode = decode
        self._token_ids: list[int] = []
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._member: Backend | None = None
        self._first: lanekv_pb2.GenerateReply | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0  # the first reply's: prompt tokens a prefix cache spared
        self.prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the first reply's, when the plan asks
        self.endpoint = ""

    async def start(self) -> None:
        """Start the call on a daemon and wait for its first reply; raises ``APIError``."""
        backends, request, tried = self._backends, self.plan.proto(), []
        last: APIError | None = None
        while True:
            try:
                member = backends.pick(exclude=tried, prompt_ids=self.plan.prompt_ids)
            except APIError:
                if last is not None:
                    raise last from None
                raise
            call = member.stub.Generate(request, timeout=self._timeout_s, metadata=backends.metadata)
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as err:
                backends.done(member)
                last = from_grpc(err.code(), err.details(), member.endpoint)
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise last from None
                backends.lost(member, f"Generate {err.code().name}: {err.details()}")
                tried.append(member)
                continue
            except BaseException:  # cancelled while waiting: the call goes too
                call.cancel()
                backends.done(member)
                raise
            self._call, self._member, self.endpoint = call, member, member.endpoint
            if first is grpc.aio.EOF:
                self._end()
                raise APIError(502, f"decode daemon {member.endpoint} ended the stream without a reply")
            # What its prefix cache holds of the prompt now: remembered, the rest forgotten.
            backends.observe(member, self.plan.prompt_ids, first.prefix_cache_tokens)
            self._first = first
            self.cached_tokens = first.cached_tokens
            self.prompt_logprobs = _logprobs(first.prompt_logprobs)
            return

    def _count_to(self, stop_end: int, in_reply: int) -> None:
        """Usage counts the tokens up to the one that completed the stop string."""
        if self._decode is None or in_reply <= 1:
            return
        before = len(self._token_ids) - in_reply
        for k in range(1, in_reply):
            if len(self._decode(self._token_ids[:before + k])) >= stop_end:
                self.completion_tokens = before + k
                return

    def _armed_at(self, before: int, chars_before: int, piece: str) -> int:
        """Characters of the text of the first ``min_tokens - 1`` tokens, known once a reply
        (``piece``, after ``before`` tokens and ``chars_before`` characters) reached
        ``min_tokens``: a stop string ending past them may stop the request (vLLM checks
        stop strings once min_tokens tokens were made)."""
        upto = self.plan.sampling.min_tokens - 1
        if upto <= before:
            return chars_before
        if self._decode is not None:
            return len(self._decode(self._token_ids[:upto]))
        return chars_before + len(piece)  # no tokenizer: the whole reply counts as before the bound

    async def deltas(self) -> AsyncIterator[Delta]:
        """The text as it comes; the last delta carries the finish reason. Raises ``APIError``."""
        if self._first is None:
            raise RuntimeError("Generation.deltas before start")
        min_tokens = self.plan.sampling.min_tokens
        stops, reply, ended = StopMatcher(self.plan.stop, 0 if min_tokens <= 1 else None), self._first, False
        pending: list[TokenLogprob] = []  # logprobs of tokens whose text is held back
        try:
            while True:
                if reply is grpc.aio.EOF:
                    raise APIError(502, f"decode daemon {self.endpoint} ended the stream unfinished")
                before = self.completion_tokens
                self.completion_tokens += len(reply.token_ids)
                self._token_ids.extend(reply.token_ids)
                pending += _logprobs(reply.logprobs)
                if stops.armed_at is None and self.completion_tokens >= min_tokens:
                    stops.arm(self._armed_at(before, stops.length, reply.text))
                text = stops.feed(reply.text)
                if stops.hit:
                    self._count_to(stops.stop_end, len(reply.token_ids))
                    kept = len(pending) - (before + len(reply.token_ids) - self.completion_tokens)
                    yield Delta(text, "stop", tuple(pending[:max(kept, 0)]))
                    return
                if reply.finished:
                    if reply.finish_reason not in FINISH_REASONS:
                        raise APIError(500, f"decode daemon {self.endpoint} ended the request: "
                                       f"{reply.finish_reason or 'no reason given'}")
                    ended = True  # the daemon has let the request go
                    yield Delta(text + stops.flush(), reply.finish_reason, tuple(pending))
                    return
                if text or pending:
                    yield Delta(text, None, tuple(pending))
                    pending = []
                try:
                    reply = await self._call.read()
                except grpc.aio.AioRpcError as err:
                    if err.code() == grpc.StatusCode.UNAVAILABLE:
                        self._backends.lost(self._member, f"Generate {err.code().name}: {err.details()}")
                    raise from_grpc(err.code(), err.details(), self.endpoint) from None
        finally:
            self._end(cancel=not ended)

    def cancel(self) -> None:
        """Cancel the Generate call (the daemon frees the request); safe at any time."""
        if self._call is not None:
            self._call.cancel()

    def _end(self, cancel: bool = True) -> None:
        if self._call is None:
            return
        if cancel:
            self._call.cancel()  # after the finish a no-op; before it, the daemon stops the request
        self._call = None
        self._backends.done(self._member)


def _logprobs(entries) -> tuple[TokenLogprob, ...]:
    """``lanekv.v1.TokenLogprob`` messages -> ``TokenLogprob``s."""
    return tuple(TokenLogprob(lp.token_id, lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs)))
                 for lp in entries)


async def wait_disconnect(receive) -> None:
    """Returns once the HTTP client has gone (ASGI ``http.disconnect``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(work: asyncio.Future, receive) -> bool:
    """Await ``work`` unless the client goes first (then ``work`` is cancelled); True if it went."""
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work in done:
        work.result()
        return False
    work.cancel()
    try:
        await work
    except (asyncio.CancelledError, APIError):
        pass
    return True
