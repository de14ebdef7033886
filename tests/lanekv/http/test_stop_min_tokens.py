"""Stop strings and ``min_tokens`` (vLLM's semantics): a stop string completed by the first
``min_tokens - 1`` tokens does not stop the request; one completed later does, and the text
that could begin one is never returned before it is known."""

from __future__ import annotations

import asyncio

import grpc
from lanekv.proto import lanekv_pb2

from lanekv.http.generate import Generation, Plan, StopMatcher
from lanekv.http.protocol import Sampling

PIECES = ["a", " STOP", " b", " STOP", " c", " d"]  # token i decodes to PIECES[i]


def _decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


class _Call:
    def __init__(self, replies: list[lanekv_pb2.GenerateReply]) -> None:
        self._replies = list(replies)
        self.cancelled = False

    async def read(self):
        return self._replies.pop(0) if self._replies else grpc.aio.EOF

    def cancel(self) -> None:
        self.cancelled = True


class _Backends:
    def done(self, member) -> None:
        pass


def _run(min_tokens: int, batches: list[list[int]], stop: tuple[str, ...] = (" STOP",),
         decode=_decode) -> tuple[str, str | None, int]:
    """The text, finish reason and completion tokens of a generation whose daemon sends
    ``batches`` of tokens (the last one finished by length)."""
    replies = [lanekv_pb2.GenerateReply(token_ids=b, text=_decode(b), finished=i == len(batches) - 1,
                                        finish_reason="length" if i == len(batches) - 1 else "")
               for i, b in enumerate(batches)]
    plan = Plan("r", (1, 2), sum(map(len, batches)), Sampling(min_tokens=min_tokens), stop)
    generation = Generation(_Backends(), plan, 5.0, decode)
    call = _Call(replies[1:])
    generation._call, generation._first = call, replies[0]

    async def collect():
        parts, reason = [], None
        async for delta in generation.deltas():
            parts.append(delta.text)
            reason = delta.finish_reason or reason
        return "".join(parts), reason

    text, reason = asyncio.run(collect())
    return text, reason, generation.completion_tokens


def test_a_stop_string_inside_min_tokens_does_not_stop():
    one_by_one = [[i] for i in range(6)]
    assert _run(0, one_by_one) == ("a", "stop", 2)
    assert _run(2, one_by_one) == ("a", "stop", 2)  # the 2nd token completes it: it counts
    assert _run(3, one_by_one) == ("a STOP b", "stop", 4)  # the 1st is inside min_tokens
    assert _run(5, one_by_one) == ("a STOP b STOP c d", "length", 6)


def test_batched_replies_find_where_min_tokens_ends():
    # One reply carries the tokens on both sides of the bound.
    assert _run(3, [[0, 1, 2, 3], [4, 5]]) == ("a STOP b", "stop", 4)
    assert _run(3, [[0], [1, 2, 3, 4, 5]]) == ("a STOP b", "stop", 4)
    # Without a tokenizer, a reply that reaches min_tokens counts as before the bound.
    assert _run(3, [[0, 1], [2], [3], [4, 5]], decode=None) == ("a STOP b", "stop", 4)


def test_the_matcher_holds_back_a_possible_stop_while_unarmed():
    stops = StopMatcher(("XY",), armed_at=None)
    assert stops.feed("aXY b X") == "aXY b "  # "X" could begin a stop string: held back
    stops.arm(stops.length)
    assert stops.feed("Y c") == ""
    assert stops.hit and stops.stop_end == len("aXY b XY")
    # A stop string ending exactly at the bound does not count; one past it does.
    late = StopMatcher(("XY",), armed_at=None)
    assert late.feed("aXY") == "aXY"
    late.arm(3)
    assert late.feed("Z") == "Z" and not late.hit
    assert late.feed("XY") == "" and late.hit and late.stop_end == len("aXYZXY")
