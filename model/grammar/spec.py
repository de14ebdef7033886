"""What a request's output must match: a grammar named by its kind and its text.

A ``GrammarSpec`` is plain data (it travels in ``SamplingParams``, in the
gRPC requests from the front to the decode daemon and from the decode daemon
to the prefill daemon, and to the prefill ranks). Kinds, as vLLM names its
structured-output fields:

- ``json_schema``: a JSON schema, as JSON text; ``json_object``: any JSON object (text empty);
- ``regex``: a regular expression the whole output matches;
- ``grammar``: an EBNF grammar (xgrammar's GBNF dialect, root rule ``root``);
- ``choice``: one of a list of strings, as a JSON array of strings.

``check_syntax`` parses the spec without a tokenizer (the HTTP front's check,
so a bad spec is a 400 before any daemon sees it); ``model.grammar.matcher``
compiles it against a tokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar longer than this is refused
MAX_CHOICES = 1024
# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:123: "; clients get the rest.
# A string character in xgrammar's printed EBNF: its bounded strings' class, and JSON's.
_LAX_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_CHAR = '[^\\0-\\x1f\\"\\\\]'
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind {self.kind!r} must be one of {', '.join(KINDS)}")
        if not isinstance(self.text, str):
            raise TypeError(f"grammar text must be a str, got {type(self.text).__name__}")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"grammar ({self.kind}) has {len(self.text)} characters, "
                             f"at most {MAX_GRAMMAR_CHARS}")
        if self.kind == "json_object" and self.text:
            raise ValueError("grammar kind json_object takes no text")
        if self.kind != "json_object" and not self.text:
            raise ValueError(f"grammar ({self.kind}) is empty")

    def choices(self) -> list[str]:
        """A ``choice`` spec's strings (ValueError when the text is not a JSON array of them)."""
        try:
            values = json.loads(self.text)
        except ValueError:
            values = None
        if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
            raise ValueError(f"grammar (choice) must be a JSON array of non-empty strings, got {self.text[:80]!r}")
        if len(values) > MAX_CHOICES:
            raise ValueError(f"grammar (choice) has {len(values)} strings, at most {MAX_CHOICES}")
        return values

    def ebnf_of_choices(self) -> str:
        """The ``choice`` spec as an EBNF grammar: ``root ::= "a" | "b"``."""
        # JSON string escapes are those of the EBNF's string literals (\\", \\\\, \\n, \\uXXXX).
        return "root ::= " + " | ".join(json.dumps(v, ensure_ascii=True) for v in self.choices())


def error_text(err: BaseException) -> str:
    """xgrammar's error message without its source location, on one line."""
    lines = [_LOCATION.sub("", line).strip() for line in str(err).splitlines()]
    return " ".join(line for line in lines if line) or type(err).__name__


def grammar_of(spec: GrammarSpec):
    """The spec as an ``xgrammar.Grammar`` (no tokenizer needed); ValueError naming the
    kind and xgrammar's reason when it does not parse."""
    import xgrammar as xgr

    ebnf = spec.ebnf_of_choices() if spec.kind == "choice" else spec.text
    try:
        if spec.kind == "json_schema":
            json.loads(spec.text)  # xgrammar's message on bad JSON quotes the whole text
            return _strict_strings(xgr.Grammar.from_json_schema(spec.text, **JSON_FORMAT))
        if spec.kind == "json_object":
            return _strict_strings(xgr.Grammar.from_json_schema('{"type": "object"}', **JSON_FORMAT,
                                                                 strict_mode=False))
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        return xgr.Grammar.from_ebnf(ebnf)
    except ValueError as err:
        raise ValueError(f"grammar ({spec.kind}) does not compile: {error_text(err)}") from None
    except RuntimeError as err:
        raise ValueError(f"grammar ({spec.kind}) does not compile: {error_text(err)}") from None


def _strict_strings(grammar):
    """``grammar`` with JSON's rule for string characters everywhere: xgrammar's strings of
    bounded length admit raw control characters other than CR and LF, which JSON (and
    every strict parser) refuses; its unbounded strings exclude U+0000-U+001F already."""
    import xgrammar as xgr

    text = str(grammar)
    return xgr.Grammar.from_ebnf(text.replace(_LAX_CHAR, _JSON_CHAR)) if _LAX_CHAR in text else grammar


def check_syntax(spec: GrammarSpec) -> None:
    """ValueError when ``spec`` does not parse (see ``grammar_of``)."""
    grammar_of(spec)


# JSON is generated compact, with the separators of json.dumps (", " and ": "): a
# grammar that allows any whitespace lets a model emit whitespace forever.
JSON_FORMAT = {"any_whitespace": False}
