"""moe_route: the one-launch router kernel (interpreted on CPU) against the torch router
ops, softmax and sigmoid scoring, with and without group limits, odd group sizes."""

import pytest
import torch
from lanekv.kernels.moe.route import moe_route, moe_route_ref, moe_route_triton

from tests.markers import requires_gpu


def _by_id(weights, ids):
    """Each row's (ids, weights) sorted by id: the kernel's order of the k choices is its own."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


CASES = [
    # experts, top_k, n_group, topk_group, scoring, norm, scaling
    (8, 2, 1, 1, "softmax", False, 1.0),  # V2-Lite-like
    (12, 3, 4, 2, "softmax", True, 1.0),  # group-limited, groups of 3 (no power of two)
    (16, 3, 4, 2, "sigmoid", True, 2.5),  # V3-like
    (24, 4, 3, 1, "sigmoid", False, 1.5),  # one group of 8 kept
    (10, 3, 1, 1, "sigmoid", True, 1.0),
]


@pytest.mark.parametrize("experts,top_k,n_group,topk_group,scoring,norm,scaling", CASES)
def test_triton_matches_reference(experts, top_k, n_group, topk_group, scoring, norm, scaling):
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = torch.randn(7, experts, generator=gen) * 3
    bias = torch.randn(experts, generator=gen) * 0.5 if scoring == "sigmoid" else None
    args = (logits, bias, top_k, n_group, topk_group, scoring, norm, scaling)
    want_ids, want_w = _by_id(*moe_route_ref(*args))
    got_ids, got_w = _by_id(*moe_route_triton(*args))
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32


def test_group_limit_is_kept():
    """Sigmoid with a large bias on group 0's experts: every pick comes from the best two
    groups, and a row's weights sum to the scaling factor with norm_topk_prob."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(20, 16, generator=gen)
    bias = torch.zeros(16)
    bias[:4] = 5.0  # group 0 always ranks first
    weights, ids = moe_route_triton(logits, bias, 3, 4, 2, "sigmoid", True, 2.5)
    groups = ids // 4
    assert (groups == 0).any(dim=1).all()
    assert all(len(set(row)) <= 2 for row in groups.tolist())
    torch.testing.assert_close(weights.sum(-1), torch.full((20,), 2.5))


def test_dispatcher_and_empty(monkeypatch: pytest.MonkeyPatch):
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(
        moe_route(logits, None, 2, 1, 1, "softmax", False, 1.0),
        moe_route_ref(logits, None, 2, 1, 1, "softmax", False, 1.0)))
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    ids = moe_route(logits, None, 2, 1, 1, "softmax", False, 1.0)[1]
    assert torch.equal(ids.sort(-1)[0], logits.topk(2)[1].sort(-1)[0])
    weights, ids = moe_route_triton(torch.zeros(0, 8), None, 2, 1, 1, "softmax", False, 1.0)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("change,match", [
    ({"logits": torch.zeros(3, 8, dtype=torch.float16)}, "logits must be a float32"),
    ({"scoring": "relu"}, "scoring='relu'"),
    ({"n_group": 3}, "n_group=3 must be a positive int dividing"),
    ({"topk_group": 3}, "topk_group=3 must be an int"),
    ({"top_k": 5}, "top_k=5 must be an int in \\[1, 4\\]"),
    ({"bias": torch.zeros(8)}, "correction_bias is only for sigmoid"),
    ({"scoring": "sigmoid"}, "correction_bias must be a float32 tensor \\[8\\]"),
    ({"norm": 1}, "norm_topk_prob must be a bool"),
    ({"scaling": float("nan")}, "scaling must be a finite number"),
])
def test_bad_arguments_are_refused(change, match):
    args = {"logits": torch.zeros(3, 8), "bias": None, "top_k": 2, "n_group": 2,
            "topk_group": 1, "scoring": "softmax", "norm": False, "scaling": 1.0}
    args.update(change)
    for impl in (moe_route_triton, moe_route_ref):
        with pytest.raises(ValueError, match=match):
            impl(*args.values())


@requires_gpu
@pytest.mark.parametrize("experts,top_k,n_group,topk_group,scoring,norm,scaling", [
    (64, 6, 1, 1, "softmax", False, 1.0),  # DeepSeek-V2-Lite
    (256, 8, 8, 4, "sigmoid", True, 2.5),  # DeepSeek-V3
    (128, 8, 1, 1, "softmax", True, 1.0),  # Qwen3-MoE
])
def test_gpu_matches_reference(experts, top_k, n_group, topk_group, scoring, norm, scaling):
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, experts, device="cuda", generator=gen)
    bias = torch.randn(experts, device="cuda", generator=gen) * 0.1 if scoring == "sigmoid" else None
    args = (logits, bias, top_k, n_group, topk_group, scoring, norm, scaling)
    want_ids, want_w = _by_id(*moe_route_ref(*args))
    got_ids, got_w = _by_id(*moe_route_triton(*args))
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
