"""OpenAI request bodies -> the front's own values, every field checked.

A bad field is an ``APIError`` 400 whose ``param`` names it (the OpenAI
shape). Every field is either implemented (``HONOURED``: OpenAI's and the
vLLM extras lanekv runs: ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ...), accepted only at its
default (``DEFAULTS_ONLY``: asking for nothing this front does not do), or
refused: a field this front does not know is a 400 naming it, never silently
ignored (vLLM's and SGLang's other extras included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from lanekv.http.errors import bad_field
from lanekv.http.grammar import FIELDS as GRAMMAR_FIELDS
from lanekv.http.grammar import grammar_from_body
from lanekv.model.grammar import GrammarSpec

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_SEED = 2**64 - 1
MAX_LOGIT_BIAS = 300
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_COMPLETION_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI's own limit is 5)
# Fields both endpoints run (user and safety_identifier only identify the caller).
_COMMON = ("model", "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop",
           "stop_token_ids", "stream", "stream_options", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "user", "safety_identifier")
_COMMON += GRAMMAR_FIELDS  # structured output (lanekv/http/grammar.py)
HONOURED = {
    "completion": frozenset((*_COMMON, "prompt", "logprobs", "best_of", "echo")),
    "chat": frozenset((*_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs",
                       "add_generation_prompt", "chat_template_kwargs")),
}
# Fields accepted only while they hold their default (what the front does), or None.
DEFAULTS_ONLY = {
    "completion": {"suffix": None},
    "chat": {"echo": False, "tools": None, "tool_choice": None, "functions": None, "function_call": None,
             "audio": None, "modalities": None, "prediction": None,
             "parallel_tool_calls": None, "metadata": None, "store": False, "service_tier": None,
             "reasoning_effort": None, "verbosity": None, "web_search_options": None,
             "prompt_cache_key": None, "prompt_cache_retention": None, "prompt_cache_options": None,
             "moderation": None},
    "both": {"skip_special_tokens": True, "spaces_between_special_tokens": True,
             "include_stop_str_in_output": False, "use_beam_search": False, "best_of": 1},
}
# Template variables the request itself sets: chat_template_kwargs may not name them.
TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "tools", "documents")
# Values of those fields that ask for nothing this front does not do.
HARMLESS = {"tool_choice": ("none", "auto"), "modalities": (["text"],)}


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut
    seed: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each token's logprob and the k most likely
    grammar: GrammarSpec | None = None  # structured output


@dataclass(frozen=True)
class Common:
    """The fields completions and chat completions share."""

    model: str
    max_tokens: int | None  # None: the endpoint's default
    sampling: Sampling
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    stream: bool
    include_usage: bool
    max_tokens_field: str = "max_tokens"  # the name the client gave the bound (errors name it)


@dataclass(frozen=True)
class CompletionRequest:
    common: Common
    prompt: str | tuple[int, ...]
    # The prompt comes back before the output (with its logprobs when ``logprobs`` is set);
    # ``max_tokens: 0`` is allowed with it: the prompt alone (``lanekv.http.echo``).
    echo: bool = False

    @property
    def prompt_logprobs(self) -> int | None:
        """Top tokens of each prompt token's logprob the reply needs (echo + logprobs), or None."""
        return self.common.sampling.logprobs if self.echo else None


@dataclass(frozen=True)
class ChatRequest:
    common: Common
    messages: tuple[dict[str, Any], ...]
    add_generation_prompt: bool
    template_kwargs: dict[str, Any]

    @property
    def text_chars(self) -> int:
        """Characters of the messages' text (bounded before the template renders them)."""
        return sum(len(part) for m in self.messages for part in _texts(m.get("content")))


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    echo = _bool(body, "echo", False)
    zero = body.get("max_tokens")
    if echo and not isinstance(zero, bool) and zero in (0, 0.0):
        # echo with max_tokens 0 (lm-eval's loglikelihood): the prompt and its logprobs only.
        return CompletionRequest(replace(_common({**body, "max_tokens": 1}, "completion"), max_tokens=0),
                                 _prompt(body.get("prompt")), echo)
    common = _common(body, "completion")
    return CompletionRequest(common, _prompt(body.get("prompt")), echo)


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    common = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", f"must be a non-empty array of messages, got {_show(messages)}")
    checked = tuple(_message(i, m) for i, m in enumerate(messages))
    add = _bool(body, "add_generation_prompt", True)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise bad_field("chat_template_kwargs", f"must be an object, got {_show(kwargs)}")
    for name in TEMPLATE_ARGUMENTS:
        if name in kwargs:
            raise bad_field(f"chat_template_kwargs.{name}", f"is set by the request itself; give "
                            f"{'it as a top-level field' if name == 'add_generation_prompt' else 'messages'}"
                            " instead")
    return ChatRequest(common, checked, add, kwargs)


# -- fields -------------------------------------------------------------------


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_field("body", f"must be a JSON object, got {_show(body)}")
    return body


