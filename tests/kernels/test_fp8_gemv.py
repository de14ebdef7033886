"""The gemv family (the CUDA-core split-K GEMV of 1 to 4 rows, ``gemm_gemv.py``) and
SiLU-and-multiply fused into the w8a16 and gemv down projections: against the torch
reference over odd sizes (interpreted; float16 and float32, bf16 being the GPU's), the
fused down projection bit for bit against ``silu_mul`` then the linear, the refusals,
the table and the MLP path choosing them, the sm_90 build (compiled offline), and the
same checks compiled in bf16 on a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lanekv.kernels import arrivals
from lanekv.kernels.fp8 import gemm as gemm_module
from lanekv.kernels.fp8 import gemm_gemv as gemv_module
from lanekv.kernels.fp8.gemm import (
    block_fp8_matmul_triton,
    fp8_linear_ref,
    fp8_linear_triton,
    linear_plan,
    silu_mul_fp8_linear_ref,
    silu_mul_fp8_linear_triton,
)
from lanekv.kernels.fp8.gemm_configs import (
    GEMV_MAX_ROWS,
    TABLE_ENV,
    GemmConfig,
    candidate_configs,
    check_config,
    config_family,
    load_table,
    select_config,
    table_entry,
)
from lanekv.kernels.fp8.gemm_gemv import gemv_linear
from lanekv.kernels.fp8.quant import (
    per_token_group_quant_fp8_triton,
    silu_mul_quant_fp8_triton,
    silu_mul_ref,
    silu_mul_triton,
)
from lanekv.kernels.fp8.weights import quantize_weight_blocks

from tests.markers import requires_gpu

ROOT = Path(__file__).resolve().parents[2]


def _inputs(rows, cols, depth, block, dtype, seed, device="cpu", gate_up=False):
    gen = torch.Generator().manual_seed(seed)
    # weights over three decades, so the blocks' scales differ
    spread = torch.logspace(-1.5, 1.5, cols)[torch.randperm(cols, generator=gen)][:, None]
    w, w_scale = quantize_weight_blocks(torch.randn(cols, depth, generator=gen) * spread
                                        * depth ** -0.5, block)
    x = torch.randn(rows, 2 * depth if gate_up else depth, generator=gen).to(dtype)
    bias = torch.randn(cols, generator=gen).to(dtype)
    return [t.to(device) for t in (x, w, w_scale, bias)]


def _gemv(block_n, block_k, split, warps=4, stages=1):
    return GemmConfig(16, block_n, block_k, 1, split, warps, stages, gemv=True)


# N off the tile; K with a tail inside a scale group (200 = 3 * 64 + 8, 257 = 2 * 128 + 1,
# 72 = 4 * 16 + 8); a tile across two scale blocks (64 columns, 32-row blocks); a k step
# of half the group; split-K 1 and more (more splits than groups: 16 over 5)
GEMV_CASES = [
    (70, 200, (32, 64), 32, 32),
    (130, 257, (128, 128), 64, 128),
    (40, 72, (16, 16), 16, 16),
    (96, 160, (32, 32), 64, 16),
]


F32, F16 = torch.float32, torch.float16


# (case, rows, split, stages, dtype): every case at 1 to 4 rows between them, split-K 1,
# 3 and 16 (more splits than groups), with and without the prefetch, both dtypes
@pytest.mark.parametrize("case,rows,split,stages,dtype", [
    (0, 1, 1, 1, F32), (0, 4, 3, 1, F16), (0, 2, 16, 1, F32), (0, 3, 1, 1, F16),
    (1, 1, 3, 2, F16), (1, 2, 1, 2, F32), (1, 4, 16, 1, F32), (1, 3, 3, 2, F16),
    (2, 1, 16, 2, F32), (2, 4, 1, 2, F16), (2, 3, 3, 1, F32),
    (3, 2, 3, 1, F16), (3, 4, 1, 1, F32), (3, 1, 16, 1, F16),
])
def test_gemv_linear_equals_the_reference(case, rows, split, stages, dtype):
    """float32: to float32 summation order; float16: near the float32 reference of the
    same float16 inputs (the kernel sums exact products in float32 and rounds once).
    Two stages prefetch the next group's tile (a k step of one group only)."""
    cols, depth, block, block_n, block_k = GEMV_CASES[case]
    x, w, w_scale, bias = _inputs(rows, cols, depth, block, dtype, seed=rows + cols + split)
    if block_k != block[1]:
        stages = 1
    cfg = _gemv(block_n, block_k, split, stages=stages)
    for b in (None, bias):
        out = fp8_linear_triton(x, w, w_scale, block, b, config=cfg)
        assert out.dtype == dtype and out.shape == (rows, cols)
        ref32 = fp8_linear_ref(x.float(), w, w_scale, block, None if b is None else b.float())
        tol = 1e-5 if dtype == torch.float32 else 1e-3
        torch.testing.assert_close(out.float(), ref32, rtol=tol, atol=tol)


