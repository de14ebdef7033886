"""DSA indexer scores (prefill and paged decode) and top-k: Triton (interpreted) vs torch."""

import pytest
import torch
from lanekv.kernels.dsa.index_cache import IndexCacheSpec, read_index_k_ref, store_index_k_ref
from lanekv.kernels.dsa.indexer import (
    LARGE_STEP_CONFIG,
    IndexScoreConfig,
    default_index_score_config,
    index_score_programs,
    index_scores,
    index_scores_ref,
    index_scores_triton,
    index_topk,
    paged_index_keys_triton,
    paged_index_scores,
    paged_index_scores_ref,
    paged_index_scores_triton,
    score_keys_ref,
)

from tests.markers import requires_gpu


def _inputs(tq, tk, heads, dim, dtype, gen):
    q = torch.randn(tq, heads, dim, generator=gen).to(dtype)
    k = torch.randn(tk, dim, generator=gen).to(dtype)
    w = torch.randn(tq, heads, generator=gen)
    return q, k, w


def _direct(q, k, w, pos, scale):
    """The formula, spelled out per key in float64."""
    dots = torch.einsum("thd,sd->ths", q.double(), k.double()) * scale
    out = (w.double()[:, :, None] * dots.clamp_min(0)).sum(1)
    hidden = torch.arange(k.shape[0])[None, :] > pos[:, None]
    return out.masked_fill(hidden, float("-inf"))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
