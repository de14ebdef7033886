"""The DeepSeek-V2-Lite decode layer's big kernels, each over candidate launch configs,
against the bytes it must read: which tiles to put in the tables.

Sections (``--parts``, default all), at each ``--tokens`` (batch 1 and 16 by default):

- ``gate_up`` and ``down``: the MoE decode kernels of ``kernels/moe/decode.py`` one at a
  time (``launch_decode_gate_up``, ``launch_decode_down``), 64 experts, top 6, hidden
  2048, width 1408, 2 shared slices, for every ``DecodeTiles`` of ``MOE_CANDIDATES``
  (the first is what ``decode_tiles`` picks now, marked ``table``); the floor is the
  bytes of the experts the batch touches plus the shared expert's, at the copy rate;
- ``router``: ``router_logits`` (one launch) against ``F.linear(x.float(), w)``, the
  V2-Lite (64 x 2048) and V3 (256 x 7168) gates;
- ``gemv`` (with ``--fp8`` only): one token's whole block-FP8 experts, the tensor-core
  decode kernels against the CUDA-core GEMVs of ``kernels/fp8/moe_gemv.py`` at each
  ``GEMV_CANDIDATES`` entry;
- ``mla``: the paged MLA decode (16 heads, latent 512 + 64, pages of 64) at each
  ``--contexts`` for every ``MLADecodeConfig`` of ``MLA_CANDIDATES`` (the first is
  the default), with the page table as wide as a captured graph's (``--table-positions``,
  163840 for V2-Lite: the split count the graph runs), stage 2 included; the floor is
  the latent bytes read.

With ``--fp8`` the MoE sections run the block-FP8 kernels instead (``kernels/fp8/moe_decode.py``:
e4m3 experts and shared expert, 128 x 128 scale blocks, the shared slices fused in), the
first candidate ``fp8_decode_tiles``' pick and the others those inside one scale block;
the floor counts one byte a weight.

Every candidate's output is checked against the default's (MoE, router: the torch
line; MLA: the torch reference) before it is timed; a config that fails to compile is
recorded with its error. Kernels are timed as CUDA graphs of 20 calls (as the decode
step replays them), the median replay over 20. The best config of each case is
printed last and written under ``best`` in ``--json``.

    python bench/moe_decode_sweep.py --json moe_decode_sweep.json
    python bench/moe_decode_sweep.py --parts mla --contexts 1024 32768 131072 --tokens 1 16
    python bench/moe_decode_sweep.py --parts gate_up down --fp8 --json moe_decode_sweep_fp8.json

On a CPU (``--tiny``, the Triton interpreter): tiny shapes, two candidates each, timed
with the wall clock, to check the script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--tiny" in sys.argv:  # before the kernel modules are imported
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["LANEKV_CPU_KERNELS"] = "triton"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lanekv.kernels.fp8.moe_decode import (  # noqa: E402
    Fp8SharedExpert,
    fp8_decode_tiles,
    moe_experts_fp8_decode_triton,
)
from lanekv.kernels.fp8.moe_gemv import MoEGemvTiles, gemv_fits, moe_experts_fp8_gemv  # noqa: E402
from lanekv.kernels.fp8.weights import quantize_weight_blocks  # noqa: E402
from lanekv.kernels.mla.paged_decode import paged_mla_decode_attention_triton  # noqa: E402
from lanekv.kernels.mla.paged_decode_ref import paged_mla_decode_attention_ref  # noqa: E402
from lanekv.kernels.mla.splits import MLADecodeConfig, default_mla_config  # noqa: E402
from lanekv.kernels.moe.decode import (  # noqa: E402
    DOWN,
    GATE_UP,
    DecodeTiles,
    decode_tiles,
    launch_decode_down,
    launch_decode_gate_up,
)
from lanekv.kernels.moe.gate import router_logits_ref, router_logits_triton  # noqa: E402

from bench.deepseek import copy_rate  # noqa: E402
from bench.deepseek_kernels import GRAPH_CALLS, graph_us  # noqa: E402

PARTS = ("gate_up", "down", "router", "mla", "gemv")
# the one-token CUDA-core FP8 experts' launch knobs (block_n of gate/up, of down, warps)
GEMV_CANDIDATES = [MoEGemvTiles(u, d, w) for u, d, w in (
    (32, 32, 4), (16, 16, 4), (64, 64, 4), (32, 32, 2), (32, 32, 8), (64, 32, 4), (16, 32, 2),
    (128, 128, 8))]
# experts, top_k, hidden, width, shared slices
V2_LITE_MOE = (64, 6, 2048, 1408, 2)
TINY_MOE = (8, 2, 48, 40, 2)
TINY_MOE_FP8 = (8, 2, 48, 32, 2)  # the width whole 16-wide scale blocks
FP8_BLOCK, TINY_FP8_BLOCK = (128, 128), (16, 16)
# (block_m, block_n, block_k, num_warps, num_stages); the launcher's own pick goes first
MOE_CANDIDATES = [DecodeTiles(16, n, k, w, s) for n, k, w, s in (
    (32, 128, 4, 3), (32, 128, 4, 4), (32, 128, 4, 2), (32, 64, 4, 4), (32, 256, 4, 2),
    (32, 256, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3),
    (64, 128, 8, 3), (16, 128, 4, 4), (16, 256, 4, 3), (16, 64, 4, 4))]
# (block_n, num_warps, num_stages, min_split_keys) with 16-head blocks, then one program per
# SM (half the splits, half the partials) at two split sizes; the default goes first
MLA_CANDIDATES = [MLADecodeConfig(block_h=16, block_n=n, num_warps=w, num_stages=s,
                                  min_split_keys=k) for n, w, s, k in (
    (32, 4, 2, 256), (32, 4, 2, 32), (32, 4, 2, 128), (32, 4, 3, 64), (32, 4, 4, 64),
    (32, 4, 3, 128), (32, 8, 2, 64), (64, 4, 2, 64), (64, 8, 2, 64), (64, 8, 3, 64),
    (64, 8, 3, 128), (16, 4, 2, 32), (16, 4, 3, 32), (16, 4, 3, 64))] + [
    MLADecodeConfig(block_h=16, block_n=32, programs_per_sm=1, min_split_keys=k) for k in (64, 128)]
ROUTERS = {"v2_lite": (64, 2048), "v3": (256, 7168)}


class Timer:
    """Microseconds per call: ``bench.deepseek_kernels.graph_us`` on a GPU (a CUDA graph of
    its GRAPH_CALLS calls, the median replay), the wall clock of one call on a CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        return graph_us(fn)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def _moe_inputs(shape, tokens: int, dtype, device, gen):
    experts, top_k, hidden, width, shared = shape
    like = {"device": device}
    x = torch.randn(tokens, hidden, generator=gen, **like).to(dtype)
    w13 = (torch.randn(experts, 2 * width, hidden, generator=gen, **like) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, width, generator=gen, **like) * width ** -0.5).to(dtype)
    s13 = (torch.randn(2 * shared * width, hidden, generator=gen, **like) * hidden ** -0.5).to(dtype)
    s2 = (torch.randn(hidden, shared * width, generator=gen, **like) * width ** -0.5).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen, **like)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen, **like)
    return x, w13, w2, s13, s2, weights, ids