@pytest.mark.parametrize("rows,split,stages", [(1, 3, 1), (4, 16, 1), (2, 2, 2), (3, 5, 2)])
def test_the_last_split_adds_the_partials_as_the_reduce_launch_did(rows, split, stages,
                                                                    monkeypatch):
    """Split-K partials added by each column tile's last split (``kernels.arrivals``)
    equal the separate reduce launch's bit for bit (same float32 sums in the same order),
    with and without bias, in one launch: the reduce kernel never runs; and the counters
    are back at zero for the next launch."""
    cols, depth, block, block_n, _ = GEMV_CASES[1]  # 130 columns: a ragged last tile
    x, w, w_scale, bias = _inputs(rows, cols, depth, block, F32, seed=11 * rows + split)
    cfg = _gemv(block_n, 128, split, stages=stages)
    apart = [gemv_linear(x, w, w_scale, block, b, cfg, last_reduces=False) for b in (None, bias)]
    held = []

    def counting(device, groups):
        held.append(torch.zeros(groups, dtype=torch.int32))
        return held[-1]

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the separate reduce kernel was launched")

    monkeypatch.setattr(gemv_module, "counters", counting)
    monkeypatch.setattr(gemv_module, "_gemv_reduce_kernel", NoLaunch())
    for b, expected in zip((None, bias), apart):
        assert torch.equal(gemv_linear(x, w, w_scale, block, b, cfg), expected)
    assert [c.shape[0] for c in held] == [3, 3]  # one counter a column tile: 130 / 64
    assert all(not c.any() for c in held)


def test_arrival_counters_are_the_devices_and_refuse_too_many_groups():
    """On a CPU each call gets zeroed counters of its own; more groups than the slots
    ask for the separate launch (None)."""
    assert torch.equal(arrivals.counters(torch.device("cpu"), 7), torch.zeros(7, dtype=torch.int32))
    assert arrivals.counters(torch.device("cpu"), arrivals.SLOTS + 1) is None


def test_gemv_reads_the_weight_once_for_all_rows_and_quantizes_nothing(monkeypatch):
    """Each row of a 4-row GEMV equals that row alone (no row mixes into another, the
    summation order is the row's own), and no activation quantization runs."""
    block = (32, 32)
    x, w, w_scale, bias = _inputs(4, 96, 160, block, torch.float32, seed=5)
    runs = []
    for name in ("per_token_group_quant_fp8", "silu_mul_quant_fp8"):
        real = getattr(gemm_module, name)
        monkeypatch.setattr(gemm_module, name,
                            lambda *a, real=real, **k: runs.append(1) or real(*a, **k))
    cfg = _gemv(32, 32, 2)
    out = fp8_linear_triton(x, w, w_scale, block, bias, config=cfg)
    for r in range(4):
        assert torch.equal(out[r], fp8_linear_triton(x[r:r + 1], w, w_scale, block, bias,
                                                     config=cfg)[0])
    assert not runs


W8A16_DOWN = GemmConfig(16, 32, 32, 4, 2, 4, 1, w8a16=True)


