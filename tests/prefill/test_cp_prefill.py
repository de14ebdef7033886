"""CP prefill against transformers and against a single-rank run.

Most (cp_size, page_size) pairs run with rank threads (``ThreadedPrefillEngine``:
the same rank code, an in-process all-gather); the real rank processes with
gloo are covered by ``tests/prefill/test_cp_launcher.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from lanekv.model.sampling import SamplingParams
from lanekv.prefill.cp.launcher import PrefillInput
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.engine_config import EngineConfig
from lanekv.prefill.layout import NotOwnedError

from tests.checkpoints import write_llama, write_qwen2
from tests.prefill.oracle import hf_last_logits, random_prompts

# Lengths from one token to a few hundred; with page 16 and cp 4 the short
# ones have fewer pages than ranks (compute padding).
PROMPT_LENS = [1, 7, 33, 130, 301]
LANE_PAGES = 1200  # room for every prompt twice at page_size 1 on one lane


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    (write_llama if request.param == "llama" else write_qwen2)(path)
    return path


@pytest.fixture(scope="module")
def hf_logits(checkpoint):
    """Last-token logits of transformers' forward for each prompt (float32)."""
    return hf_last_logits(checkpoint, random_prompts(PROMPT_LENS))


def _engine(checkpoint, cp, ps, **kw):
    cfg = EngineConfig(str(checkpoint), cp_size=cp, page_size=ps, pages_per_lane=LANE_PAGES, pool_fill=math.nan, **kw)
    return ThreadedPrefillEngine(cfg)


@pytest.fixture(scope="module")
def single_rank_kv(checkpoint):
    """K/V of every prompt from a cp=1 run, by position: [L, 2, T, Hkv, D]."""
    eng = _engine(checkpoint, 1, 1)
    out = {}
    for ids, res in zip(random_prompts(PROMPT_LENS), eng.prefill([PrefillInput(p) for p in random_prompts(PROMPT_LENS)])):
        out[len(ids)] = eng.read_pages([p.page for p in res.pages])
    return out


