"""CP prefill of DeepSeek-V3.2 (DSA) against transformers and a single-rank run:
the pool rows (latent, then the index key) gathered by loc across ranks equal
cp=1's, each rank writes only its own rows, the fp8 index rows are the torch
quantization of the keys, and prefix reuse gives the same logits and rows."""

from __future__ import annotations

import math

import pytest
import torch
from lanekv.kernels.dsa.index_cache import quantize_index_k_ref, read_index_k_ref
from lanekv.model.attention import pool_rows
from lanekv.prefill.cp.launcher import PrefillInput
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.engine_config import EngineConfig

from tests.checkpoints import write_deepseek_v32
from tests.prefill.oracle import hf_last_logits, prefill_with_prefix, random_prompts

PROMPT_LENS = [1, 6, 29, 70]
LANE_PAGES = 200


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_deepseek_v32(tmp_path_factory.mktemp("v32"), index_topk=5)


@pytest.fixture(scope="module")
def hf_logits(checkpoint):
    return hf_last_logits(checkpoint, random_prompts(PROMPT_LENS), attn_implementation="eager")


def _engine(checkpoint, cp, ps, cache_dtype="model"):
    return ThreadedPrefillEngine(EngineConfig(
        str(checkpoint), cp_size=cp, page_size=ps, pages_per_lane=LANE_PAGES, pool_fill=math.nan,
        index_cache_dtype=cache_dtype))


def _rows(eng, res):
    """The request's pool rows ``[layers, tokens, head_dim]`` in position order."""
    return eng.read_pages([p.page for p in res.pages])[:, 0, : res.num_tokens, 0]


@pytest.fixture(scope="module")
def single_rank_rows(checkpoint):
    out = {}
    for cache_dtype in ("model", "fp8_e4m3"):
        eng = _engine(checkpoint, 1, 1, cache_dtype)
        prompts = random_prompts(PROMPT_LENS)
        out[cache_dtype] = {len(ids): _rows(eng, res) for ids, res in
                            zip(prompts, eng.prefill([PrefillInput(p) for p in prompts]))}
    return out


@pytest.mark.parametrize("cp_size,page_size,cache_dtype", [
    (2, 1, "model"), (3, 4, "model"), (4, 2, "fp8_e4m3"), (2, 16, "fp8_e4m3")])
def test_dsa_cp_prefill_matches_transformers_and_single_rank(
        checkpoint, hf_logits, single_rank_rows, cp_size, page_size, cache_dtype):
    eng = _engine(checkpoint, cp_size, page_size, cache_dtype)
    lay = pool_rows(eng.loaded.config, torch.float32, cache_dtype)
    results = eng.prefill([PrefillInput(p) for p in random_prompts(PROMPT_LENS)], return_logits=True)
    written = {r: set() for r in range(cp_size)}
    for res in results:
        n = res.num_tokens
        if cache_dtype == "model":  # the keys transformers scores: the same logits
            torch.testing.assert_close(res.logits, hf_logits[n], rtol=1e-4, atol=1e-4)
        rows, single = _rows(eng, res), single_rank_rows[cache_dtype][n]
        assert rows.shape[2] == lay.head_dim
        # Gathered by loc across ranks: cp=1's rows, latent and index key alike.
        torch.testing.assert_close(rows[..., : lay.latent_dim], single[..., : lay.latent_dim],
                                   rtol=1e-5, atol=1e-5)
        for layer in range(rows.shape[0]):
            raw, raw_single = (lay.index_rows(t[layer].contiguous()).contiguous()
                               for t in (rows, single))
            keys, keys_single = (read_index_k_ref(t, torch.arange(n), lay.index).float()
                                 for t in (raw, raw_single))
            if cache_dtype == "model":
                torch.testing.assert_close(keys, keys_single, rtol=1e-5, atol=1e-5)
                continue
            # fp8: the bytes are the torch quantization of the keys; a key one float32
            # ulp off on another rank may land on the neighbouring e4m3 value, no further.
            assert torch.equal(quantize_index_k_ref(keys, lay.index), raw)
            torch.testing.assert_close(keys, keys_single, rtol=0.13, atol=1e-3)
            assert (raw != raw_single).float().mean() < 0.05
        for info in res.pages:
            phys = info.page // cp_size
            written[info.owner].update(range(phys * page_size, phys * page_size + info.valid_rows))
    for r in range(cp_size):  # each rank wrote its own rows, whole, and nothing else
        pool = eng.pool_snapshot(r)[:, 0, :, 0]  # [layers, rows, head_dim]
        unwritten = torch.isnan(pool[..., : lay.latent_dim]).any(2).any(0)
        assert set(torch.nonzero(~unwritten).flatten().tolist()) == written[r]


def test_dsa_prefix_reuse_equals_full_prompt(checkpoint, hf_logits):
    eng = _engine(checkpoint, 3, 4)
    prompt = random_prompts(PROMPT_LENS)[3]  # 70 tokens
    reused, whole = prefill_with_prefix(eng, prompt, 40, 9)  # 9 of its 10 pages of 4
    assert reused.prefix_len == 36
    torch.testing.assert_close(reused.logits, hf_logits[70], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_rows(eng, reused), _rows(eng, whole))
