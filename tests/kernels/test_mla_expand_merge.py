"""mla_expand_partials: the split partials merged in the expansion's prologue, Triton
(interpreted on CPU) against the reference and against the unsplit decode then the
plain expansion. Partials and direct outputs that no request owns are NaN, so a
read of one shows."""

from __future__ import annotations

import pytest
import torch
from lanekv.kernels.mla.absorb import mla_expand_output_ref, mla_expand_output_triton
from lanekv.kernels.mla.expand_merge import (
    FUSED_MERGE_MAX_TOKENS,
    merged_latent_ref,
    mla_expand_partials,
    mla_expand_partials_ref,
    mla_expand_partials_triton,
)
from lanekv.kernels.mla.merge import merge_mla_partials
from lanekv.kernels.mla.paged_decode import MLAPartials, paged_mla_decode_stage1
from lanekv.kernels.mla.paged_decode_ref import paged_mla_decode_attention_ref
from lanekv.kernels.mla.splits import MLADecodeConfig, busy_splits_ref

from tests.kernels.test_mla_decode import RANK, make_problem
from tests.markers import requires_gpu


def poisoned_stage1(heads, page_size, lens, dtype, num_splits, cfg, *, rank=RANK, rope=8,
                    device="cpu", seed=0) -> tuple[MLAPartials, torch.Tensor]:
    """Stage 1's output with every slot the merge must not read set to NaN, and the
    unsplit reference's latent output."""
    p = make_problem(heads, page_size, lens, dtype, rank=rank, rope=rope, seed=seed,
                     device=device)
    scale = 0.3
    parts = paged_mla_decode_stage1(*p, page_size, scale, rank, num_splits=num_splits, config=cfg)
    if parts.part_o is not None:
        _, max_kv_len, split_keys, block_n = parts.busy
        for b, n in enumerate(lens):
            used = busy_splits_ref(min(n, max_kv_len), parts.part_o.shape[2], split_keys, block_n)[0]
            parts.part_o[b, :, used:] = float("nan")
            parts.part_lse[b, :, used:] = float("nan")
            if used > 1:
                parts.out[b] = float("nan")  # merged: the direct output is never written
            else:
                parts.part_o[b] = float("nan")
                parts.part_lse[b] = float("nan")
    return parts, paged_mla_decode_attention_ref(*p, page_size, scale, rank)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("heads,page_size,lens,num_splits,block_n,split_keys,v_dim", [
    (3, 3, [0, 5, 17, 70], 8, 16, 16, 20),  # none, one and several busy splits
    (5, 4, [70], 3, 16, 16, 9),  # one request capped at 3 splits, 9 columns (one block)
    (17, 5, [37, 0], 2, 16, 40, 36),  # two head blocks' heads, columns past two blocks
    (4, 2, [9, 33], 1, 16, 16, 16),  # one split: no partials, the plain expansion
    (2, 16, [3, 600], 40, 16, 16, 16),  # 38 busy splits: two chunks of 32
])
def test_expansion_merges_the_partials(dtype, tol, heads, page_size, lens, num_splits, block_n,
                                       split_keys, v_dim):
    cfg = MLADecodeConfig(block_n=block_n, min_split_keys=split_keys)
    parts, o_latent = poisoned_stage1(heads, page_size, lens, dtype, num_splits, cfg,
                                      seed=heads + len(lens))
    assert (parts.part_o is None) == (num_splits == 1)
    w_v = (torch.randn(heads, v_dim, RANK, generator=torch.Generator().manual_seed(3))
           * RANK ** -0.5).to(dtype)
    got = mla_expand_partials_triton(parts, w_v)
    assert got.shape == (len(lens), heads, v_dim) and got.is_contiguous()
    assert not got.isnan().any()
    want = mla_expand_partials_ref(parts, w_v)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    unsplit = mla_expand_output_ref(o_latent, w_v)  # the merge was right, not only alike
    torch.testing.assert_close(got, unsplit, rtol=4 * tol, atol=4 * tol)
    if 0 in lens:  # an empty request's output is zeros
        assert torch.equal(got[lens.index(0)], torch.zeros_like(got[0]))


