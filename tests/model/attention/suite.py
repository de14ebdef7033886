"""One suite per attention kind: its three callbacks on one tiny checkpoint.

``KindSuite`` holds the tests; ``test_gqa.py``, ``test_mla.py`` and
``test_dsa.py`` each subclass it with a checkpoint writer and the kind's name.
Every path is held against transformers (greedy tokens of ``generate``, the
last prompt token's logits) and the paths against each other:

- CP prefill (two ranks, pages of 4, through ``ThreadedPrefillEngine``):
  transformers' logits;
- CP prefill, its rows placed in a decode pool, then paged decode
  (``DecodeEngine``): transformers' greedy tokens;
- the colocated run (``prefill_into_pool``, then paged decode): the same
  tokens, and the rows it stores are the rows the CP prefill stored.

DSA runs with the index keys in the model dtype (``index_cache_dtype="model"``):
the keys transformers scores, so the same selection and the same tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from lanekv.decode.colocated import generate_colocated, prefill_into_pool
from lanekv.decode.engine import DecodeEngine
from lanekv.decode.pool import PagePool, PageTable
from lanekv.model.attention import kind_of
from lanekv.model.checkpoint import load_model
from lanekv.model.sampling import SamplingParams
from lanekv.prefill.cp.launcher import PrefillInput
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.engine_config import EngineConfig

from tests.checkpoints import EOS_TOKEN_ID
from tests.prefill.oracle import hf_last_logits, random_prompts

PROMPT_LENS = (7, 13)
NEW_TOKENS = 5
CP_SIZE, PAGE_SIZE = 2, 4
INDEX_CACHE_DTYPE = "model"
GREEDY = SamplingParams()


def _hf_greedy(path, prompts, max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=EOS_TOKEN_ID)
            outs.append(out[0, len(ids):].tolist())
    return outs


def _decode(engine: DecodeEngine, firsts: dict[str, int]) -> dict[str, list[int]]:
    outputs = {rid: [first] for rid, first in firsts.items()}
    for _ in range(4 * NEW_TOKENS):
        if not engine.has_work:
            break
        for event in engine.step():
            if event.token_id is not None:
                outputs[event.request_id].append(event.token_id)
    assert not engine.has_work, "decode did not finish"
    return outputs


class KindSuite:
    """Subclasses set ``kind`` and ``write`` (a ``tests.checkpoints`` writer)."""

    kind: str
    write = None

    @pytest.fixture(scope="class")
    def checkpoint(self, tmp_path_factory):
        return type(self).write(tmp_path_factory.mktemp(self.kind))

    @pytest.fixture(scope="class")
    def loaded(self, checkpoint):
        return load_model(checkpoint)

    @pytest.fixture(scope="class")
    def prompts(self):
        return random_prompts(PROMPT_LENS, seed=3)

    @pytest.fixture(scope="class")
    def hf_tokens(self, checkpoint, prompts):
        return _hf_greedy(checkpoint, prompts, NEW_TOKENS)

    @pytest.fixture(scope="class")
    def cp(self, checkpoint, prompts):
        """The CP engine and its results, with logits."""
        eng = ThreadedPrefillEngine(EngineConfig(
            str(checkpoint), cp_size=CP_SIZE, page_size=PAGE_SIZE, pages_per_lane=32,
            pool_fill=math.nan, index_cache_dtype=INDEX_CACHE_DTYPE))
        return eng, eng.prefill([PrefillInput(p) for p in prompts], return_logits=True)

    def _pool(self, loaded) -> PagePool:
        return PagePool.for_model(loaded.config, 16, PAGE_SIZE, torch.float32,
                                  index_cache_dtype=INDEX_CACHE_DTYPE)

    def test_the_config_is_of_this_kind(self, loaded):
        assert kind_of(loaded.config).name == self.kind

    def test_cp_prefill_matches_transformers(self, checkpoint, prompts, cp):
        hf = hf_last_logits(checkpoint, prompts, attn_implementation="eager")
        _, results = cp
        for ids, res in zip(prompts, results):
            assert res.num_tokens == len(ids)
            torch.testing.assert_close(res.logits, hf[len(ids)], rtol=1e-4, atol=1e-4)

    def test_cp_prefill_then_paged_decode_match_transformers(self, loaded, prompts, cp, hf_tokens):
        eng, results = cp
        pool = self._pool(loaded)
        engine = DecodeEngine(loaded.model, pool)
        firsts = {}
        for i, res in enumerate(results):
            n = res.num_tokens
            table = PageTable.allocate(pool, n)
            rows = eng.read_pages([p.page for p in res.pages])[:, :, :n]  # [L, kv, n, Hkv, D]
            pool.tensor[:, :, table.locs_for(range(n))] = rows.to(pool.tensor.device)
            engine.add(f"r{i}", table, res.first_token, GREEDY, NEW_TOKENS, ignore_eos=True)
            firsts[f"r{i}"] = res.first_token
        outputs = _decode(engine, firsts)
        assert [outputs[f"r{i}"] for i in range(len(prompts))] == hf_tokens

    def test_colocated_matches_transformers(self, loaded, prompts, hf_tokens):
        got = generate_colocated(loaded.model, self._pool(loaded), prompts, GREEDY, NEW_TOKENS,
                                 ignore_eos=True)
        assert got == hf_tokens

    def test_colocated_stores_the_rows_cp_prefill_stores(self, loaded, prompts, cp):
        eng, results = cp
        pool = self._pool(loaded)
        for ids, res in zip(prompts, results):
            table, first = prefill_into_pool(loaded.model, pool, ids, GREEDY)
            assert first == res.first_token
            ours = pool.tensor[:, :, table.locs_for(range(len(ids)))]
            theirs = eng.read_pages([p.page for p in res.pages])[:, :, : len(ids)]
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
            table.release()
