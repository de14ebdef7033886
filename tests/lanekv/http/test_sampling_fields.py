"""Every request field of both OpenAI schemas and of vLLM's extras is honoured or refused by name.

The field lists come from the installed ``openai`` package's request types, so
a field the client learns is checked here the day it appears.
"""

from __future__ import annotations

import typing

import pytest
from openai.types.chat.completion_create_params import CompletionCreateParamsBase as ChatParams
from openai.types.completion_create_params import CompletionCreateParamsBase as CompletionParams

from lanekv.http.errors import APIError
from lanekv.http.protocol import DEFAULTS_ONLY, HONOURED, parse_chat, parse_completion

BASE = {"completion": {"model": "tiny", "prompt": "w5 w6"},
        "chat": {"model": "tiny", "messages": [{"role": "user", "content": "w5"}]}}
PARSE = {"completion": parse_completion, "chat": parse_chat}
# A value that asks for something, for each field lanekv runs.
VALUES = {
    "temperature": 0.5, "top_p": 0.5, "top_k": 7, "min_p": 0.2, "seed": 3, "max_tokens": 4,
    "max_completion_tokens": 4, "stop": ["w9"], "stop_token_ids": [3], "stream": True,
    "stream_options": {"include_usage": True}, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "repetition_penalty": 1.3, "logit_bias": {"5": 2.0}, "min_tokens": 2, "ignore_eos": True,
    "logprobs": 3, "top_logprobs": 3, "add_generation_prompt": False,
    "chat_template_kwargs": {"x": 1}, "echo": True, "n": 1, "best_of": 1, "user": "u", "safety_identifier": "s",
    # structured output (lanekv/http/grammar.py)
    "response_format": {"type": "json_object"}, "guided_json": {"type": "object"}, "guided_regex": "a+",
    "guided_choice": ["a", "b"], "guided_grammar": 'root ::= "a"', "structured_outputs": {"regex": "a+"},
}
# Fields that name the caller and change nothing (accepted, with no effect to check).
IDENTIFIERS = {"user", "safety_identifier", "n", "best_of"}
# vLLM's and SGLang's request extras (sampling params, structured output and the rest).
EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
          "length_penalty", "use_beam_search", "include_stop_str_in_output", "skip_special_tokens",
          "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "bad_words",
          "prompt_logprobs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs",
          "response_format", "add_special_tokens", "priority", "logits_processors",
          "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
          "vllm_xargs", "request_id", "echo", "continue_final_message", "documents", "chat_template",
          "mm_processor_kwargs", "regex", "ebnf", "json_schema", "no_stop_trim", "lora_path",
          "session_params", "separate_reasoning", "stream_reasoning", "rid", "return_hidden_states")


def _fields(kind: str) -> set[str]:
    params = CompletionParams if kind == "completion" else ChatParams
    return set(typing.get_type_hints(params)) | {"stream"} | set(EXTRAS)


def _asking(name: str) -> object:
    """A value of a field lanekv does not run that asks for something."""
    if name in DEFAULTS_ONLY["both"]:
        default = DEFAULTS_ONLY["both"][name]
        return (not default) if isinstance(default, bool) else 5
    return {"echo": True, "store": True, "modalities": ["audio"], "tool_choice": "required",
            "response_format": {"type": "json_object"}}.get(name, {"type": "x", "value": 1})


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_every_field_is_honoured_or_refused(kind: str) -> None:
    base = BASE[kind]
    baseline = PARSE[kind](base)
    honoured, refused = [], []
    for name in sorted(_fields(kind) - set(base)):
        body = {**base, name: VALUES[name] if name in HONOURED[kind] else _asking(name)}
        if name == "top_logprobs" or (kind == "chat" and name == "logprobs"):
            body["logprobs"] = True
        if name == "stream_options":
            body["stream"] = True
        try:
            parsed = PARSE[kind](body)
        except APIError as err:
            assert err.status == 400 and err.param == name, (name, err.message)
            assert err.message.startswith(f"{name}: ")
            refused.append(name)
            continue
        assert name in HONOURED[kind], f"{name} accepted but not listed as honoured"
        if name not in IDENTIFIERS:
            assert parsed != baseline, f"{name} accepted but changed nothing"
        honoured.append(name)
    assert {"logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "min_p",
            "repetition_penalty", "min_tokens", "ignore_eos", "seed"} <= set(honoured)
    assert {"prompt_logprobs"} <= set(refused)
    assert {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
            "structured_outputs"} <= set(honoured)
    assert {"guided_decoding_backend", "guided_whitespace_pattern", "regex", "ebnf"} <= set(refused)
    # echo (with prompt logprobs) runs on completions; chat has no such field in OpenAI's schema.
    assert ("echo" in honoured) == (kind == "completion") and ("echo" in refused) == (kind == "chat")


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_fields_at_their_default_are_accepted(kind: str) -> None:
    for name, default in {**DEFAULTS_ONLY["both"], **DEFAULTS_ONLY[kind]}.items():
        PARSE[kind]({**BASE[kind], name: default})


def test_sampling_values_reach_the_request() -> None:
    req = parse_completion({**BASE["completion"], "logit_bias": {"5": 2, "7": -1.5}, "min_p": 0.1,
                            "repetition_penalty": 1.2, "min_tokens": 3, "ignore_eos": True,
                            "presence_penalty": -0.5, "frequency_penalty": 0.25, "logprobs": 0})
    s = req.common.sampling
    assert s.logit_bias == ((5, 2.0), (7, -1.5)) and (s.min_p, s.repetition_penalty) == (0.1, 1.2)
    assert (s.min_tokens, s.ignore_eos, s.presence_penalty, s.frequency_penalty, s.logprobs) == (
        3, True, -0.5, 0.25, 0)
    chat = parse_chat({**BASE["chat"], "logprobs": True})
    assert chat.common.sampling.logprobs == 0
    assert parse_chat({**BASE["chat"], "logprobs": True, "top_logprobs": 4}).common.sampling.logprobs == 4
    assert parse_chat({**BASE["chat"], "logprobs": False}).common.sampling.logprobs is None


def test_echo_asks_for_prompt_logprobs_and_allows_max_tokens_0() -> None:
    """lm-eval's loglikelihood shape: echo, logprobs, max_tokens 0 (or 1), temperature 0, seed."""
    shape = {**BASE["completion"], "prompt": [[5, 6, 7]], "echo": True, "logprobs": 1, "temperature": 0,
             "seed": 1234}
    req = parse_completion({**shape, "max_tokens": 0})
    assert (req.echo, req.common.max_tokens, req.prompt_logprobs, req.prompt) == (True, 0, 1, (5, 6, 7))
    assert parse_completion({**shape, "max_tokens": 1}).common.max_tokens == 1
    assert parse_completion({**shape, "logprobs": None}).prompt_logprobs is None  # the text alone
    assert parse_completion({**shape, "echo": False}).prompt_logprobs is None
    with pytest.raises(APIError) as err:
        parse_completion({**shape, "echo": False, "max_tokens": 0})
    assert err.value.param == "max_tokens"
