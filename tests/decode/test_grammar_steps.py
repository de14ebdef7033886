"""Structured output in the decode engine: the matcher continues from prefill's first
token, each step's bitmask is applied inside the full step, and the request ends
with ``stop`` when the matcher terminates.

Every output parses and matches its spec (a tiny random model writes junk: only
the masks keep it valid), greedy and sampled, beside requests without a grammar
whose tokens must not change. The static-buffer step (the CUDA graphs' step, run
eagerly on the CPU), overlapped or not, equals the eager engine token for token;
on the GPU the captured step does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from lanekv.decode.colocated import prefill_into_pool
from lanekv.decode.cuda.graphs import DecodeGraphs
from lanekv.decode.engine import FINISH_LENGTH, FINISH_STOP, DecodeEngine
from lanekv.decode.pool import PagePool
from lanekv.model.checkpoint import load_model
from lanekv.model.grammar import Grammars, GrammarSpec, masks_from_bytes
from lanekv.model.sampling import SamplingParams
from lanekv.model.tokenizer import load_tokenizer

from tests.checkpoints import EOS_TOKEN_ID
from tests.grammar_checkpoints import write_grammar_checkpoint
from tests.markers import requires_gpu

pytestmark = pytest.mark.timeout(300)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 5},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}
ITEMS = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    "n": {"type": "number", "minimum": -5, "maximum": 5}}, "required": ["items"], "additionalProperties": False}


def _check(spec: GrammarSpec, text: str) -> None:
    if spec.kind == "json_schema":
        value = json.loads(text)
        schema = json.loads(spec.text)
        assert set(value) >= set(schema["required"]) and set(value) <= set(schema["properties"]), text
        if "name" in value:
            assert isinstance(value["name"], str) and len(value["name"]) <= 5
            assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
            assert isinstance(value["ok"], bool)
        else:
            assert 1 <= len(value["items"]) <= 3 and set(value["items"]) <= {"a", "b", "c"}
    elif spec.kind == "regex":
        assert re.fullmatch(spec.text, text), text
    elif spec.kind == "choice":
        assert text in json.loads(spec.text), text
    else:
        raise AssertionError(spec.kind)


SPECS = [GrammarSpec("json_schema", json.dumps(PERSON)), GrammarSpec("json_schema", json.dumps(ITEMS)),
         GrammarSpec("regex", r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}"), GrammarSpec("choice", '["left", "right"]')]


def _sampling(i: int) -> SamplingParams:
    """Every fourth request plain; the others a spec each, greedy or seeded-sampled."""
    if i % 4 == 3:
        return SamplingParams() if i % 8 == 3 else SamplingParams(temperature=0.8, seed=i)
    spec = SPECS[(i + i // 4) % len(SPECS)]
    if i % 2:
        return SamplingParams(temperature=1.0, top_p=0.95, seed=1000 + i, grammar=spec)
    return SamplingParams(grammar=spec, logprobs=2 if i % 5 == 0 else None)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_grammar_checkpoint(tmp_path_factory.mktemp("grammar-ckpt") / "llama")


def _scenario(ckpt: Path, device: str, graphs: bool, overlap: bool = True, num_requests: int = 8,
              max_new: int = 56, strip_grammar: bool = False) -> dict[str, tuple[list[int], str]]:
    """``num_requests`` requests (a third added late), prefill's first token masked as the
    prefill daemon masks it; each request's tokens (the first included) and finish reason."""
    loaded = load_model(ckpt, dtype=torch.float32, device=device)
    model = loaded.model
    tok = load_tokenizer(ckpt)
    grammars = Grammars(tok.backend, model.config.vocab_size, model.config.eos_token_ids)
    pool = PagePool.for_model(loaded.config, num_requests * 24 + 8, 4, model.dtype, device)
    engine = DecodeEngine(model, pool, max_batch_size=8, graph_sizes=(1, 2, 4, 8), overlap=overlap)
    if graphs:
        if device == "cuda":
            assert engine.capture_graphs() is not None
        else:
            engine._graphs = DecodeGraphs(model, pool, engine.graph_sizes, engine.sampler)
            engine._graphs.capture()
    out: dict[str, tuple[list[int], str]] = {}
    adds = {}
    for i in range(num_requests):
        sp = _sampling(i)
        if strip_grammar:
            sp = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed, logprobs=sp.logprobs)
        prompt = tok.encode(f"Tell me about item {i}, please.")
        mask = None if sp.grammar is None else masks_from_bytes([grammars.first_mask(sp.grammar)], grammars.words)
        table, first = prefill_into_pool(model, pool, prompt, sp, bitmask=mask)
        matcher = None if sp.grammar is None else grammars.matcher(sp.grammar)
        out[f"r{i}"] = ([first], "")
        adds.setdefault(0 if i % 3 else 1 + i % 4, []).append(
            (f"r{i}", table, first, sp, max_new, (), 1, False, prompt, matcher))
    for step in range(4 * max_new):
        for args in adds.get(step, []):
            engine.add(*args[:-1], grammar=args[-1])
        for event in engine.step():
            tokens, _ = out[event.request_id]
            if event.token_id is not None:
                tokens.append(event.token_id)
            if event.finished:
                out[event.request_id] = (tokens, event.finish_reason)
        if step > max(adds) and not engine.has_work:
            break
    assert not engine.has_work and pool.free_count == pool.num_pages
    return out


