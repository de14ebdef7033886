"""Compile the block-FP8 GEMM's sweep candidates for Hopper without a GPU.

For each candidate config of a row count (``candidate_configs``) this compiles
the kernel for ``sm_90`` with Triton's own toolchain (no device needed) and
prints the shared memory, the registers and local (spill) bytes per thread
(``cuobjdump --dump-resource-usage`` of the cubin), and how many tiles the
pipeliner keeps in flight (shared memory of ``num_stages`` tiles means the
loads are pipelined, one tile's worth means they are not). Integer arguments
are marked 16-divisible as a launch on the benchmark's shapes specializes them.

``k_loop`` is the length in SASS instructions of the k loop (the longest backward
branch's body): the work each k step issues per warp. ``wgmma`` counts the ptx's
``wgmma.mma_async`` (0: the dot took ``mma.sync``); for a w8a16 config
(``gemm_w8a16.py``) ``weight_in_registers`` says whether the ttgir's
``warp_group_dot`` takes the converted weight as its register A operand with no
``local_store`` of it back to shared memory. ``--w8a16`` compiles only the
w8a16 candidates. ``--gemv`` compiles only the gemv candidates (``gemm_gemv.py``, the
CUDA-core GEMV; ``--gemv-rows`` its row counts, 1 to 4); for them ``weight_vector_bytes``
is the widest global load of the e4m3 weight (16: 16-byte vectors along K) and
``fma`` the k loop's FFMA count. ``--silu`` compiles the w8a16 and gemv candidates
with SiLU-and-multiply fused into the activation load (the down projection).

With ``--plan MODEL`` it compiles instead what that model's decode linears run at
``--rows`` on a device of ``--device-name`` (its committed table, else the
heuristic; ``linear_plan`` decides whether the GEMM quantizes the activations
itself; a w8a8 down projection takes ``silu_mul_quant_fp8``'s output, a w8a16 or gemv
one fuses the SiLU), each beside the other variant of the same config.

    python bench/fp8_gemm_compile.py --rows 2048
    python bench/fp8_gemm_compile.py --rows 1 --quant-a     # the fused decode linear
    python bench/fp8_gemm_compile.py --rows 1 --w8a16       # the weight-only-dequant family
    python bench/fp8_gemm_compile.py --rows 1 --gemv --gemv-rows 1 4 --silu  # the GEMV, fused SiLU
    python bench/fp8_gemm_compile.py --plan llama3_8b --rows 1 16 64
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

import torch  # noqa: E402
import triton  # noqa: E402
from lanekv.kernels.fp8.gemm import _block_fp8_matmul_kernel, linear_plan  # noqa: E402
from lanekv.kernels.fp8.gemm_configs import (  # noqa: E402
    GemmConfig,
    candidate_configs,
    config_for_device,
)
from lanekv.kernels.fp8.gemm_gemv import _gemv_kernel, _register_cap  # noqa: E402
from lanekv.kernels.fp8.gemm_w8a16 import _w8a16_kernel  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_DIVISIBLE = ("a_ptr", "as_ptr", "w_ptr", "ws_ptr", "bias_ptr", "out_ptr", "part_ptr", "cols",
              "depth", "stride_a", "stride_as", "stride_w", "stride_ws", "stride_out")


def compile_config(cfg: GemmConfig, *, quant_a: bool = False, even_k: bool = True,
                   block: tuple[int, int] = (128, 128), ints: dict[str, int] | None = None,
                   rows: int = 1, silu: bool = False) -> dict:
    """``cfg`` compiled for sm_90 as ``_launch`` runs it on a checkpoint's scale
    ``block`` (a padded dot tile takes pointer loads, as the launcher does). ``ints``:
    a launch's integer arguments; only those divisible by 16 are marked so (default:
    all of them, as on the benchmark's shapes). A w8a16 config compiles
    ``_w8a16_kernel`` on bf16 activations (``quant_a`` does not apply), a gemv config
    ``_gemv_kernel`` for ``rows`` rows; ``silu``: either with SiLU-and-multiply fused
    into the activation load."""
    if cfg.gemv:
        return _compile_gemv(cfg, rows=rows, silu=silu, even_k=even_k, block=block, ints=ints)
    if cfg.w8a16:
        return _compile_w8a16(cfg, even_k=even_k, block=block, ints=ints, silu=silu)
    tma = cfg.tma and cfg.dot_k == cfg.block_k
    a_type = ("*bf16" if quant_a else
              f"tensordesc<fp8e4nv[{cfg.block_m}, {cfg.block_k}]>" if tma else "*fp8e4nv")
    w_type = f"tensordesc<fp8e4nv[{cfg.block_n}, {cfg.block_k}]>" if tma else "*fp8e4nv"
    sig = dict(a_ptr=a_type, as_ptr="*fp32", w_ptr=w_type, ws_ptr="*fp32", bias_ptr="*fp32",
               out_ptr="*bf16", part_ptr="*fp32", rows="i32", cols="i32", depth="i32",
               stride_a="i32", stride_as="i32", stride_w="i32", stride_ws="i32", stride_out="i32")
    consts = dict(GROUP_N=block[0], GROUP_K=block[1], HAS_BIAS=False, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_K=cfg.dot_k, GROUP_M=cfg.group_m,
                  SPLIT_K=cfg.split_k, EVEN_K=even_k, TMA=tma, LAG=cfg.lag,
                  PERSISTENT=cfg.persistent, QUANT_A=quant_a, UE8M0=False, HW_CAST=True,
                  USE_PDL=False)
    sig.update({name: "constexpr" for name in consts})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _DIVISIBLE
             if not sig[n].startswith("tensordesc") and (ints is None or ints.get(n, 0) % 16 == 0)}
    kernel = triton.compile(ASTSource(_block_fp8_matmul_kernel, sig, consts, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return _report(cfg, kernel, (cfg.block_m + cfg.block_n) * cfg.dot_k)


def _compile_w8a16(cfg: GemmConfig, *, even_k: bool, block: tuple[int, int],
                   ints: dict[str, int] | None, silu: bool = False) -> dict:
    sig = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", bias_ptr="*fp32",
               out_ptr="*bf16", part_ptr="*fp32", rows="i32", cols="i32", depth="i32",
               stride_x="i32", stride_w="i32", stride_ws="i32", stride_out="i32")
    consts = dict(GROUP_N=block[0], GROUP_K=block[1], HAS_BIAS=False, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  SPLIT_K=cfg.split_k, EVEN_K=even_k, DOT_PRECISION="tf32", SILU=silu, USE_PDL=False)
    sig.update({name: "constexpr" for name in consts})
    names = list(sig)
    renamed = {"x_ptr": "a_ptr", "stride_x": "stride_a"}  # ints use the w8a8 names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in consts and n != "rows"
             and (ints is None or ints.get(renamed.get(n, n), 0) % 16 == 0)}
    kernel = triton.compile(ASTSource(_w8a16_kernel, sig, consts, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ttgir = kernel.asm["ttgir"]
    # the converted weight feeds the dot from registers: a warp_group_dot whose A operand
    # is a dot-operand tensor (not a shared-memory descriptor) and no local_store at all
    register_a = re.search(r"ttng\.warp_group_dot .*?\} : tensor<[^>]*#ttg\.dot_op<\{opIdx = 0",
                           ttgir)
    rec = _report(cfg, kernel, cfg.block_n * cfg.block_k + 2 * cfg.block_m * cfg.block_k)
    rec["weight_in_registers"] = bool(register_a) and "ttg.local_store" not in ttgir
    return rec


def _compile_gemv(cfg: GemmConfig, *, rows: int, silu: bool, even_k: bool,
                  block: tuple[int, int], ints: dict[str, int] | None) -> dict:
    """``_gemv_kernel`` as ``gemv_linear`` launches it on bf16 activations; ``even_k``
    False compiles the same kernel (its ragged last group is a runtime branch) with a K
    that is not 16-divisible."""
    sig = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", bias_ptr="*fp32",
               out_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32", cols="i32", depth="i32",
               stride_x="i32", stride_w="i32", stride_ws="i32", stride_out="i32")
    # split-K as it runs on a GPU: the last split of a column tile adds the partials
    consts = dict(GROUP_N=block[0], GROUP_K=block[1], HAS_BIAS=False, ROWS=rows,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, SILU=silu,
                  PREFETCH=cfg.num_stages > 1, LAST_REDUCES=cfg.split_k > 1, SCALED=True,
                  USE_PDL=False)
    sig.update({name: "constexpr" for name in consts})
    names = list(sig)
    renamed = {"x_ptr": "a_ptr", "stride_x": "stride_a"}
    ragged = {} if even_k else {"depth": 1, "stride_w": 1, "stride_x": 1}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in consts and n not in ragged
             and (ints is None or ints.get(renamed.get(n, n), 0) % 16 == 0)}
    kernel = triton.compile(ASTSource(_gemv_kernel, sig, consts, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                         **_register_cap(cfg, cfg.split_k > 1)))
    rec = _report(cfg, kernel, cfg.block_n * cfg.block_k)
    ptx = kernel.asm["ptx"]
    # the weight's widest load in bytes: plain (ld.global.v4.b32: 16) or pipelined through
    # shared memory (cp.async of 16 bytes)
    widths = [int(v or 1) * int(b) // 8 for v, b in
              re.findall(r"ld\.global(?:\.[a-z0-9_:]+)*?(?:\.v(\d))?\.b(\d+)", ptx)]
    widths += [int(b) for b in re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*, (\d+)", ptx)]
    rec.update(rows=rows, silu=silu, weight_vector_bytes=max(widths, default=0))
    return rec


def _report(cfg: GemmConfig, kernel, tile_bytes: int) -> dict:
    """Shared memory, registers, spills, pipelined tiles, store widths, k loop, wgmma."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    # global stores by width: the epilogue should store whole vectors (v4/v2), never
    # one bf16 element per instruction
    stores = dict(Counter(re.findall(r"\bst\.global(?:\.v\d)?\.b\d+", kernel.asm["ptx"])))
    return dict(config=cfg.name(), shared=kernel.metadata.shared, global_stores=stores,
                registers=int(regs.group(1)) if regs else None,
                local_bytes=int(local.group(1)) if local else None,
                tiles_in_flight=kernel.metadata.shared // tile_bytes, k_loop=k_loop_length(sass),
                wgmma=len(re.findall(r"wgmma\.mma_async", kernel.asm["ptx"])),
                ffma=len(re.findall(r"\bFFMA\b", sass)))


