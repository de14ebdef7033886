"""Compile the MLA decode chain's kernels for Hopper without a GPU.

At DeepSeek-V2-Lite's widths (16 heads, 512 + 64 latent, 128 + 64 query dims, 128 V
dims, bf16) this compiles for ``sm_90`` with Triton's own toolchain: the fused
RoPE + kv_a norm + latent store (plain and FP8 rows), stage 1 of the split decode
(``split_keys`` now a runtime argument) and the expansion that merges the split
partials in its prologue. It prints each one's shared memory, registers and local
(spill) bytes per thread (``cuobjdump --dump-resource-usage``, as
``bench/fp8_gemm_compile.py`` does), so a change that spills shows before a device run.

    python bench/mla_chain_compile.py
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import lanekv  # noqa: F401  (the package first)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from lanekv.kernels.mla.expand_merge import _expand_partials_kernel  # noqa: E402
from lanekv.kernels.mla.latent_store import _mla_rope_norm_store_kernel  # noqa: E402
from lanekv.kernels.mla.paged_decode import _paged_mla_decode_kernel  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HEADS, RANK, ROPE, V_DIM = 16, 512, 64, 128


def _ints(*names: str) -> dict[str, str]:
    return {n: "i32" for n in names}


def compile_kernel(fn, sig: dict[str, str], consts: dict, num_warps: int, num_stages: int = 2,
                   **options) -> dict:
    """``fn`` compiled for sm_90 with every pointer 16-byte aligned (as torch allocates);
    ``USE_PDL`` (``kernels.pdl``), where the kernel has it, off unless ``consts`` says."""
    if "USE_PDL" in fn.arg_names:
        consts = {**consts, "USE_PDL": consts.get("USE_PDL", False)}
    sig = {**sig, **{name: "constexpr" for name in consts}}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*")}
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages, **options))
    registers, local_bytes = resource_usage(kernel)
    return dict(shared=kernel.metadata.shared, registers=registers, local_bytes=local_bytes)


def resource_usage(kernel) -> tuple[int | None, int | None]:
    """A compiled kernel's registers per thread and local (spill) bytes, from cuobjdump."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
    regs, local = re.search(r"REG:(\d+)", usage), re.search(r"LOCAL:(\d+)", usage)
    return (int(regs.group(1)) if regs else None, int(local.group(1)) if local else None)


def rope_norm_store(fp8: bool) -> dict:
    cache = "*u8" if fp8 else "*bf16"
    parts = (["*fp8e4nv", "*fp32", "*bf16", "*u8"] if fp8 else ["*bf16"] * 4)
    sig = dict(q_ptr="*bf16", kv_ptr="*bf16", w_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32",
               locs_ptr="*i64", c_ptr=cache, cq_ptr=parts[0], cs_ptr=parts[1], cr_ptr=parts[2],
               cp_ptr=parts[3], **_ints("num_heads", "num_rows"), eps="fp32",
               **_ints("stride_qt", "stride_qh", "stride_kt", "stride_ct", "stride_st",
                       "stride_c"))
    consts = dict(RANK=RANK, BLOCK_R=RANK, HALF=ROPE // 2, HALF_BLOCK=ROPE // 2,
                  BLOCK_H=HEADS, GROUPS=4 if fp8 else 1, GROUPS_BLOCK=4 if fp8 else 1,
                  GROUP_SIZE=128 if fp8 else 1, PAD=0, PAD_BLOCK=2, INTERLEAVE=True,
                  KV_FP8=fp8, HW_CAST=True)
    return compile_kernel(_mla_rope_norm_store_kernel, sig, consts, 4, enable_fp_fusion=False)


def decode_stage1(fp8: bool) -> dict:
    values, scales, rope = ("*fp8e4nv", "*fp32", "*bf16") if fp8 else ("*bf16",) * 3
    sig = dict(q_ptr="*bf16", latent_ptr=values, scale_ptr=scales, rope_ptr=rope,
               table_ptr="*i32", lens_ptr="*i32", part_o_ptr="*fp32", part_lse_ptr="*fp32",
               out_ptr="*bf16", scale_log2="fp32",
               **_ints("max_kv_len", "num_heads", "split_keys", "stride_qb", "stride_qh",
                       "stride_lr", "stride_sr", "stride_pr", "stride_tb", "stride_ob",
                       "stride_oh"))
    consts = dict(RANK=RANK, ROPE=ROPE, PAGE_SIZE=16, BLOCK_H=16, BLOCK_R=RANK, BLOCK_P=ROPE,
                  BLOCK_N=32, WRITE_PARTIAL=True, DOT_PRECISION="tf32",
                  GROUP=128 if fp8 else 1, KV_FP8=fp8, ALIGN_LR=16 if fp8 else 8,
                  ALIGN_SR=1 if fp8 else 8, ALIGN_PR=1 if fp8 else 8)
    return compile_kernel(_paged_mla_decode_kernel, sig, consts, 4)


def expand_partials() -> dict:
    sig = dict(direct_ptr="*bf16", part_o_ptr="*fp32", part_lse_ptr="*fp32", lens_ptr="*i32",
               w_ptr="*bf16", out_ptr="*bf16",
               **_ints("num_tokens", "num_heads", "num_splits", "max_kv_len", "split_keys",
                       "stride_dt", "stride_dh", "stride_wh", "stride_wv", "stride_yt",
                       "stride_yh"))
    consts = dict(RANK=RANK, V_DIM=V_DIM, KEY_BLOCK=32, BLOCK_S=32, BLOCK_R=RANK, BLOCK_V=16)
    return compile_kernel(_expand_partials_kernel, sig, consts, 8)


def main() -> None:
    results = {
        "rope_norm_store_bf16": rope_norm_store(False),
        "rope_norm_store_fp8": rope_norm_store(True),
        "decode_stage1_bf16": decode_stage1(False),
        "decode_stage1_fp8": decode_stage1(True),
        "expand_partials_bf16": expand_partials(),
    }
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