@pytest.mark.parametrize("tq,tk,heads,dim", [(7, 37, 3, 24), (16, 70, 4, 32)])
def test_index_scores_triton_and_ref_match_the_formula(dtype, tol, tq, tk, heads, dim):
    gen = torch.Generator().manual_seed(tq * tk)
    q, k, w = _inputs(tq, tk, heads, dim, dtype, gen)
    # A CP rank's queries: a few positions out of order, the last key's among them.
    pos = torch.randperm(tk, generator=gen)[:tq]
    pos[0] = tk - 1
    want = _direct(q, k, w, pos, 0.125).float()
    ref = index_scores_ref(q, k, w, pos, 0.125)
    got = index_scores_triton(q, k, w, pos, 0.125)
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(ref.isinf(), want.isinf())
    fin = want.isfinite()
    torch.testing.assert_close(ref[fin], want[fin], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[fin], ref[fin], atol=tol, rtol=tol)
    assert torch.equal(index_scores(q, k, w, pos, 0.125), ref)  # CPU dispatch is the reference


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "model"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_paged_index_scores_match_reference(cache_dtype, page_size):
    gen = torch.Generator().manual_seed(page_size)
    heads, dim, pages = 3, 32, 24
    spec = IndexCacheSpec(head_dim=dim, cache_dtype=cache_dtype, model_dtype=torch.float32,
                          block=16)
    pool = spec.alloc_pool(pages * page_size)
    store_index_k_ref(torch.randn(pool.shape[0], dim, generator=gen), pool,
                      torch.arange(pool.shape[0]), spec)
    seq_lens = torch.tensor([1, 13, 0, 9], dtype=torch.int32)
    width = 16 // page_size
    page_table = torch.stack([torch.randperm(pages, generator=gen)[:width] for _ in range(4)])
    page_table = page_table.int()
    q = torch.randn(4, heads, dim, generator=gen)
    w = torch.randn(4, heads, generator=gen)
    ref = paged_index_scores_ref(q, w, pool, page_table, seq_lens, page_size, 0.2, spec)
    got = paged_index_scores_triton(q, w, pool, page_table, seq_lens, page_size, 0.2, spec)
    assert got.shape == (4, 16)
    assert torch.equal(got.isinf(), ref.isinf())
    assert torch.equal(ref.isinf(), torch.arange(16)[None, :] >= seq_lens[:, None])
    torch.testing.assert_close(got[ref.isfinite()], ref[ref.isfinite()], atol=1e-4, rtol=1e-4)
    # The paged scores are the prefill scores of the last position over the dequantized keys.
    b = 1
    t = torch.arange(13)
    rows = page_table[b, t // page_size].long() * page_size + t % page_size
    keys = read_index_k_ref(pool, rows, spec).float()
    dense = index_scores_ref(q[b:b + 1], keys, w[b:b + 1], torch.tensor([12]), 0.2)
    torch.testing.assert_close(ref[b, :13], dense[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(paged_index_scores(q, w, pool, page_table, seq_lens, page_size, 0.2, spec),
                       ref)


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "model"])
def test_paged_index_scores_spread_over_programs_match_reference(cache_dtype):
    """Odd shapes (5 heads, 48 dims in 3 scale blocks, page 3) with several programs per
    request walking strided key blocks: some programs only write the ``-inf`` tail, one
    request is longer than the others' programs reach in one step, one is empty."""
    gen = torch.Generator().manual_seed(3)
    heads, dim, page, pages = 5, 48, 3, 40
    spec = IndexCacheSpec(head_dim=dim, cache_dtype=cache_dtype, model_dtype=torch.float32,
                          block=16)
    # Rows at a wider stride than the index row, as in the DSA pool plane.
    plane = torch.zeros(pages * page, spec.row_bytes + 12, dtype=torch.uint8)
    pool = plane[:, 4 : 4 + spec.row_bytes]
    store_index_k_ref(torch.randn(pool.shape[0], dim, generator=gen) * 3, pool,
                      torch.arange(pool.shape[0]), spec)
    width = 29  # 87 keys of room per request
    table = torch.stack([torch.randperm(pages, generator=gen)[:width] for _ in range(3)]).int()
    lens = torch.tensor([37, 0, 87], dtype=torch.int32)
    q = torch.randn(3, heads, dim, generator=gen)
    w = torch.randn(3, heads, generator=gen)
    ref = paged_index_scores_ref(q, w, pool, table, lens, page, 0.3, spec)
    cfg = IndexScoreConfig(block_n=16, programs_per_sm=10, num_stages=2)
    assert index_score_programs(3, width * page, 1, cfg) == 4  # of 6 key blocks a request
    for config in (cfg, None):
        got = paged_index_scores_triton(q, w, pool, table, lens, page, 0.3, spec, config=config)
        assert torch.equal(got.isinf(), ref.isinf())
        assert torch.equal(ref.isinf(), torch.arange(width * page)[None, :] >= lens[:, None])
        fin = ref.isfinite()
        torch.testing.assert_close(got[fin], ref[fin], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="config must be an IndexScoreConfig"):
        paged_index_scores_triton(q, w, pool, table, lens, page, 0.3, spec, config=(16, 1))


def test_default_scoring_config_by_shape():
    small = IndexScoreConfig(block_n=32, programs_per_sm=4, num_warps=4, num_stages=3)
    assert default_index_score_config(1, 8192) == small
    assert default_index_score_config(1, 131072) == small
    assert default_index_score_config(16, 8192) == small
    assert default_index_score_config(16, 131072) == LARGE_STEP_CONFIG
    assert LARGE_STEP_CONFIG == IndexScoreConfig(64, 4, 4, 2)


def test_topk_takes_all_visible_keys_when_fewer_and_pads():
    scores = torch.tensor([[0.5, float("-inf"), float("-inf")],
                           [0.1, 0.3, float("-inf")],
                           [0.2, 0.9, 0.4]])
    got = index_topk(scores, 2)
    assert got.dtype == torch.int32
    assert got[0].tolist() == [0, -1]
    assert sorted(got[1].tolist()) == [0, 1]
    assert sorted(got[2].tolist()) == [1, 2]
    wide = index_topk(scores, 5)  # more than the keys: every visible key, -1 padded
    assert wide.shape == (3, 5)
    assert sorted(wide[2].tolist()) == [-1, -1, 0, 1, 2]
    assert sorted(wide[0].tolist()) == [-1, -1, -1, -1, 0]


def test_topk_breaks_exact_ties_as_torch_topk():
    # Scores at exactly 0 after the relu tie; the set is torch.topk's on the same row.
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(6, 50, generator=gen).clamp_min(0)
    scores[:, 40:] = float("-inf")
    got = index_topk(scores, 30)
    want = scores.topk(30, dim=-1).indices
    for row in range(6):
        assert set(got[row].tolist()) == set(want[row].tolist())


def test_kernel_selection_differs_from_reference_only_at_near_ties():
    gen = torch.Generator().manual_seed(9)
    tq, tk, topk = 16, 64, 8
    q, k, w = _inputs(tq, tk, 4, 32, torch.float16, gen)
    pos = torch.arange(tk - tq, tk)
    ref = index_scores_ref(q, k, w, pos, 0.25)
    got = index_scores_triton(q, k, w, pos, 0.25)
    sel_ref, sel_got = index_topk(ref, topk), index_topk(got, topk)
    kth = ref.topk(topk, dim=-1).values[:, -1]
    swapped = 0
    for row in range(tq):
        a, b = set(sel_ref[row].tolist()), set(sel_got[row].tolist())
        for key in a ^ b:  # a key in one set only scores within rounding of the cut
            assert abs(float(ref[row, key]) - float(kth[row])) <= 2e-2 * (1 + abs(float(kth[row])))
        swapped += len(a ^ b)
    assert swapped <= tq  # near-ties are rare, not the rule


def test_fp8_selection_matches_model_dtype_except_within_the_quantization_bound():
    # The same keys in an fp8 pool and a model-dtype pool: each score moves by at most
    # sum_h |w_h| * scale * sum_d |q_hd| * |k_d - fp8(k_d)|, and a key kept by one pool
    # only scores within the two keys' bounds of the key it displaced.
    gen = torch.Generator().manual_seed(21)
    heads, dim, seq_len, topk = 4, 32, 48, 12
    keys = torch.randn(seq_len, dim, generator=gen)
    q = torch.randn(1, heads, dim, generator=gen)
    w = torch.randn(1, heads, generator=gen)
    table = torch.arange(seq_len // 4, dtype=torch.int32)[None]
    lens = torch.tensor([seq_len], dtype=torch.int32)
    scores, deq = {}, None
    for cache_dtype in ("fp8_e4m3", "model"):
        spec = IndexCacheSpec(head_dim=dim, cache_dtype=cache_dtype, model_dtype=torch.float32,
                              block=16)
        pool = spec.alloc_pool(seq_len)
        store_index_k_ref(keys, pool, torch.arange(seq_len), spec)
        scores[cache_dtype] = paged_index_scores_triton(q, w, pool, table, lens, 4, 0.2, spec)[0]
        if cache_dtype == "fp8_e4m3":
            deq = read_index_k_ref(pool, torch.arange(seq_len), spec)
    bound = 0.2 * (w[0].abs()[:, None] * (q[0].abs() @ (keys - deq).abs().T)).sum(0)  # [seq_len]
    exact, fp8 = scores["model"], scores["fp8_e4m3"]
    assert ((fp8 - exact).abs() <= bound * 1.01 + 1e-5).all()
    a = set(index_topk(exact[None], topk)[0].tolist())
    b = set(index_topk(fp8[None], topk)[0].tolist())
    for gained in b - a:
        for lost in a - b:
            assert float(exact[lost] - exact[gained]) <= float(bound[lost] + bound[gained]) + 1e-5
    assert 0 < len(a ^ b) <= 4  # this seed swaps one near-tied pair: the case is exercised


def test_arguments_are_refused_by_name():
    q, k, w = torch.zeros(3, 2, 16), torch.zeros(5, 16), torch.zeros(3, 2)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="weights has shape"):
        index_scores_triton(q, k, w[:, :1], pos, 1.0)
    with pytest.raises(ValueError, match="k rows have 8 values"):
        index_scores_ref(q, k[:, :8], w, pos, 1.0)
    with pytest.raises(ValueError, match="k.dtype is torch.float16"):
        index_scores_triton(q, k.half(), w, pos, 1.0)
    with pytest.raises(ValueError, match="q_positions must be a 1-D int64"):
        index_scores_ref(q, k, w, pos.int(), 1.0)
    with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
        index_scores_triton(q, k, w, pos, float("nan"))
    with pytest.raises(ValueError, match="weights.dtype must be one of"):
        index_scores_ref(q, k, w.half(), pos, 1.0)
    spec = IndexCacheSpec(head_dim=16, model_dtype=torch.float32, block=16)
    pool = spec.alloc_pool(8)
    table, lens = torch.zeros(3, 2, dtype=torch.int32), torch.tensor([1, 2, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens holds 9, outside"):
        paged_index_scores_triton(q, w, pool, table, lens, 4, 1.0, spec)
    with pytest.raises(ValueError, match="page_table holds page 5"):
        paged_index_scores_ref(q, w, pool, table + 5, lens.clamp_max(8), 4, 1.0, spec)
    with pytest.raises(ValueError, match="pool must be a uint8 tensor"):
        paged_index_scores_triton(q, w, pool[:, :16], table, lens.clamp_max(8), 4, 1.0, spec)
    with pytest.raises(ValueError, match="page_size must be a positive int dividing"):
        paged_index_scores_ref(q, w, pool, table, lens.clamp_max(6), 3, 1.0, spec)
    with pytest.raises(ValueError, match="topk must be a positive int"):
        index_topk(torch.zeros(2, 3), 0)


@requires_gpu
def test_indexer_gpu_bf16_matches_reference():
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, dim = 64, 128
    q = torch.randn(256, heads, dim, device="cuda", generator=gen).bfloat16()
    k = torch.randn(4096, dim, device="cuda", generator=gen).bfloat16()
    w = torch.randn(256, heads, device="cuda", generator=gen)
    pos = torch.arange(4096 - 256, 4096, device="cuda")
    ref = index_scores_ref(q, k, w, pos, dim ** -0.5)
    got = index_scores_triton(q, k, w, pos, dim ** -0.5)
    fin = ref.isfinite()
    assert torch.equal(got.isfinite(), fin)
    torch.testing.assert_close(got[fin], ref[fin], atol=5e-2, rtol=2e-2)
    for cache_dtype in ("fp8_e4m3", "model"):
        spec = IndexCacheSpec(head_dim=dim, cache_dtype=cache_dtype)
        pool = spec.alloc_pool(8192, "cuda")
        t = torch.arange(4096, device="cuda")
        store_index_k_ref(k, pool, (t // 16 * 2) * 16 + t % 16, spec)  # logical page p at 2p
        table = (torch.arange(256, device="cuda") * 2).int()[None].repeat(8, 1)  # page size 16
        lens = torch.tensor([4096, 1, 17, 300, 2048, 4000, 16, 33], dtype=torch.int32,
                            device="cuda")
        qd, wd = q[:8], w[:8]
        want = paged_index_scores_ref(qd, wd, pool, table, lens, 16, 0.1, spec)
        have = paged_index_scores_triton(qd, wd, pool, table, lens, 16, 0.1, spec)
        assert torch.equal(have.isfinite(), want.isfinite())
        torch.testing.assert_close(have[want.isfinite()], want[want.isfinite()], atol=5e-2,
                                   rtol=2e-2)


@requires_gpu
@pytest.mark.parametrize("fp8_latent", [False, True])
def test_paged_index_scores_gpu_long_context_on_the_dsa_plane(fp8_latent):
    """V3.2's index rows inside the DSA pool plane (1296- or 800-byte rows, 16-byte
    vector loads), batch 1 over 20k keys in page 64 (hundreds of programs, each many
    key blocks) and batch 3, for each launch config the bench sweeps."""
    from lanekv.kernels.dsa.pool_layout import DSARowLayout
    from lanekv.kernels.dsa.select import first_topk_ref, topk_of_keys_triton

    lay = DSARowLayout(576, IndexCacheSpec(128, "fp8_e4m3", torch.bfloat16),
                       fp8_rank=512 if fp8_latent else 0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = 384 * 64
    plane = torch.zeros(rows, lay.head_dim, dtype=lay.dtype, device="cuda")
    index = lay.index_rows(plane)
    keys = (torch.randn(rows, 128, device="cuda", generator=gen) * 2).bfloat16()
    store_index_k_ref(keys, index, torch.arange(rows, device="cuda"), lay.index)
    table = torch.randperm(384, device="cuda", generator=gen).int().view(1, 384)
    for lens in ([20000], [64 * 384 - 5, 1, 0]):
        t = table.repeat(len(lens), 1)
        n = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(len(lens), 64, 128, device="cuda", generator=gen).bfloat16()
        w = torch.randn(len(lens), 64, device="cuda", generator=gen)
        ref = paged_index_scores_ref(q, w, index, t, n, 64, 128 ** -0.5, lay.index)
        fin = ref.isfinite()
        for cfg in (None, IndexScoreConfig(32, 2, 4, 2), IndexScoreConfig(128, 8, 8, 3)):
            got = paged_index_scores_triton(q, w, index, t, n, 64, 128 ** -0.5, lay.index,
                                            config=cfg)
            assert torch.equal(got.isfinite(), fin)
            torch.testing.assert_close(got[fin], ref[fin], atol=5e-2, rtol=2e-2)
            keys = paged_index_keys_triton(q, w, index, t, n, 64, 128 ** -0.5, lay.index,
                                           config=cfg)
            assert torch.equal(keys, score_keys_ref(got))  # the same scores, as keys
            assert torch.equal(topk_of_keys_triton(keys, 2048), first_topk_ref(got, 2048))
