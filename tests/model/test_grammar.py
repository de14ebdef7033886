"""Grammar specs and xgrammar's matchers over a byte-level tokenizer (model/grammar/).

The first token's mask is what prefill applies: a regex that forces its first
character leaves only the tokens that spell it. A matcher driven by the masks
only (the most likely allowed token under random logits) always produces text
that matches the spec, and ends on the model's end-of-sequence token.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from lanekv.model.grammar import (
    Grammars,
    GrammarSpec,
    check_syntax,
    fill_bitmasks,
    masks_from_bytes,
)
from lanekv.model.grammar.spec import MAX_GRAMMAR_CHARS
from lanekv.model.sampling import SamplingParams, sample_full, unpack_bitmask

from lanekv.tiny_model import _tokenizer
from tests.checkpoints import EOS_TOKEN_ID, VOCAB_SIZE

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tag": {"enum": ["red", "green"]}}, "required": ["name", "age", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer(VOCAB_SIZE)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, VOCAB_SIZE, (EOS_TOKEN_ID,))


def test_spec_checks():
    with pytest.raises(ValueError, match="grammar kind 'yaml'"):
        GrammarSpec("yaml", "x")
    with pytest.raises(ValueError, match=r"grammar \(regex\) is empty"):
        GrammarSpec("regex", "")
    with pytest.raises(ValueError, match="json_object takes no text"):
        GrammarSpec("json_object", "{}")
    with pytest.raises(ValueError, match="at most"):
        GrammarSpec("regex", "a" * (MAX_GRAMMAR_CHARS + 1))
    with pytest.raises(ValueError, match=r"grammar \(choice\) must be a JSON array"):
        check_syntax(GrammarSpec("choice", '["a", 3]'))
    with pytest.raises(ValueError, match=r"min_tokens=2 cannot be combined with structured output"):
        SamplingParams(min_tokens=2, grammar=GrammarSpec("json_object"))
    assert not SamplingParams(grammar=GrammarSpec("json_object")).plain


@pytest.mark.parametrize("spec, reason", [
    (GrammarSpec("json_schema", '{"type": "nope"}'), 'Unsupported type "nope"'),
    (GrammarSpec("json_schema", "{not json"), "does not compile"),
    (GrammarSpec("regex", "[a-z"), "Unclosed"),
    (GrammarSpec("grammar", "root ::= missing"), 'Rule "missing" is not defined'),
])
def test_specs_that_do_not_compile_say_why(spec, reason, grammars):
    with pytest.raises(ValueError, match=re.escape(f"grammar ({spec.kind}) does not compile")) as err:
        check_syntax(spec)
    assert reason in str(err.value) and "/project/" not in str(err.value)
    with pytest.raises(ValueError, match=re.escape(reason)):
        grammars.compile(spec)


def _allowed(mask: torch.Tensor) -> list[int]:
    return unpack_bitmask(mask.view(1, -1), VOCAB_SIZE)[0].nonzero().flatten().tolist()


def test_first_mask_of_a_forced_regex(grammars, tokenizer):
    mask = masks_from_bytes([grammars.first_mask(GrammarSpec("regex", r"Q[0-9]{2}")), None], grammars.words)
    allowed = _allowed(mask[0])
    assert allowed and all(tokenizer.decode([t]) == "Q" for t in allowed)
    assert _allowed(mask[1]) == list(range(VOCAB_SIZE))  # no grammar: every token
    # Applied by the sampler: the forced token wins against logits that favour another.
    logits = torch.zeros(2, VOCAB_SIZE)
    logits[:, 50] = 30.0
    out = sample_full(logits, [SamplingParams(grammar=GrammarSpec("regex", "Q[0-9]{2}")), SamplingParams()], 0,
                      bitmask=mask)
    assert out.tokens.tolist() == [allowed[0], 50]


SPECS = [
    (GrammarSpec("json_schema", json.dumps(SCHEMA)), "schema"),
    (GrammarSpec("json_object"), "object"),
    (GrammarSpec("regex", r"(yes|no)-[a-c]{1,3}"), r"(yes|no)-[a-c]{1,3}"),
    (GrammarSpec("choice", json.dumps(["alpha", "beta \"q\"", "gamma"])), None),
    (GrammarSpec("grammar", 'root ::= "x" ("+" "x"){0,3}'), r"x(\+x){0,3}"),
]


@pytest.mark.parametrize("spec, check", SPECS, ids=[s.kind for s, _ in SPECS])
def test_masked_generation_always_matches(spec, check, grammars, tokenizer):
    """Random logits, the allowed token with the highest one each step (the mask alone
    keeps the output valid), until the matcher terminates."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(4):
        matcher = grammars.matcher(spec)
        bitmask = torch.empty((1, grammars.words), dtype=torch.int32)
        out = []
        for _ in range(200):
            fill_bitmasks([matcher], bitmask)
            logits = torch.randn(VOCAB_SIZE, generator=gen)
            if spec.kind == "json_object":  # close objects soon: a random walk nests deep
                for t in range(VOCAB_SIZE):
                    if tokenizer.decode([t]) == "}":
                        logits[t] += 2.0
            logits[~unpack_bitmask(bitmask, VOCAB_SIZE)[0]] = -float("inf")
            token = int(logits.argmax())
            assert matcher.accept(token)
            out.append(token)
            if matcher.terminated:
                break
        assert matcher.terminated and out[-1] == EOS_TOKEN_ID, (trial, tokenizer.decode(out))
        text = tokenizer.decode(out[:-1])
        if check == "schema":
            value = json.loads(text)
            assert set(value) == {"name", "age", "tag"} and len(value["name"]) <= 6
            assert 0 <= value["age"] <= 99 and value["tag"] in ("red", "green")
        elif check == "object":
            assert isinstance(json.loads(text), dict)
        elif check is None:
            assert text in json.loads(spec.text)
        else:
            assert re.fullmatch(check, text), text


def test_masks_from_bytes_checks_the_width(grammars):
    with pytest.raises(ValueError, match="grammar mask of row 0 has 4 bytes"):
        masks_from_bytes([b"\0\0\0\0"], grammars.words)
    assert masks_from_bytes([None, None], grammars.words) is None


def test_grammars_need_a_tokenizer_and_eos():
    with pytest.raises(ValueError, match="tokenizer.json"):
        Grammars(None, VOCAB_SIZE, (2,))
    with pytest.raises(ValueError, match="eos_token_id"):
        Grammars(_tokenizer(VOCAB_SIZE), VOCAB_SIZE, ())


def test_compiled_grammars_are_kept_by_spec_within_a_byte_bound(monkeypatch):
    import lanekv.model.grammar.matcher as matcher_module

    grammars = Grammars(_tokenizer(VOCAB_SIZE), VOCAB_SIZE, (EOS_TOKEN_ID,))
    a, b = GrammarSpec("regex", "a+"), GrammarSpec("regex", "b+")
    first = grammars.compile(a)
    assert grammars.compile(GrammarSpec("regex", "a+")) is first  # the same spec: compiled once
    monkeypatch.setattr(matcher_module, "CACHE_BYTES", first.memory_size_bytes)
    grammars.compile(b)  # over the bound: the least recently used goes
    assert grammars.compile(b) is grammars.compile(b) and grammars.compile(a) is not first