def k_loop_length(sass: str) -> int:
    """Instructions in the longest loop of a SASS listing (a backward branch's body)."""
    addrs = [(int(m.group(1), 16), m.group(2))
             for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    longest = 0
    for addr, text in addrs:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            longest = max(longest, sum(1 for a, _ in addrs if start <= a <= addr))
    return longest


def plan(model: str, rows: int, device_name: str, sms: int) -> list[dict]:
    """Each decode linear of ``model`` at ``rows``: the config and fusion it runs with on
    ``device_name``, compiled as it runs (``compiled``) and as the other variant."""
    from bench.fp8 import SHAPES

    out = []
    for name, n, k in SHAPES[model]:
        cfg = config_for_device(rows, n, k, (128, 128), device_name, sms)
        # a down projection: w8a16 and gemv fuse the SiLU into their activation load, w8a8
        # takes silu_mul_quant_fp8's output
        down, unquantized = name.endswith("down"), cfg.w8a16 or cfg.gemv
        fused = (not down and not unquantized
                 and linear_plan(rows, n, k, (128, 128), torch.device("cpu"), config=cfg).fuse_quant)
        twin = cfg._replace(w8a16=False, gemv=False)
        other = (compile_config(twin, quant_a=True) if unquantized else
                 compile_config(cfg, quant_a=not fused) if cfg.block_k == 128 or fused else None)
        out.append(dict(linear=name, n=n, k=k, rows=rows, config=cfg.name(), fused_quant=fused,
                        fused_silu=down and unquantized,
                        compiled=compile_config(cfg, quant_a=fused, rows=rows,
                                                silu=down and unquantized),
                        other_variant=other))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[2048])
    ap.add_argument("--plan", default=None, help="a model of bench/fp8.py: its decode linears")
    ap.add_argument("--device-name", default="NVIDIA H200", help="--plan: whose table")
    ap.add_argument("--sms", type=int, default=132, help="--plan: SMs, for the heuristic")
    ap.add_argument("--quant-a", action="store_true", help="the variant that quantizes x itself")
    ap.add_argument("--ragged-k", action="store_true", help="K not a multiple of 128")
    ap.add_argument("--w8a16", action="store_true", help="only the w8a16 candidates")
    ap.add_argument("--gemv", action="store_true", help="only the gemv candidates")
    ap.add_argument("--gemv-rows", type=int, nargs="+", default=[1], choices=(1, 2, 3, 4),
                    help="--gemv: the row counts to compile each candidate for")
    ap.add_argument("--silu", action="store_true",
                    help="w8a16 and gemv: SiLU-and-multiply fused into the activation load")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out = []
    if args.plan:
        for rows in args.rows:
            for rec in plan(args.plan, rows, args.device_name, args.sms):
                out.append(rec)
                print(json.dumps(rec), flush=True)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        return
    for cfg in candidate_configs(args.rows[0], (128, 128)):
        if (args.w8a16 and not cfg.w8a16) or (args.gemv and not cfg.gemv):
            continue
        for rows in args.gemv_rows if cfg.gemv else [args.rows[0]]:
            try:
                rec = compile_config(cfg, quant_a=args.quant_a, even_k=not args.ragged_k,
                                     rows=rows, silu=args.silu and (cfg.w8a16 or cfg.gemv))
            except Exception as err:  # noqa: BLE001  (reported per config)
                rec = dict(config=cfg.name(), error=f"{type(err).__name__}: {str(err)[:200]}")
            out.append(rec)
            print(json.dumps(rec), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