def _moe_case(kernel: str, tokens: int, args, timer: Timer, rate: float, candidates,
              gen: torch.Generator) -> list[dict]:
    shape = (TINY_MOE_FP8 if args.fp8 else TINY_MOE) if args.tiny else V2_LITE_MOE
    experts, top_k, hidden, width, shared = shape
    x, w13, w2, s13, s2, weights, ids = _moe_inputs(shape, tokens, args.dtype, args.device, gen)
    touched = int(torch.unique(ids).numel())
    item = 1 if args.fp8 else x.element_size()
    if kernel == GATE_UP:
        nbytes = (touched * w13[0].numel() + s13.numel()) * item
    else:
        nbytes = (touched * w2[0].numel() + s2.numel()) * item
    active = min(experts, top_k) + shared
    fp8 = {}  # the e4m3 weights' scales (block-FP8 kernels), else nothing
    if args.fp8:
        block = TINY_FP8_BLOCK if args.tiny else FP8_BLOCK
        (w13, w13_s), (w2, w2_s), (s13, s13_s), (s2, s2_s) = (
            quantize_weight_blocks(w, block) for w in (w13, w2, s13, s2))
        up_fp8 = {"scales": w13_s, "block": block, "shared_scales": s13_s}
        down_fp8 = {"scales": w2_s, "block": block, "shared_scales": s2_s}
        fp8 = up_fp8 if kernel == GATE_UP else down_fp8
        picked = fp8_decode_tiles(x, kernel, active, width, hidden, block)
        up_tiles = fp8_decode_tiles(x, GATE_UP, active, width, hidden, block)
        candidates = [c for c in candidates if not (block[0] % c.block_n or block[1] % c.block_k)]
    else:
        up_fp8 = {}
        picked = decode_tiles(x, kernel, active, width, hidden)
        up_tiles = decode_tiles(x, GATE_UP, active, width, hidden)
    h = launch_decode_gate_up(x, w13, ids, s13, up_tiles, **up_fp8)

    def call(tiles):
        if kernel == GATE_UP:
            return launch_decode_gate_up(x, w13, ids, s13, tiles, **fp8)
        return launch_decode_down(x, h, w2, ids, weights, s2, tiles, **fp8)
    want = call(picked)
    floor_us = nbytes / rate / 1e3
    rows = []
    for i, tiles in enumerate([picked, *[c for c in candidates if c != picked]]):
        key = {"kernel": kernel, "tokens": tokens, "tiles": ",".join(map(str, tiles)),
               "table": i == 0}
        try:
            err = _rel(call(tiles), want)
            us = timer(lambda tiles=tiles: call(tiles))
        except Exception as exc:  # a tile set that does not compile or fit: recorded
            rows.append(dict(key, error=f"{type(exc).__name__}: {str(exc)[:120]}"))
            continue
        rows.append(dict(key, us=us, floor_us=floor_us, of_floor=floor_us / us,
                         gbps=nbytes / us / 1e3, bytes=nbytes, experts_touched=touched,
                         rel_err=err, ok=err < 1e-2))
    return rows


