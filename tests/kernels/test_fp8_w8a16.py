"""The w8a16 (weight-only-dequant) family of the block-FP8 GEMM: the linear of
unquantized activations against ``fp8_linear_ref`` over odd sizes (interpreted), the
heuristic's pick at decode's few rows (a tuned table entry still winning), no
activation quantization anywhere, and the sm_90 build (compiled offline) taking
wgmma with the converted weight as its register operand."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lanekv.kernels.fp8 import gemm as gemm_module
from lanekv.kernels.fp8.gemm import fp8_linear_ref, fp8_linear_triton, linear_plan
from lanekv.kernels.fp8.gemm_configs import (
    TABLE_ENV,
    GemmConfig,
    config_for_device,
    default_config,
    load_table,
    table_entry,
)
from lanekv.kernels.fp8.weights import quantize_weight_blocks

ROOT = Path(__file__).resolve().parents[2]


def _inputs(rows, cols, depth, block, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # weights over three decades, so the blocks' scales differ
    spread = torch.logspace(-1.5, 1.5, cols)[torch.randperm(cols, generator=gen)][:, None]
    w, w_scale = quantize_weight_blocks(torch.randn(cols, depth, generator=gen) * spread
                                        * depth ** -0.5, block)
    x = torch.randn(rows, depth, generator=gen).to(dtype)
    bias = torch.randn(cols, generator=gen).to(dtype)
    return x, w, w_scale, bias


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("cols,depth,block,cfg", [
    # 16-wide scale groups as the tiny checkpoints use; N and K off the tile
    (40, 72, (16, 16), GemmConfig(16, 32, 16, 4, 1, 4, 1, w8a16=True)),
    # a tile across two scale blocks (a scale per column); k steps inside one group
    (70, 200, (32, 64), GemmConfig(16, 64, 32, 4, 3, 4, 1, w8a16=True)),
    (130, 257, (128, 128), GemmConfig(16, 32, 128, 4, 2, 4, 1, w8a16=True)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w8a16_linear_equals_the_reference(rows, cols, depth, block, cfg, dtype):
    """Split-K 1 and more, with and without bias; float32 to float32 summation order;
    float16 to the output's rounding against the float32 reference of the same float16
    inputs (the kernel sums exact products in float32; the float16 reference rounds the
    scaled weights to float16 first, so it is only near: 1e-3 of the norm)."""
    x, w, w_scale, bias = _inputs(rows, cols, depth, block, dtype, seed=rows + cols)
    for b in (None, bias):
        out = fp8_linear_triton(x, w, w_scale, block, b, config=cfg)
        assert out.dtype == dtype and out.shape == (rows, cols)
        ref32 = fp8_linear_ref(x.float(), w, w_scale, block, None if b is None else b.float())
        tol = 1e-5 if dtype == torch.float32 else 1e-3
        torch.testing.assert_close(out.float(), ref32, rtol=tol, atol=tol)
        ref = fp8_linear_ref(x, w, w_scale, block, b).float()
        assert (out.float() - ref).norm() <= 1e-3 * ref.norm()


def test_w8a16_runs_no_quantization_and_is_closer_to_the_reference_than_w8a8(monkeypatch):
    """The activations stay unquantized: the quantizer never runs, and the result is
    the reference's to float32 rounding where w8a8's carries the e4m3 rounding of x."""
    block = (32, 32)
    x, w, w_scale, bias = _inputs(5, 96, 160, block, torch.float32, seed=9)
    runs = []
    real = gemm_module.per_token_group_quant_fp8
    monkeypatch.setattr(gemm_module, "per_token_group_quant_fp8",
                        lambda *a, **k: runs.append(1) or real(*a, **k))
    cfg = GemmConfig(16, 32, 32, 4, 1, 4, 1)
    w8a16 = fp8_linear_triton(x, w, w_scale, block, bias, config=cfg._replace(w8a16=True))
    assert not runs
    w8a8 = fp8_linear_triton(x, w, w_scale, block, bias, config=cfg, fuse_quant=False)
    assert runs  # (the counter counts)
    ref = fp8_linear_ref(x, w, w_scale, block, bias)
    err16, err8 = (w8a16 - ref).norm() / ref.norm(), (w8a8 - ref).norm() / ref.norm()
    assert err16 < 1e-6 < 1e-3 < err8, (err16, err8)


def test_the_heuristic_picks_w8a16_at_16_rows_or_fewer_and_a_table_entry_wins(
        tmp_path, monkeypatch):
    monkeypatch.delenv(TABLE_ENV, raising=False)
    for rows in (1, 7, 16):
        cfg = default_config(rows, 4096, 4096, (128, 128))
        assert cfg.w8a16 and cfg.block_m == 16 and cfg.block_k == 128, cfg
        plan = linear_plan(rows, 4096, 4096, (128, 128), torch.device("cpu"), config=cfg)
        assert plan == (cfg, False)
    assert not default_config(17, 4096, 4096, (128, 128)).w8a16
    assert not default_config(2048, 4096, 4096, (128, 128)).w8a16
    # an untuned shape on an H200 takes the heuristic's w8a16; a tuned w8a8 entry wins, and
    # an entry written before the field existed loads as w8a8
    assert config_for_device(1, 1000, 1024, (128, 128), "NVIDIA H200", 132).w8a16
    tuned = GemmConfig(16, 64, 128, 8, 4, 4, 5)
    old = table_entry(1, 1000, 1024, (128, 128), tuned)
    del old["config"]["w8a16"]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"entries": [old]}))
    load_table.cache_clear()
    monkeypatch.setenv(TABLE_ENV, str(path))
    assert config_for_device(1, 1000, 1024, (128, 128), "NVIDIA H200", 132) == tuned
    # a tuned w8a16 entry at the CPU: the table's pick; an explicit fuse_quant asks for
    # quantized activations, so it runs as the same tiles' w8a8 twin
    path2 = tmp_path / "table2.json"
    path2.write_text(json.dumps({"entries": [
        table_entry(4, 96, 160, (32, 32), GemmConfig(16, 32, 32, 4, 2, 4, 1, w8a16=True))]}))
    monkeypatch.setenv(TABLE_ENV, str(path2))
    cpu = torch.device("cpu")
    assert linear_plan(4, 96, 160, (32, 32), cpu).config.w8a16
    twin = linear_plan(4, 96, 160, (32, 32), cpu, fuse_quant=True)
    assert twin == (GemmConfig(16, 32, 32, 4, 2, 4, 1), True)
    x, w, w_scale, _ = _inputs(4, 96, 160, (32, 32), torch.float32, seed=4)
    torch.testing.assert_close(fp8_linear_triton(x, w, w_scale, (32, 32)),
                               fp8_linear_ref(x, w, w_scale, (32, 32)), rtol=1e-5, atol=1e-5)
    load_table.cache_clear()


_COMPILE = """
import json, sys
sys.path.insert(0, {root!r})
from bench.fp8_gemm_compile import compile_config
from lanekv.kernels.fp8.gemm_configs import GemmConfig
out = {{}}
for bn, split in ((32, 1), (64, 4), (128, 1)):
    cfg = GemmConfig(16, bn, 128, 8, split, 4, 4, w8a16=True)
    out[cfg.name()] = compile_config(cfg)
out["ragged"] = compile_config(GemmConfig(16, 64, 128, 8, 1, 4, 4, w8a16=True), even_k=False)
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_w8a16_compiles_for_sm_90_with_the_converted_weight_feeding_wgmma_from_registers():
    """Offline for sm_90 (the decision in gemm_w8a16.py's docstring): with 64 or 128
    columns per tile the dot is a wgmma whose A operand is the converted weight in
    registers, never stored back to shared memory; 32 columns take mma.sync; the
    epilogue stores vectors; nothing spills."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", TABLE_ENV)}
    proc = subprocess.run([sys.executable, "-c", _COMPILE.format(root=str(ROOT))], env=env,
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, rec in recs.items():
        assert rec["local_bytes"] == 0 and rec["k_loop"] > 0, (name, rec)
        assert all(".v" in store for store in rec["global_stores"]), (name, rec)
        wide = name == "ragged" or "n32k" not in name
        assert rec["weight_in_registers"] is wide and (rec["wgmma"] > 0) is wide, (name, rec)
