"""The decode selection as a captured step runs it: index scores over a page table
wider than any request (the graph's width, stale page ids past each request's
pages), keys past ``seq_len`` at ``-inf``, ``first_topk``, then sparse MLA decode
skipping the ``-1`` slots. It must select and attend what the exact per-request
path does, for requests longer than ``topk``, shorter than it, and padding rows
(``seq_len`` 0); exact ties go to the lowest positions whatever the width."""

import pytest
import torch
from lanekv.kernels.dsa.index_cache import IndexCacheSpec, store_index_k_ref
from lanekv.kernels.dsa.indexer import (
    IndexScoreConfig,
    paged_index_keys,
    paged_index_keys_ref,
    paged_index_keys_triton,
    paged_index_scores_ref,
    paged_index_scores_triton,
    score_keys_ref,
)
from lanekv.kernels.dsa.pool_layout import DSARowLayout
from lanekv.kernels.dsa.select import (
    decode_select,
    first_topk,
    first_topk_ref,
    first_topk_triton,
    select_fixed_width,
    topk_of_keys,
    topk_of_keys_ref,
    topk_of_keys_triton,
)
from lanekv.kernels.dsa.sparse_mla import sparse_mla_decode_ref, sparse_mla_decode_triton
from lanekv.kernels.dsa.topk import radix_topk_ref

from tests.markers import requires_gpu

LATENT, ROPE, DIM, PAGE, TOPK = 16, 8, 32, 4, 6


@pytest.mark.parametrize("first_topk", [first_topk_ref, first_topk_triton])
def test_first_topk_matches_topk_and_breaks_ties_to_the_lowest_position(first_topk):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 50, generator=gen)
    got = first_topk(scores, 7)
    assert torch.equal(got.long().sort().values, scores.topk(7).indices.sort().values)
    tied = torch.tensor([[0.0, -0.0, 2.0, 0.0, float("-inf"), -1.0, 0.0]])
    assert first_topk(tied, 4).tolist() == [[2, 0, 1, 3]]  # -0.0 ties with 0.0
    assert first_topk(tied, 9).tolist() == [[2, 0, 1, 3, 6, 5, -1, -1, -1]]
    wider = torch.cat([tied, torch.full((1, 40), float("-inf"))], dim=1)
    for k in (1, 3, 4, 6, 9):
        assert torch.equal(first_topk(wider, k), first_topk(tied, k))
    assert first_topk(torch.empty(0, 5), 3).shape == (0, 3)
    with pytest.raises(ValueError, match="topk must be"):
        first_topk(scores, 0)
    with pytest.raises(ValueError, match="scores must be"):
        first_topk(scores.double(), 2)
    assert torch.equal(first_topk(scores, 70), first_topk_ref(scores, 70))  # k past the width