def bench_moe(kernel: str, args, timer: Timer, rate: float, candidates) -> list[dict]:
    """One MoE decode kernel over the candidates, at each token count."""
    gen = torch.Generator(device=args.device).manual_seed(0)
    return [row for tokens in args.tokens
            for row in _moe_case(kernel, tokens, args, timer, rate, candidates, gen)]


def bench_gemv(args, timer: Timer, rate: float) -> list[dict]:
    """One token's block-FP8 experts, shared slices in, whole (three launches each): the
    tensor-core decode kernels at their tiles against the CUDA-core GEMVs
    (``kernels/fp8/moe_gemv.py``) at each of ``GEMV_CANDIDATES``; the floor is the e4m3
    bytes of the touched experts and the shared expert."""
    shape = TINY_MOE_FP8 if args.tiny else V2_LITE_MOE
    block = TINY_FP8_BLOCK if args.tiny else FP8_BLOCK
    experts, top_k, hidden, width, slices = shape
    gen = torch.Generator(device=args.device).manual_seed(2)
    x, w13, w2, s13, s2, weights, ids = _moe_inputs(shape, 1, args.dtype, args.device, gen)
    (w13, w13_s), (w2, w2_s), (s13, s13_s), (s2, s2_s) = (
        quantize_weight_blocks(w, block) for w in (w13, w2, s13, s2))
    shared = Fp8SharedExpert(s13, s13_s, s2, s2_s)
    nbytes = (top_k + slices) * 3 * width * hidden  # one byte a weight, scales apart
    floor_us = nbytes / rate / 1e3

    def tensor_cores():
        return moe_experts_fp8_decode_triton(x, w13, w13_s, w2, w2_s, weights, ids, block,
                                             shared=shared, config=fp8_decode_tiles(
                                                 x, GATE_UP, top_k + slices, width, hidden, block))
    want = tensor_cores()
    rows = [{"path": "tensor cores", "tiles": "decode default", "us": timer(tensor_cores),
             "floor_us": floor_us, "rel_err": 0.0, "ok": True}]
    for tiles in GEMV_CANDIDATES:
        key = {"path": "gemv", "tiles": ",".join(map(str, tiles))}
        if not gemv_fits(1, width, hidden, block, tiles):
            rows.append(dict(key, error="does not fit the shapes"))
            continue

        def call(tiles=tiles):
            return moe_experts_fp8_gemv(x, w13, w13_s, w2, w2_s, weights, ids, block,
                                        shared=shared, tiles=tiles)
        try:
            err = _rel(call(), want)
            rows.append(dict(key, us=timer(call), floor_us=floor_us, rel_err=err, ok=err < 2e-2))
        except Exception as exc:  # a launch config that does not compile: recorded
            rows.append(dict(key, error=f"{type(exc).__name__}: {str(exc)[:120]}"))
    for row in rows:
        if "us" in row:
            row["of_floor"] = floor_us / row["us"]
            row["vs_tensor_cores"] = rows[0]["us"] / row["us"]
    return rows


