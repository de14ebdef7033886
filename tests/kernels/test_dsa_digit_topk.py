"""digit_topk: radix_topk's exact output (first_topk's set in ascending position order,
``-1`` padded) by 8-bit digit passes over a row split across programs, against
radix_topk_ref under the interpreter on tiny odd shapes (one program a row, and split
rows with several blocks a program), and on the GPU at V3.2's sizes."""

import pytest
import torch
from lanekv.kernels.dsa.digit_topk import (
    LENS_FEW,
    LENS_MANY,
    NARROW,
    TOPK_ENV,
    WIDE,
    DigitTopkConfig,
    digit_topk_config,
    digit_topk_programs,
    digit_topk_split,
    digit_topk_triton,
    exact_topk,
    exact_topk_ref,
    exact_topk_triton,
    topk_method,
)
from lanekv.kernels.dsa.topk import radix_topk_ref, radix_topk_triton

from tests.markers import requires_gpu

SPLIT = DigitTopkConfig(block=128, min_span=128, programs_per_sm=64, max_programs=3)


def _scores(gen, rows, cols):
    s = torch.randn(rows, cols, generator=gen)
    s[0, 11:] = float("-inf")  # fewer finite scores than some k: all kept, -1 padded
    s[1, ::3] = 0.0  # exact ties at 0, cut inside them for several k
    s[1, 1::7] = -0.0  # ties with 0.0
    s[2] = 1.5  # a row of ties: the lowest positions
    s[3] = float("-inf")  # nothing to select
    s[4] = s[4].round()  # few distinct values: ties at every digit's cut
    return s


@pytest.mark.parametrize("cols,config,ks", [
    (37, None, (1, 7, 40)),  # one program a row (rows shorter than k too)
    (301, DigitTopkConfig(block=256, min_span=16, programs_per_sm=64, max_programs=2),
     (100,)),  # two programs of one block each, the second short
    (700, SPLIT, (5,)),  # three programs of two blocks, the last one's second short
    (700, SPLIT, (699,)),
])
def test_kernel_equals_reference(cols, config, ks):
    gen = torch.Generator().manual_seed(cols)
    s = _scores(gen, 5, cols)
    for k in ks:
        got = digit_topk_triton(s, k, config=config)
        assert got.dtype == torch.int32 and got.shape == (5, k)
        assert torch.equal(got, radix_topk_ref(s, k)), (cols, k, config)


def test_split_and_single_agree_on_wide_rows_and_ties():
    gen = torch.Generator().manual_seed(7)
    s = torch.full((2, 380), float("-inf"))
    s[0, :90] = torch.randn(90, generator=gen)  # a short request in a wide table
    s[1, :350] = torch.randint(-3, 4, (350,), generator=gen).float()  # ties at the cut
    s[1, 5] = float("inf")
    for k in (13,):
        want = radix_topk_ref(s, k)
        assert torch.equal(digit_topk_triton(s, k, config=SPLIT), want)
        assert torch.equal(digit_topk_triton(s, k, config=SPLIT._replace(max_programs=1)), want)
        assert torch.equal(radix_topk_triton(s, k, chunk=256), want)  # as radix_topk selects


@pytest.mark.parametrize("config", [SPLIT, SPLIT._replace(max_programs=1)])
def test_lens_reads_only_each_rows_own_keys(config):
    """A captured step's table is wider than its rows: with ``lens`` the programs share
    each row's own keys, and what lies past them (finite here) is never selected."""
    gen = torch.Generator().manual_seed(11)
    s = torch.randn(7, 700, generator=gen)
    s[1, ::3] = 0.0  # ties at the cut
    s[3] = s[3].round()  # few distinct values: ties at every digit's cut
    lens = torch.tensor([650, 60, 0, 700, 900, -4, 129], dtype=torch.int32)
    padded = s.masked_fill(torch.arange(700)[None, :] >= lens[:, None], float("-inf"))
    for k in (5, 64, 700):
        want = exact_topk_ref(s, k, lens)
        assert torch.equal(want, radix_topk_ref(padded, k))
        assert torch.equal(digit_topk_triton(s, k, lens=lens, config=config), want), (k, config)
    # Without lens, the same rows padded with -inf select the same (one k: the interpreter is slow).
    assert torch.equal(digit_topk_triton(padded, 64, config=config), exact_topk_ref(s, 64, lens))
    assert torch.equal(exact_topk(s, 9, lens), exact_topk_ref(s, 9, lens))  # CPU: the reference
    with pytest.raises(ValueError, match=r"^lens must be a dense \[7\] int32 tensor on cpu"):
        digit_topk_triton(s, 3, lens=lens.long())
    with pytest.raises(ValueError, match=r"^lens must be a dense \[7\] int32 tensor"):
        exact_topk(s, 3, lens[:3])