def _setup(cache_dtype: str):
    lay = DSARowLayout(LATENT + ROPE, IndexCacheSpec(DIM, cache_dtype, torch.float32, block=16))
    gen = torch.Generator().manual_seed(7)
    plane = torch.randn(12 * PAGE, lay.head_dim, generator=gen)
    index = lay.index_rows(plane)
    store_index_k_ref(torch.randn(index.shape[0], DIM, generator=gen), index,
                      torch.arange(index.shape[0]), lay.index)
    # request 0: 3 pages, 11 keys; 1: 4 keys (< TOPK); 2: padding (seq_len 0); 3: 1 key
    exact = torch.tensor([[5, 2, 9], [7, 0, 0], [0, 0, 0], [3, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([11, 4, 0, 1], dtype=torch.int32)
    wide = torch.cat([exact, torch.tensor([[8, 1, 11, 4, 6]] * 4, dtype=torch.int32)], dim=1)
    q, w = torch.randn(4, 3, DIM, generator=gen), torch.randn(4, 3, generator=gen)
    return lay, plane, index, exact, wide, lens, q, w, gen


@pytest.mark.parametrize("cache_dtype", ["model", "fp8_e4m3"])
def test_fixed_width_selection_and_attention_equal_the_exact_path(cache_dtype):
    lay, plane, index, exact, wide, lens, q, w, gen = _setup(cache_dtype)
    scores = paged_index_scores_triton(q, w, index, wide, lens, PAGE, 0.3, lay.index)
    assert scores.shape == (4, wide.shape[1] * PAGE)
    chosen = first_topk(scores, TOPK)
    want = decode_select(q, w, index, exact, lens, PAGE, 0.3, TOPK, lay.index)  # exact lengths
    for b, n in enumerate(lens.tolist()):
        assert sorted(chosen[b].tolist()) == sorted(want[b].tolist())
        assert (chosen[b] >= 0).sum() == min(n, TOPK)  # past seq_len: never chosen, -1
    assert (chosen[2] == -1).all()
    qa = torch.randn(4, 2, LATENT + ROPE, generator=gen)
    got = sparse_mla_decode_triton(qa, lay.latent(plane), wide, chosen, PAGE, 0.25, LATENT)
    ref = sparse_mla_decode_ref(qa, lay.latent(plane), exact, want, PAGE, 0.25, LATENT)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert (got[2] == 0).all()  # a padding row attends nothing


@pytest.mark.parametrize("cache_dtype", ["model", "fp8_e4m3"])
def test_keys_written_by_the_scoring_kernel_select_what_first_topk_selects(cache_dtype):
    """The scoring kernel's int64 keys are ``first_topk``'s keys of its own float32
    scores bit for bit (several programs a request, the ``-inf`` tail included), and
    their top-k is ``first_topk``'s: exact ties (zero index keys) go to the lowest
    positions, over the exact width and over a wider one alike."""
    lay, plane, index, exact, wide, lens, q, w, gen = _setup(cache_dtype)
    zero = torch.zeros(4, DIM)
    store_index_k_ref(zero, index, torch.tensor([5 * PAGE, 5 * PAGE + 2, 2 * PAGE + 1, 7 * PAGE]),
                      lay.index)  # request 0's positions 0, 2, 5 and request 1's 0 score 0
    cfg = IndexScoreConfig(block_n=16, programs_per_sm=3, num_stages=2)
    for table in (exact, wide):
        scores = paged_index_scores_triton(q, w, index, table, lens, PAGE, 0.3, lay.index,
                                           config=cfg)
        keys = paged_index_keys_triton(q, w, index, table, lens, PAGE, 0.3, lay.index,
                                       config=cfg)
        assert keys.dtype == torch.int64 and torch.equal(keys, score_keys_ref(scores))
        assert (scores[0] == 0).sum() >= 3  # exact ties, inside request 0's top 6
        ref = paged_index_scores_ref(q, w, index, table, lens, PAGE, 0.3, lay.index)
        assert torch.equal(paged_index_keys_ref(q, w, index, table, lens, PAGE, 0.3, lay.index),
                           score_keys_ref(ref))
        assert torch.equal(paged_index_keys(q, w, index, table, lens, PAGE, 0.3, lay.index),
                           score_keys_ref(ref))  # CPU dispatch: the reference
        for k in (1, 3, TOPK, 20):
            want = first_topk_ref(scores, k)
            assert torch.equal(topk_of_keys_triton(keys, k), want)
            assert torch.equal(topk_of_keys_ref(keys, k), want)
            assert torch.equal(topk_of_keys(keys, k), want)
    got = select_fixed_width(q, w, index, wide, lens, PAGE, 0.3, TOPK, lay.index)  # CPU: torch
    assert torch.equal(got, select_fixed_width(q, w, index, exact, lens, PAGE, 0.3, TOPK,
                                               lay.index))
    assert torch.equal(got, radix_topk_ref(ref, TOPK))  # first_topk's set, ascending
    with pytest.raises(ValueError, match="keys must be a 2-D torch.int64"):
        topk_of_keys_triton(scores, 2)


@requires_gpu
def test_cuda_selection_does_not_depend_on_the_table_width():
    """On CUDA ``decode_select`` is the fixed-width path; a wider table (a captured
    step's) selects the same positions, exact ties included (zero index keys)."""
    lay = DSARowLayout(576, IndexCacheSpec(128, "fp8_e4m3", torch.bfloat16))
    gen = torch.Generator(device="cuda").manual_seed(0)
    plane = torch.randn(64 * 64, lay.head_dim, device="cuda", generator=gen).bfloat16()
    keys = (torch.randn(plane.shape[0], 128, device="cuda", generator=gen) * 2).bfloat16()
    keys[::3] = 0  # every third key scores exactly 0: ties
    store_index_k_ref(keys, lay.index_rows(plane), torch.arange(plane.shape[0], device="cuda"),
                      lay.index)
    table = torch.randperm(64, device="cuda", generator=gen)[:48].int().view(4, 12)
    wide = torch.cat([table, table.flip(1)], dim=1)
    lens = torch.tensor([768, 1, 0, 513], dtype=torch.int32, device="cuda")
    q = torch.randn(4, 64, 128, device="cuda", generator=gen).bfloat16()
    w = -torch.rand(4, 64, device="cuda", generator=gen)  # negative weights: zeros score best
    index = lay.index_rows(plane)
    narrow = decode_select(q, w, index, table, lens, 64, 0.1, 256, lay.index)
    assert torch.equal(decode_select(q, w, index, wide, lens, 64, 0.1, 256, lay.index), narrow)
    assert (narrow[2] == -1).all() and (narrow[1, 1:] == -1).all() and narrow[1, 0] == 0