def bench_router(args, timer: Timer) -> list[dict]:
    gen = torch.Generator(device=args.device).manual_seed(1)
    rows = []
    for name, (experts, hidden) in ROUTERS.items():
        if args.tiny:
            experts, hidden = experts // 16, hidden // 64
        w = torch.randn(experts, hidden, generator=gen, device=args.device) * hidden ** -0.5
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, generator=gen, device=args.device).to(args.dtype)
            err = _rel(router_logits_triton(x, w), router_logits_ref(x, w))
            k_us = timer(lambda x=x, w=w: router_logits_triton(x, w))
            t_us = timer(lambda x=x, w=w: F.linear(x.float(), w))
            rows.append({"gate": name, "tokens": tokens, "kernel_us": k_us, "torch_us": t_us,
                         "speedup": t_us / k_us, "rel_err": err, "ok": err < 1e-5})
    return rows


def _mla_case(batch: int, context: int, args, timer: Timer, rate: float, candidates,
              gen: torch.Generator) -> list[dict]:
    heads, rank, rope, page = (4, 32, 16, 4) if args.tiny else (16, 512, 64, 64)
    scale = (128 + 64) ** -0.5
    width = max(1, args.table_positions // page)  # a captured graph's page table
    pages = -(-context // page)
    q = torch.randn(batch, heads, rank + rope, generator=gen, device=args.device).to(args.dtype)
    cache = torch.randn(batch * pages * page, rank + rope, generator=gen,
                        device=args.device).to(args.dtype)
    table = torch.zeros(batch, max(width, pages), dtype=torch.int32, device=args.device)
    table[:, :pages] = torch.randperm(batch * pages, generator=gen,
                                      device=args.device).int().view(batch, pages)
    lens = torch.full((batch,), context, dtype=torch.int32, device=args.device)
    want = paged_mla_decode_attention_ref(q, cache, table, lens, page, scale, rank)
    nbytes = batch * context * (rank + rope) * cache.element_size()
    floor_us = nbytes / rate / 1e3
    default = default_mla_config(heads)

    def call(cfg):
        return paged_mla_decode_attention_triton(q, cache, table, lens, page, scale, rank,
                                                 config=cfg)
    rows = []
    for i, cfg in enumerate([default, *[c for c in candidates if c != default]]):
        key = {"batch": batch, "context": context, "table_pages": table.shape[1],
               "config": f"n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
                         f"keys{cfg.min_split_keys} sm{cfg.programs_per_sm}",
               "default": i == 0}
        try:
            err = _rel(call(cfg), want)
            us = timer(lambda cfg=cfg: call(cfg))
        except Exception as exc:  # a config that does not compile or fit: recorded
            rows.append(dict(key, error=f"{type(exc).__name__}: {str(exc)[:120]}"))
            continue
        rows.append(dict(key, us=us, floor_us=floor_us, of_floor=floor_us / us,
                         gbps=nbytes / us / 1e3, rel_err=err, ok=err < 2e-2))
    return rows


def bench_mla(args, timer: Timer, rate: float, candidates) -> list[dict]:
    gen = torch.Generator(device=args.device).manual_seed(2)
    return [row for context in args.contexts for batch in args.tokens
            for row in _mla_case(batch, context, args, timer, rate, candidates, gen)]


def best_of(rows: list[dict], group: tuple[str, ...], label: str) -> list[dict]:
    """Per case (the ``group`` keys), the fastest correct row and the default/table row."""
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        if "us" in r and r.get("ok"):
            cases.setdefault(tuple(r[k] for k in group), []).append(r)
    out = []
    for case, found in cases.items():
        best = min(found, key=lambda r: r["us"])
        mine = next((r for r in found if r.get(label)), None)
        out.append({**dict(zip(group, case)), "best": best.get("tiles") or best.get("config"),
                    "best_us": best["us"], "best_of_floor": best.get("of_floor"),
                    f"{label}_us": mine["us"] if mine else None,
                    "gain": (mine["us"] / best["us"]) if mine else None})
    return out


def print_rows(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(f"\n== {title} ==")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in (r.get(k, "") for k in keys)]
        print("| " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16],
                    help="MoE/router tokens and MLA batch sizes")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--table-positions", type=int, default=163840,
                    help="positions the MLA page table spans (a graph's: the model's maximum)")
    ap.add_argument("--tiny", action="store_true", help="CPU check: tiny shapes, interpreted")
    ap.add_argument("--fp8", action="store_true",
                    help="the MoE sections on block-FP8 experts (kernels/fp8/moe_decode.py)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("bench/moe_decode_sweep.py times compiled kernels and needs a CUDA GPU "
              "(--tiny checks the script on a CPU)", file=sys.stderr)
        return 2
    if any(t < 1 or t > 64 for t in args.tokens) or any(c < 1 for c in args.contexts):
        raise SystemExit(f"--tokens must be in [1, 64] and --contexts >= 1, got {args.tokens}, "
                         f"{args.contexts}")
    args.device = torch.device("cuda" if cuda else "cpu")
    args.dtype = torch.bfloat16 if cuda else torch.float32
    if args.tiny:
        args.contexts = [min(c, 40) for c in args.contexts]
        args.table_positions = min(args.table_positions, 64)
    timer = Timer(cuda)
    rate = copy_rate(args.device) / 1e9
    moe_candidates = MOE_CANDIDATES[:2] if args.tiny else MOE_CANDIDATES
    mla_candidates = MLA_CANDIDATES[:2] if args.tiny else MLA_CANDIDATES
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
              "torch": torch.__version__, "fp8_experts": args.fp8,
              "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "floor_gbps": rate, "graph_calls": GRAPH_CALLS if cuda else 0, "best": {}}
    runs = {
        "gate_up": (lambda: bench_moe(GATE_UP, args, timer, rate, moe_candidates),
                    ("kernel", "tokens"), "table"),
        "down": (lambda: bench_moe(DOWN, args, timer, rate, moe_candidates),
                 ("kernel", "tokens"), "table"),
        "router": (lambda: bench_router(args, timer), None, None),
        "mla": (lambda: bench_mla(args, timer, rate, mla_candidates), ("batch", "context"),
                "default"),
        "gemv": (lambda: bench_gemv(args, timer, rate), None, None),
    }
    for part in PARTS:
        if part not in args.parts or (part == "gemv" and not args.fp8):
            continue
        run, group, label = runs[part]
        result[part] = run()
        print_rows(part, result[part])
        if group is not None:
            result["best"][part] = best_of(result[part], group, label)
        if args.json:  # after each part, so a long run keeps what it measured
            args.json.write_text(json.dumps(result, indent=2))
    for part, rows in result["best"].items():
        print_rows(f"best {part} (gain: the launcher's pick over the best)", rows)
    print(f"\nfloors at {rate:.0f} GB/s; " + (f"kernels timed as CUDA graphs of {GRAPH_CALLS} calls"
                                             if cuda else "CPU check, times meaningless"))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
