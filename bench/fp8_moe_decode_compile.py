"""Compile the block-FP8 decode experts' kernels at DeepSeek-V2-Lite's shapes for Hopper,
without a GPU: the routed experts alone and with the shared expert fused in
(``kernels/fp8/moe_decode.py``), at the tiles ``fp8_decode_tiles`` picks on an H200.

``--gemv`` compiles the one-token CUDA-core experts (``kernels/fp8/moe_gemv.py``) at the
same shapes and tiles ``MoEGemvTiles()``, the shared slices fused, as JSON.

``--grouped`` compiles the grouped (prefill-size) FP8 expert kernels of
``kernels/fp8/experts.py`` instead, at the tiles a CUDA device takes, for scale blocks of
16 (the tiny test checkpoints: their dots run in float16, Triton's fp8 dot needing K >= 32)
and 128, and prints each kernel's dot operand types.

The launcher runs on CPU tensors with its launches recorded, not run
(``bench.pdl_compile.recording``), so each kernel is compiled with the arguments and
constexprs a step gives it; prints shared memory, registers and local (spill) bytes per
thread of each (``cuobjdump --dump-resource-usage``). Run with the interpreter off:

    python bench/fp8_moe_decode_compile.py [--tokens 1 16]
    python bench/fp8_moe_decode_compile.py --grouped
    python bench/fp8_moe_decode_compile.py --gemv
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import lanekv  # noqa: F401  (the package first)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from lanekv.kernels.fp8.experts import MoETiles, moe_experts_fp8_triton  # noqa: E402
from lanekv.kernels.fp8.moe_decode import Fp8SharedExpert, moe_experts_fp8_decode_triton  # noqa: E402
from lanekv.kernels.fp8.moe_gemv import moe_experts_fp8_gemv  # noqa: E402
from lanekv.kernels.fp8.weights import FP8_DTYPE  # noqa: E402
from lanekv.kernels.moe.decode import DecodeTiles  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.mla_chain_compile import resource_usage  # noqa: E402
from bench.pdl_compile import _OPTIONS, _arg_type, recording  # noqa: E402

# V2-Lite: hidden 2048, expert width 1408 (11 blocks of 128), top 6, two shared slices.
# Eight experts stand for the 64: no kernel specializes on the count (only on strides).
HIDDEN, INTER, TOP_K, EXPERTS, SLICES, BLOCK = 2048, 1408, 6, 8, 2, (128, 128)
# the default decode tiles on 132 SMs (fp8_decode_tiles takes its table over them where it
# lists the kernel and bucket): 8 active experts (6 + 2 slices) x 44 column tiles of 32
# cover the SMs twice; the k step one 128-wide scale group
H200_TILES = DecodeTiles(16, 32, 128, 4, 4)


def _fp8(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    scales = [*shape[:-2], -(-shape[-2] // BLOCK[0]), -(-shape[-1] // BLOCK[1])]
    return torch.zeros(shape, dtype=FP8_DTYPE), torch.ones(scales)


def launches(tokens: int, shared: bool) -> list:
    x = torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16)
    (w13, s13), (w2, s2) = _fp8(EXPERTS, 2 * INTER, HIDDEN), _fp8(EXPERTS, HIDDEN, INTER)
    extra = Fp8SharedExpert(*_fp8(2 * SLICES * INTER, HIDDEN), *_fp8(HIDDEN, SLICES * INTER)) if (
        shared) else None
    ids = torch.arange(TOP_K).repeat(tokens, 1)
    with recording(run=False) as seen:
        moe_experts_fp8_decode_triton(x, w13, s13, w2, s2, torch.ones(ids.shape), ids, BLOCK,
                                      shared=extra, config=H200_TILES)
    return seen


def gemv_launches() -> list:
    """The one-token CUDA-core experts' launches at V2-Lite's shapes, shared slices in."""
    x = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)
    (w13, s13), (w2, s2) = _fp8(EXPERTS, 2 * INTER, HIDDEN), _fp8(EXPERTS, HIDDEN, INTER)
    extra = Fp8SharedExpert(*_fp8(2 * SLICES * INTER, HIDDEN), *_fp8(HIDDEN, SLICES * INTER))
    ids = torch.arange(TOP_K)[None]
    with recording(run=False) as seen:
        moe_experts_fp8_gemv(x, w13, s13, w2, s2, torch.ones(ids.shape), ids, BLOCK, shared=extra)
    return [ln for ln in seen if "gemv" in ln.name]


def grouped_launches(block_k: int, tokens: int = 40) -> list:
    """The grouped FP8 experts' launches at ``tokens`` (prefill sizes) with square scale
    blocks of ``block_k``, at the decode-size tiles a CUDA device takes for them."""
    hidden, inter, experts, top_k = 4 * block_k, 2 * block_k, 4, 2
    block = (block_k, block_k)

    def fp8(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        scales = [*shape[:-2], -(-shape[-2] // block_k), -(-shape[-1] // block_k)]
        return torch.zeros(shape, dtype=FP8_DTYPE), torch.ones(scales)

    (w13, s13), (w2, s2) = fp8(experts, 2 * inter, hidden), fp8(experts, hidden, inter)
    ids = torch.arange(top_k).repeat(tokens, 1)
    with recording(run=False) as seen:
        moe_experts_fp8_triton(torch.zeros(tokens, hidden, dtype=torch.bfloat16), w13, s13, w2,
                               s2, torch.ones(ids.shape), ids, block,
                               tiles=MoETiles(16, 64, min(block_k, 128), 4, 4))
    return [ln for ln in seen if ln.name.startswith("_fp8_")]


def resources(launch, dots: bool = False) -> dict:
    fn = launch.kernel
    sig, consts, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = launch.args[param.name]
        if param.is_constexpr or value is None:
            sig[param.name], consts[param.name] = "constexpr", value
            continue
        sig[param.name] = _arg_type(param.name, value)
        if isinstance(value, torch.Tensor) or (
                isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]  # as a launch specializes them
    options = {k: launch.options[k] for k in _OPTIONS if k in launch.options}
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    registers, local_bytes = resource_usage(kernel)
    out = dict(shared_mem=kernel.metadata.shared, registers=registers, local_bytes=local_bytes)
    if dots:  # each dot's operand element types (TTGIR ``tensor<MxKxTYPE, ...>``), 16-byte loads
        out["vector_loads"] = len(re.findall(r"ld\.global[^\n]*\.v4\.", kernel.asm["ptx"]))
        out["dot_operands"] = [re.findall(r"tensor<\d+x\d+x(\w+),", ln)[:2]
                               for ln in kernel.asm["ttgir"].splitlines()
                               if re.search(r"\b(tt\.dot|ttng\.warp_group_dot) ", ln)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--gemv", action="store_true",
                    help="the one-token CUDA-core FP8 experts at V2-Lite shapes, as JSON")
    ap.add_argument("--grouped", action="store_true",
                    help="the grouped FP8 expert kernels at scale blocks of 16 and 128, as JSON")
    args = ap.parse_args()
    if args.gemv:
        print(json.dumps([dict(resources(ln, dots=True), kernel=ln.name) for ln in gemv_launches()]))
        return
    if args.grouped:
        print(json.dumps([dict(resources(ln, dots=True), kernel=ln.name, block_k=block_k)
                          for block_k in (16, 128) for ln in grouped_launches(block_k)]))
        return
    print(f"triton {triton.__version__}, sm_90, tiles {H200_TILES}")
    for tokens in args.tokens:
        for shared in (False, True):
            for launch in launches(tokens, shared):
                print(f"tokens {tokens:>2} shared {'fused' if shared else 'apart':>5} "
                      f"{launch.name:<24} {resources(launch)}", flush=True)


if __name__ == "__main__":
    main()
