"""cp_prefill_attention: Triton kernel (interpreted on CPU) and reference vs float64 math."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from lanekv.kernels.prefill.attention import (
    cp_prefill_attention,
    cp_prefill_attention_triton,
    launch_cp_prefill_attention,
)
from lanekv.kernels.prefill.config import AttnLaunchConfig
from lanekv.kernels.prefill.reference import AttnSegments, cp_prefill_attention_ref

from tests.markers import requires_gpu

# Kernel cases run compiled on a GPU machine and interpreted on CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = float("nan")
LSE_SENTINEL = -12345.0


class Batch(NamedTuple):
    q: torch.Tensor  # [Tq, Hq, Dqk]
    k: torch.Tensor  # [Tk, Hkv, Dqk] (a page pool when paged)
    v: torch.Tensor  # [Tk, Hkv, Dv]
    segments: AttnSegments
    page_table: torch.Tensor | None
    page_size: int
    covered: torch.Tensor  # [Tq] bool


def make_batch(requests, *, hq, hkv, head_dim, dtype, page_size=0, q_gap=2, seed=0, device=DEVICE,
               v_head_dim=None):
    """requests: [(kv_len, [(q_pos, q_len), ...]), ...]; q rows get gaps nobody covers.

    v_head_dim defaults to head_dim (the qk head dim)."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    gen = torch.Generator().manual_seed(seed)
    q_start, q_len, q_pos, kv_start, row = [], [], [], [], q_gap
    for r, (kv_len, segs) in enumerate(requests):
        for pos, length in segs:
            if pos + length > kv_len:
                raise ValueError("test request: segment past its kv_len")
            q_start.append(row)
            q_len.append(length)
            q_pos.append(pos)
            kv_start.append(r)  # the request index for now
            row += length + q_gap
    tq = row
    # Queries as a slice of a wider buffer: a row stride that is not Hq * D.
    q = torch.randn(tq, hq + 3, head_dim, generator=gen).to(dtype)[:, 2 : 2 + hq]
    page_table = None
    if page_size:
        max_pages = max(math.ceil(kv_len / page_size) for kv_len, _ in requests) + 1
        num_pages = len(requests) * max_pages + 3
        perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
        page_table = perm[: len(requests) * max_pages].view(len(requests), max_pages).contiguous()
        tk = num_pages * page_size
    else:
        offsets, tk = [], 5  # rows before the first request stay unread
        for kv_len, _ in requests:
            offsets.append(tk)
            tk += kv_len + 3
        kv_start = [offsets[r] for r in kv_start]
    k = torch.randn(tk, hkv, head_dim, generator=gen).to(dtype)
    v = torch.randn(tk, hkv, v_head_dim, generator=gen).to(dtype)
    covered = torch.zeros(tq, dtype=torch.bool)
    for s, n in zip(q_start, q_len, strict=True):
        covered[s : s + n] = True
    segments = AttnSegments(*(torch.tensor(x, dtype=torch.int32, device=device)
                              for x in (q_start, q_len, q_pos, kv_start)))
    if page_table is not None:
        page_table = page_table.to(device)
    return Batch(q.to(device), k.to(device), v.to(device), segments, page_table, page_size, covered.to(device))


def to_cpu(batch: Batch) -> Batch:
    return Batch(batch.q.cpu(), batch.k.cpu(), batch.v.cpu(), AttnSegments(*(t.cpu() for t in batch.segments)),
                 None if batch.page_table is None else batch.page_table.cpu(), batch.page_size,
                 batch.covered.cpu())


