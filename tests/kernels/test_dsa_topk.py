"""radix_topk: the exact top-k of index scores in a few Triton launches, against its
reference (``first_topk``'s set in ascending position order), under the interpreter
on tiny odd shapes with several levels, and on the GPU at DeepSeek-V3.2's sizes."""

import pytest
import torch
from lanekv.kernels.dsa.select import first_topk_ref
from lanekv.kernels.dsa.topk import (
    radix_topk,
    radix_topk_levels,
    radix_topk_ref,
    radix_topk_triton,
)

from tests.markers import requires_gpu


def _scores(gen, rows, cols):
    s = torch.randn(rows, cols, generator=gen)
    s[0, 11:] = float("-inf")  # fewer finite scores than some k: all kept, -1 padded
    s[1, ::3] = 0.0  # exact ties at 0, cut inside them for several k
    s[1, 1] = -0.0  # ties with 0.0
    s[2] = 1.5  # a row of ties: the lowest positions
    s[3] = float("-inf")  # nothing to select
    s[4] = s[4].round()  # few distinct values: many ties at every cut
    return s


def test_reference_is_first_topk_sorted():
    gen = torch.Generator().manual_seed(1)
    s = _scores(gen, 6, 37)
    for k in (1, 5, 12, 40):
        ref = radix_topk_ref(s, k)
        want = first_topk_ref(s, k)
        for row in range(6):
            chosen = sorted(x for x in want[row].tolist() if x >= 0)
            assert ref[row].tolist() == chosen + [-1] * (k - len(chosen))
    assert torch.equal(radix_topk(s, 5), radix_topk_ref(s, 5))  # CPU dispatch: the reference


@pytest.mark.parametrize("cols,chunk,ks", [(37, None, (1, 7, 200)), (70, 16, (3, 8)),
                                            (64, 32, (7, 16))])
def test_kernel_equals_reference_over_levels(cols, chunk, ks):
    gen = torch.Generator().manual_seed(cols)
    s = _scores(gen, 6, cols)
    for k in ks:
        got = radix_topk_triton(s, k, chunk=chunk)
        assert got.dtype == torch.int32 and got.shape == (6, k)
        assert torch.equal(got, radix_topk_ref(s, k)), (k, chunk, radix_topk_levels(cols, k, chunk))
    if cols == 70:
        assert radix_topk_levels(cols, 8, 16) == [5, 3, 2, 1]  # four levels exercised


def test_selection_does_not_depend_on_the_width_past_the_last_score():
    gen = torch.Generator().manual_seed(4)
    s = _scores(gen, 6, 40)
    wide = torch.cat([s, torch.full((6, 50), float("-inf"))], dim=1)
    for k in (2, 30):
        assert torch.equal(radix_topk_triton(wide, k, chunk=32), radix_topk_triton(s, k, chunk=32))


def test_levels_and_arguments():
    assert radix_topk_levels(8192, 2048) == [1]
    assert radix_topk_levels(32768, 2048) == [4, 1]
    assert radix_topk_levels(131072, 2048) == [16, 4, 1]
    assert radix_topk_levels(163840, 2048) == [20, 5, 2, 1]
    assert radix_topk_triton(torch.empty(0, 5), 3).shape == (0, 3)
    assert radix_topk_triton(torch.empty(2, 0), 3).tolist() == [[-1] * 3] * 2
    with pytest.raises(ValueError, match="topk must be a positive int"):
        radix_topk_triton(torch.zeros(2, 3), 0)
    with pytest.raises(ValueError, match="scores must be a 2-D float32"):
        radix_topk_ref(torch.zeros(2, 3, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="chunk must be None or a power of two in"):
        radix_topk_triton(torch.zeros(2, 3), 2, chunk=24)
    with pytest.raises(ValueError, match="topk must be at most 16384"):
        radix_topk_triton(torch.zeros(1, 3), 20000)
    with pytest.raises(ValueError, match="scores must be dense"):
        radix_topk_triton(torch.zeros(3, 4).t(), 2)


@requires_gpu
def test_gpu_equals_reference_at_v32_sizes():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, cols in ((1, 8192), (1, 131072), (3, 20000), (16, 32768), (2, 163840)):
        s = torch.randn(rows, cols, device="cuda", generator=gen)
        s[0, cols // 2 :] = float("-inf")  # a request at half the table's width
        s[-1, ::5] = 0.0  # many exact ties
        if rows > 2:
            s[1] = s[1].round()  # few distinct values: ties at every level's cut
        for k in (2048, 100, 1):
            for warps in (8, 16):
                got = radix_topk_triton(s, k, num_warps=warps)
                assert torch.equal(got, radix_topk_ref(s, k)), (rows, cols, k, warps)
