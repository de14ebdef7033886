"""Structured output through the whole PD path: front -> decode -> prefill (first token
masked there) -> KV transfer -> decode (the matcher continued) -> front.

A tiny random model writes junk; under a grammar its every output must still
parse and validate, greedy and seeded-sampled, streamed or not, on both
endpoints. The first token is checked on the prefill side directly (a regex
that forces it). A spec xgrammar cannot compile, and a structured-output field
lanekv does not take, are 400s naming the field.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from lanekv.model.tokenizer import load_tokenizer
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.security import open_channel

from tests.grammar_checkpoints import write_grammar_checkpoint
from tests.lanekv.http.front import (
    AUTH,
    ENV,
    PAGE_SIZE,
    SECURITY,
    decode_daemon,
    openai_client,
    running_front,
)

pytestmark = pytest.mark.timeout(300)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 5},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "label": {"enum": ["north", "south"]}},
         "required": ["x", "label"], "additionalProperties": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_grammar_checkpoint(tmp_path_factory.mktemp("front-grammar") / "tiny")


@pytest.fixture(scope="module")
def daemons(checkpoint):
    engine = EngineConfig(str(checkpoint), cp_size=2, page_size=PAGE_SIZE, pages_per_lane=200,
                          start_timeout_s=120)
    prefill = PrefillDaemon(engine, DaemonConfig(lease_s=600, security=SECURITY))
    decode = None
    try:
        decode = decode_daemon(checkpoint, [prefill.endpoint])
        yield prefill, decode
    finally:
        if decode is not None:
            decode.stop(grace_s=1.0)
        prefill.stop()


@pytest.fixture(scope="module")
def front(checkpoint, daemons, tmp_path_factory):
    with running_front(checkpoint, [daemons[1].endpoint], tmp_path_factory.mktemp("f"), *AUTH, env=ENV) as url:
        yield url


def _valid(schema: dict, value) -> None:
    assert isinstance(value, dict) and set(value) == set(schema["required"]), value
    for key, rule in schema["properties"].items():
        v = value[key]
        if "enum" in rule:
            assert v in rule["enum"]
        elif rule["type"] == "string":
            assert isinstance(v, str) and len(v) <= rule["maxLength"]
        elif rule["type"] == "integer":
            assert isinstance(v, int) and rule["minimum"] <= v <= rule["maximum"]
        else:
            assert isinstance(v, list) and len(v) <= 2 and set(v) <= {"x", "y"}


@pytest.mark.parametrize("schema", [PERSON, POINT], ids=["person", "point"])
def test_chat_json_schema_greedy_and_sampled(front, schema):
    client = openai_client(front)
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}, {"temperature": 0.9, "seed": 11,
                                                                          "top_p": 0.9}):
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Describe someone as JSON."}], max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}},
            **sampling)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (sampling, choice.message.content)
        _valid(schema, json.loads(choice.message.content))


def test_completions_regex_choice_grammar_and_streamed_schema(front):
    client = openai_client(front)
    regex = r"[A-Z][a-z]{1,5}-[0-9]{2}"
    for seed in (None, 3):
        kw = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
        reply = client.completions.create(model="tiny", prompt="An id:", max_tokens=20,
                                          extra_body={"guided_regex": regex}, **kw)
        assert reply.choices[0].finish_reason == "stop" and re.fullmatch(regex, reply.choices[0].text)
        reply = client.completions.create(model="tiny", prompt="Pick:", max_tokens=20,
                                          extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, **kw)
        assert reply.choices[0].text in ("yes", "no", "maybe")
        reply = client.completions.create(
            model="tiny", prompt="Sum:", max_tokens=30,
            extra_body={"guided_grammar": 'root ::= num (" + " num){0,2}\nnum ::= [1-9] [0-9]?'}, **kw)
        assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){0,2}", reply.choices[0].text), reply.choices[0].text
    stream = client.completions.create(model="tiny", prompt="A point:", max_tokens=60, stream=True, seed=5,
                                       temperature=1.0, extra_body={"guided_json": POINT})
    text, reasons = "", []
    for chunk in stream:
        text += chunk.choices[0].text
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "stop"
    _valid(POINT, json.loads(text))


def test_json_object_and_a_cut_output(front):
    client = openai_client(front)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON please"}], max_tokens=120, temperature=0,
        response_format={"type": "json_object"}, logit_bias=_closing_bias())
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    # Cut by max_tokens: "length", the output a prefix of a valid one.
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON please"}], max_tokens=4, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert reply.choices[0].finish_reason == "length"
    assert '{"name": "'.startswith(reply.choices[0].message.content)


def _closing_bias() -> dict[str, float]:
    """Make '}' likely, so that the random model closes its object soon."""
    return {str(t): 8.0 for t in _token_ids_of("}")}


def _token_ids_of(text: str) -> list[int]:
    from lanekv.tiny_model import _tokenizer

    tok = _tokenizer(300)
    return [t for t in range(tok.get_vocab_size()) if tok.decode([t]) == text]


def test_first_token_is_constrained_on_the_prefill_side(checkpoint, daemons):
    """The prefill daemon's own reply: its first token is the one a forcing regex allows,
    where the unconstrained greedy token is another."""
    prefill, _ = daemons
    tok = load_tokenizer(checkpoint)
    with open_channel(prefill.endpoint, SECURITY) as channel:
        stub = lanekv_pb2_grpc.PrefillServiceStub(channel)

        def first(kind: str = "", text: str = "", rid: str = "") -> int:
            request = lanekv_pb2.PrefillRequest(
                token_ids=lanekv_pb2.TokenIds(ids=tok.encode("Say something")), request_id=rid,
                sampling=lanekv_pb2.SamplingParams(grammar_kind=kind, grammar=text))
            return stub.Prefill(request, timeout=60).first_token

        free = first(rid="free")
        forced = first("regex", "Q[0-9]+", "forced")
        assert tok.decode([forced]) == "Q" and tok.decode([free]) != "Q"
        with pytest.raises(Exception) as err:
            first("json_schema", '{"type": "nope"}', "bad")
        assert err.value.code().name == "INVALID_ARGUMENT"
        assert "sampling.grammar (json_schema) does not compile" in err.value.details()


def test_refusals_name_the_field(front):
    client = openai_client(front)
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"extra_body": {"guided_regex": "(ab"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= nothing"}}, "guided_grammar"),
        ({"extra_body": {"guided_decoding_backend": "outlines"}}, "guided_decoding_backend"),
        ({"extra_body": {"structured_outputs": {"structural_tag": "x"}}}, "structured_outputs.structural_tag"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], **kwargs)
        body = err.value.body
        assert body["param"] == param and body["message"].startswith(param), body