def test_programs_chooser_and_arguments(monkeypatch):
    cfg = DigitTopkConfig()
    assert digit_topk_split(1, 8192, 132, cfg) == (4, 2048)  # batch 1: one block a program
    assert digit_topk_split(1, 131072, 132, cfg) == (32, 4096)  # at most 32 a row
    assert digit_topk_split(1, 163840, 132, cfg) == (27, 6144)  # none left without a block
    assert digit_topk_split(16, 131072, 132, cfg) == (8, 16384)
    assert digit_topk_programs(200, 8192, 132, cfg) == 1
    monkeypatch.delenv(TOPK_ENV, raising=False)  # auto: split rows take digit_topk
    assert digit_topk_config(8192) == NARROW and digit_topk_config(16385) == WIDE
    assert digit_topk_config(8192, 1, lens=True) == NARROW  # a table no wider than 16k
    assert digit_topk_config(163840, 4, lens=True) == LENS_FEW
    assert digit_topk_config(163840, 5, lens=True) == LENS_MANY
    assert digit_topk_split(1, 163840, 132, LENS_FEW) == (32, 5120)
    assert topk_method(4, 163840, 132, lens=True) == "digit"
    assert topk_method(300, 163840, 132, lens=True) == "radix"  # one program a row
    assert digit_topk_split(1, 8192, 132, NARROW) == (8, 1024)
    assert digit_topk_split(16, 131072, 132, WIDE) == (16, 8192)  # 17 wanted, 16 cover it
    assert topk_method(1, 8192, 132) == topk_method(16, 131072, 132) == "digit"
    assert topk_method(200, 8192, 132) == topk_method(1, 1024, 132) == "radix"
    monkeypatch.setenv(TOPK_ENV, "radix")
    assert topk_method(1, 8192, 132) == "radix"
    monkeypatch.setenv(TOPK_ENV, "digit")
    assert topk_method(200, 8192, 132) == "digit"
    monkeypatch.setenv(TOPK_ENV, "fast")
    with pytest.raises(ValueError, match="LANEKV_DSA_TOPK must be radix, digit or auto, got 'fast'"):
        topk_method(1, 8192, 132)
    monkeypatch.setenv(TOPK_ENV, "auto")
    assert topk_method(1, 8192, 132) == topk_method(16, 131072, 132) == "digit"
    assert topk_method(200, 8192, 132) == topk_method(1, 1024, 132) == "radix"
    s = torch.randn(3, 50)
    assert torch.equal(exact_topk(s, 9), radix_topk_ref(s, 9))  # CPU dispatch: the reference
    assert torch.equal(exact_topk_triton(s, 9), radix_topk_ref(s, 9))
    assert digit_topk_triton(torch.empty(0, 5), 3).shape == (0, 3)
    assert digit_topk_triton(torch.empty(2, 0), 3).tolist() == [[-1] * 3] * 2
    with pytest.raises(ValueError, match="topk must be a positive int"):
        digit_topk_triton(torch.zeros(2, 3), 0)
    with pytest.raises(ValueError, match="config must be a DigitTopkConfig"):
        digit_topk_triton(torch.zeros(2, 3), 2, config=(256, 16, 1, 1, 4))
    with pytest.raises(ValueError, match="DigitTopkConfig.block must be a power of two"):
        digit_topk_triton(torch.zeros(2, 3), 2, config=DigitTopkConfig(block=300))
    with pytest.raises(ValueError, match="DigitTopkConfig.min_span must be a positive int"):
        digit_topk_triton(torch.zeros(2, 3), 2, config=DigitTopkConfig(min_span=0))
    with pytest.raises(ValueError, match="scores must be dense"):
        digit_topk_triton(torch.zeros(3, 4).t(), 2)


@requires_gpu
def test_gpu_equals_reference_at_v32_sizes():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, cols in ((1, 8192), (1, 131072), (3, 20000), (16, 32768), (16, 131072),
                       (2, 163840), (64, 8192)):
        s = torch.randn(rows, cols, device="cuda", generator=gen)
        s[0, cols // 2 :] = float("-inf")  # a request at half the table's width
        s[-1, ::5] = 0.0  # many exact ties
        if rows > 2:
            s[1] = s[1].round()  # few distinct values: ties at every digit's cut
        for k in (2048, 100, 1):
            want = radix_topk_ref(s, k)
            for cfg in (None, DigitTopkConfig(block=1024, num_warps=4),
                        DigitTopkConfig(min_span=1 << 20)):
                got = digit_topk_triton(s, k, config=cfg)
                assert torch.equal(got, want), (rows, cols, k, cfg)
            assert torch.equal(exact_topk(s, k), want), (rows, cols, k)
            lens = torch.full((rows,), cols, dtype=torch.int32, device="cuda")
            lens[0] = cols // 2
            junk = s.clone()
            junk[0, cols // 2 :] = 7.0  # past lens: never read
            assert torch.equal(exact_topk(junk, k, lens), want), (rows, cols, k)
