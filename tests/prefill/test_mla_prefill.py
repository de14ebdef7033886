"""CP prefill of DeepSeek-V2/V3 (MLA latent rows) against transformers and a
single-rank run: the latent rows gathered by loc across ranks equal cp=1's,
each rank writes only its own latent rows, prefix reuse gives the same rows."""

from __future__ import annotations

import math

import pytest
import torch
from lanekv.kernels.prefill.reference import AttnSegments
from lanekv.model.attention.mla import mla_prefill_attention
from lanekv.prefill.cp.launcher import PrefillInput
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.engine_config import EngineConfig

from tests.checkpoints import DEEPSEEK_WRITERS
from tests.prefill.oracle import hf_last_logits, prefill_with_prefix, random_prompts

PROMPT_LENS = [1, 6, 29, 70]
LANE_PAGES = 400
LATENT = 40


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def checkpoint(request, tmp_path_factory):
    return DEEPSEEK_WRITERS[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hf_logits(checkpoint):
    return hf_last_logits(checkpoint, random_prompts(PROMPT_LENS), attn_implementation="eager")


def _engine(checkpoint, cp, ps):
    return ThreadedPrefillEngine(EngineConfig(str(checkpoint), cp_size=cp, page_size=ps,
                                              pages_per_lane=LANE_PAGES, pool_fill=math.nan))


@pytest.fixture(scope="module")
def single_rank_latent(checkpoint):
    eng = _engine(checkpoint, 1, 1)
    prompts = random_prompts(PROMPT_LENS)
    return {len(ids): eng.read_pages([p.page for p in res.pages])
            for ids, res in zip(prompts, eng.prefill([PrefillInput(p) for p in prompts]))}


@pytest.mark.parametrize("cp_size,page_size", [(1, 4), (2, 1), (2, 16), (3, 4), (4, 2)])
def test_mla_cp_prefill_matches_transformers_and_single_rank(
        checkpoint, hf_logits, single_rank_latent, cp_size, page_size):
    eng = _engine(checkpoint, cp_size, page_size)
    assert eng.pool_snapshot(0).shape[1:4:2] == (1, 1)  # one plane, one head of the latent
    results = eng.prefill([PrefillInput(p) for p in random_prompts(PROMPT_LENS)], return_logits=True)
    written = {r: set() for r in range(cp_size)}
    for res in results:
        n = res.num_tokens
        torch.testing.assert_close(res.logits, hf_logits[n], rtol=1e-4, atol=1e-4)
        latent = eng.read_pages([p.page for p in res.pages])[:, :, :n]
        assert latent.shape == (eng.loaded.config.num_layers, 1, n, 1, LATENT)
        torch.testing.assert_close(latent, single_rank_latent[n][:, :, :n], rtol=1e-5, atol=1e-5)
        for info in res.pages:
            phys = info.page // cp_size
            written[info.owner].update(range(phys * page_size, phys * page_size + info.valid_rows))
    for r in range(cp_size):
        per_row = torch.isnan(eng.pool_snapshot(r).permute(2, 0, 1, 3, 4).flatten(1))
        assert set(torch.nonzero(~per_row.any(1)).flatten().tolist()) == written[r]
        assert bool(((~per_row.any(1)) | per_row.all(1)).all()), "a row was partly written"


def test_mla_prefix_reuse_equals_full_prompt(checkpoint, hf_logits):
    eng = _engine(checkpoint, 3, 4)
    prompt = random_prompts(PROMPT_LENS)[3]  # 70 tokens
    reused, whole = prefill_with_prefix(eng, prompt, 40, 9)  # 9 of its 10 pages of 4
    assert reused.prefix_len == 36
    torch.testing.assert_close(reused.logits, hf_logits[70], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(eng.read_pages([p.page for p in reused.pages])[:, :, :70],
                               eng.read_pages([p.page for p in whole.pages])[:, :, :70])


def test_mla_head_dims_reach_the_kernel_unpadded(monkeypatch):
    """qk 24 / v 16 go to the Triton kernel as they are (no padding to a power of
    two) and give the reference's attention."""
    import lanekv.model.attention.base as base

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 4, d, generator=gen) for d in (24, 24, 16))
    segments = AttnSegments(*(torch.tensor(x, dtype=torch.int32) for x in ([0], [9], [0], [0])))
    plain = mla_prefill_attention(q, k, v, segments, 0.3)
    assert plain.shape == (9, 4, 16)
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    seen = []
    real = base.cp_prefill_attention

    def spy(q, k, v, *args):
        seen.append((q.shape[2], k.shape[2], v.shape[2]))
        return real(q, k, v, *args)

    monkeypatch.setattr(base, "cp_prefill_attention", spy)
    torch.testing.assert_close(mla_prefill_attention(q, k, v, segments, 0.3), plain,
                               rtol=1e-5, atol=1e-5)
    assert seen == [(24, 24, 16)]


@pytest.mark.parametrize("cp_size,page_size", [(2, 16), (3, 4)])
def test_mla_cp_prefill_through_the_sdpa_path_matches_transformers(
        checkpoint, hf_logits, single_rank_latent, cp_size, page_size, monkeypatch):
    """LANEKV_PREFILL_ATTENTION=cudnn: each rank's chunks go through the segment-by-segment
    path (its float32 torch twin here), split past position 0 and merged; logits and the
    latent rows every later layer wrote are those of the Triton path's run."""
    import lanekv.kernels.prefill.sdpa as sdpa

    monkeypatch.setenv(sdpa.PREFILL_ATTENTION_ENV, "cudnn")
    calls = []
    real = sdpa.sdpa_prefill_attention
    monkeypatch.setattr("lanekv.model.attention.base.sdpa_prefill_attention",
                        lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    eng = _engine(checkpoint, cp_size, page_size)
    results = eng.prefill([PrefillInput(p) for p in random_prompts(PROMPT_LENS)], return_logits=True)
    for res in results:
        n = res.num_tokens
        torch.testing.assert_close(res.logits, hf_logits[n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(eng.read_pages([p.page for p in res.pages])[:, :, :n],
                                   single_rank_latent[n][:, :, :n], rtol=1e-5, atol=1e-5)
    assert calls and any(q_pos > 0 for segs in calls for _, _, q_pos, _ in segs)
    if page_size == 4:  # a cached prefix of 9 pages of 4 (test_mla_prefix_reuse_equals_full_prompt's)
        reused, _ = prefill_with_prefix(eng, random_prompts(PROMPT_LENS)[3], 40, 9)
        assert reused.prefix_len == 36
        torch.testing.assert_close(reused.logits, hf_logits[70], rtol=1e-4, atol=1e-4)
