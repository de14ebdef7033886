"""The decode engine's logits processors and logprobs against transformers.

A plain-Python reference of vLLM's sampler semantics (min_tokens, logit_bias,
repetition/presence/frequency penalties) over transformers' fp32 logits of
the whole sequence decides each greedy token; the engine's raw logprobs must
equal transformers' log_softmax within 1e-4.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lanekv.decode.colocated import prefill_into_pool
from lanekv.decode.engine import FINISH_LENGTH, FINISH_STOP, DecodeEngine
from lanekv.decode.pool import PagePool
from lanekv.model.checkpoint import load_model
from lanekv.model.sampling import SamplingParams

from tests.checkpoints import EOS_TOKEN_ID, VOCAB_SIZE, write_llama


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("sampling-ckpt") / "llama")


@pytest.fixture(scope="module")
def hf(ckpt: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager",
                                                dtype=torch.float32).eval()


def reference_process(logits: list[float], prompt: list[int], outputs: list[int],
                      sp: SamplingParams, eos: int) -> list[float]:
    x = list(logits)
    if len(outputs) < sp.min_tokens:
        for t in {*sp.stop_token_ids, *(() if sp.ignore_eos else (eos,))}:
            x[t] = -math.inf
    for t, bias in sp.logit_bias:
        x[t] += bias
    for t in set(prompt) | set(outputs):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(outputs):
        x[t] -= sp.frequency_penalty * outputs.count(t) + sp.presence_penalty
    return x


def run_engine(ckpt: Path, prompt: list[int], sp: SamplingParams, max_new: int):
    loaded = load_model(ckpt)
    pool = PagePool.for_model(loaded.config, 32, 4, torch.float32)
    engine = DecodeEngine(loaded.model, pool, max_batch_size=4)
    first_lp: list[float] = []
    table, first = prefill_into_pool(loaded.model, pool, prompt, sp, first_lp)
    engine.add("r", table, first, sp, max_new, prompt_ids=prompt)
    events = []
    for _ in range(4 * max_new):
        events += engine.step()
        if events and events[-1].finished:
            break
    assert pool.free_count == pool.num_pages and engine.sampler.free_slots == 4 + 8
    return first, first_lp[0], events


@pytest.mark.parametrize("sp", [
    SamplingParams(repetition_penalty=1.7, logprobs=5),
    SamplingParams(presence_penalty=1.5, frequency_penalty=0.9, logit_bias=((7, 3.0), (11, -2.0))),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=-0.5, logprobs=0),
])
def test_penalised_greedy_matches_reference(ckpt, hf, sp) -> None:
    prompt = [5, 9, 9, 30, 7, 41, 5, 12]
    max_new = 10
    first, first_lp, events = run_engine(ckpt, prompt, sp, max_new)
    tokens = [first] + [e.token_id for e in events if e.token_id is not None]
    logprobs = [first_lp] + [e.logprobs.logprob for e in events if e.logprobs is not None]
    outputs: list[int] = []
    with torch.inference_mode():
        for k, token in enumerate(tokens):
            logits = hf(torch.tensor([prompt + outputs])).logits[0, -1].float()
            want = reference_process(logits.tolist(), prompt, outputs, sp, EOS_TOKEN_ID)
            assert token == max(range(VOCAB_SIZE), key=lambda t: (want[t], -t)), f"token {k}"
            if sp.logprobs is not None:
                ref = torch.log_softmax(logits, -1)
                assert abs(logprobs[k] - ref[token].item()) < 1e-4
                if k:
                    top = events[k - 1].logprobs.top
                    assert len(top) == sp.logprobs
                    for tid, value in top:
                        assert abs(value - ref[tid].item()) < 1e-4
                    if top:
                        assert top[0][0] == int(ref.argmax())
            outputs.append(token)
    assert len(tokens) == max_new or events[-1].finish_reason == FINISH_STOP


def test_min_tokens_and_ignore_eos(ckpt) -> None:
    prompt = [5, 9, 30, 7]
    eos_first = ((EOS_TOKEN_ID, 100.0),)  # EOS wins every step it is allowed
    first, _, events = run_engine(ckpt, prompt, SamplingParams(logit_bias=eos_first, min_tokens=4), 12)
    tokens = [first] + [e.token_id for e in events]
    assert EOS_TOKEN_ID not in tokens[:4] and tokens[4] == EOS_TOKEN_ID and len(tokens) == 5
    assert events[-1].finish_reason == FINISH_STOP
    first, _, events = run_engine(ckpt, prompt, SamplingParams(logit_bias=eos_first, ignore_eos=True), 7)
    tokens = [first] + [e.token_id for e in events]
    assert tokens == [EOS_TOKEN_ID] * 7 and events[-1].finish_reason == FINISH_LENGTH


def test_min_p_keeps_only_likely_tokens(ckpt) -> None:
    prompt = [5, 9, 30, 7]
    for seed in range(6):
        sp = SamplingParams(temperature=1.5, min_p=0.5, seed=seed, logprobs=20)
        first, first_lp, events = run_engine(ckpt, prompt, sp, 4)
        for e in events:
            best = e.logprobs.top[0][1]
            # min_p on the temperature-scaled probabilities: p >= min_p * p_max
            assert (e.logprobs.logprob - best) / 1.5 >= math.log(0.5) - 1e-5
