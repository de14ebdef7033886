"""Structured-output fields of a request body -> one ``GrammarSpec``, or a 400 naming the field.

Both endpoints take, as vLLM names them:

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``;
- ``guided_json`` (a schema, as an object or JSON text), ``guided_regex``,
  ``guided_grammar`` (EBNF, xgrammar's dialect), ``guided_choice`` (strings);
- ``structured_outputs``: an object with one of ``json``, ``regex``,
  ``grammar``, ``choice`` or ``json_object: true``.

At most one of them per request. Anything else vLLM takes there
(``guided_decoding_backend``, ``guided_whitespace_pattern``, ``structural_tag``,
``structured_outputs.whitespace_pattern``, ...) is refused by name. The spec is
parsed here without a tokenizer (``check_syntax``), so a schema, regex or
grammar xgrammar cannot read is a 400 naming the field before any daemon
sees the request; the daemons compile it against their tokenizers.
"""

from __future__ import annotations

import json
from typing import Any

from lanekv.http.errors import bad_field
from lanekv.model.grammar import GrammarSpec, check_syntax

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
          "structured_outputs")
# structured_outputs' keys and the kind each gives.
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
                   "json_object": "json_object"}
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def grammar_from_body(body: dict[str, Any]) -> tuple[GrammarSpec | None, str | None]:
    """The request's grammar and the field that gave it, or ``(None, None)``."""
    found = []
    for name in FIELDS:
        value = body.get(name)
        if value is None:
            continue
        spec, field = _parse(name, value)
        if spec is not None:
            found.append((spec, field))
    if len(found) > 1:
        raise bad_field(found[1][1], f"give one structured-output field; {found[0][1]} is given already")
    if not found:
        return None, None
    spec, field = found[0]
    try:
        check_syntax(spec)
    except ValueError as err:
        raise bad_field(field, str(err)) from None
    return spec, field


def _parse(name: str, value: Any) -> tuple[GrammarSpec | None, str]:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar",
            "guided_choice": "choice"}[name]
    return _spec(kind, value, name), name


def _response_format(value: Any) -> tuple[GrammarSpec | None, str]:
    if not isinstance(value, dict):
        raise bad_field("response_format", f"must be an object, got {_show(value)}")
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise bad_field(f"response_format.{extra[0]}", "is not supported by this server")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return GrammarSpec("json_object"), "response_format"
    if kind != "json_schema":
        raise bad_field("response_format.type", f"must be text, json_object or json_schema, got {_show(kind)}")
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise bad_field("response_format.json_schema", f"must be an object, got {_show(inner)}")
    for key in inner:
        if key not in JSON_SCHEMA_KEYS:
            raise bad_field(f"response_format.json_schema.{key}", "is not supported by this server")
    if "strict" in inner and inner["strict"] is not None and not isinstance(inner["strict"], bool):
        raise bad_field("response_format.json_schema.strict", f"must be true or false, got {_show(inner['strict'])}")
    field = "response_format.json_schema.schema"
    return _spec("json_schema", inner.get("schema"), field), field


def _structured_outputs(value: Any) -> tuple[GrammarSpec | None, str]:
    if not isinstance(value, dict):
        raise bad_field("structured_outputs", f"must be an object, got {_show(value)}")
    given = [(k, v) for k, v in value.items() if v is not None and v is not False]
    for key, _ in given:
        if key not in STRUCTURED_KEYS:
            raise bad_field(f"structured_outputs.{key}", "is not supported by this server")
    if len(given) > 1:
        raise bad_field(f"structured_outputs.{given[1][0]}",
                        f"give one of {', '.join(STRUCTURED_KEYS)}; {given[0][0]} is given already")
    if not given:
        return None, "structured_outputs"
    key, inner = given[0]
    field = f"structured_outputs.{key}"
    if key == "json_object":
        if inner is not True:
            raise bad_field(field, f"must be true or false, got {_show(inner)}")
        return GrammarSpec("json_object"), field
    return _spec(STRUCTURED_KEYS[key], inner, field), field


def _spec(kind: str, value: Any, field: str) -> GrammarSpec:
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as err:
                raise bad_field(field, f"is not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise bad_field(field, f"must be a JSON schema object, got {_show(value)}")
        text = json.dumps(value, ensure_ascii=False)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise bad_field(field, f"must be a non-empty array of non-empty strings, got {_show(value)}")
        text = json.dumps(value, ensure_ascii=False)
    else:
        if not isinstance(value, str) or not value:
            raise bad_field(field, f"must be a non-empty string, got {_show(value)}")
        text = value
    try:
        return GrammarSpec(kind, text)
    except ValueError as err:
        raise bad_field(field, str(err)) from None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
