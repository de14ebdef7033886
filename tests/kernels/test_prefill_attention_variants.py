"""cp_prefill_attention's kernel variants (AttnLaunchConfig switches) against the float64 math.

Every switch combination of ``MLA_PREFILL_VARIANTS`` runs under the interpreter on
tiny tiles over odd segment lengths (float32): TMA needs contiguous K/V whose qk dim
splits exactly (48 = 32 + 16, or 32 alone) and a power-of-two v dim; the other
switches also run paged and with masked head dims. On the GPU each variant runs at
DeepSeek's dims (qk 192 = 128 + 64, v 128, bf16) against the torch reference.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lanekv.kernels.prefill import attention
from lanekv.kernels.prefill.attention import launch_cp_prefill_attention
from lanekv.kernels.prefill.config import (
    LAUNCH_SWITCHES,
    MLA_PREFILL_DEFAULT,
    MLA_PREFILL_FALLBACK,
    MLA_PREFILL_SWEEP,
    MLA_PREFILL_VARIANTS,
    AttnLaunchConfig,
    runnable_config,
)
from lanekv.kernels.prefill.reference import cp_prefill_attention_ref

from tests.kernels.test_prefill_attention import (
    LSE_SENTINEL,
    THREE_REQUESTS,
    TWO_REQUESTS,
    check_against_naive,
    make_batch,
    naive_attention,
    poisoned_out,
)
from tests.markers import requires_gpu

# Each switch combination the sweep times, as the set of switches turned on.
SWITCHES = sorted({tuple(n for n in LAUNCH_SWITCHES if getattr(c, n)) for c in MLA_PREFILL_VARIANTS})


def _switch_id(switch) -> str:
    return "+".join(switch) or "plain"


def _config(block_m: int, block_n: int, switch) -> AttnLaunchConfig:
    return AttnLaunchConfig(block_m, block_n, 4, 1, **{name: True for name in switch})


def _tol(switch) -> float:
    # exp_bf16 rounds the softmax's exponents and powers to bfloat16 even for float32 inputs
    return 1e-2 if "exp_bf16" in switch else 2e-5


def _launch(batch, scale: float, config: AttnLaunchConfig):
    out = poisoned_out(batch)
    lse = torch.full(batch.q.shape[:2], LSE_SENTINEL, dtype=torch.float32, device=batch.q.device)
    launch_cp_prefill_attention(batch.q, batch.k, batch.v, batch.segments, scale, batch.page_table,
                                batch.page_size, out, lse, config)
    return out, lse


def _check_against_ref(batch, out: torch.Tensor, lse: torch.Tensor, scale: float,
                       tol: float = 2e-5) -> None:
    """The kernel equals its torch reference (name_ref) on covered rows and leaves the rest."""
    want = cp_prefill_attention_ref(batch.q, batch.k, batch.v, batch.segments, scale,
                                    page_table=batch.page_table, page_size=batch.page_size,
                                    return_lse=True)
    cov = batch.covered
    assert not out[cov].isnan().any(), "a covered output element was not written"
    assert out[~cov].isnan().all(), "an uncovered output row was written"
    assert (lse[~cov] == LSE_SENTINEL).all(), "an uncovered lse row was written"
    if tol > 2e-5:  # rounded p: compare the whole output, as the bench does
        err = (out[cov] - want.out[cov]).norm() / want.out[cov].norm()
        assert err < tol, f"output relative error {err:.2e}"
        assert not torch.equal(out[cov], want.out[cov]), "the rounding path did not run"
    else:
        torch.testing.assert_close(out[cov], want.out[cov], atol=tol, rtol=tol)
    torch.testing.assert_close(lse[cov], want.lse[cov], atol=tol, rtol=tol)


def test_the_sweep_covers_each_switch() -> None:
    # The bench times these; a switch no variant turns on would go unmeasured.
    for field in LAUNCH_SWITCHES:
        assert any(getattr(c, field) for c in MLA_PREFILL_VARIANTS), field
    assert AttnLaunchConfig(128, 128, 8, 2) in MLA_PREFILL_VARIANTS  # the measured default
    # the sweep times the default beside its candidates; every candidate is tested here
    assert MLA_PREFILL_DEFAULT in MLA_PREFILL_SWEEP
    assert set(MLA_PREFILL_SWEEP) <= set(MLA_PREFILL_VARIANTS)
    assert not (MLA_PREFILL_FALLBACK.tma or MLA_PREFILL_FALLBACK.warp_specialize)
    labels = [c.label for c in MLA_PREFILL_VARIANTS]
    assert len(set(labels)) == len(labels)
    assert AttnLaunchConfig(128, 64, 8, 4, tma=True, overlap=True).label == "128,64,8,4+tma+overlap"


# Two shapes (a qk tail or none; tiles taller or wider), taken in turn and both for the
# combinations of the most switches.
_SHAPES = [(32, 16, 48, 32, 4, 2), (16, 32, 32, 16, 2, 2)]
_REF_CASES = [(switch, *shape) for i, switch in enumerate(SWITCHES)
              for j, shape in enumerate(_SHAPES) if len(switch) >= 3 or i % 2 == j]


@pytest.mark.parametrize("switch,block_m,block_n,qk_dim,v_dim,hq,hkv", _REF_CASES,
                         ids=[f"{_switch_id(c[0])}-{c[1]}x{c[2]}" for c in _REF_CASES])
def test_variant_equals_reference(switch, block_m: int, block_n: int, qk_dim: int, v_dim: int, hq: int,
                                  hkv: int) -> None:
    batch = make_batch(THREE_REQUESTS, hq=hq, hkv=hkv, head_dim=qk_dim, v_head_dim=v_dim,
                       dtype=torch.float32, seed=qk_dim + block_m)
    scale = 1.0 / math.sqrt(qk_dim)
    out, lse = _launch(batch, scale, _config(block_m, block_n, switch))
    _check_against_ref(batch, out, lse, scale, _tol(switch))


# The pointer path of the switches (warp_specialize needs tma; overlap runs here too, though
# the sweep pairs it with tma only).
POINTER_SWITCHES = sorted({tuple(n for n in s if n != "tma") for s in SWITCHES if "warp_specialize" not in s}
                          | {("overlap",)})


@pytest.mark.parametrize("switch", POINTER_SWITCHES, ids=_switch_id)
@pytest.mark.parametrize("page_size,qk_dim,v_dim", [(3, 24, 20), (0, 40, 12)])
def test_pointer_variants_paged_and_masked_dims(switch, page_size: int, qk_dim: int, v_dim: int) -> None:
    batch = make_batch(TWO_REQUESTS, hq=4, hkv=1, head_dim=qk_dim, v_head_dim=v_dim,
                       dtype=torch.float32, page_size=page_size, seed=page_size + qk_dim)
    out, lse = _launch(batch, 0.3, _config(16, 16, switch))
    _check_against_ref(batch, out, lse, 0.3, _tol(switch))


def test_variants_match_float64() -> None:
    # The reference itself is checked against float64 math elsewhere; here two variants
    # meet the float64 oracle directly, and a float16 run of each switch rounds near it.
    batch = make_batch(TWO_REQUESTS, hq=2, hkv=1, head_dim=48, v_head_dim=32, dtype=torch.float32,
                       seed=9)
    for config in (AttnLaunchConfig(16, 16, 4, 1, tma=True, overlap=True),
                   AttnLaunchConfig(32, 16, 4, 1, tma=True, warp_specialize=True)):
        out, lse = _launch(batch, 0.2, config)
        check_against_naive(batch, out, lse, 0.2)


@pytest.mark.parametrize("switch", SWITCHES, ids=_switch_id)
def test_variant_float16_matches_float64(switch) -> None:
    batch = make_batch(TWO_REQUESTS, hq=2, hkv=2, head_dim=32, v_head_dim=16, dtype=torch.float16,
                       seed=4)
    out, lse = _launch(batch, 0.25, _config(16, 16, switch))
    if "exp_bf16" in switch:  # p rounded to bfloat16: a looser bound than float16's 2e-3
        want, _ = naive_attention(batch, 0.25)
        cov = batch.covered
        assert not out[cov].isnan().any() and out[~cov].isnan().all()
        err = (out[cov].double() - want[cov]).norm() / want[cov].norm()
        assert err < 1e-2, f"output relative error {err:.2e}"
    else:
        check_against_naive(batch, out, lse, 0.25)


def _refusals():
    contig = dict(requests=TWO_REQUESTS, hq=2, hkv=1, head_dim=48, v_head_dim=32)
    return [
        ("tma_paged", dict(contig, page_size=3), AttnLaunchConfig(16, 16, 4, 1, tma=True),
         "config.tma=True reads contiguous K/V only"),
        ("tma_masked_qk", dict(contig, head_dim=40), AttnLaunchConfig(16, 16, 4, 1, tma=True),
         r"qk 40 \(32 \+ 16\)"),
        ("tma_masked_v", dict(contig, v_head_dim=24), AttnLaunchConfig(16, 16, 4, 1, tma=True),
         "v 24"),
        ("ws_without_tma", contig, AttnLaunchConfig(16, 16, 4, 1, warp_specialize=True),
         "config.warp_specialize=True needs tma=True"),
        ("ws_with_overlap", contig,
         AttnLaunchConfig(16, 16, 4, 1, tma=True, overlap=True, warp_specialize=True),
         "overlap=True"),
        ("block_m", contig, AttnLaunchConfig(24, 16, 4, 1), "config.block_m must be a power of two"),
        ("block_n", contig, AttnLaunchConfig(16, 8, 4, 1), "config.block_n must be a power of two"),
        ("num_stages", contig, AttnLaunchConfig(16, 16, 4, 0), "config.num_stages must be an int"),
    ]


@pytest.mark.parametrize("name,kwargs,config,match", _refusals(), ids=[r[0] for r in _refusals()])
def test_refused_configs(name, kwargs, config, match) -> None:
    batch = make_batch(**kwargs, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match=match):
        _launch(batch, 0.2, config)


def test_refused_config_types() -> None:
    batch = make_batch(TWO_REQUESTS, hq=2, hkv=1, head_dim=48, v_head_dim=32, dtype=torch.float32)
    with pytest.raises(TypeError, match="config.tma must be a bool, got 1"):
        _launch(batch, 0.2, AttnLaunchConfig(16, 16, 4, 1, tma=1))


def test_tma_refuses_unaligned_rows() -> None:
    # 20 float16 values = 40 bytes per token row: not a multiple of 16.
    batch = make_batch(TWO_REQUESTS, hq=1, hkv=1, head_dim=16, v_head_dim=16, dtype=torch.float16)
    k = torch.randn(batch.k.shape[0], 1, 20, dtype=torch.float16)[:, :, :16]
    with pytest.raises(ValueError, match=r"needs k with .* got strides \(20, 20, 1\)"):
        launch_cp_prefill_attention(batch.q, k, batch.v, batch.segments, 0.2, None, 0,
                                    poisoned_out(batch), None, AttnLaunchConfig(16, 16, 4, 1, tma=True))


@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32)])
def test_warp_specialized_loop_weights_rows_past_the_visible_keys_by_zero(block_m, block_n) -> None:
    # The one-loop form reads whole key blocks past each request's visible keys (the next
    # request's rows, the gaps between requests, TMA's zeros past the end): huge finite
    # values there must not reach any stored row. One segment longer than the tiles ends
    # off a block boundary; empty slots past the last block store nothing.
    requests = [(45, [(0, 45)]), (19, [(2, 17)]), (37, [(30, 7)])]
    batch = make_batch(requests, hq=2, hkv=2, head_dim=48, v_head_dim=32, dtype=torch.float32,
                       seed=block_m)
    visible = torch.zeros(batch.k.shape[0], dtype=torch.bool)
    for kv_start, q_pos, q_len in zip(batch.segments.kv_start.tolist(), batch.segments.q_pos.tolist(),
                                      batch.segments.q_len.tolist(), strict=True):
        visible[kv_start : kv_start + q_pos + q_len] = True
    k, v = batch.k.clone(), batch.v.clone()
    k[~visible], v[~visible] = 3e4, -5e4  # every row no stored query may see
    batch = batch._replace(k=k, v=v)
    out, lse = _launch(batch, 0.2, AttnLaunchConfig(block_m, block_n, 4, 1, tma=True,
                                                    warp_specialize=True))
    _check_against_ref(batch, out, lse, 0.2)
    check_against_naive(batch, out, lse, 0.2)


def test_warp_specialized_launch_sets_a_scratch_allocator_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Descriptors made in the kernel need Triton's scratch allocator; a caller's own stays.
    import triton
    from triton.runtime import _allocation

    seen = []
    monkeypatch.setattr(triton, "set_allocator", seen.append)
    monkeypatch.setattr(_allocation, "_allocator", _allocation.ContextVar("a", default=_allocation._NULL_ALLOCATOR))
    attention._ensure_tma_scratch()
    assert seen == [attention._tma_scratch]
    _allocation._allocator.set(print)  # the caller's allocator
    attention._ensure_tma_scratch()
    assert seen == [attention._tma_scratch]


def test_default_falls_back_where_its_switches_cannot_run() -> None:
    ws = AttnLaunchConfig(128, 128, 4, 2, tma=True, warp_specialize=True)
    contig = make_batch(TWO_REQUESTS, hq=2, hkv=1, head_dim=48, v_head_dim=32, dtype=torch.float32)
    paged = make_batch(TWO_REQUESTS, hq=2, hkv=1, head_dim=48, v_head_dim=32, dtype=torch.float32,
                       page_size=3)
    masked = make_batch(TWO_REQUESTS, hq=2, hkv=1, head_dim=40, v_head_dim=32, dtype=torch.float32)
    for b, want in ((contig, ws), (paged, MLA_PREFILL_FALLBACK), (masked, MLA_PREFILL_FALLBACK)):
        assert runnable_config(ws, b.q, b.k, b.v, b.page_table) == want
    plain = AttnLaunchConfig(128, 128, 8, 2)
    assert runnable_config(plain, paged.q, paged.k, paged.v, paged.page_table) == plain


def test_heads_fast_refuses_a_grid_past_the_y_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_MAX_GRID_Y", 4)
    batch = make_batch(TWO_REQUESTS, hq=2, hkv=1, head_dim=32, v_head_dim=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="config.heads_fast=True puts the .* query blocks on the grid's y"):
        _launch(batch, 0.2, AttnLaunchConfig(16, 16, 4, 1, heads_fast=True))
    out, lse = _launch(batch, 0.2, AttnLaunchConfig(16, 16, 4, 1))  # slots on x: no limit there
    check_against_naive(batch, out, lse, 0.2)


# ---- GPU: every sweep variant at DeepSeek's dims (qk 192 = 128 + 64, v 128, bf16) ---------


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@requires_gpu
@pytest.mark.parametrize("config", MLA_PREFILL_VARIANTS, ids=lambda c: c.label)
def test_gpu_variant_bf16_deepseek_dims(config: AttnLaunchConfig) -> None:
    requests = [(700, [(0, 300), (437, 263)]), (333, [(300, 33)]), (129, [(0, 129)])]
    batch = make_batch(requests, hq=16, hkv=16, head_dim=192, v_head_dim=128,
                       dtype=torch.bfloat16, device="cuda", seed=config.block_n)
    scale = 192**-0.5
    out, lse = _launch(batch, scale, config)
    want = cp_prefill_attention_ref(batch.q, batch.k, batch.v, batch.segments, scale, return_lse=True)
    cov = batch.covered
    assert out[~cov].isnan().all() and not out[cov].isnan().any()
    assert _rel(out[cov], want.out[cov]) < 1e-2
    torch.testing.assert_close(lse[cov], want.lse[cov], atol=2e-2, rtol=2e-2)


_COMPILE = """
import json, sys
sys.path.insert(0, {root!r})
from bench.mla_prefill_compile import compile_config
from bench.mla_prefill_sweep import parse_config
print(json.dumps(compile_config(parse_config("128,128,4,2+tma+warp_specialize"))))
"""


@pytest.mark.timeout(300)
def test_warp_specialized_variant_compiles_specialized_for_sm90():
    """Compiled offline for sm_90 (Triton's own toolchain): the one-loop form is split into a
    TMA producer warpgroup and two consumer warpgroups with registers moved to the
    consumers, without spilling (a scan, a second loop or a pointer load of q silently or
    loudly undoes that; Triton 3.9's verifier also checks each TMA copy against its box)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE.format(root=str(root))], env=env,
                          capture_output=True, text=True, timeout=280, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rec["warp_specialized"] and rec["partition_warps"] == [4, 4], rec
    assert 232 in rec["setmaxnreg"] and rec["local_bytes"] == 0, rec
    assert rec["shared"] <= 232448, rec  # the H200's 227 KB per block