def naive_attention(batch: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 on the CPU, one query row at a time, written apart from the reference."""
    batch = to_cpu(batch)
    q, k, v = batch.q.double(), batch.k.double(), batch.v.double()
    hq, hkv = q.shape[1], k.shape[1]
    kv_head = torch.arange(hq) // (hq // hkv)
    out = torch.zeros(q.shape[0], hq, v.shape[2], dtype=torch.float64)
    lse = torch.zeros(q.shape[:2], dtype=torch.float64)
    for q_start, q_len, q_pos, kv_start in zip(*(t.tolist() for t in batch.segments), strict=True):
        for i in range(q_len):
            keys = []
            for j in range(q_pos + i + 1):
                if batch.page_table is None:
                    keys.append(kv_start + j)
                else:
                    page = int(batch.page_table[kv_start, j // batch.page_size])
                    keys.append(page * batch.page_size + j % batch.page_size)
            kk = k[keys][:, kv_head]  # [L, Hq, Dqk]
            vv = v[keys][:, kv_head]
            scores = torch.einsum("hd,lhd->hl", q[q_start + i], kk) * scale
            weights = torch.softmax(scores, dim=-1)
            out[q_start + i] = torch.einsum("hl,lhd->hd", weights, vv)
            lse[q_start + i] = torch.logsumexp(scores, dim=-1)
    return out, lse


def poisoned_out(batch: Batch) -> torch.Tensor:
    """[Tq, Hq, Dv] of NaN: an element the kernel should write and does not stays NaN."""
    return batch.q.new_full((*batch.q.shape[:2], batch.v.shape[2]), POISON)


def run_op(op, batch: Batch, scale: float, **kwargs):
    out = poisoned_out(batch)
    lse = torch.full(batch.q.shape[:2], LSE_SENTINEL, dtype=torch.float32, device=batch.q.device)
    got = op(batch.q, batch.k, batch.v, batch.segments, scale, page_table=batch.page_table,
             page_size=batch.page_size, out=out, return_lse=True, lse_out=lse, **kwargs)
    assert got.out is out and got.lse is lse
    return out, lse


def check_against_naive(batch: Batch, out: torch.Tensor, lse: torch.Tensor, scale: float) -> None:
    want_out, want_lse = naive_attention(batch, scale)
    out, lse, cov = out.cpu(), lse.cpu(), batch.covered.cpu()
    assert not out[cov].isnan().any(), "a covered output element was not written"
    assert out[~cov].isnan().all(), "an uncovered output row was written"
    assert (lse[~cov] == LSE_SENTINEL).all(), "an uncovered lse row was written"
    tol = 2e-3 if batch.q.dtype == torch.float16 else 2e-5
    err = (out[cov].double() - want_out[cov]).norm() / want_out[cov].norm()
    assert err < tol, f"output relative error {err:.2e}"
    torch.testing.assert_close(lse[cov].double(), want_lse[cov], atol=tol, rtol=tol)


# Request A: a cached prefix of 14 (query blocks start two keys before a key
# block edge, where an off-by-one in the unmasked range shows), then its prev
# and next chunks; B: a one-row segment and an empty one; C: a chunk from 0.
THREE_REQUESTS = [
    (83, [(14, 37), (60, 23)]),
    (9, [(8, 1), (3, 0)]),
    (21, [(0, 21)]),
]
TWO_REQUESTS = [
    (50, [(0, 17), (33, 17)]),
    (26, [(11, 15)]),
]

CASES = {
    # name: (requests, hq, hkv, head_dim, dtype, page_size)
    "contig_gqa1_fp32": (THREE_REQUESTS, 2, 2, 64, torch.float32, 0),
    "contig_gqa4_fp16": (TWO_REQUESTS, 4, 1, 64, torch.float16, 0),
    "paged1_gqa8_fp16": (TWO_REQUESTS, 8, 1, 64, torch.float16, 1),
    "paged3_gqa4_fp32": (THREE_REQUESTS, 8, 2, 64, torch.float32, 3),
    "paged16_gqa1_fp16": (THREE_REQUESTS, 2, 2, 64, torch.float16, 16),
    "contig_d128_fp16": (TWO_REQUESTS, 4, 2, 128, torch.float16, 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_and_ref_match_float64(name: str) -> None:
    requests, hq, hkv, head_dim, dtype, page_size = CASES[name]
    batch = make_batch(requests, hq=hq, hkv=hkv, head_dim=head_dim, dtype=dtype, page_size=page_size)
    scale = 1.0 / math.sqrt(head_dim)
    for op in (cp_prefill_attention_triton, cp_prefill_attention_ref):
        out, lse = run_op(op, batch, scale)
        check_against_naive(batch, out, lse, scale)


@pytest.mark.parametrize("block_m,block_n", [(16, 32), (16, 16)])
def test_other_tile_shapes(block_m: int, block_n: int) -> None:
    batch = make_batch(THREE_REQUESTS, hq=4, hkv=2, head_dim=64, dtype=torch.float32, page_size=3, seed=1)
    scale = 0.1
    out = poisoned_out(batch)
    lse = torch.full(batch.q.shape[:2], LSE_SENTINEL, dtype=torch.float32, device=batch.q.device)
    launch_cp_prefill_attention(batch.q, batch.k, batch.v, batch.segments, scale, batch.page_table,
                                batch.page_size, out, lse, AttnLaunchConfig(block_m, block_n, 4, 1))
    check_against_naive(batch, out, lse, scale)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed: int) -> None:
    """Random positions hit every alignment of blocks against the causal diagonal."""
    gen = torch.Generator().manual_seed(100 + seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    requests = []
    for _ in range(draw(1, 3)):
        kv_len = draw(1, 130)
        segs = []
        for _ in range(draw(1, 3)):
            q_pos = draw(0, kv_len - 1)
            segs.append((q_pos, draw(0, kv_len - q_pos)))
        requests.append((kv_len, segs))
    hkv = (1, 2)[seed % 2]
    group = (1, 4, 8)[seed % 3]
    page_size = (0, 1, 3, 16, 5, 0)[seed]
    batch = make_batch(requests, hq=hkv * group, hkv=hkv, head_dim=64, dtype=torch.float32,
                       page_size=page_size, seed=seed)
    out, lse = run_op(cp_prefill_attention_triton, batch, 0.2)
    check_against_naive(batch, out, lse, 0.2)


def test_without_out_and_lse() -> None:
    batch = make_batch(TWO_REQUESTS, hq=2, hkv=1, head_dim=64, dtype=torch.float32, seed=2)
    out = cp_prefill_attention_triton(batch.q, batch.k, batch.v, batch.segments, 0.125)
    assert isinstance(out, torch.Tensor) and out.shape == batch.q.shape and out.dtype == batch.q.dtype
    want, _ = naive_attention(batch, 0.125)
    out, cov = out.cpu(), batch.covered.cpu()
    assert (out[cov].double() - want[cov]).norm() / want[cov].norm() < 2e-5


def test_no_segments_writes_nothing() -> None:
    q = torch.randn(4, 2, 64)
    k = torch.randn(4, 2, 64)
    empty = AttnSegments(*(torch.zeros(0, dtype=torch.int32) for _ in range(4)))
    out = torch.full_like(q, POISON)
    cp_prefill_attention_triton(q, k, k, empty, 0.125, out=out)
    assert out.isnan().all()


def test_dispatcher_runs_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LANEKV_CPU_KERNELS", raising=False)
    batch = make_batch(TWO_REQUESTS, hq=2, hkv=1, head_dim=64, dtype=torch.float32, seed=3, device="cpu")
    got = cp_prefill_attention(batch.q, batch.k, batch.v, batch.segments, 0.125)
    want = cp_prefill_attention_ref(batch.q, batch.k, batch.v, batch.segments, 0.125)
    assert torch.equal(got[batch.covered], want[batch.covered])


def test_dispatcher_runs_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA tensors always take the kernel; CPU ones only with the opt-in.
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    batch = make_batch(TWO_REQUESTS, hq=2, hkv=1, head_dim=64, dtype=torch.float16, seed=3)
    got = cp_prefill_attention(batch.q, batch.k, batch.v, batch.segments, 0.125)
    want = cp_prefill_attention_triton(batch.q, batch.k, batch.v, batch.segments, 0.125)
    assert torch.equal(got[batch.covered], want[batch.covered])
    ref = cp_prefill_attention_ref(batch.q, batch.k, batch.v, batch.segments, 0.125)
    assert not torch.equal(got[batch.covered], ref[batch.covered]), "float16 kernel and float32 reference round apart"


def _bad_calls():
    """(name, kwargs override, exception, match) for every validated argument."""
    q = torch.randn(8, 4, 64)
    k = torch.randn(12, 2, 64)
    seg = AttnSegments(*(torch.tensor(x, dtype=torch.int32) for x in ([0], [8], [0], [0])))
    table = torch.zeros(1, 4, dtype=torch.int32)

    def segs(**fields):
        return seg._replace(**{f: torch.tensor(x, dtype=torch.int32) for f, x in fields.items()})

    return [
        ("q_dtype", dict(q=q.to(torch.int32)), ValueError, "q dtype"),
        ("k_dtype", dict(k=k.half()), ValueError, "k dtype"),
        ("q_rank", dict(q=q[0]), ValueError, "q must be"),
        ("head_dim", dict(q=torch.randn(8, 4, 264), k=torch.randn(12, 2, 264)), ValueError,
         "q head_dim 264"),
        ("v_head_dim", dict(v=torch.randn(12, 2, 0)), ValueError, "v head_dim 0"),
        ("gqa", dict(q=torch.randn(8, 3, 64)), ValueError, "q heads"),
        ("v_shape", dict(v=k[:10]), ValueError, "v shape"),
        ("k_stride", dict(k=torch.randn(12, 2, 128)[..., ::2]), ValueError, "k needs a contiguous"),
        ("scale", dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
        ("segments_type", dict(segments=tuple(seg)), TypeError, "segments"),
        ("segments_dtype", dict(segments=seg._replace(q_pos=seg.q_pos.long())), ValueError, "segments.q_pos"),
        ("segments_len", dict(segments=seg._replace(kv_start=torch.zeros(2, dtype=torch.int32))),
         ValueError, "segments.kv_start"),
        ("segments_device", dict(segments=seg._replace(q_len=seg.q_len.to("meta"))), ValueError, "q_len"),
        ("page_size_alone", dict(page_size=4), ValueError, "page_size"),
        ("page_size_zero", dict(page_table=table, page_size=0), ValueError, "page_size"),
        ("page_table_dtype", dict(page_table=table.long(), page_size=4), ValueError, "page_table dtype"),
        ("out_shape", dict(out=torch.empty(8, 4, 32)), ValueError, "out"),
        ("out_dtype", dict(out=q.half()), ValueError, "out dtype"),
        ("lse_without_flag", dict(lse_out=torch.empty(8, 4)), ValueError, "lse_out"),
        ("lse_dtype", dict(return_lse=True, lse_out=torch.empty(8, 4, dtype=torch.float64)), ValueError, "lse_out"),
        ("q_rows", dict(segments=segs(q_len=[9])), ValueError, "q_start"),
        ("negative", dict(segments=segs(q_pos=[-1])), ValueError, "segments.q_pos"),
        ("k_rows", dict(segments=segs(kv_start=[5])), ValueError, "kv_start"),
        ("overlap", dict(segments=segs(q_start=[0, 3], q_len=[4, 4], q_pos=[0, 4], kv_start=[0, 0])),
         ValueError, "overlap"),
        ("page_id", dict(page_table=table + 3, page_size=4), ValueError, "page id"),
        ("page_cols", dict(page_table=table[:, :1], page_size=4), ValueError, "pages"),
    ], dict(q=q, k=k, v=k, segments=seg, softmax_scale=0.125)


BAD_CALL_NAMES = [case[0] for case in _bad_calls()[0]]


@pytest.mark.parametrize("name", BAD_CALL_NAMES)
@pytest.mark.parametrize("op", [cp_prefill_attention_triton, cp_prefill_attention_ref])
def test_validation_errors(op, name: str) -> None:
    cases, base = _bad_calls()
    _, override, exc, match = next(case for case in cases if case[0] == name)
    args = {**base, **override}
    with pytest.raises(exc, match=match):
        op(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("segments"),
           args.pop("softmax_scale"), **args)


# ---- GPU: bf16, long sequences, torch SDPA as the yardstick -----------------


def _sdpa_causal(q, k, v, scale):
    """Whole-sequence causal attention through torch SDPA, [T, H, D] in and out."""
    group = q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1)[None]
    kt = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    vt = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    return o[0].transpose(0, 1)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@requires_gpu
@pytest.mark.parametrize("seq_len", [1000, 4096])
def test_gpu_bf16_matches_sdpa(seq_len: int) -> None:
    torch.manual_seed(seq_len)
    q = torch.randn(seq_len, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(seq_len, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(seq_len, 8, 128, device="cuda", dtype=torch.bfloat16)
    scale = 128**-0.5
    want = _sdpa_causal(q, k, v, scale)
    one = AttnSegments(*(torch.tensor([x], dtype=torch.int32, device="cuda") for x in (0, seq_len, 0, 0)))
    got = cp_prefill_attention_triton(q, k, v, one, scale, validate=True)
    assert _rel(got, want) < 1e-2
    # The zigzag rank-0 view of cp=2: chunks 0 and 3 of four, the same rows.
    c = seq_len // 4
    rows = torch.cat([torch.arange(c), torch.arange(seq_len - c, seq_len)]).cuda()
    zig = AttnSegments(*(torch.tensor(x, dtype=torch.int32, device="cuda")
                         for x in ([0, c], [c, c], [0, seq_len - c], [0, 0])))
    out = torch.full_like(q[rows], float("nan"))
    got_rank = cp_prefill_attention_triton(q[rows].contiguous(), k, v, zig, scale, out=out)
    assert _rel(got_rank, want[rows]) < 1e-2


@requires_gpu
@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_gpu_paged_equals_contiguous(page_size: int) -> None:
    requests = [(700, [(0, 100), (500, 200)]), (333, [(300, 33)]), (64, [(63, 1)])]
    batch = make_batch(requests, hq=32, hkv=8, head_dim=128, dtype=torch.bfloat16, device="cuda",
                       page_size=page_size, seed=page_size)
    scale = 128**-0.5
    out, lse = run_op(cp_prefill_attention_triton, batch, scale, validate=True)
    want_out, want_lse = run_op(cp_prefill_attention_ref, batch, scale)
    cov = batch.covered
    assert out[~cov].isnan().all() and (lse[~cov] == LSE_SENTINEL).all()
    assert not out[cov].isnan().any()
    assert _rel(out[cov], want_out[cov]) < 1e-2
    torch.testing.assert_close(lse[cov], want_lse[cov], atol=1e-2, rtol=1e-2)


@requires_gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_paged_long_matches_contiguous(page_size: int) -> None:
    # 4k rows take the 128-row tile config; pages in shuffled order must give
    # what the contiguous layout gives, for one segment and for a zigzag pair.
    seq_len, c = 4096, 512
    torch.manual_seed(page_size)
    q = torch.randn(seq_len, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(seq_len, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(seq_len, 8, 128, device="cuda", dtype=torch.bfloat16)
    num_pages = seq_len // page_size
    perm = torch.randperm(num_pages, device="cuda")
    pools = []
    for t in (k, v):
        pool = torch.empty_like(t).view(num_pages, page_size, 8, 128)
        pool[perm] = t.view(num_pages, page_size, 8, 128)  # logical page j -> physical perm[j]
        pools.append(pool.view(seq_len, 8, 128))
    page_table = perm.to(torch.int32)[None]
    for cols in (([0], [seq_len], [0], [0]), ([0, c], [c, c], [0, seq_len - c], [0, 0])):
        segs = AttnSegments(*(torch.tensor(x, dtype=torch.int32, device="cuda") for x in cols))
        want = cp_prefill_attention_triton(q, k, v, segs, 128**-0.5)
        got = cp_prefill_attention_triton(q, *pools, segs, 128**-0.5, page_table=page_table,
                                          page_size=page_size, validate=True)
        rows = int(segs.q_len.sum())
        assert _rel(got[:rows], want[:rows]) < 1e-3