def test_the_fused_merge_equals_the_standalone_one():
    """The same split decode merged by ``merge_mla_partials`` then expanded, and merged in
    the expansion: float32, equal to rounding."""
    cfg = MLADecodeConfig(block_n=16, min_split_keys=16)
    p = make_problem(6, 4, [3, 60], torch.float32, seed=9)
    parts = paged_mla_decode_stage1(*p, 4, 0.2, RANK, num_splits=5, config=cfg)
    w_v = torch.randn(6, 24, RANK, generator=torch.Generator().manual_seed(1))
    fused = mla_expand_partials_triton(parts, w_v)
    merged = parts.out.clone()
    merge_mla_partials(parts.part_o, parts.part_lse, merged, busy=parts.busy)
    torch.testing.assert_close(merged_latent_ref(parts), merged, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused, mla_expand_output_triton(merged, w_v), rtol=1e-5, atol=1e-5)


def test_larger_batches_take_the_standalone_merge(monkeypatch):
    """Over ``FUSED_MERGE_MAX_TOKENS`` requests the dispatcher merges with
    ``merge_mla_partials`` (which writes the merged rows into ``parts.out``), then expands."""
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    cfg = MLADecodeConfig(block_n=16, min_split_keys=16)
    lens = [20 + 7 * i for i in range(FUSED_MERGE_MAX_TOKENS + 1)]
    parts, o_latent = poisoned_stage1(2, 8, lens, torch.float32, 3, cfg, seed=4)
    w_v = torch.randn(2, 16, RANK, generator=torch.Generator().manual_seed(2))
    want = mla_expand_partials_ref(parts, w_v)
    got = mla_expand_partials(parts, w_v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.out, o_latent, rtol=1e-5, atol=1e-5)  # merged in place


def test_without_triton_the_dispatcher_takes_the_reference(monkeypatch):
    monkeypatch.delenv("LANEKV_CPU_KERNELS", raising=False)
    o = torch.randn(2, 3, RANK)
    w_v = torch.randn(3, 8, RANK)
    torch.testing.assert_close(mla_expand_partials(MLAPartials(o), w_v),
                               mla_expand_output_ref(o, w_v))


def test_rejects_bad_arguments():
    cfg = MLADecodeConfig(block_n=16, min_split_keys=16)
    p = make_problem(3, 4, [40, 7], torch.float32, seed=2)
    parts = paged_mla_decode_stage1(*p, 4, 0.2, RANK, num_splits=4, config=cfg)
    w_v = torch.randn(3, 8, RANK)
    bad = [
        ((parts.out, w_v), "parts must be MLAPartials"),
        ((parts._replace(out=parts.out[0]), w_v), "parts.out must be a 3-D"),
        ((parts, w_v[:2]), r"w_v must be a torch.float32 \[H=3"),
        ((parts, w_v.half()), "w_v must be"),
        ((parts, torch.randn(3, RANK, 8).transpose(1, 2)), "w_v must be"),
        ((parts._replace(part_o=parts.part_o.half()), w_v), "parts.part_o must be"),
        ((parts._replace(part_o=parts.part_o[:, :2]), w_v), "parts.part_o must be"),
        ((parts._replace(part_lse=parts.part_lse[..., :1]), w_v), "parts.part_lse must be"),
        ((parts._replace(busy=parts.busy[:3]), w_v), "parts.busy must be"),
        ((parts._replace(busy=(parts.busy[0].long(), *parts.busy[1:])), w_v), "parts.busy"),
        ((parts._replace(busy=(*parts.busy[:2], 0, 16)), w_v), "parts.busy"),
        ((MLAPartials(parts.out, part_lse=parts.part_lse), w_v), "parts.part_lse and"),
    ]
    for impl in (mla_expand_partials_triton, mla_expand_partials_ref):
        for args, match in bad:
            with pytest.raises(ValueError, match=match):
                impl(*args)


@requires_gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gpu_bf16_deepseek_shapes(batch):
    """V2-Lite's 16 heads at the captured split count, lengths from none to 3k."""
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(0, 3000, (batch,), generator=gen).tolist()
    lens[0] = 1024
    parts, o_latent = poisoned_stage1(16, 16, lens, torch.bfloat16, None, None, rank=512,
                                      rope=64, device="cuda", seed=batch)
    w_v = (torch.randn(16, 128, 512, device="cuda") * 512 ** -0.5).bfloat16()
    got = mla_expand_partials_triton(parts, w_v)
    assert not got.isnan().any()
    want = mla_expand_output_ref(o_latent.float(), w_v.float())
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)
