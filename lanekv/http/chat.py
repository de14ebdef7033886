"""Chat messages -> prompt text, through the checkpoint's own chat template.

The template comes from ``chat_template.jinja`` or, without it,
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named
templates of which ``default`` is taken). It renders as transformers'
``apply_chat_template`` renders it: a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, loop controls, the ``generation`` tag,
``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps non-ASCII
text; the template sees ``messages``, ``add_generation_prompt``, the
tokenizer's named special tokens as strings and the request's
``chat_template_kwargs``. The text is then tokenized without adding special
tokens (the template writes them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lanekv.http.errors import bad_field

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (it marks assistant text
    for training masks, which serving does not need)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One checkpoint's compiled chat template and the special tokens it may use."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as err:
            raise ValueError(f"chat_template does not compile: {err}") from err
        self.special_tokens = dict(special_tokens)

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The template of checkpoint folder ``path``; None when it has none."""
        path = Path(path)
        config = _read_config(path)
        if (path / TEMPLATE_FILE).exists():
            source = (path / TEMPLATE_FILE).read_text(encoding="utf-8")
        else:
            source = _template_of(config.get("chat_template"), path / CONFIG_FILE)
            if source is None:
                return None
        return cls(source, _special_tokens(config))

    @classmethod
    def from_flag(cls, value: str, path: str | Path) -> ChatTemplate:
        """``--chat-template``: a file holding a template, or the template itself (text
        with a Jinja ``{{`` or ``{%``); the special tokens come from checkpoint ``path``."""
        file = Path(value)
        try:
            is_file = file.is_file()
        except OSError:  # a template too long to be a path
            is_file = False
        if is_file:
            try:
                source = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise ValueError(f"chat_template={value!r} is not a readable text file: {err}") from err
        elif "{{" in value or "{%" in value:
            source = value
        else:
            raise ValueError(f"chat_template={value!r} is neither a file nor a Jinja template")
        return cls(source, _special_tokens(_read_config(Path(path))))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt text; a template that refuses the conversation is a 400 on ``messages``."""
        # The request's own variables win over kwargs of the same name (the protocol refuses those).
        variables = {**self.special_tokens, **kwargs}
        for name in ("messages", "add_generation_prompt", "tools", "documents"):
            variables.pop(name, None)
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as err:
            raise bad_field("messages", f"the chat template refused them: {err}") from err
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise bad_field("messages", f"the chat template failed on them: {type(err).__name__}: "
                            f"{err}") from err


def _read_config(path: Path) -> dict[str, Any]:
    if not (path / CONFIG_FILE).exists():
        return {}
    try:
        return json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path / CONFIG_FILE} is not readable JSON: {err}") from err


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _template_of(value: Any, where: Path) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{where}: chat_template must be a string or a list of named templates "
                     "with a 'default'")
