"""Prompt logprobs from the CP ranks, each scoring the tokens after its own rows, equal
transformers' log-softmax within 1e-4 (fp32, CPU), for every CP size and a mixed batch."""

from __future__ import annotations

import pytest
import torch
from lanekv.prefill.cp.launcher import CPPrefillEngine, PrefillInput
from lanekv.prefill.cp.prompt_logprobs import PromptRows, merge_prompt_logprobs
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.engine_config import EngineConfig

from tests.checkpoints import write_llama
from tests.markers import requires_gpu

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("llama-plp"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager",
                                                dtype=torch.float32).eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 290, (n,), generator=g).tolist() for n in (2, 13, 37)]


def _prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)  # [len, vocab]


def _check(hf, prompt: list[int], got, k: int) -> None:
    ref = _prompt_logprobs(hf, prompt)
    assert [e.token_id for e in got] == prompt[1:]
    for p, entry in enumerate(got, start=1):
        assert abs(entry.logprob - ref[p - 1, prompt[p]].item()) < 1e-4, p
        assert len(entry.top) == k
        values, ids = ref[p - 1].topk(k)
        assert [t for t, _ in entry.top] == ids.tolist()
        for (_, v), w in zip(entry.top, values.tolist(), strict=True):
            assert abs(v - w) < 1e-4, p


@pytest.mark.parametrize("cp_size, page_size", [(1, 4), (2, 4), (3, 8)])
def test_ranks_score_their_own_rows_equal_transformers(checkpoint, hf, cp_size, page_size):
    cfg = EngineConfig(str(checkpoint), cp_size=cp_size, page_size=page_size, pages_per_lane=64)
    engine = ThreadedPrefillEngine(cfg)
    prompts, ks = _prompts(), (3, None, 0)
    results = engine.prefill([PrefillInput(p, prompt_logprobs=k) for p, k in zip(prompts, ks)],
                             return_logits=True)
    for prompt, k, res in zip(prompts, ks, results):
        if k is None:
            assert res.prompt_logprobs is None
            continue
        _check(hf, prompt, res.prompt_logprobs, k)
    # The first token is still sampled from the last row (unchanged by the scoring).
    with torch.inference_mode():
        want = hf(torch.tensor([prompts[2]])).logits[0, -1].argmax().item()
    assert results[2].first_token == want


def test_rank_processes_send_back_only_their_rows(checkpoint, hf):
    cfg = EngineConfig(str(checkpoint), cp_size=2, page_size=4, pages_per_lane=32, start_timeout_s=120)
    prompt = _prompts()[2]
    with CPPrefillEngine(cfg) as engine:
        res = engine.prefill([PrefillInput(prompt, prompt_logprobs=2)])[0]
    _check(hf, prompt, res.prompt_logprobs, 2)


def test_a_cached_prefix_is_refused_and_gaps_are_errors(checkpoint):
    cfg = EngineConfig(str(checkpoint), cp_size=1, page_size=4, pages_per_lane=16)
    engine = ThreadedPrefillEngine(cfg)
    with pytest.raises(ValueError, match="prompt_logprobs needs the whole prompt"):
        engine.prefill([PrefillInput(list(range(3, 12)), prefix_pages=[0], prompt_logprobs=1)])
    part = PromptRows(0, [1, 3], [-1.0, -2.0], [[], []], [[], []])
    with pytest.raises(RuntimeError, match="scored by no rank"):
        merge_prompt_logprobs([5, 6, 7, 8], [part])
    with pytest.raises(RuntimeError, match="scored twice"):
        merge_prompt_logprobs([5, 6, 7, 8], [part, part])


@requires_gpu
def test_prompt_logprobs_on_gpu_with_captured_graphs(checkpoint, hf):
    """On a GPU (fp32), the rows come from the captured prefill graphs; the scores still
    equal transformers' (CPU, fp32) within 1e-3."""
    cfg = EngineConfig(str(checkpoint), cp_size=1, page_size=16, pages_per_lane=64, device="cuda")
    engine = ThreadedPrefillEngine(cfg)
    engine.capture_graphs(128)
    prompts = _prompts()
    results = engine.prefill([PrefillInput(p, prompt_logprobs=4) for p in prompts])
    for prompt, res in zip(prompts, results):
        ref = _prompt_logprobs(hf, prompt)
        assert [e.token_id for e in res.prompt_logprobs] == prompt[1:]
        for p, entry in enumerate(res.prompt_logprobs, start=1):
            assert abs(entry.logprob - ref[p - 1, prompt[p]].item()) < 1e-3, p
            assert abs(entry.top[0][1] - ref[p - 1].max().item()) < 1e-3, p
