"""Generate's replies: events queued while a reply was on its way go out in one
reply (a client slower than the step gets fewer, fuller replies), and the text
of a batch is what its tokens add, decoded once."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest
from lanekv.decode.detokenize import Detokenizer
from lanekv.decode.engine import TokenEvent
from lanekv.decode.generate import _ABANDONED, GenerateCall, GeneratePipeline
from lanekv.decode.service import _reply
from lanekv.model.tokenizer import load_tokenizer
from lanekv.runtime.status import Refusal

from tests.checkpoints import write_llama


def _pipeline() -> GeneratePipeline:
    return GeneratePipeline(SimpleNamespace(stopping=threading.Event()))


def _call(*items) -> GenerateCall:
    events = queue.SimpleQueue()
    for item in items:
        events.put(item)
    return GenerateCall(spec=None, events=events)


def _event(step: int, finished: bool = False) -> TokenEvent:
    return TokenEvent("r", 10 + step, step, finished, "length" if finished else None)


def test_queued_events_go_out_in_one_reply():
    call = _call(_event(1), _event(2), _event(3, finished=True))
    assert list(_pipeline()._events(call)) == [[_event(1), _event(2), _event(3, True)]]


def test_events_taken_one_by_one_when_the_client_keeps_up():
    call = _call()
    batches = _pipeline()._events(call)
    call.events.put(_event(1))
    assert next(batches) == [_event(1)]
    call.events.put(_event(2, finished=True))
    assert next(batches) == [_event(2, True)]
    with pytest.raises(StopIteration):
        next(batches)


def test_a_control_item_ends_the_batch_then_the_call():
    batches = _pipeline()._events(_call(_event(1), _event(2), _ABANDONED, _event(3)))
    assert next(batches) == [_event(1), _event(2)]
    with pytest.raises(Refusal, match="client went away"):
        next(batches)


def test_batched_text_equals_the_pieces(tmp_path):
    tokenizer = load_tokenizer(write_llama(tmp_path / "m", tokenizer=True))
    ids = [5, 77, 120, 3, 250, 9, 31, 200, 14]
    one_by_one = Detokenizer(tokenizer)
    pieces = "".join(one_by_one.piece(t) for t in ids)
    batched = Detokenizer(tokenizer)
    reply = _reply("r", [TokenEvent("r", t, i, i == len(ids) - 1, None) for i, t in enumerate(ids[:4])],
                   batched)
    rest = _reply("r", [TokenEvent("r", t, i, True, "stop") for i, t in enumerate(ids[4:])], batched)
    assert list(reply.token_ids) == ids[:4] and list(rest.token_ids) == ids[4:]
    assert reply.text + rest.text == pieces == tokenizer.decode(ids)
    assert rest.finished and rest.finish_reason == "stop"
