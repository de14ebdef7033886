"""The fused RoPE + FP8 quantize + store (``kernels/fp8/rope_store.py``) against the unfused
launches it replaced, and a device-to-device copy of the same bytes (needs a CUDA GPU).

    python bench/fp8_rope_store.py --json bench/results/fp8_rope_store_h200.json

GQA on Llama-3-8B shapes (32 q heads, 8 KV heads of 128, bf16): ``rope_store_kv_fp8``
against ``apply_rotary`` on q and k, ``pack_kv_fp8_rows`` of k and v and ``store_kv``.
MLA on DeepSeek-V3 shapes (latent 512 + 64, bf16): ``mla_rope_store_fp8`` against
``mla_rope`` on the key, ``pack_mla_fp8_rows`` and ``store_kv``. Rows 1 and 64 (decode
batches) and 8192 (a prefill chunk). GB/s counts the bytes each must move (read q, k, v
or the latent and cos/sin; write q and the rows), the same for both; the copy is a
``copy_`` of that many bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

ROWS = (1, 64, 8192)


def _ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def gqa(tokens: int) -> dict:
    from lanekv.kernels.fp8.kv_rows import kv_fp8_head_bytes, pack_kv_fp8_rows
    from lanekv.kernels.fp8.rope_store import rope_store_kv_fp8
    from lanekv.kernels.rope_store import apply_rotary
    from lanekv.kernels.store_kv import store_kv

    dev, bf16, hq, hkv, d = "cuda", torch.bfloat16, 32, 8, 128
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=dev, dtype=bf16)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], -1))
    angles = torch.rand(tokens, d // 2, device=dev) * 100
    cos, sin = (torch.cat((f(angles), f(angles)), -1).to(bf16) for f in (torch.cos, torch.sin))
    caches = torch.zeros(2, 2 * tokens, hkv, kv_fp8_head_bytes(d), dtype=torch.uint8, device=dev)
    locs = torch.randperm(2 * tokens, device=dev)[:tokens]

    def unfused():
        qr, kr = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        store_kv(pack_kv_fp8_rows(kr), pack_kv_fp8_rows(v), caches[0], caches[1], locs)
        return qr

    def fused():
        return rope_store_kv_fp8(q, k, v, cos, sin, caches[0], caches[1], locs)

    moved = qkv.numel() * 2 + 2 * cos.numel() * 2 + q.numel() * 2 + 2 * tokens * hkv * (d + 4)
    return _row("gqa_llama3_8b", tokens, moved, fused, unfused)


def mla(tokens: int) -> dict:
    from lanekv.kernels.fp8.kv_rows import mla_fp8_row_stride, pack_mla_fp8_rows
    from lanekv.kernels.fp8.rope_store import mla_rope_store_fp8
    from lanekv.kernels.rope_store import mla_rope
    from lanekv.kernels.store_kv import store_kv

    dev, bf16, rank, rope = "cuda", torch.bfloat16, 512, 64
    latent = torch.randn(tokens, rank + rope, device=dev, dtype=bf16)
    angles = torch.rand(tokens, rope // 2, device=dev) * 100
    cos, sin = angles.cos(), angles.sin()
    stride = mla_fp8_row_stride(rank, rope)
    cache = torch.zeros(2 * tokens, 1, stride, dtype=torch.uint8, device=dev)
    locs = torch.randperm(2 * tokens, device=dev)[:tokens]
    q_none = torch.empty(tokens, 0, rope, device=dev, dtype=bf16)

    def unfused():
        mla_rope(q_none, latent[:, rank:], cos, sin, True)  # in place, as the model did
        rows = pack_mla_fp8_rows(latent, rank)[:, None]  # 656 bytes: no padding for V3
        store_kv(rows, rows, cache, cache, locs)

    def fused():
        mla_rope_store_fp8(latent, cos, sin, True, cache[:, 0], locs, rank)

    moved = latent.numel() * 2 + 2 * cos.numel() * 4 + tokens * stride
    return _row("mla_deepseek_v3", tokens, moved, fused, unfused)


def _row(kind: str, tokens: int, moved: int, fused, unfused) -> dict:
    src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    fused_ms, unfused_ms = _ms(fused), _ms(unfused)
    copy_ms = _ms(lambda: dst.copy_(src))  # reads and writes half the bytes each: ``moved`` in all
    return dict(kind=kind, tokens=tokens, bytes=moved, fused_us=fused_ms * 1e3,
                unfused_us=unfused_ms * 1e3, copy_us=copy_ms * 1e3,
                fused_gbps=moved / fused_ms / 1e6, speedup=unfused_ms / fused_ms,
                of_copy=copy_ms / fused_ms)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/fp8_rope_store.py times the compiled Triton kernels and needs a CUDA GPU",
              file=sys.stderr)
        return 2
    rows = [bench(tokens) for bench in (gqa, mla) for tokens in ROWS]
    print(f"{'kind':<18}{'tokens':>8}{'fused us':>11}{'unfused us':>12}{'copy us':>10}"
          f"{'GB/s':>9}{'speedup':>9}{'of copy':>9}")
    for r in rows:
        print(f"{r['kind']:<18}{r['tokens']:>8}{r['fused_us']:>11.2f}{r['unfused_us']:>12.2f}"
              f"{r['copy_us']:>10.2f}{r['fused_gbps']:>9.0f}{r['speedup']:>9.2f}{r['of_copy']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(0), rows=rows),
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