def _assert_valid(ckpt: Path, out: dict[str, tuple[list[int], str]]) -> None:
    tok = load_tokenizer(ckpt)
    for i in range(len(out)):
        tokens, reason = out[f"r{i}"]
        sp = _sampling(i)
        if sp.grammar is None:
            continue
        assert reason == FINISH_STOP and tokens[-1] == EOS_TOKEN_ID, (i, reason, tok.decode(tokens))
        _check(sp.grammar, tok.decode(tokens[:-1]))


@pytest.fixture(scope="module")
def eager(ckpt: Path) -> dict[str, tuple[list[int], str]]:
    return _scenario(ckpt, "cpu", graphs=False)


def test_grammar_outputs_match_their_specs_and_leave_other_rows_alone(ckpt, eager):
    out = eager
    _assert_valid(ckpt, out)
    plain = _scenario(ckpt, "cpu", graphs=False, strip_grammar=True)
    for i in range(len(out)):
        if _sampling(i).grammar is None:
            assert out[f"r{i}"] == plain[f"r{i}"]  # all-ones rows: unchanged beside masked ones
    # The masks decide: without them the random model writes no valid output at all.
    tok = load_tokenizer(ckpt)
    for i in range(len(out)):
        sp = _sampling(i)
        if sp.grammar is not None and sp.grammar.kind == "json_schema":
            tokens, _ = plain[f"r{i}"]
            with pytest.raises(ValueError):
                json.loads(tok.decode(tokens))


@pytest.mark.parametrize("overlap", [True, False])
def test_static_step_with_masks_equals_eager_cpu(ckpt, eager, overlap):
    static = _scenario(ckpt, "cpu", graphs=True, overlap=overlap)
    assert static == eager
    _assert_valid(ckpt, static)


def test_a_cut_output_ends_by_length(ckpt):
    """max_new_tokens below what the schema needs: finish_reason length, the output a
    prefix of a valid one (as vLLM's)."""
    loaded = load_model(ckpt)
    tok = load_tokenizer(ckpt)
    grammars = Grammars(tok.backend, loaded.config.vocab_size, loaded.config.eos_token_ids)
    pool = PagePool.for_model(loaded.config, 16, 4, loaded.model.dtype, "cpu")
    engine = DecodeEngine(loaded.model, pool, max_batch_size=2)
    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    sp = SamplingParams(grammar=spec)
    prompt = tok.encode("Who?")
    table, first = prefill_into_pool(loaded.model, pool, prompt, sp,
                                     bitmask=masks_from_bytes([grammars.first_mask(spec)], grammars.words))
    engine.add("cut", table, first, sp, 5, grammar=grammars.matcher(spec))
    events = []
    while engine.has_work:
        events += engine.step()
    assert events[-1].finish_reason == FINISH_LENGTH
    text = tok.decode([first] + [e.token_id for e in events])
    assert '{"name": "'.startswith(text) and len(events) == 4


def test_the_engine_samples_the_first_token_under_the_grammar(ckpt):
    """A prompt the decode side holds whole (its prefix cache): the engine samples the
    first token itself, from the matcher's start (``start_step=0``)."""
    loaded = load_model(ckpt)
    tok = load_tokenizer(ckpt)
    grammars = Grammars(tok.backend, loaded.config.vocab_size, loaded.config.eos_token_ids)
    pool = PagePool.for_model(loaded.config, 32, 4, loaded.model.dtype, "cpu")
    engine = DecodeEngine(loaded.model, pool, max_batch_size=2)
    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    prompt = tok.encode("Who is it?")
    table, _ = prefill_into_pool(loaded.model, pool, prompt[:-1], SamplingParams())
    engine.add("cached", table, prompt[-1], SamplingParams(grammar=spec), 60, start_step=0,
               grammar=grammars.matcher(spec))
    events = []
    while engine.has_work:
        events += engine.step()
    assert events[0].step == 0 and events[-1].finish_reason == FINISH_STOP
    tokens = [e.token_id for e in events]
    assert tokens[-1] == EOS_TOKEN_ID
    _check(spec, tok.decode(tokens[:-1]))


def test_a_first_token_outside_the_grammar_is_refused(ckpt):
    loaded = load_model(ckpt)
    tok = load_tokenizer(ckpt)
    grammars = Grammars(tok.backend, loaded.config.vocab_size, loaded.config.eos_token_ids)
    pool = PagePool.for_model(loaded.config, 16, 4, loaded.model.dtype, "cpu")
    engine = DecodeEngine(loaded.model, pool, max_batch_size=2)
    spec = GrammarSpec("regex", "Q+")
    table, _ = prefill_into_pool(loaded.model, pool, tok.encode("Hi"), SamplingParams())
    with pytest.raises(ValueError, match=r"first token \d+ is not allowed by its grammar \(regex\)"):
        engine.add("bad", table, tok.encode("x", add_special_tokens=False)[0], SamplingParams(grammar=spec), 5,
                   grammar=grammars.matcher(spec))
    with pytest.raises(ValueError, match="grammar and sampling.grammar must come together"):
        engine.add("bad", table, 5, SamplingParams(grammar=spec), 5)
    table.release()


@requires_gpu
def test_graph_replay_with_masks_equals_eager_gpu(ckpt):
    """The captured full step with the bitmask copied in before each replay equals the
    eager step token for token, overlapped or not; every output valid."""
    eager = _scenario(ckpt, "cuda", graphs=False, num_requests=16)
    _assert_valid(ckpt, eager)
    for overlap in (True, False):
        assert _scenario(ckpt, "cuda", graphs=True, overlap=overlap, num_requests=16) == eager
