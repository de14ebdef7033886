"""Compile the DSA top-k kernels for Hopper without a GPU.

``kernels/dsa/digit_topk.py``'s three kernels (one program a row; a split row's digit
pass, at the first and the last digit; its selection) and ``radix_topk``'s first level,
at the decode step's shapes (float32 scores, top 2048), for ``sm_90`` with Triton's
own toolchain. It prints each one's shared memory, registers and local (spill) bytes
per thread (``mla_chain_compile.resource_usage``), so a change that spills shows
before a device run.

    python bench/topk_compile.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lanekv  # noqa: F401  (the package first)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lanekv.kernels.dsa.digit_topk import (  # noqa: E402
    DigitTopkConfig,
    _digit_pass_kernel,
    _digit_select_kernel,
    _digit_topk_row_kernel,
)
from lanekv.kernels.dsa.topk import DEFAULT_CHUNK, _radix_topk_kernel  # noqa: E402

from bench.mla_chain_compile import _ints, compile_kernel  # noqa: E402

CFG = DigitTopkConfig()


def row_kernel() -> dict:
    sig = dict(src_ptr="*fp32", lens_ptr="*i32", out_ptr="*i32",
               **_ints("n_cols", "topk", "stride_s", "stride_o"))
    return compile_kernel(_digit_topk_row_kernel, sig, dict(HAS_LENS=True, BLOCK=CFG.block),
                          CFG.num_warps)


def pass_kernel(digit: int) -> dict:
    sig = dict(src_ptr="*fp32", lens_ptr="*i32", hist_ptr="*i32", above_ptr="*i32",
               state_ptr="*i64", **_ints("n_cols", "topk", "span", "stride_s"))
    return compile_kernel(_digit_pass_kernel, sig,
                          dict(HAS_LENS=True, DIGIT=digit, BLOCK=CFG.block), CFG.num_warps)


def select_kernel() -> dict:
    sig = dict(src_ptr="*fp32", lens_ptr="*i32", hist_ptr="*i32", above_ptr="*i32",
               state_ptr="*i64", out_ptr="*i32",
               **_ints("n_cols", "topk", "span", "stride_s", "stride_o"))
    return compile_kernel(_digit_select_kernel, sig, dict(HAS_LENS=True, BLOCK=CFG.block),
                          CFG.num_warps)


def radix_first_level() -> dict:
    sig = dict(src_ptr="*fp32", in_order_ptr="*fp32", in_pos_ptr="*fp32", in_cnt_ptr="*fp32",
               out_order_ptr="*i32", out_pos_ptr="*i32", out_cnt_ptr="*i32",
               **_ints("n_cols", "topk", "n_lists", "stride_s", "stride_in", "stride_cnt_in",
                       "stride_out", "stride_cnt_out"))
    consts = dict(FROM_SCORES=True, FINAL=True, CHUNK=DEFAULT_CHUNK, KPAD=2048)
    return compile_kernel(_radix_topk_kernel, sig, consts, 16)


def main() -> None:
    results = {"digit_row": row_kernel(), "digit_pass_0": pass_kernel(0),
               "digit_pass_3": pass_kernel(3), "digit_select": select_kernel(),
               "radix_level_1": radix_first_level()}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
