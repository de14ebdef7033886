"""echo's pieces without daemons: the prompt's text and entries, their reply shape, and the
gRPC field that asks for prompt logprobs."""

from __future__ import annotations

import grpc
import pytest
from lanekv.proto import lanekv_pb2
from lanekv.runtime.requests import prompt_logprobs_from_proto
from lanekv.runtime.status import Refusal

from lanekv.http.echo import Echo
from lanekv.http.errors import APIError
from lanekv.http.generate import TokenLogprob
from lanekv.http.replies import ReplyShape


def _text(token: int) -> str:
    return f"<{token}>"


def test_the_prompt_comes_first_with_a_null_first_entry():
    echo = Echo.of((4, 5, 6), (4, 5, 6), 0, None, _text)
    assert (echo.text, echo.only) == ("<4><5><6>", True)
    assert Echo.of("w4 w5", (1, 4, 5), 3, None, _text).text == "w4 w5"  # a text prompt as given
    assert Echo.of((4, 5), (4, 5), 3, lambda ids: "decoded", _text).text == "decoded"
    scored = (TokenLogprob(5, -1.5, ((7, -0.5),)), TokenLogprob(6, -2.0, ((6, -2.0),)))
    entries = echo.entries(scored)
    shape = ReplyShape(False, "r", "m", 0, logprobs=True, token_text=_text)
    lp = shape.logprobs_of([*entries, TokenLogprob(9, -0.1, ((9, -0.1),))])
    assert lp["tokens"] == ["<4>", "<5>", "<6>", "<9>"]
    assert lp["token_logprobs"] == [None, -1.5, -2.0, -0.1]
    assert lp["top_logprobs"] == [None, {"<7>": -0.5, "<5>": -1.5}, {"<6>": -2.0}, {"<9>": -0.1}]
    assert lp["text_offset"] == [0, 3, 6, 9]
    with pytest.raises(APIError) as err:
        echo.entries(scored[:1])  # one prompt token short
    assert err.value.status == 502


def test_the_grpc_field_is_checked():
    assert prompt_logprobs_from_proto(lanekv_pb2.GenerateRequest()) is None
    assert prompt_logprobs_from_proto(lanekv_pb2.GenerateRequest(has_prompt_logprobs=True)) == 0
    assert prompt_logprobs_from_proto(lanekv_pb2.PrefillRequest(prompt_logprobs=5, has_prompt_logprobs=True)) == 5
    with pytest.raises(Refusal) as err:
        prompt_logprobs_from_proto(lanekv_pb2.GenerateRequest(prompt_logprobs=21, has_prompt_logprobs=True))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in err.value.message
