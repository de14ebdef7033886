"""add_rmsnorm: Triton (interpreted on CPU) against the torch reference, which
is the model's unfused RMSNorm (residual add, float32 statistics)."""

import pytest
import torch
from lanekv.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref, add_rmsnorm_triton

from tests.markers import requires_gpu


def _unfused(x, residual, weight, eps):
    summed = x if residual is None else x + residual
    s = summed.float()
    normed = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, summed


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows,cols", [(1, 8), (5, 24)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_unfused(dtype, tol, rows, cols, with_residual):
    gen = torch.Generator().manual_seed(rows * 7 + cols)
    x = torch.randn(rows, cols, generator=gen).to(dtype)
    residual = torch.randn(rows, cols, generator=gen).to(dtype) if with_residual else None
    weight = (1 + torch.randn(cols, generator=gen)).to(dtype)
    want_out, want_sum = _unfused(x, residual, weight, 1e-5)
    ref_out, ref_sum = add_rmsnorm_ref(x, residual, weight, 1e-5)
    assert torch.equal(ref_out, want_out) and torch.equal(ref_sum, want_sum)
    out, summed = add_rmsnorm_triton(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_sum)
    torch.testing.assert_close(out, want_out, rtol=tol, atol=tol)


def test_add_rmsnorm_strided_rows_and_empty():
    x = torch.randn(6, 32)[::2, :16]
    weight = torch.ones(16)
    out, _ = add_rmsnorm_triton(x, None, weight, 1e-6)
    torch.testing.assert_close(out, add_rmsnorm_ref(x, None, weight, 1e-6)[0])
    empty = torch.empty(0, 16)
    assert add_rmsnorm_triton(empty, empty, weight, 1e-6)[0].shape == (0, 16)


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.zeros(3)), "x must be a 2-D"),
    (dict(residual=torch.zeros(2, 5)), "residual must be"),
    (dict(weight=torch.zeros(3)), "weight must be"),
    (dict(eps=0.0), "eps must be"),
    (dict(x=torch.zeros(2, 4, dtype=torch.int32)), "x.dtype"),
])
def test_add_rmsnorm_refuses_bad_args(bad, match):
    args = dict(x=torch.zeros(2, 4), residual=torch.zeros(2, 4), weight=torch.ones(4), eps=1e-5)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        add_rmsnorm(**args)


@requires_gpu
def test_add_rmsnorm_gpu_bf16():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(33, 4096, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(33, 4096, device="cuda", generator=gen).bfloat16()
    weight = torch.rand(4096, device="cuda", generator=gen).bfloat16()
    out, summed = add_rmsnorm(x, residual, weight, 1e-5)
    want_out, want_sum = _unfused(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_sum)
    torch.testing.assert_close(out, want_out, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("impl", [add_rmsnorm_triton, add_rmsnorm_ref])
def test_out_in_place_inside_a_wider_row(impl):
    """MLA's latent row: the first 21 values of each 37-wide GEMM row normed in place
    (``out`` is ``x``), the rest of the row untouched; ``out`` elsewhere too."""
    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(3, 37, generator=gen)
    before = rows.clone()
    weight = 1 + torch.randn(21, generator=gen)
    want = add_rmsnorm_ref(before[:, :21], None, weight, 1e-6)[0]
    part = rows[:, :21]
    got, summed = impl(part, None, weight, 1e-6, out=part)
    assert got.data_ptr() == rows.data_ptr() and summed.data_ptr() == rows.data_ptr()
    torch.testing.assert_close(rows[:, :21], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(rows[:, 21:], before[:, 21:])
    dest = torch.empty(3, 21)
    impl(before[:, :21], torch.ones(3, 21), weight, 1e-6, out=dest)
    torch.testing.assert_close(dest, add_rmsnorm_ref(before[:, :21], torch.ones(3, 21), weight,
                                                     1e-6)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out,match", [
    (torch.empty(3, 20), "out must be a torch.float32 tensor of shape \\(3, 21\\)"),
    (torch.empty(3, 21, dtype=torch.float16), "out must be a torch.float32"),
    (torch.empty(21, 3).t(), "out must be dense"),
])
def test_bad_out_is_refused(out, match):
    for impl in (add_rmsnorm_triton, add_rmsnorm_ref):
        with pytest.raises(ValueError, match=match):
            impl(torch.zeros(3, 21), None, torch.ones(21), 1e-6, out=out)
