"""The block-FP8 GEMM at prefill's many rows: the default tile and the sweep's short
candidate list, each candidate equal to the reference under the interpreter on a
ragged shape, and the compiled epilogue storing whole vectors (the Hopper build,
compiled offline: no GPU needed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lanekv.kernels.fp8.gemm import block_fp8_matmul_ref, block_fp8_matmul_triton
from lanekv.kernels.fp8.gemm_configs import (
    FAMILIES,
    GemmConfig,
    candidate_configs,
    config_family,
    default_config,
    prefill_candidates,
)
from lanekv.kernels.fp8.quant import per_token_group_quant_fp8_ref
from lanekv.kernels.fp8.weights import quantize_weight_blocks

from tests.markers import requires_gpu

ROOT = Path(__file__).resolve().parents[2]
STANDARD = GemmConfig(64, 128, 128, 8, 1, 4, 3)


@pytest.mark.parametrize("rows", [256, 2048, 8192, 32768])
def test_prefill_rows_default_to_the_standard_tile(rows):
    cfg = default_config(rows, 4096, 4096, (128, 128))
    assert cfg == STANDARD and config_family(cfg) == "tiles"
    assert default_config(rows, 4096, 4096, (64, 64)).block_k == 64


def test_rows_below_256_keep_their_defaults():
    assert default_config(255, 4096, 4096, (128, 128)) == GemmConfig(64, 128, 128, 8, 1, 4, 4)
    assert default_config(64, 4096, 4096, (128, 128)).block_m == 64
    assert default_config(1, 4096, 4096, (128, 128)).block_m == 16


@pytest.mark.parametrize("rows", [256, 2048, 8192])
def test_prefill_candidates_are_few_start_with_the_default_and_cover_the_families(rows):
    cands = candidate_configs(rows, (128, 128))
    assert cands == prefill_candidates(128) and 1 <= len(cands) <= 8
    assert len(set(cands)) == len(cands)
    assert cands[0] == default_config(rows, 4096, 4096, (128, 128))
    # split-K, w8a16 and gemv are decode rows' families
    assert {config_family(c) for c in cands} == set(FAMILIES) - {"splitk", "w8a16", "gemv"}
    for cfg in cands:
        assert GemmConfig.from_dict(cfg.to_dict()) == cfg
        smem = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k
        assert smem <= 200 * 1024, cfg.name()


def _inputs(rows, cols, depth, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=gen) * torch.logspace(-2, 2, depth)
    w, w_scale = quantize_weight_blocks(torch.randn(cols, depth, generator=gen) * depth ** -0.5,
                                        (128, 128))
    a, a_scale = per_token_group_quant_fp8_ref(x, 128)
    return [t.to(device) for t in (a, a_scale, w, w_scale, torch.randn(cols, generator=gen))]


@pytest.mark.parametrize("index", range(len(prefill_candidates())))
def test_each_prefill_candidate_equals_reference_on_ragged_tiles(index):
    """70 rows (ragged in 64- and 128-row tiles), 200 columns (ragged in 128 and 256:
    the masked stores), K of three scale groups, with and without a bias."""
    cfg = prefill_candidates()[index]
    a, a_scale, w, w_scale, bias = _inputs(70, 200, 384, seed=index)
    for b in (None, bias):
        out = block_fp8_matmul_triton(a, a_scale, w, w_scale, (128, 128), torch.float32, b,
                                      config=cfg)
        ref = block_fp8_matmul_ref(a, a_scale, w, w_scale, (128, 128), torch.float32, b)
        # float32 summation order: within 1e-5 of the output's scale
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


_COMPILE = """
import json, sys
sys.path.insert(0, {root!r})
from bench.fp8_gemm_compile import compile_config
from lanekv.kernels.fp8.gemm_configs import GemmConfig
out = [compile_config(GemmConfig(64, 128, 128, 8, 1, 4, 3)),
       compile_config(GemmConfig(16, 64, 128, 8, 4, 4, 4))]
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_the_compiled_epilogue_stores_whole_vectors():
    """Compiled for sm_90 (Triton's own toolchain, offline): the bf16 output tile and the
    float32 split-K partials are stored in 16-byte vectors, never one element per store
    (clamped indices hid the columns' contiguity and made prefill tiles store bf16 one
    at a time)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE.format(root=str(ROOT))], env=env,
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    prefill, split = json.loads(proc.stdout.strip().splitlines()[-1])
    for rec in (prefill, split):
        stores = rec["global_stores"]
        assert stores, rec
        assert all(".v4." in kind for kind in stores), rec  # 16-byte stores only
    assert prefill["local_bytes"] == 0, prefill  # no register spills


@requires_gpu
@pytest.mark.parametrize("rows,cols,depth", [(2048, 3072, 2048), (1000, 576, 2048),
                                             (300, 4096, 1344)])
def test_gpu_prefill_default_and_candidates_equal_reference(rows, cols, depth):
    """Compiled, at prefill row counts: the default pick (no config given) and every
    candidate, on a full shape, a ragged column tile (576) and a K of 10.5 groups."""
    a, a_scale, w, w_scale, bias = _inputs(rows, cols, depth, seed=rows, device="cuda")
    ref = block_fp8_matmul_ref(a, a_scale, w, w_scale, (128, 128), torch.float32, bias)
    for cfg in [None, *prefill_candidates()]:
        out = block_fp8_matmul_triton(a, a_scale, w, w_scale, (128, 128), torch.bfloat16, bias,
                                      config=cfg)
        # bf16 output rounding, and Hopper's fp8 dot summing each step at reduced precision
        torch.testing.assert_close(out.float(), ref, rtol=1e-2,
                                   atol=1e-2 * ref.abs().max().item(), msg=lambda m, c=cfg: f"{c}: {m}")
