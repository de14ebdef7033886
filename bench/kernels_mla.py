"""MLA kernels on one GPU: paged MLA decode GB/s, prefill attention at qk 192 / v 128 vs SDPA.

Decode: ``paged_mla_decode_attention_triton`` at DeepSeek latent dims (R 512,
P 64, bf16) with 16 heads (V2-Lite) and 128 (V3), pages in scrambled order.
GB/s counts the latent bytes a step must read, sum(seq_lens) * (R+P) * 2 B,
once (q and out are small); beside it ``dst.copy_(src)`` of the same bytes in
the same run (read + write counted, as bench/kernels_copy.py). Times are eager
do_bench medians and CUDA-graph device times, both with the L2 flushed.

Prefill: ``cp_prefill_attention_triton`` on the decompressed per-head shapes
(16 heads, qk 192 = 128 nope + 64 rope, v 128, one causal segment); FLOPs are
the causal work 2 * (Dqk + Dv) * H * sum over rows of (pos + 1). SDPA runs the
same shapes with each backend that takes Dv != Dqk, and FLASH also with v
zero-padded to 192 (its output sliced back), in the same run.

Every kernel result is checked against its torch reference (rel. err < 1e-2)
before it is timed.

    python bench/kernels_mla.py --json bench/results/kernels_mla_h200.json [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lanekv.kernels.mla.paged_decode import paged_mla_decode_attention_triton  # noqa: E402
from lanekv.kernels.mla.paged_decode_ref import paged_mla_decode_attention_ref  # noqa: E402
from lanekv.kernels.mla.splits import MLADecodeConfig, default_mla_config  # noqa: E402
from lanekv.kernels.prefill.attention import (  # noqa: E402
    cp_prefill_attention_triton,
    launch_cp_prefill_attention,
)
from lanekv.kernels.prefill.config import AttnLaunchConfig, default_config  # noqa: E402
from lanekv.kernels.prefill.reference import AttnSegments, cp_prefill_attention_ref  # noqa: E402

from bench.kernels_copy import _copy_times, _times, _warm_gpu  # noqa: E402

RANK, ROPE, QK_DIM, V_DIM = 512, 64, 192, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"
MAX_REL_ERR = 1e-2
DECODE_SHAPES = [(h, b, n) for h in (16, 128) for b, n in ((1, 4096), (16, 4096), (64, 4096),
                                                          (1, 32768))]
PREFILL_SHAPES = [(16, 4096), (16, 16384), (16, 32768), (128, 4096)]
DECODE_SWEEP = [MLADecodeConfig(block_h=bh, block_n=bn, num_warps=w, num_stages=s)
                for bh, bn, w, s in ((16, 64, 4, 2), (16, 32, 4, 3), (32, 32, 8, 2),
                                     (64, 32, 8, 2))]
PREFILL_SWEEP = [AttnLaunchConfig(*c) for c in ((64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2))]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _decode_problem(heads: int, batch: int, kv_len: int, page_size: int):
    pages_per_req = kv_len // page_size
    num_pages = batch * pages_per_req + 8
    pool = torch.randn(1, 1, num_pages * page_size, 1, RANK + ROPE, device=DEVICE, dtype=DTYPE)
    table = torch.randperm(num_pages, device=DEVICE)[: batch * pages_per_req]
    table = table.view(batch, pages_per_req).to(torch.int32)
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, heads, RANK + ROPE, device=DEVICE, dtype=DTYPE)
    return q, pool[0, 0, :, 0, :], table, seq_lens


def decode(rows: list[dict], shapes, configs, page_size: int) -> None:
    scale = QK_DIM**-0.5
    for heads, batch, kv_len in shapes:
        args = _decode_problem(heads, batch, kv_len, page_size)
        latent_bytes = batch * kv_len * (RANK + ROPE) * 2
        copy_ms, copy_graph_ms = _copy_times(latent_bytes)
        check = min(batch, 4)  # the reference loops over requests: check the first few
        sub = (args[0][:check], args[1], args[2][:check], args[3][:check])
        want = paged_mla_decode_attention_ref(*sub, page_size, scale, RANK)
        for cfg in configs:
            call = partial(paged_mla_decode_attention_triton, *args, page_size, scale, RANK,
                           config=cfg)
            err = _rel_err(paged_mla_decode_attention_triton(*sub, page_size, scale, RANK,
                                                             config=cfg), want)
            ms, graph_ms = _times(call) if err < MAX_REL_ERR else (float("nan"),) * 2
            rows.append(dict(
                op="mla_decode", heads=heads, batch=batch, kv_len=kv_len, page_size=page_size,
                latent_mb=latent_bytes / 1e6, ms=ms, graph_ms=graph_ms,
                gbs=latent_bytes / ms * 1e-6, graph_gbs=latent_bytes / graph_ms * 1e-6,
                copy_gbs=2 * latent_bytes / copy_ms * 1e-6,
                copy_graph_gbs=2 * latent_bytes / copy_graph_ms * 1e-6,
                rel_err=err, ok=err < MAX_REL_ERR,
                config=(cfg or default_mla_config(heads))._asdict()))
        del args
        torch.cuda.empty_cache()


def _sdpa_rates(q, k, v, scale: float, flops: float) -> dict:
    """TFLOP/s of each SDPA backend on [T, H, D] inputs; None where it refuses the shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4, k4, v4 = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))
    v_pad = F.pad(v4, (0, q.shape[2] - v.shape[2]))
    calls = {
        "flash_vpad": (SDPBackend.FLASH_ATTENTION, v_pad),
        "flash": (SDPBackend.FLASH_ATTENTION, v4),
        "cudnn": (SDPBackend.CUDNN_ATTENTION, v4),
        "efficient": (SDPBackend.EFFICIENT_ATTENTION, v4),
    }
    rates, outs = {}, {}
    for name, (backend, vv) in calls.items():
        def fn(vv=vv):
            return F.scaled_dot_product_attention(q4, k4, vv, is_causal=True, scale=scale)
        try:
            with sdpa_kernel(backend):
                outs[name] = fn()[0, :, :, : v.shape[2]].transpose(0, 1)
                ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
            rates[name] = flops / ms * 1e-9
        except RuntimeError:
            rates[name] = None
    return dict(rates=rates, outs=outs)