def _common(body: dict[str, Any], kind: str) -> Common:
    defaults = {**DEFAULTS_ONLY["both"], **DEFAULTS_ONLY[kind]}
    for name in body:
        if name not in HONOURED[kind] and name not in defaults:
            raise bad_field(name, "is not supported by this server")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_field("model", f"must be a non-empty string, got {_show(model)}")
    for name in ("n", "best_of"):
        value = body.get(name, 1)
        if value is not None and (not _is_int(value) or value != 1):
            raise bad_field(name, f"only {name}=1 is supported (one choice per request), got {_show(value)}")
    for name, default in defaults.items():
        value = body.get(name)
        if value is None or value == default or value in ({}, []) or value in HARMLESS.get(name, ()):
            continue
        raise bad_field(name, f"is not supported by this server, got {_show(value)}")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad_field("top_p", "must be in (0, 1], got 0")
    top_k = _int(body, "top_k", 0, -1, 2**31 - 1)
    seed = _int(body, "seed", None, 0, MAX_SEED)
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    repetition = _number(body, "repetition_penalty", 1.0, 0.0, 1e6)
    if repetition == 0:
        raise bad_field("repetition_penalty", "must be > 0, got 0")
    presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    min_tokens = _int(body, "min_tokens", 0, 0, 2**31 - 1)
    ignore_eos = _bool(body, "ignore_eos", False)
    logprobs = _logprobs(body, kind)
    grammar, grammar_field = grammar_from_body(body)
    if grammar is not None and min_tokens:
        raise bad_field("min_tokens", f"cannot be combined with {grammar_field}: the grammar decides "
                        "where the output ends")
    max_tokens = _int(body, "max_tokens", None, 1, 2**31 - 1)
    max_completion = _int(body, "max_completion_tokens", None, 1, 2**31 - 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad_field("max_completion_tokens",
                        f"{max_completion} disagrees with max_tokens={max_tokens}; give one")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_field("stream_options", f"must be an object, got {_show(options)}")
        if not stream:
            raise bad_field("stream_options", "is only allowed with stream=true")
        include_usage = _bool(options, "include_usage", False, prefix="stream_options.")
    return Common(
        model=model,
        max_tokens=max_completion if max_completion is not None else max_tokens,
        max_tokens_field="max_completion_tokens" if max_completion is not None else "max_tokens",
        sampling=Sampling(temperature, top_p, max(top_k, 0), seed, min_p, repetition, presence, frequency,
                          _logit_bias(body.get("logit_bias")), min_tokens, ignore_eos, logprobs, grammar),
        stop=_stop(body.get("stop")),
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids")),
        stream=stream,
        include_usage=include_usage,
    )


def _logprobs(body: dict[str, Any], kind: str) -> int | None:
    """Chat: ``logprobs`` true/false and ``top_logprobs`` 0..20; completions: ``logprobs`` 0..20."""
    if kind == "completion":
        return _int(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    top = _int(body, "top_logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    if not _bool(body, "logprobs", False):
        if top is not None:
            raise bad_field("top_logprobs", "needs logprobs=true")
        return None
    return top or 0


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad_field("logit_bias", f"must be an object of token id -> bias, got {_show(bias)}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_field("logit_bias", f"{len(bias)} entries, at most {MAX_LOGIT_BIAS}")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if token < 0 or str(token) != str(key).strip():
            raise bad_field("logit_bias", f"keys must be token ids, got {_show(key)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_field("logit_bias", f"bias of token {token} must be a number in [-100, 100], "
                            f"got {_show(value)}")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _prompt(prompt: Any) -> str | tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_field("prompt", "must not be empty")
        return _unicode("prompt", prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(t < 0 for t in prompt):
            raise bad_field("prompt", f"token ids must be >= 0, got {min(prompt)}")
        return tuple(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_field("prompt", f"a batch of {len(prompt)} prompts is not supported; send one per request")
    raise bad_field("prompt", f"must be a non-empty string or array of token ids, got {_show(prompt)}")


def _message(i: int, message: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad_field(where, f"must be an object, got {_show(message)}")
    role = message.get("role")
    if role not in ROLES:
        raise bad_field(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {_show(role)}")
    content = message.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise bad_field(f"{where}.content[{j}]",
                                f"only text parts are supported, got {_show(part)}")
            _unicode(f"{where}.content[{j}].text", part["text"])
    elif content is None:
        if role != "assistant":
            raise bad_field(f"{where}.content", f"is required for role {role!r}")
    elif not isinstance(content, str):
        raise bad_field(f"{where}.content", f"must be a string or an array of text parts, got {_show(content)}")
    else:
        _unicode(f"{where}.content", content)
    # As transformers does: keys holding None are dropped (templates test for presence).
    return {k: v for k, v in message.items() if v is not None}


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_field("stop", f"must be a string or an array of strings, got {_show(stop)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_field("stop", f"{len(stops)} strings, at most {MAX_STOP_STRINGS}")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad_field("stop", f"each string must have 1..{MAX_STOP_CHARS} characters, got {_show(s)}")
        _unicode("stop", s)
    return tuple(dict.fromkeys(stops))


def _stop_token_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
        raise bad_field("stop_token_ids", f"must be an array of token ids >= 0, got {_show(ids)}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad_field("stop_token_ids", f"{len(ids)} ids, at most {MAX_STOP_TOKEN_IDS}")
    return tuple(ids)


def _unicode(field: str, text: str) -> str:
    """``text`` if it is valid Unicode; JSON's escapes can carry lone surrogates (``\\ud800``),
    which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise bad_field(field, f"holds a lone surrogate {text[err.start]!r} at character {err.start}; "
                        "send valid Unicode") from None
    return text


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value) or not low <= value <= high:
        raise bad_field(name, f"must be an integer in [{low}, {high}], got {_show(value)}")
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise bad_field(name, f"must be a number in [{low:g}, {high:g}], got {_show(value)}")
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_field(prefix + name, f"must be true or false, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    """A short rendering of a client's value for an error line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
