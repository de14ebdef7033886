"""Request fields: each bad one is a 400 naming it; stop strings are never returned."""

from __future__ import annotations

import pytest

from lanekv.http.errors import APIError
from lanekv.http.generate import StopMatcher
from lanekv.http.protocol import Sampling, parse_chat, parse_completion

OK = {"model": "m", "prompt": "w5"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "w5"}]}


def _refused(parse, body) -> APIError:
    with pytest.raises(APIError) as err:
        parse(body)
    assert err.value.status == 400
    assert err.value.body()["error"]["type"] == "invalid_request_error"
    return err.value


@pytest.mark.parametrize(("change", "param"), [
    ({"model": None}, "model"),
    ({"model": 3}, "model"),
    ({"n": 2}, "n"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": True}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"stop": 7}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["w5", "w6"]}, "prompt"),
    ({"prompt": [3, -1]}, "prompt"),
    ({"prompt": {"text": "w5"}}, "prompt"),
    ({"echo": "yes"}, "echo"),
    ({"echo": False, "max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"guided_json": {"type": "nope"}}, "guided_json"),  # a schema xgrammar cannot compile
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
    ({"no_such_field": 1}, "no_such_field"),
])
def test_completion_field_refused(change, param):
    err = _refused(parse_completion, {**OK, **change})
    assert err.param == param
    assert err.message.startswith(f"{param}: ")
    assert "\n" not in err.message


@pytest.mark.parametrize(("change", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": 5}]},
     "messages[1].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "grammar"}}, "response_format.type"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
])
def test_chat_field_refused(change, param):
    assert _refused(parse_chat, {**CHAT, **change}).param == param


def test_body_must_be_an_object():
    assert _refused(parse_completion, ["w5"]).param == "body"


def test_values_parsed():
    req = parse_completion({**OK, "prompt": [[5, 6, 7]], "temperature": 0, "top_k": -1, "seed": 0,
                            "max_tokens": 9.0, "stop": "w9", "stop_token_ids": [2], "stream": True,
                            "stream_options": {"include_usage": True}, "n": 1, "user": "ignored"})
    assert req.prompt == (5, 6, 7)
    c = req.common
    assert c.sampling == Sampling(temperature=0.0, top_p=1.0, top_k=0, seed=0)
    assert (c.max_tokens, c.stop, c.stop_token_ids, c.stream, c.include_usage) == (9, ("w9",), (2,), True, True)
    chat = parse_chat({**CHAT, "max_completion_tokens": 5, "tool_choice": "none",
                       "response_format": {"type": "text"},
                       "messages": [{"role": "assistant", "content": None, "name": "a"}]})
    assert chat.common.max_tokens == 5
    assert chat.messages == ({"role": "assistant", "name": "a"},)  # None keys dropped
    assert chat.add_generation_prompt is True


def _run(stops, pieces):
    m, out = StopMatcher(tuple(stops)), []
    for piece in pieces:
        out.append(m.feed(piece))
        if m.hit:
            break
    else:
        out.append(m.flush())
    return out, m.hit


def test_stop_matcher_holds_only_possible_starts():
    out, hit = _run(["w9 w10"], ["w1", " w9", " w2", " w9", " w10", " w11"])
    # " w9" could start the stop string: held until the next piece says it does not.
    assert out == ["w1", " ", "w9 w2", " ", ""] and hit


def test_stop_matcher_no_stop_returns_everything():
    out, hit = _run(["zz"], ["a", "b", "z"])
    assert "".join(out) == "abz" and not hit
    assert _run([], ["a", "b"]) == (["a", "b", ""], False)


def test_stop_matcher_earliest_of_several_and_inside_one_piece():
    out, hit = _run(["cd", "b"], ["abcdef"])
    assert out == ["a"] and hit
    out, hit = _run(["xyz"], ["ax", "y", "zq"])
    assert "".join(out) == "a" and hit