@pytest.mark.parametrize("cp_size,page_size", [(2, 4), (3, 16)])
def test_cp_prefill_through_the_sdpa_path_matches_transformers(checkpoint, hf_logits, single_rank_kv,
                                                               cp_size, page_size, monkeypatch):
    """LANEKV_PREFILL_ATTENTION=cudnn: each rank's segments go through the segment-by-segment
    path (its float32 torch twin here), the KV heads repeated to the query heads, chunks past
    position 0 split and merged; logits and K/V are those of transformers and the cp=1 run."""
    import lanekv.model.attention.base as base

    monkeypatch.setenv("LANEKV_PREFILL_ATTENTION", "cudnn")
    calls = []
    real = base.sdpa_prefill_attention

    def spy(q, k, v, segments, scale):
        calls.append((q.shape[1] // k.shape[1], segments))
        return real(q, k, v, segments, scale)

    monkeypatch.setattr(base, "sdpa_prefill_attention", spy)
    eng = _engine(checkpoint, cp_size, page_size)
    for res in eng.prefill([PrefillInput(p) for p in random_prompts(PROMPT_LENS)], return_logits=True):
        n = res.num_tokens
        torch.testing.assert_close(res.logits, hf_logits[n], rtol=1e-4, atol=1e-4)
        kv = eng.read_pages([p.page for p in res.pages])[:, :, :n]
        torch.testing.assert_close(kv, single_rank_kv[n][:, :, :n], rtol=1e-5, atol=1e-5)
    assert calls and all(group > 1 for group, _ in calls)  # grouped-query heads, repeated
    assert any(q_pos > 0 for _, segs in calls for _, _, q_pos, _ in segs)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_cp_prefill_matches_transformers_and_single_rank(checkpoint, hf_logits, single_rank_kv, cp_size, page_size):
    eng = _engine(checkpoint, cp_size, page_size)
    prompts = random_prompts(PROMPT_LENS)
    # two batches: all requests at once, and a batch of one
    results = eng.prefill([PrefillInput(p) for p in prompts], return_logits=True)
    results += eng.prefill([PrefillInput(prompts[2])], return_logits=True)
    for res in results:
        n = res.num_tokens
        ref = hf_logits[n]
        torch.testing.assert_close(res.logits, ref, rtol=1e-4, atol=1e-4)
        assert res.first_token == int(ref.argmax())
        # K/V gathered from all owners by loc == the single-rank K/V (positions [0, n))
        kv = eng.read_pages([p.page for p in res.pages])[:, :, :n]
        torch.testing.assert_close(kv, single_rank_kv[n][:, :, :n], rtol=1e-5, atol=1e-5)
        assert [p.owner for p in res.pages] == [p.page % cp_size for p in res.pages]
        assert sum(p.valid_rows for p in res.pages) == n

    # each rank's pool holds exactly the rows of its own pages, nothing else
    written = {r: set() for r in range(cp_size)}
    for res in results:
        for info in res.pages:
            phys = info.page // cp_size
            written[info.owner].update(range(phys * page_size, phys * page_size + info.valid_rows))
    for r in range(cp_size):
        pool = eng.pool_snapshot(r)  # poisoned with NaN at start
        per_row = torch.isnan(pool.permute(2, 0, 1, 3, 4).flatten(1))  # [rows, L*2*Hkv*D]
        rows = ~per_row.any(1)  # fully written
        untouched = per_row.all(1)
        assert set(torch.nonzero(rows).flatten().tolist()) == written[r]
        assert bool((rows | untouched).all()), "a row was partly written"

    # freeing every page returns the lanes to their start
    for res in results:
        eng.free(res.new_pages)
    assert eng.allocator.free_counts() == [LANE_PAGES] * cp_size


@pytest.mark.parametrize("cp_size, page_size", [(2, 4), (3, 16), (4, 1)])
def test_prefix_reuse_equals_full_prompt(checkpoint, hf_logits, cp_size, page_size):
    eng = _engine(checkpoint, cp_size, page_size)
    prompt = random_prompts(PROMPT_LENS)[4]  # 301 tokens
    first = eng.prefill([PrefillInput(prompt[:160])])[0]
    prefix_pages = [p.page for p in first.pages][: 160 // page_size - 1]  # page-aligned, < 160 tokens
    reused = eng.prefill([PrefillInput(prompt, prefix_pages=prefix_pages)], return_logits=True)[0]
    assert reused.prefix_len == len(prefix_pages) * page_size
    torch.testing.assert_close(reused.logits, hf_logits[301], rtol=1e-4, atol=1e-4)
    assert [p.page for p in reused.pages[: len(prefix_pages)]] == prefix_pages
    # the reused request wrote only its new pages; its K/V equals a whole-prompt run
    whole = eng.prefill([PrefillInput(prompt)])[0]
    kv_reused = eng.read_pages([p.page for p in reused.pages])[:, :, :301]
    kv_whole = eng.read_pages([p.page for p in whole.pages])[:, :, :301]
    torch.testing.assert_close(kv_reused, kv_whole, rtol=1e-5, atol=1e-5)


def test_sampling_is_seeded_and_done_by_the_last_token_owner(checkpoint):
    prompts = random_prompts([50, 77], seed=3)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=1234)
    one = _engine(checkpoint, 1, 4).prefill([PrefillInput(p, params) for p in prompts])
    three = _engine(checkpoint, 3, 4).prefill([PrefillInput(p, params) for p in prompts])
    assert [r.first_token for r in one] == [r.first_token for r in three]


def test_bad_inputs_are_refused_without_leaking_pages(checkpoint):
    eng = _engine(checkpoint, 2, 4)
    with pytest.raises(ValueError, match="inputs is empty"):
        eng.prefill([])
    with pytest.raises(ValueError, match="prefix_pages"):
        eng.prefill([PrefillInput([5, 6, 7, 8], prefix_pages=[0])])
    with pytest.raises(ValueError, match="token_ids is empty"):
        eng.prefill([PrefillInput([])])
    assert eng.allocator.free_counts() == [LANE_PAGES, LANE_PAGES]


def test_a_rank_refuses_a_loc_it_does_not_own(checkpoint):
    from lanekv.prefill.cp.messages import RunPrefill
    from lanekv.prefill.cp.runner import PrefillBatch

    eng = _engine(checkpoint, 2, 4)
    bad = PrefillBatch(("r",), ((5, 6, 7, 8, 9),), (0,), ((),), ((1, 0),), (SamplingParams(),))
    with pytest.raises(NotOwnedError, match="owns"):
        eng.call(RunPrefill(bad))


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("cp_size", dict(cp_size=0)),
        ("page_size", dict(page_size=-1)),
        ("pages_per_lane", dict(pages_per_lane=0)),
        ("dtype", dict(dtype="int8")),
        ("device", dict(device="tpu")),
    ],
)
def test_engine_config_errors_name_the_field(checkpoint, field, kwargs):
    with pytest.raises(ValueError, match=field):
        EngineConfig(str(checkpoint), **kwargs)


def test_engine_config_missing_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        EngineConfig(str(tmp_path / "nope"))