@pytest.mark.parametrize("cfg,rows", [(_gemv(32, 32, 1), 1), (_gemv(32, 16, 2), 4),
                                      (_gemv(64, 32, 2, stages=2), 3), (W8A16_DOWN, 1),
                                      (W8A16_DOWN, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_silu_down_is_bit_identical_to_silu_mul_then_the_linear(cfg, rows, dtype,
                                                                      monkeypatch):
    """The down projection reading gate_up itself equals ``silu_mul`` then the same
    config's linear bit for bit (the product rounded to the dtype as ``silu_mul`` rounds
    it), with a bias and a ragged K (72 = 2 * 32 + 8), in one launch fewer: neither
    ``silu_mul`` nor ``silu_mul_quant_fp8`` runs; and it is the reference's op."""
    block = (32, 32)
    gate_up, w, w_scale, bias = _inputs(rows, 50, 72, block, dtype, seed=rows, gate_up=True)
    unfused = silu_mul_fp8_linear_triton(gate_up, w, w_scale, block, bias, config=cfg,
                                         fuse_silu=False)
    assert torch.equal(unfused, fp8_linear_triton(silu_mul_triton(gate_up), w, w_scale, block,
                                                  bias, config=cfg))
    runs = []
    for name in ("silu_mul_triton", "silu_mul_quant_fp8"):
        real = getattr(gemm_module, name)
        monkeypatch.setattr(gemm_module, name,
                            lambda *a, real=real, **k: runs.append(1) or real(*a, **k))
    fused = silu_mul_fp8_linear_triton(gate_up, w, w_scale, block, bias, config=cfg)
    assert not runs
    assert fused.dtype == dtype and fused.shape == (rows, 50)
    assert torch.equal(fused, unfused)
    # the reference in the same dtype (torch's SiLU and multiply, F.linear)
    ref = silu_mul_fp8_linear_ref(gate_up, w, w_scale, block, bias).float()
    if dtype == torch.float32:
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    else:
        assert (fused.float() - ref).norm() <= 1e-3 * ref.norm()
    # leading dims kept, as the MLP hands them
    assert torch.equal(silu_mul_fp8_linear_triton(gate_up[None], w, w_scale, block, bias,
                                                  config=cfg)[0], fused)


@pytest.mark.parametrize("rows,inter,group,dtype", [(1, 16, 16, F32), (3, 100, 32, F16),
                                                    (5, 1500, 128, F32)])
def test_silu_mul_is_the_product_silu_mul_quant_quantizes(rows, inter, group, dtype):
    """``silu_mul`` writes what ``silu_mul_quant_fp8`` quantizes (one jit definition of
    the rounding): quantizing its output is bit for bit the fused quantization; against
    torch's ops it differs by at most the kernel's exp ulp before the rounding."""
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(dtype)
    h = silu_mul_triton(gate_up)
    assert h.dtype == dtype and h.shape == (rows, inter)
    q, s = silu_mul_quant_fp8_triton(gate_up, group)
    q2, s2 = per_token_group_quant_fp8_triton(h, group)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    ref = silu_mul_ref(gate_up)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(h, ref, rtol=4 * eps, atol=1e-30)


def test_gemv_refusals_name_the_field_and_value():
    block = (32, 32)
    x, w, w_scale, _ = _inputs(5, 64, 64, block, torch.float32, seed=1)
    cfg = _gemv(32, 32, 1)
    with pytest.raises(ValueError, match=r"rows=5: config.gemv=True \(m16n32k32g1s1w4st1V\) "
                                         r"takes at most 4 rows"):
        fp8_linear_triton(x, w, w_scale, block, config=cfg)
    with pytest.raises(ValueError, match="rows=5: config.gemv=True"):
        gemv_linear(x, w, w_scale, block, None, cfg)
    with pytest.raises(ValueError, match="rows=5: config.gemv=True"):
        silu_mul_fp8_linear_triton(torch.cat([x, x], 1), w, w_scale, block, config=cfg)
    with pytest.raises(ValueError, match="config.block_k=64 must divide block_k=32"):
        fp8_linear_triton(x[:2], w, w_scale, block, config=cfg._replace(block_k=64))
    with pytest.raises(ValueError, match="config.num_stages=2 prefetches the next scale group's "
                                         "tile: it needs config.block_k=16 to equal block_k=32"):
        fp8_linear_triton(x[:2], w, w_scale, block, config=_gemv(32, 16, 1, stages=2))
    with pytest.raises(ValueError, match="fuse_quant=True asks for quantized activations but "
                                         r"config m16n32k32g1s1w4st1V has gemv=True"):
        fp8_linear_triton(x[:2], w, w_scale, block, fuse_quant=True, config=cfg)
    a, a_scale = per_token_group_quant_fp8_triton(x, 32)
    with pytest.raises(ValueError, match=r"config.gemv=True \(m16n32k32g1s1w4st1V\) reads"):
        block_fp8_matmul_triton(a, a_scale, w, w_scale, block, torch.float32, config=cfg)
    with pytest.raises(ValueError, match="fuse_silu=True needs a w8a16 or gemv config"):
        silu_mul_fp8_linear_triton(torch.cat([x, x], 1), w, w_scale, block, fuse_silu=True,
                                   config=GemmConfig(16, 32, 32))
    with pytest.raises(ValueError, match=r"gate_up must be \[\.\.\., 2 \* I\], got \(5, 63\)"):
        silu_mul_fp8_linear_triton(x[:, :63], w, w_scale, block, config=cfg)
    with pytest.raises(ValueError, match="config must be a GemmConfig with gemv=True"):
        gemv_linear(x[:2], w, w_scale, block, None, GemmConfig(16, 32, 32))
    for switch in ("tma", "persistent", "lag", "quant_first", "w8a16"):
        with pytest.raises(ValueError, match=f"{switch}=True cannot go with gemv=True"):
            GemmConfig.from_dict(dict(cfg.to_dict(), **{switch: True}))
    with pytest.raises(ValueError, match="gemv must be a bool, got 1"):
        GemmConfig.from_dict(dict(cfg.to_dict(), gemv=1))


def test_gemv_candidates_and_a_table_entry_serve_at_most_4_rows(tmp_path, monkeypatch):
    """The sweep tries gemv at 1 to 4 rows only; a table's gemv entry is the pick for 1
    to 4 rows (the MLP's down projection then fuses its SiLU) and never for more (the
    interpreter's tiles there); an entry written before the field existed loads as w8a8."""
    for rows in (1, 4, 5, 16):
        gemv = [c for c in candidate_configs(rows, (128, 128)) if c.gemv]
        assert bool(gemv) is (rows <= GEMV_MAX_ROWS)
        assert all(config_family(c) == "gemv" and GemmConfig.from_dict(c.to_dict()) == c
                   for c in gemv)
    block, cpu = (32, 32), torch.device("cpu")
    cfg = _gemv(32, 32, 2)
    old = table_entry(1, 80, 96, block, GemmConfig(16, 32, 32))
    del old["config"]["gemv"]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"entries": [table_entry(1, 50, 72, block, cfg), old]}))
    load_table.cache_clear()
    monkeypatch.setenv(TABLE_ENV, str(path))
    try:
        assert select_config(1, 80, 96, block, cpu) == GemmConfig(16, 32, 32)
        for rows in (1, 2, 4):
            assert select_config(rows, 50, 72, block, cpu) == cfg
            assert linear_plan(rows, 50, 72, block, cpu) == (cfg, False)
        assert not select_config(5, 50, 72, block, cpu).gemv
        # an explicit fuse_quant runs the pick's w8a8 twin
        assert linear_plan(2, 50, 72, block, cpu, fuse_quant=True).config == cfg._replace(
            gemv=False)
        gate_up, w, w_scale, bias = _inputs(3, 50, 72, block, torch.float32, seed=3,
                                            gate_up=True)
        assert torch.equal(silu_mul_fp8_linear_triton(gate_up, w, w_scale, block, bias),
                           silu_mul_fp8_linear_triton(gate_up, w, w_scale, block, bias,
                                                      config=cfg))
    finally:
        load_table.cache_clear()


