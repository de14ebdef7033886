"""Probe: which FP8 MLA row shapes the compiled paged MLA decode kernel reads on a GPU.

Each case runs in a child process (a misaligned access poisons the CUDA context), with
CUDA_LAUNCH_BLOCKING=1: rank, rope, model dtype, padding of the pool row.
Usage: python bench/probe_mla_fp8_align.py
"""

from __future__ import annotations

import os
import subprocess
import sys

CASE = r'''
import sys, torch
from lanekv.kernels.fp8.kv_rows import pack_mla_fp8_rows_ref
from lanekv.kernels.mla.paged_decode import paged_mla_decode_attention_triton
from lanekv.kernels.mla.paged_decode_ref import paged_mla_decode_attention_ref
rank, rope, dtype, pad = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3]), int(sys.argv[4])
page_size, pages = 16, 8
rows = pages * page_size
packed = pack_mla_fp8_rows_ref(torch.randn(rows, rank + rope, device="cuda").to(dtype), rank)
cache = torch.cat((packed, torch.zeros(rows, pad, dtype=torch.uint8, device="cuda")), dim=1)
table = torch.arange(pages, dtype=torch.int32, device="cuda").view(1, pages)
lens = torch.tensor([rows - 3], dtype=torch.int32, device="cuda")
q = torch.randn(1, 4, rank + rope, device="cuda").to(dtype)
got = paged_mla_decode_attention_triton(q, cache, table, lens, page_size, 0.1, rank)
want = paged_mla_decode_attention_ref(q, cache, table, lens, page_size, 0.1, rank)
print(f"max err {(got.float() - want.float()).abs().max().item():.3g}")
'''

CASES = [(32, 8, "float32", 0), (32, 8, "bfloat16", 0), (32, 8, "float32", 12), (32, 16, "float32", 0),
         (128, 16, "float32", 0), (128, 64, "bfloat16", 0), (512, 64, "float32", 0), (512, 64, "bfloat16", 144)]


def main() -> None:
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    for rank, rope, dtype, pad in CASES:
        row = rank + 4 * (rank // min(128, rank)) + 2 * rope
        done = subprocess.run([sys.executable, "-c", CASE, str(rank), str(rope), dtype, str(pad)],
                              capture_output=True, text=True, env=env, timeout=120)
        last = (done.stdout.strip() or done.stderr.strip()).splitlines()[-1:] or ["?"]
        print(f"rank {rank:4d} rope {rope:3d} {dtype:9s} row {row:4d}+{pad:3d} B: rc={done.returncode} {last[0][:120]}")


if __name__ == "__main__":
    main()
