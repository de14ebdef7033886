"""paged_mla_decode_attention: Triton (interpreted on CPU) and reference vs float64 math.

Latent pools are 5-D ``[L, 1, rows, 1, R+P]`` as the MLA pool keeps them, and
the kernels read the per-layer view ``pool[l, 0, :, 0, :]``. Rows no request
reaches are NaN, so a read past a request's last key shows in the output.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from lanekv.kernels.mla.absorb import (
    mla_absorb_query_ref,
    mla_absorb_query_triton,
    mla_expand_output_ref,
    mla_expand_output_triton,
)
from lanekv.kernels.mla.latent_rows import row_stride_args, stride_align
from lanekv.kernels.mla.merge import merge_mla_partials
from lanekv.kernels.mla.paged_decode import (
    paged_mla_decode_attention,
    paged_mla_decode_attention_triton,
)
from lanekv.kernels.mla.paged_decode_ref import paged_mla_decode_attention_ref
from lanekv.kernels.mla.splits import (
    MLADecodeConfig,
    busy_splits_ref,
    choose_mla_splits,
    choose_split_keys,
    default_mla_config,
)

from tests.markers import requires_gpu

RANK, ROPE = 32, 8


class Problem(NamedTuple):
    q: torch.Tensor  # [B, H, R+P]
    latent: torch.Tensor  # [rows, R+P], a view of a [L, 1, rows, 1, R+P] pool
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32


def make_problem(heads, page_size, seq_lens, dtype, *, rank=RANK, rope=ROPE, seed=0,
                 device="cpu", layer=1) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    batch, width = len(seq_lens), rank + rope
    max_pages = max(1, max(math.ceil(n / page_size) for n in seq_lens) + 1)
    num_pages = batch * max_pages + 3
    rows = num_pages * page_size
    pool = torch.full((3, 1, rows, 1, width), float("nan"))
    perm = torch.randperm(num_pages, generator=gen)[: batch * max_pages]
    page_table = perm.view(batch, max_pages).to(torch.int32)
    for b, n in enumerate(seq_lens):  # only the rows a request reaches hold numbers
        t = torch.arange(n)
        used = page_table[b, t // page_size].long() * page_size + t % page_size
        pool[layer, 0, used, 0] = torch.randn(n, width, generator=gen)
    q = torch.randn(batch, heads, width, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    pool = pool.to(device=device, dtype=dtype)
    return Problem(q.to(device=device, dtype=dtype), pool[layer, 0, :, 0, :],
                   page_table.to(device), lens.to(device))


def naive_mla(p: Problem, page_size: int, scale: float, rank: int) -> torch.Tensor:
    """float64, one (request, head) at a time; latent rows gathered page by page."""
    batch, heads, _ = p.q.shape
    out = torch.zeros(batch, heads, rank, dtype=torch.float64)
    for b in range(batch):
        n = int(p.seq_lens[b])
        if n == 0:
            continue
        rows = []
        for slot in range(math.ceil(n / page_size)):
            first = int(p.page_table[b, slot]) * page_size
            rows.extend(range(first, first + page_size))
        latent = p.latent.cpu()[torch.tensor(rows[:n])].double()  # [n, R+P]
        for h in range(heads):
            logits = latent @ p.q[b, h].cpu().double() * scale
            weights = torch.exp(logits - logits.max())
            out[b, h] = (weights / weights.sum()) @ latent[:, :rank]
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-12)).item()


CASES = [
    # (heads, page_size, seq_lens): lengths cross page and key-block edges
    (4, 1, [1, 9, 70]),
    (4, 4, [70, 0, 5, 33]),
    (4, 16, [130, 17]),
    (20, 4, [37, 16]),  # two head blocks, the second partly padding
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("heads,page_size,seq_lens", CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_mla_decode_matches_float64(dtype, heads, page_size, seq_lens, num_splits):
    p = make_problem(heads, page_size, seq_lens, dtype, seed=page_size + heads)
    scale = 0.7 / math.sqrt(RANK + ROPE)
    want = naive_mla(p, page_size, scale, RANK)
    out = torch.full((len(seq_lens), heads, RANK), float("nan"), dtype=dtype)
    got = paged_mla_decode_attention_triton(*p, page_size, scale, RANK, out=out,
                                            num_splits=num_splits,
                                            config=MLADecodeConfig(block_n=16))
    assert got is out
    assert not torch.isnan(out).any()
    # fp16 rounds the probabilities before the PV product (as flash decoding does).
    assert rel_err(out, want) < (2e-3 if dtype == torch.float16 else 1e-5)
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_reference_matches_float64(dtype):
    p = make_problem(4, 4, [33, 0, 1, 12], dtype, seed=11)
    want = naive_mla(p, 4, 0.3, RANK)
    got = paged_mla_decode_attention_ref(*p, 4, 0.3, RANK)
    assert got.shape == (4, 4, RANK)
    assert rel_err(got, want) < (1e-3 if dtype == torch.float16 else 1e-6)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.equal(paged_mla_decode_attention(*p, 4, 0.3, RANK), got)


@pytest.mark.parametrize("rank,rope", [(24, 1), (20, 12)])
def test_odd_dims(rank, rope):
    # R and P off powers of two (a single RoPE value too) take masked columns.
    p = make_problem(4, 4, [21, 6], torch.float32, rank=rank, rope=rope, seed=rank)
    want = naive_mla(p, 4, 0.2, rank)
    got = paged_mla_decode_attention_triton(*p, 4, 0.2, rank, num_splits=2)
    assert rel_err(got, want) < 1e-5


def test_dispatcher_runs_triton_when_asked(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    p = make_problem(4, 4, [19, 3], torch.float16, seed=2)
    got = paged_mla_decode_attention(*p, 4, 0.2, RANK, num_splits=2)
    assert torch.equal(got, paged_mla_decode_attention_triton(*p, 4, 0.2, RANK, num_splits=2))
    assert not torch.equal(got, paged_mla_decode_attention_ref(*p, 4, 0.2, RANK))


def test_into_strided_out_and_default_config():
    p = make_problem(4, 16, [40, 3], torch.float32, seed=4)
    want = naive_mla(p, 16, 0.25, RANK)
    wide = torch.full((2, 4, RANK + 16), float("nan"))
    out = wide[:, :, 8 : 8 + RANK]
    paged_mla_decode_attention_triton(*p, 16, 0.25, RANK, out=out)
    assert rel_err(out, want) < 1e-5
    assert torch.isnan(wide[:, :, :8]).all() and torch.isnan(wide[:, :, 8 + RANK :]).all()


def test_fixed_grid_serves_any_lengths():
    # One num_splits and one page-table width (a captured graph's) for shorter and longer batches.
    p = make_problem(4, 4, [60, 60], torch.float32, seed=9)
    for lens in ([1, 60], [59, 0], [13, 44]):
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        q = p._replace(seq_lens=seq_lens)
        got = paged_mla_decode_attention_triton(*q, 4, 0.3, RANK, num_splits=4)
        assert rel_err(got, naive_mla(q, 4, 0.3, RANK)) < 1e-5


def test_wide_head_blocks():
    # The many-heads tiles (64 heads a block) on 20 heads: one block, 44 rows of padding.
    p = make_problem(20, 4, [37, 5], torch.float32, seed=8)
    cfg = default_mla_config(128)
    assert cfg.block_h == 64 and default_mla_config(16).block_h == 16
    got = paged_mla_decode_attention_triton(*p, 4, 0.3, RANK, num_splits=2, config=cfg)
    assert rel_err(got, naive_mla(p, 4, 0.3, RANK)) < 1e-5


def test_split_keys_are_one_key_block_where_programs_are_few():
    """Batch 1 to 8 at 16 heads on 132 SMs split a context into 32-key blocks (a 1k-token
    request: 33 busy programs), more programs take min_split_keys, rounded to key blocks."""
    cfg = MLADecodeConfig()
    assert [choose_split_keys(n, 132, cfg) for n in (1, 8, 9, 64, 0)] == [32, 32, 64, 64, 64]
    assert busy_splits_ref(1025, choose_mla_splits(1, 1 << 16, 132, cfg, split_keys=32), 32,
                           32)[0] == 33
    assert choose_split_keys(1, 132, cfg._replace(few_programs_split_keys=0)) == 64
    assert choose_split_keys(1, 132, MLADecodeConfig(block_n=16, min_split_keys=40)) == 32
    assert choose_split_keys(3, 132, MLADecodeConfig(block_n=16, min_split_keys=40)) == 32
    assert choose_split_keys(9, 132, MLADecodeConfig(block_n=16, min_split_keys=40)) == 48
    assert choose_split_keys(1, 1, cfg) == 64  # the interpreter's one "SM"


def test_choose_mla_splits_fills_the_gpu():
    cfg = MLADecodeConfig()
    assert choose_mla_splits(1, 1 << 20, 132, cfg) == 2 * 132  # one request, one head block
    assert choose_mla_splits(1, 4096, 132, cfg, split_keys=32) == 128  # never fewer keys
    assert choose_mla_splits(1, 8192, 132, cfg) == 8192 // cfg.min_split_keys
    assert choose_mla_splits(1, 512, 132, cfg) == 512 // cfg.min_split_keys  # never fewer keys
    assert choose_mla_splits(64 * 8, 8192, 132, cfg) == 1
    assert choose_mla_splits(0, 100, 132, cfg) == 1


def test_row_strides_go_divided_by_their_power_of_two():
    # a DSA plane's bf16 rows (648 values), its FP8 rows' scales (200 floats), odd strides
    assert [stride_align(s) for s in (648, 800, 200, 576, 13, 6, 0)] == [8, 16, 8, 16, 1, 2, 16]
    assert row_stride_args((648, 200, 13)) == ((81, 25, 13),
                                              {"ALIGN_LR": 8, "ALIGN_SR": 8, "ALIGN_PR": 1})


def test_busy_splits_cover_every_key_once():
    """A request's busy splits: at most num_splits, none empty, together every key once,
    each more than half split_keys keys (whole blocks) unless num_splits caps their count."""
    for num_splits in (1, 3, 8, 264):
        for seq_len in (0, 1, 15, 16, 17, 63, 64, 65, 1025, 5000):
            for split_keys, block_n in ((16, 16), (64, 32), (256, 32)):
                busy, per = busy_splits_ref(seq_len, num_splits, split_keys, block_n)
                assert 0 <= busy <= num_splits and per % block_n == 0 and per > 0
                assert busy == (0 if seq_len == 0 else -(-seq_len // per))
                assert (busy - 1) * per < seq_len <= busy * per or seq_len == busy == 0
                if busy > 1 and busy < num_splits:
                    assert 2 * per > split_keys


@pytest.mark.parametrize("splits", [5, 37])  # one loop step of 8 splits (interpreted); five
def test_merge_without_lengths_takes_every_split(splits):
    """The sparse kernel's merge (no lengths): every split, -inf lse for an empty one, and
    a single split copied through; all empty gives zeros."""
    gen = torch.Generator().manual_seed(6)
    part_o = torch.randn(2, 3, splits, 20, generator=gen)
    lse = torch.randn(2, 3, splits, generator=gen)
    lse[0, :, 1] = float("-inf")
    lse[1, 2] = float("-inf")
    out = torch.full((2, 3, 20), float("nan"))
    merge_mla_partials(part_o, lse, out)
    w = torch.exp2(lse - lse.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)).nan_to_num(0.0)
    want = (w[..., None] * part_o.nan_to_num(0.0)).sum(2) / w.sum(-1, keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1, 2], torch.zeros(20))
    one = torch.full((2, 3, 20), float("nan"))
    merge_mla_partials(part_o[:, :, :1].contiguous(), lse[:, :, :1].clamp_min(0.0).contiguous(), one)
    torch.testing.assert_close(one, part_o[:, :, 0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("heads,page_size,block_n,split_keys", [(4, 3, 16, 16), (20, 5, 16, 40)])
def test_wide_grid_busy_and_direct_requests(heads, page_size, block_n, split_keys):
    """A captured-size grid (8 splits) over lengths that use none, one (written straight to
    out, the merge leaving it) and several splits, in one batch; out starts NaN."""
    lens = [0, 5, 16, 17, 40, 131]
    p = make_problem(heads, page_size, lens, torch.float32, seed=heads + page_size)
    cfg = MLADecodeConfig(block_n=block_n, min_split_keys=split_keys)
    out = torch.full((len(lens), heads, RANK), float("nan"))
    paged_mla_decode_attention_triton(*p, page_size, 0.3, RANK, out=out, num_splits=8, config=cfg)
    assert not out.isnan().any()
    assert rel_err(out, naive_mla(p, page_size, 0.3, RANK)) < 1e-5
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    used = [busy_splits_ref(n, 8, -(-split_keys // block_n) * block_n, block_n)[0] for n in lens]
    assert used[1] == 1 and max(used) > 2  # both kinds are in the batch


@pytest.mark.parametrize("impl", [paged_mla_decode_attention_triton, paged_mla_decode_attention_ref])
def test_rejects_bad_arguments(impl):
    q, latent, table, lens = make_problem(4, 2, [3, 4], torch.float32, seed=0)
    bad = [
        (dict(q=q[0]), "q must be a 3-D"),
        (dict(q=q.to(torch.int32)), "q.dtype must be"),
        (dict(latent=latent.half()), "latent_cache.dtype is"),
        (dict(latent=latent[:, :-1]), r"latent_cache must be \[rows, 40\]"),
        (dict(latent=torch.zeros(latent.shape[0], 80)[:, ::2]), "latent_cache must have a dense"),
        (dict(rank=0), "kv_lora_rank must be an int"),
        (dict(rank=40), r"kv_lora_rank must be an int in \[1, 39\]"),
        (dict(rank=32.0), "kv_lora_rank must be an int"),
        (dict(table=table.long()), "page_table must be a 2-D int32"),
        (dict(table=torch.zeros(2, 8, dtype=torch.int32)[:, ::2]), "page_table must have a dense"),
        (dict(lens=lens[:1]), "seq_lens has 1 entries"),
        (dict(lens=torch.tensor([3, 99], dtype=torch.int32)), r"seq_lens holds 99, outside \[0, 6\]"),
        (dict(lens=torch.tensor([3, -1], dtype=torch.int32)), "seq_lens holds -1, outside"),
        (dict(table=table + 10_000), "page_table holds page 100"),
        (dict(page_size=0), "page_size must be"),
        (dict(page_size=4), "18 rows, not a multiple of page_size 4"),
        (dict(scale=float("inf")), "softmax_scale"),
        (dict(scale=-1.0), "softmax_scale"),
        (dict(out=torch.empty(2, 4, 40)), "out is"),
        (dict(num_splits=0), "num_splits"),
    ]
    for override, match in bad:
        args = {**dict(q=q, latent=latent, table=table, lens=lens, page_size=2, scale=1.0,
                       rank=RANK, out=None, num_splits=None), **override}
        with pytest.raises(ValueError, match=match):
            impl(args["q"], args["latent"], args["table"], args["lens"], args["page_size"],
                 args["scale"], args["rank"], out=args["out"], num_splits=args["num_splits"])


# ---- GPU: bf16 at DeepSeek shapes (R 512, P 64) -----------------------------


@requires_gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_bf16_deepseek_shapes(heads, page_size):
    gen = torch.Generator().manual_seed(heads + page_size)
    max_len = 5000 if heads == 16 else 2000
    seq_lens = torch.randint(1, max_len, (8,), generator=gen).tolist()
    seq_lens[0], seq_lens[1] = max_len, 0
    p = make_problem(heads, page_size, seq_lens, torch.bfloat16, rank=512, rope=64, seed=heads,
                     device="cuda")
    scale = 192**-0.5
    want = paged_mla_decode_attention_ref(*p, page_size, scale, 512).double().cpu()
    for num_splits in (None, 1, 7):
        got = paged_mla_decode_attention_triton(*p, page_size, scale, 512, num_splits=num_splits)
        assert not got.isnan().any()
        assert rel_err(got, want) < 1e-2
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("tokens,heads,nope,rope,rank,v_dim", [
    (1, 3, 24, 8, 40, 20), (5, 2, 16, 0, 33, 16), (19, 4, 40, 12, 24, 36)])
def test_absorb_and_expand_match_the_einsums(dtype, tol, tokens, heads, nope, rope, rank, v_dim):
    """The one-launch projections of the absorbed form against the batched GEMMs: odd
    dims, more tokens than one block of 16, q a strided view, w_k/w_v views of kv_b."""
    gen = torch.Generator().manual_seed(tokens + heads)
    q = torch.randn(tokens, heads, nope + rope + 5, generator=gen).to(dtype)[..., 5:]
    kv_b = (torch.randn(heads, nope + v_dim, rank, generator=gen) * rank ** -0.5).to(dtype)
    w_k, w_v = kv_b[:, :nope], kv_b[:, nope:]
    got = mla_absorb_query_triton(q, w_k)
    torch.testing.assert_close(got, mla_absorb_query_ref(q, w_k), rtol=tol, atol=tol)
    assert torch.equal(got[..., rank:], q[..., nope:])
    o = torch.randn(tokens, heads, rank, generator=gen).to(dtype)
    got = mla_expand_output_triton(o, w_v)
    assert got.is_contiguous()
    torch.testing.assert_close(got, mla_expand_output_ref(o, w_v), rtol=tol, atol=tol)


def test_absorb_and_expand_refuse_bad_shapes():
    q, w = torch.zeros(2, 3, 20), torch.zeros(3, 16, 8)
    with pytest.raises(ValueError, match="w_k must be a 3-D tensor"):
        mla_absorb_query_triton(q, w[:2])
    with pytest.raises(ValueError, match="w_k.dtype"):
        mla_absorb_query_ref(q, w.half())
    with pytest.raises(ValueError, match="w_k has 24 rows per head"):
        mla_absorb_query_triton(q, torch.zeros(3, 24, 8))
    with pytest.raises(ValueError, match="w_v rows have 8 values but o_latent has 9"):
        mla_expand_output_triton(torch.zeros(2, 3, 9), w)
    with pytest.raises(ValueError, match="o_latent must be a 3-D tensor"):
        mla_expand_output_ref(torch.zeros(2, 9), w)


@requires_gpu
@pytest.mark.parametrize("tokens,heads", [(1, 16), (64, 128)])
def test_absorb_and_expand_gpu_bf16(tokens, heads):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q = torch.randn(tokens, heads, 192, device="cuda", generator=gen).bfloat16()
    kv_b = (torch.randn(heads, 256, 512, device="cuda", generator=gen) * 512 ** -0.5).bfloat16()
    want = mla_absorb_query_ref(q.float(), kv_b[:, :128].float())
    got = mla_absorb_query_triton(q, kv_b[:, :128])
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    o = torch.randn(tokens, heads, 512, device="cuda", generator=gen).bfloat16()
    want = mla_expand_output_ref(o.float(), kv_b[:, 128:].float())
    got = mla_expand_output_triton(o, kv_b[:, 128:])
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