def prefill(rows: list[dict], shapes, configs, with_sdpa: bool) -> None:
    scale = QK_DIM**-0.5
    for heads, seq_len in shapes:
        gen = torch.Generator(device=DEVICE).manual_seed(seq_len + heads)
        q, k = (torch.randn(seq_len, heads, QK_DIM, device=DEVICE, generator=gen, dtype=DTYPE)
                for _ in range(2))
        v = torch.randn(seq_len, heads, V_DIM, device=DEVICE, generator=gen, dtype=DTYPE)
        segs = AttnSegments(*(torch.tensor([x], dtype=torch.int32, device=DEVICE)
                              for x in (0, seq_len, 0, 0)))
        flops = 2.0 * (QK_DIM + V_DIM) * heads * seq_len * (seq_len + 1) / 2
        sdpa = _sdpa_rates(q, k, v, scale, flops) if with_sdpa else dict(rates={}, outs={})
        want = next(iter(sdpa["outs"].values()), None)
        if want is None:  # no SDPA backend: the torch reference on the first 512 rows
            rows_checked = min(seq_len, 512)
            want = cp_prefill_attention_ref(q[:rows_checked], k, v, segs._replace(
                q_len=torch.tensor([rows_checked], dtype=torch.int32, device=DEVICE)), scale)
        out = torch.empty(seq_len, heads, V_DIM, device=DEVICE, dtype=DTYPE)
        for cfg in configs:
            if cfg is None:  # the public launcher with its default tiles
                cfg = default_config(q)
                call = partial(cp_prefill_attention_triton, q, k, v, segs, scale, out=out)
            else:
                call = partial(launch_cp_prefill_attention, q, k, v, segs, scale, None, 0, out,
                               None, cfg)
            out.fill_(float("nan"))
            try:
                call()
                torch.cuda.synchronize()
            except (triton.runtime.errors.OutOfResources, RuntimeError) as exc:
                rows.append(dict(op="prefill", heads=heads, seq_len=seq_len,
                                 config=cfg._asdict(), error=type(exc).__name__))
                continue
            err = _rel_err(out[: want.shape[0]], want)
            ms = (triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
                  if err < MAX_REL_ERR else float("nan"))
            best = max((r for r in sdpa["rates"].values() if r), default=None)
            tflops = flops / ms * 1e-9
            rows.append(dict(op="prefill", heads=heads, seq_len=seq_len, tflop=flops * 1e-12,
                             ms=ms, tflops=tflops, sdpa=sdpa["rates"], sdpa_best=best,
                             vs_sdpa_best=None if best is None else tflops / best,
                             rel_err=err, ok=err < MAX_REL_ERR, config=cfg._asdict()))
        del q, k, v, out, sdpa
        torch.cuda.empty_cache()


