"""rerange: out[i] = src[index[i]], bit-exact for any dtype and trailing shape."""

import pytest
import torch
from lanekv.kernels.rerange import rerange, rerange_ref, rerange_triton

from tests.markers import requires_gpu

SENTINEL = 0xC3


def _bytes(t):
    return t.contiguous().unsqueeze(-1).view(torch.uint8)


def _random_rows(shape, dtype, gen):
    """Random bytes viewed as ``dtype`` (NaN bit patterns included)."""
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).squeeze(-1)


def _poisoned(shape, dtype):
    out = torch.empty(shape, dtype=dtype)
    out.unsqueeze(-1).view(torch.uint8).fill_(SENTINEL)
    return out


def _rank_major_index(rank_lens, pad_to):
    """Index that turns an all-gather of padded rank blocks into rank order, padding dropped."""
    rows = [r * pad_to + i for r, n in enumerate(rank_lens) for i in range(n)]
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize(
    "dtype,row_shape",
    [(torch.bfloat16, (3, 8)), (torch.float16, (7,)), (torch.float32, (2, 3, 5)),
     (torch.uint8, (13,)), (torch.int64, ()), (torch.float8_e5m2, (4, 6))],
)
@pytest.mark.parametrize("impl", [rerange_triton, rerange_ref])
def test_rerange_moves_rows_bit_exact(dtype, row_shape, impl):
    gen = torch.Generator().manual_seed(len(row_shape) + dtype.itemsize)
    src = _random_rows((29, *row_shape), dtype, gen)
    index = torch.cat([torch.randperm(29, generator=gen), torch.tensor([4, 4, 0, 28])])
    out = _poisoned((index.numel(), *row_shape), dtype)
    assert impl(src, index, out) is out
    want = torch.stack([src[i] for i in index.tolist()])
    assert torch.equal(_bytes(out), _bytes(want))


@pytest.mark.parametrize("impl", [rerange_triton, rerange_ref])
def test_rerange_drops_all_gather_padding(impl):
    # Three ranks padded to 5 rows each; the planner's index keeps 4 + 5 + 2 real rows.
    gen = torch.Generator().manual_seed(0)
    src = _random_rows((15, 2, 4), torch.float16, gen)
    index = _rank_major_index([4, 5, 2], pad_to=5)
    got = impl(src, index)
    want = torch.cat([src[0:4], src[5:10], src[10:12]])
    assert torch.equal(_bytes(got), _bytes(want))


def test_rerange_strided_rows_and_empty_index():
    gen = torch.Generator().manual_seed(5)
    wide = _random_rows((10, 24), torch.float32, gen)
    src = wide[:, 8:16]  # rows of 8 values with a row stride of 24
    out_wide = _poisoned((6, 12), torch.float32)
    out = out_wide[:, 2:10]
    index = torch.tensor([9, 0, 3, 3, 7, 1])
    rerange_triton(src, index, out)
    assert torch.equal(_bytes(out), _bytes(src[index]))
    assert torch.equal(_bytes(out_wide[:, :2]), _bytes(_poisoned((6, 2), torch.float32)))
    assert rerange_triton(src, torch.empty(0, dtype=torch.int64)).shape == (0, 8)


def test_rerange_dispatcher_on_cpu():
    src = torch.arange(12.0).view(6, 2)
    index = torch.tensor([5, 1, 1])
    assert torch.equal(rerange(src, index), src[index])


@pytest.mark.parametrize("impl", [rerange_triton, rerange_ref])
def test_rerange_rejects_bad_arguments(impl):
    src = torch.zeros(5, 3)
    with pytest.raises(ValueError, match="index holds 5"):
        impl(src, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="index holds -2"):
        impl(src, torch.tensor([-2, 1]))
    with pytest.raises(ValueError, match="index must be a 1-D int64"):
        impl(src, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="out has shape"):
        impl(src, torch.tensor([0, 1]), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="out.dtype"):
        impl(src, torch.tensor([0, 1]), torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="index is on meta"):
        impl(src, torch.tensor([0, 1]).to("meta"))


def test_rerange_triton_rejects_rows_that_are_not_dense():
    src = torch.zeros(3, 5, 4).transpose(1, 2)
    with pytest.raises(ValueError, match="src must have contiguous rows"):
        rerange_triton(src, torch.tensor([0, 1]))


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_rerange_gpu_matches_reference(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    raw = torch.randint(0, 256, (8192, 8, 128 * dtype.itemsize), device="cuda",
                        generator=gen, dtype=torch.uint8)
    src = raw.view(dtype)
    index = torch.randperm(8192, device="cuda", generator=gen)[:7000]
    assert torch.equal(_bytes(rerange_triton(src, index)), _bytes(rerange_ref(src, index)))