def test_the_mlp_down_projection_fuses_its_silu_where_the_config_is_gemv(tmp_path,
                                                                         monkeypatch):
    """An FP8 MLP's ``silu_mul_down`` at decode rows with a gemv (or w8a16) pick for its
    down projection: the interpreted kernels run the fused projection, no ``silu_mul``
    nor ``silu_mul_quant_fp8`` launch; a w8a8 pick still quantizes the product."""
    from lanekv.model.llama import silu_mul_down
    from lanekv.model.quant.config import WeightQuant
    from lanekv.model.quant.linear import quantize_linears
    from torch import nn

    block = (32, 32)
    mlp = nn.Sequential(nn.Linear(72, 50, bias=False))
    quantize_linears(mlp, WeightQuant(block=block))
    down = mlp[0]
    gate_up = torch.randn(2, 144, generator=torch.Generator().manual_seed(2))
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    runs = []
    for name in ("silu_mul_triton", "silu_mul_quant_fp8"):
        real = getattr(gemm_module, name)
        monkeypatch.setattr(gemm_module, name,
                            lambda *a, name=name, real=real, **k: runs.append(name) or real(*a, **k))
    path = tmp_path / "table.json"
    load_table.cache_clear()
    monkeypatch.setenv(TABLE_ENV, str(path))
    try:
        for cfg in (_gemv(32, 32, 2), W8A16_DOWN, GemmConfig(16, 32, 32)):
            path.write_text(json.dumps({"entries": [table_entry(2, 50, 72, block, cfg)]}))
            load_table.cache_clear()
            runs.clear()
            out = silu_mul_down(down, gate_up)
            fused = cfg.gemv or cfg.w8a16
            assert runs == ([] if fused else ["silu_mul_quant_fp8"]), (cfg.name(), runs)
            if fused:
                assert torch.equal(out, silu_mul_fp8_linear_triton(
                    gate_up, down.weight, down.weight_scale_inv, block, config=cfg,
                    fuse_silu=False))
    finally:
        load_table.cache_clear()


