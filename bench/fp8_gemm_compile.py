"""Compile the block-FP8 GEMM's sweep candidates for Hopper without a GPU.

For each candidate config of a row count (``candidate_configs``) this compiles
the kernel for ``sm_90`` with Triton's own toolchain (no device needed) and
prints the shared memory, the registers and local (spill) bytes per thread
(``cuobjdump --dump-resource-usage`` of the cubin), and how many tiles the
pipeliner keeps in flight (shared memory of ``num_stages`` tiles means the
loads are pipelined, one tile's worth means they are not). Integer arguments
are marked 16-divisible as a launch on the benchmark's shapes specializes them.

    python bench/fp8_gemm_compile.py --rows 2048
    python bench/fp8_gemm_compile.py --rows 1 --quant-a     # the fused decode linear
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import lanekv  # noqa: F401  (the package first)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from lanekv.kernels.fp8.gemm import _block_fp8_matmul_kernel  # noqa: E402
from lanekv.kernels.fp8.gemm_configs import GemmConfig, candidate_configs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_DIVISIBLE = ("a_ptr", "as_ptr", "w_ptr", "ws_ptr", "bias_ptr", "out_ptr", "part_ptr", "cols",
              "depth", "stride_a", "stride_as", "stride_w", "stride_ws", "stride_out")


def compile_config(cfg: GemmConfig, *, quant_a: bool = False, even_k: bool = True) -> dict:
    a_type = ("*bf16" if quant_a else
              f"tensordesc<fp8e4nv[{cfg.block_m}, {cfg.block_k}]>" if cfg.tma else "*fp8e4nv")
    w_type = f"tensordesc<fp8e4nv[{cfg.block_n}, {cfg.block_k}]>" if cfg.tma else "*fp8e4nv"
    sig = dict(a_ptr=a_type, as_ptr="*fp32", w_ptr=w_type, ws_ptr="*fp32", bias_ptr="*fp32",
               out_ptr="*bf16", part_ptr="*fp32", rows="i32", cols="i32", depth="i32",
               stride_a="i32", stride_as="i32", stride_w="i32", stride_ws="i32", stride_out="i32")
    consts = dict(GROUP_N=128, GROUP_K=128, HAS_BIAS=False, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  SPLIT_K=cfg.split_k, EVEN_K=even_k, TMA=cfg.tma, LAG=cfg.lag, FOLD=cfg.fold,
                  PERSISTENT=cfg.persistent, QUANT_A=quant_a, UE8M0=False, HW_CAST=True)
    sig.update({name: "constexpr" for name in consts})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _DIVISIBLE
             if not sig[n].startswith("tensordesc")}
    kernel = triton.compile(ASTSource(_block_fp8_matmul_kernel, sig, consts, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    tile_bytes = (cfg.block_m + cfg.block_n) * cfg.block_k
    # global stores by width: the epilogue should store whole vectors (v4/v2), never
    # one bf16 element per instruction
    stores = dict(Counter(re.findall(r"\bst\.global(?:\.v\d)?\.b\d+", kernel.asm["ptx"])))
    return dict(config=cfg.name(), shared=kernel.metadata.shared, global_stores=stores,
                registers=int(regs.group(1)) if regs else None,
                local_bytes=int(local.group(1)) if local else None,
                tiles_in_flight=kernel.metadata.shared // tile_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--quant-a", action="store_true", help="the variant that quantizes x itself")
    ap.add_argument("--ragged-k", action="store_true", help="K not a multiple of 128")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out = []
    for cfg in candidate_configs(args.rows, (128, 128)):
        try:
            rec = compile_config(cfg, quant_a=args.quant_a, even_k=not args.ragged_k)
        except Exception as err:  # noqa: BLE001  (reported per config)
            rec = dict(config=cfg.name(), error=f"{type(err).__name__}: {str(err)[:200]}")
        out.append(rec)
        print(json.dumps(rec), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
