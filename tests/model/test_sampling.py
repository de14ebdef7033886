"""Greedy, seeded and filtered sampling; parameter validation."""

from __future__ import annotations

import math

import pytest
import torch
from lanekv.model.sampling import SamplingParams, sample, step_seed

GREEDY = SamplingParams()


def _logits(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def test_greedy_is_argmax_lowest_index_on_ties() -> None:
    logits = _logits(6, 50)
    logits[2, 7] = logits[2, 30] = 100.0  # tie: the lower id wins
    tokens = sample(logits, [GREEDY] * 6, step=0)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens[2].item() == 7


def test_greedy_ignores_seed_top_k_top_p() -> None:
    logits = _logits(3, 40)
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.3, seed=s) for s in range(3)]
    assert torch.equal(sample(logits, params, step=4), logits.argmax(-1))


def test_seeded_sampling_replays_and_ignores_batching() -> None:
    logits = _logits(4, 64, seed=1)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (10, 11, 12, 13)]
    first = sample(logits, params, step=3)
    assert torch.equal(first, sample(logits, params, step=3))
    # Row 2 alone, or in a batch with greedy rows and other steps, samples the same.
    alone = sample(logits[2:3], [params[2]], step=3)
    mixed = sample(logits, [GREEDY, GREEDY, params[2], params[3]], step=[0, 9, 3, 5])
    assert alone.item() == first[2].item() == mixed[2].item()


def test_steps_and_seeds_give_different_draws() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any fixed draw would repeat
    params = SamplingParams(temperature=1.0, seed=7)
    by_step = {sample(logits, [params], step=s).item() for s in range(20)}
    by_seed = {sample(logits, [SamplingParams(temperature=1.0, seed=s)], step=0).item()
               for s in range(20)}
    assert len(by_step) > 10 and len(by_seed) > 10
    assert step_seed(7, 0) != step_seed(7, 1) != step_seed(8, 0)


def test_unseeded_sampling_returns_valid_tokens() -> None:
    logits = _logits(8, 30)
    tokens = sample(logits, [SamplingParams(temperature=0.8)] * 8, step=0)
    assert tokens.shape == (8,) and bool(((tokens >= 0) & (tokens < 30)).all())


def test_top_k_support() -> None:
    logits = _logits(1, 50, seed=2)
    top = set(logits[0].topk(3).indices.tolist())
    seen = {
        sample(logits, [SamplingParams(temperature=5.0, top_k=3, seed=s)], step=0).item()
        for s in range(200)
    }
    assert seen == top  # hot enough to reach all three, never a fourth
    one = [SamplingParams(temperature=5.0, top_k=1, seed=s) for s in range(20)]
    assert torch.equal(sample(logits.expand(20, -1).contiguous(), one, step=0),
                       logits.argmax(-1).expand(20))


@pytest.mark.parametrize(("top_p", "support"), [(0.4, {1}), (0.6, {1, 3}), (0.9, {1, 3, 0})])
def test_top_p_support(top_p: float, support: set[int]) -> None:
    # Sorted probabilities: token 1 0.5, token 3 0.3, token 0 0.15, token 2 0.05.
    logits = _log_probs([0.15, 0.5, 0.05, 0.3])[None].expand(400, -1).contiguous()
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s) for s in range(400)]
    assert set(sample(logits, params, step=0).tolist()) == support


def test_sampled_frequencies_follow_the_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    logits = _log_probs(probs)[None].expand(n, -1).contiguous()
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
    counts = torch.bincount(sample(logits, params, step=1), minlength=4).double() / n
    # 4000 draws: the standard error of each frequency is below 0.008.
    assert torch.allclose(counts, torch.tensor(probs, dtype=torch.float64), atol=0.03)


def test_temperature_and_top_k_compose() -> None:
    # Temperature 0.5 squares the probabilities (0.01, 0.04, 0.49 before
    # renormalising); top_k=2 then drops token 0.
    logits = _log_probs([0.1, 0.2, 0.7])[None]
    n = 3000
    params = [SamplingParams(temperature=0.5, top_k=2, seed=s) for s in range(n)]
    tokens = sample(logits.expand(n, -1).contiguous(), params, step=0)
    assert 0 not in tokens.tolist()
    share = (tokens == 1).double().mean().item()
    assert abs(share - 0.2**2 / (0.2**2 + 0.7**2)) < 0.02


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"temperature": -0.1}, ValueError, "temperature"),
        ({"temperature": math.nan}, ValueError, "temperature"),
        ({"temperature": "hot"}, TypeError, "temperature"),
        ({"top_k": -1}, ValueError, "top_k"),
        ({"top_k": 2.5}, TypeError, "top_k"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"seed": -3}, ValueError, "seed"),
        ({"seed": 1.0}, TypeError, "seed"),
    ],
)
def test_validation_names_the_field(kwargs: dict, error: type, field: str) -> None:
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


def test_sample_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="len\\(params\\)"):
        sample(_logits(2, 10), [GREEDY], step=0)
    with pytest.raises(ValueError, match="len\\(step\\)"):
        sample(_logits(2, 10), [GREEDY, GREEDY], step=[0])
    with pytest.raises(TypeError, match="float32"):
        sample(_logits(2, 10).half(), [GREEDY, GREEDY], step=0)
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(10), [GREEDY], step=0)


def test_tiny_positive_temperature_is_refused():
    # logits / 1e-38 overflows to inf; such a temperature must be 0 (greedy) instead
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=1e-38, seed=1)
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