def _f(x, spec: str) -> str:
    return format("-", ">" + spec.split(".")[0]) if x is None else format(x, spec)


def print_tables(rows: list[dict]) -> None:
    print(f"{'decode':<8} {'H':>4} {'B':>3} {'kv':>6} {'MB':>7} {'ms':>7} {'GB/s':>6} "
          f"{'graph':>6} {'copy':>6} {'copyG':>6} {'err':>7}  config")
    for r in (r for r in rows if r["op"] == "mla_decode"):
        c = r["config"]
        print(f"{'':<8} {r['heads']:>4} {r['batch']:>3} {r['kv_len']:>6} {r['latent_mb']:>7.1f} "
              f"{r['ms']:>7.3f} {r['gbs']:>6.0f} {r['graph_gbs']:>6.0f} {r['copy_gbs']:>6.0f} "
              f"{r['copy_graph_gbs']:>6.0f} {r['rel_err']:>7.1e}  "
              f"h{c['block_h']} n{c['block_n']} w{c['num_warps']} s{c['num_stages']}")
    print(f"{'prefill':<8} {'H':>4} {'seq':>6} {'ms':>8} {'TFLOP/s':>8} {'fl_vpad':>7} "
          f"{'cudnn':>6} {'effic':>6} {'x best':>6} {'err':>7}  config")
    for r in (r for r in rows if r["op"] == "prefill"):
        c = r["config"]
        cfg = f"m{c['block_m']} n{c['block_n']} w{c['num_warps']} s{c['num_stages']}"
        if "error" in r:
            print(f"{'':<8} {r['heads']:>4} {r['seq_len']:>6}  {r['error']}  {cfg}")
            continue
        s = r["sdpa"]
        print(f"{'':<8} {r['heads']:>4} {r['seq_len']:>6} {r['ms']:>8.3f} {r['tflops']:>8.1f} "
              f"{_f(s.get('flash_vpad'), '7.1f')} {_f(s.get('cudnn'), '6.1f')} "
              f"{_f(s.get('efficient'), '6.1f')} {_f(r['vs_sdpa_best'], '6.2f')} "
              f"{r['rel_err']:>7.1e}  {cfg}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--sweep", action="store_true", help="also time tile configs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels_mla.py times compiled Triton kernels and needs a CUDA GPU",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    _warm_gpu()
    rows: list[dict] = []
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, date=datetime.date.today().isoformat(),
                command=" ".join(sys.argv))

    def save() -> None:  # after each part, so a run cut short keeps what it measured
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))

    decode(rows, DECODE_SHAPES, [None], args.page_size)
    save()
    prefill(rows, PREFILL_SHAPES, [None], with_sdpa=True)
    save()
    if args.sweep:
        decode(rows, [(16, 64, 4096), (128, 16, 4096)], DECODE_SWEEP, args.page_size)
        save()
        prefill(rows, [(16, 16384)], PREFILL_SWEEP, with_sdpa=False)
        save()
    print_tables(rows)
    return 1 if any(r.get("ok") is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
