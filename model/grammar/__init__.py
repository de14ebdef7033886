"""Structured output: grammar specs (``spec``) and xgrammar's matchers over a tokenizer (``matcher``)."""

from lanekv.model.grammar.matcher import (
    Grammars,
    RequestGrammar,
    bitmask_words,
    fill_bitmasks,
    masks_from_bytes,
)
from lanekv.model.grammar.spec import KINDS, GrammarSpec, check_syntax

__all__ = ["KINDS", "GrammarSpec", "Grammars", "RequestGrammar", "bitmask_words", "check_syntax",
           "fill_bitmasks", "masks_from_bytes"]