_COMPILE = """
import json, sys
sys.path.insert(0, {root!r})
from bench.fp8_gemm_compile import compile_config
from lanekv.kernels.fp8.gemm_configs import GemmConfig, gemv_candidates
cands = gemv_candidates()
narrow = next(c for c in cands if c.block_n == 16)
half_step = cands[-1]  # a k step of half the scale group
prefetch = next(c for c in cands if c.num_stages == 2)
out = [compile_config(prefetch, rows=1), compile_config(prefetch, rows=1, silu=True),
       compile_config(narrow, rows=4), compile_config(cands[5], rows=4, silu=True),
       compile_config(half_step, rows=2, silu=True),
       compile_config(prefetch, rows=3, even_k=False)]
w8a16 = GemmConfig(16, 64, 128, 8, 4, 4, 3, w8a16=True)
out.append(dict(compile_config(w8a16, silu=True), silu=True))
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_gemv_and_the_fused_silu_down_compile_for_sm_90_without_spills():
    """Offline for sm_90: the gemv family at 1 to 4 rows, 16 to 128 columns, with and
    without the fused SiLU and the prefetch, loads the weight in 16-byte vectors (a K that is not
    16-divisible, whose rows are not 16-byte aligned, excepted) on the CUDA cores (no
    wgmma) and spills nothing; the fused w8a16 down projection keeps its wgmma and
    spills nothing."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", TABLE_ENV)}
    proc = subprocess.run([sys.executable, "-c", _COMPILE.format(root=str(ROOT))], env=env,
                          capture_output=True, text=True, timeout=580, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = json.loads(proc.stdout.strip().splitlines()[-1])
    for rec in recs:
        assert rec["local_bytes"] == 0 and rec["k_loop"] > 0, rec
    gemv = [r for r in recs if r["config"].endswith("V")]
    assert {(r["rows"], r["silu"]) for r in gemv} == {(1, False), (1, True), (4, False),
                                                      (4, True), (2, True), (3, False)}
    for rec in gemv[:-1]:
        assert rec["weight_vector_bytes"] == 16 and rec["wgmma"] == 0 and rec["ffma"] > 0, rec
    assert recs[-1]["wgmma"] > 0 and recs[-1]["silu"], recs[-1]


def _gpu_configs():
    return [_gemv(32, 128, 1), _gemv(64, 128, 4), _gemv(128, 128, 8, 8), _gemv(64, 64, 2, 2)]


@requires_gpu
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_gpu_gemv_and_the_fused_silu_down_equal_the_reference(rows):
    """Compiled, in bf16: the GEMV against the float32 reference of the same inputs on
    Llama-3-8B's o shape, V2-Lite's kv_a (576 columns: a ragged column tile) and a K
    with a tail inside a scale group (1344 = 10.5 groups), with and without bias; the
    fused SiLU down projection (gemv and w8a16) against silu_mul then the same linear
    (bit for bit) and the reference."""
    block = (128, 128)
    for cols, depth in ((4096, 4096), (576, 2048), (384, 1344)):
        x, w, w_scale, bias = _inputs(rows, cols, depth, block, torch.bfloat16, seed=rows,
                                      device="cuda")
        gate_up = torch.randn(rows, 2 * depth, device="cuda", dtype=torch.bfloat16)
        for cfg in _gpu_configs():
            for b in (None, bias):
                out = fp8_linear_triton(x, w, w_scale, block, b, config=cfg)
                ref = fp8_linear_ref(x.float(), w, w_scale, block,
                                     None if b is None else b.float())
                torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
        for cfg in (*_gpu_configs(), GemmConfig(16, 64, 128, 8, 4, 4, 3, w8a16=True)):
            fused = silu_mul_fp8_linear_triton(gate_up, w, w_scale, block, bias, config=cfg)
            unfused = silu_mul_fp8_linear_triton(gate_up, w, w_scale, block, bias, config=cfg,
                                                 fuse_silu=False)
            assert torch.equal(fused, unfused), cfg.name()
            # the float32 reference does not round silu(gate) * up to bf16: near, by norm
            ref = silu_mul_fp8_linear_ref(gate_up.float(), w, w_scale, block, bias.float())
            assert (fused.float() - ref).norm() <= 1e-2 * ref.norm(), cfg.name()


@requires_gpu
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_gpu_last_split_reduction_replays_in_a_cuda_graph(pdl, monkeypatch):
    """Compiled, in a captured graph replayed on new inputs (with and without PDL): the
    last split's reduction equals the separate reduce launch bit for bit at every replay,
    back to back with a second GEMV sharing the counters, and the counters are zero
    after."""
    monkeypatch.setenv("LANEKV_PDL", pdl)
    block = (128, 128)
    x, w, w_scale, _ = _inputs(2, 4096, 4096, block, torch.bfloat16, seed=3, device="cuda")
    w2, w2_scale = w[:576], w_scale[:5]  # a ragged column tile, 5 scale rows
    cfg, cfg2 = _gemv(64, 128, 8), _gemv(32, 128, 4, stages=2)
    gemv_linear(x, w, w_scale, block, None, cfg)  # eager: compiles, makes the counters
    gemv_linear(x, w2, w2_scale, block, None, cfg2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv_linear(x, w, w_scale, block, None, cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = gemv_linear(x, w, w_scale, block, None, cfg)
        second = gemv_linear(x, w2, w2_scale, block, None, cfg2)
    for seed in range(4):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(first, gemv_linear(x, w, w_scale, block, None, cfg, last_reduces=False))
        assert torch.equal(second, gemv_linear(x, w2, w2_scale, block, None, cfg2,
                                               last_reduces=False))
    assert not arrivals.counters(x.device, 1).any()


# The GEMV on an unscaled 16-bit weight (``gemv_linear`` with no scales; the interpreter
# has no bfloat16: float32 here, bf16 on the GPU below)
@pytest.mark.parametrize("rows,cols,depth", [(1, 96, 200), (3, 40, 256), (4, 70, 96)])
def test_unscaled_weight_gemv_equals_f_linear(rows, cols, depth):
    """Odd column counts (ragged tiles), a K with a ragged last k step, 1 to 4 rows, with
    and without bias, split-K reduced by the last split and by the reduce launch, the
    register prefetch, and the SiLU product fused into the activation load."""
    g = torch.Generator().manual_seed(rows * depth)
    x = torch.randn(rows, depth, generator=g)
    w = torch.randn(cols, depth, generator=g)
    bias = torch.randn(cols, generator=g)
    gate_up = torch.randn(rows, 2 * depth, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    for cfg in (_gemv(32, 64, 1, 2), _gemv(16, 32, 3, 2), _gemv(32, 64, 2, 2, stages=2)):
        for b in (None, bias):
            for last in (True, False):
                out = gemv_linear(x, w, None, None, b, cfg, last_reduces=last)
                torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        fused = gemv_linear(gate_up, w, None, None, None, cfg, silu=True)
        torch.testing.assert_close(fused, F.linear(F.silu(gate) * up, w), rtol=1e-5, atol=1e-4)


def test_unscaled_weight_gemv_refuses_a_weight_not_in_x_dtype():
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match=r"^weight must be a dense torch.float32 \[N, 64\], got "
                                         r"torch.float16 \(8, 64\)$"):
        gemv_linear(x, torch.randn(8, 64).half(), None, None, None, _gemv(16, 32, 1, 2))
    with pytest.raises(ValueError, match=r"^bias must be \[8\], got \(7,\)$"):
        gemv_linear(x, torch.randn(8, 64), None, None, torch.randn(7), _gemv(16, 32, 1, 2))


def test_dense_linear_takes_the_gemv_only_where_the_table_names_the_shape(monkeypatch):
    """``dense_linear`` runs the GEMV with the table's config for a listed (N, K, SiLU) at
    the table's row count and dtype, and ``F.linear`` for anything else; both agree."""
    seen = []
    real = gemv_module.gemv_linear

    def recording(*args, **kwargs):
        seen.append(args[5])
        return real(*args, **kwargs)

    cfg = _gemv(16, 32, 2, 2)
    monkeypatch.setattr(gemv_module, "gemv_linear", recording)
    monkeypatch.setattr(gemv_module, "dense_gemv_config",
                        lambda rows, n, k, silu, dtype, device: cfg
                        if (rows, n, k, silu, dtype) == (1, 40, 96, False, torch.float32) else None)
    w = torch.randn(40, 96)
    for x in (torch.randn(1, 96), torch.randn(2, 96)):
        torch.testing.assert_close(gemv_module.dense_linear(x, w), F.linear(x, w), rtol=1e-5,
                                   atol=1e-4)
    assert seen == [cfg]  # one row: the GEMV; two rows: torch
    gate_up = torch.randn(1, 192)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(gemv_module.dense_linear(gate_up, w, silu=True),
                               F.linear(F.silu(gate) * up, w), rtol=1e-5, atol=1e-4)
    assert seen == [cfg]  # (40, 96, SiLU) is not listed


def test_the_dense_gemv_table_lists_only_gemv_configs_at_one_row():
    from lanekv.kernels.fp8 import gemm_configs

    for device, table in gemm_configs.DENSE_GEMV_TABLE.items():
        for (n, k, _silu), cfg in table.items():
            assert cfg.gemv and check_config(cfg) == cfg and cfg.block_k == 128, (device, n, k)
    # a CPU tensor, another row count or dtype: never the GEMV
    assert gemm_configs.dense_gemv_config(1, 4096, 4096, False, torch.bfloat16,
                                          torch.device("cpu")) is None


@requires_gpu
def test_gpu_dense_linear_equals_f_linear_in_bf16():
    """Compiled, bf16, one row, each of the H200 table's configs on a shape of its own
    family (and the Llama o shape through ``dense_linear``): near cuBLAS's bf16 result."""
    from lanekv.kernels.fp8 import gemm_configs

    torch.manual_seed(0)
    for (n, k, silu), cfg in gemm_configs.DENSE_GEMV_TABLE["NVIDIA H200"].items():
        n = min(n, 8192)  # the lm_head configs on fewer columns: same tiles
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        x = torch.randn(1, 2 * k if silu else k, device="cuda", dtype=torch.bfloat16)
        ref = (F.linear(F.silu(x[:, :k].float()) * x[:, k:].float(), w.float()) if silu
               else F.linear(x.float(), w.float()))
        out = gemv_linear(x, w, None, None, None, cfg, silu=silu)
        assert (out.float() - ref).norm() <= 1e-2 * ref.norm(), (n, k, cfg.name())
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 4096 ** -0.5
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    out = gemv_module.dense_linear(x, w)
    ref = F.linear(x.float(), w.float())
    assert (out.float() - ref).norm() <= 1e-2 * ref.norm()
