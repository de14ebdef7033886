"""GB/s of the paged-KV copy kernels and of paged decode attention, against a plain copy.

    python bench/kernels_copy.py [--json out.json] [--sweep]

Needs a CUDA GPU. Layout of an 8B-class model: 32 layers, 8 kv heads,
head_dim 128, bf16. Each copy op is timed beside ``dst.copy_(src)`` of the
same bytes in the same run (the measured ceiling); GB/s counts bytes read plus
bytes written. Decode attention reports GB/s of K/V read against that copy's
read+write rate. Every op is checked against its torch reference on fresh
random data before it is timed; timings are triton.testing.do_bench medians
(L2 flushed before each repetition).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lanekv.kernels.decode_attention import (  # noqa: E402
    DecodeConfig,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from lanekv.kernels.kv_layout import CopyConfig, KVCacheSpec  # noqa: E402
from lanekv.kernels.page_copy import (  # noqa: E402
    gather_pages_ref,
    gather_pages_triton,
    scatter_pages_triton,
)
from lanekv.kernels.rerange import rerange_ref, rerange_triton  # noqa: E402
from lanekv.kernels.store_kv import store_kv_ref, store_kv_triton  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, Q_HEADS = 32, 8, 128, 32
DTYPE = torch.bfloat16
DEVICE = "cuda"
REQUEST_TOKENS = 32768
_FLUSH_BYTES = 256 << 20  # as do_bench: larger than the 60 MB L2


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _graph_ms(fn, reps: int = 10) -> float:
    """Device time of ``fn`` alone: CUDA-graph replays of (L2 flush, fn) minus (L2 flush).

    do_bench times eager calls, so for small problems it also counts the host's
    launch cost (the GPU waits for Python); a decode loop would replay graphs.
    The ceiling for these times is the faster of the copy's two timings: on an
    H200 the captured copy ran 55% slower than the eager one at 4 GiB, while
    eager timing overstated a 4 MiB copy twice over.
    """
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)

    def body(with_fn: bool) -> None:
        for _ in range(reps):
            flush.zero_()
            if with_fn:
                fn()

    medians = []
    try:
        for with_fn in (True, False):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body(with_fn)  # warm-up off the capture, as torch.cuda.graph requires
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body(with_fn)
            samples = []
            for _ in range(5):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            medians.append(sorted(samples)[len(samples) // 2])
    except RuntimeError as err:  # a capture problem must not lose the eager numbers
        print(f"graph timing failed: {err}", file=sys.stderr)
        return float("nan")
    return (medians[0] - medians[1]) / reps


def _times(fn) -> tuple[float, float]:
    return _ms(fn), _graph_ms(fn)


def _copy_times(num_bytes: int) -> tuple[float, float]:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    times = _times(partial(dst.copy_, src))
    del src, dst
    return times


def _warm_gpu() -> None:
    """Bring the clocks up before the first timing (an idle H200 reads 345-405 MHz)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(300):
        dst.copy_(src)
    torch.cuda.synchronize()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.unsqueeze(-1).view(torch.uint8), b.unsqueeze(-1).view(torch.uint8))


def _row(results, op, case, moved_bytes, times, copy_times, **extra) -> None:
    (ms, graph_ms), (copy_ms, copy_graph_ms) = times, copy_times
    gbps = moved_bytes / ms / 1e6
    copy_gbps = moved_bytes / copy_ms / 1e6
    results.append(dict(op=op, case=case, bytes=moved_bytes, ms=ms, gbps=gbps,
                        copy_ms=copy_ms, copy_gbps=copy_gbps, vs_copy=gbps / copy_gbps,
                        graph_ms=graph_ms, copy_graph_ms=copy_graph_ms,
                        graph_vs_copy=min(copy_ms, copy_graph_ms) / graph_ms, **extra))
    print(_format(results[-1]), file=sys.stderr, flush=True)  # progress, if a run is cut short


def _format(r: dict) -> str:
    knobs = r["config"] or "default"
    if r.get("num_splits"):
        knobs = f"{knobs} splits={r['num_splits']}"
    return (f"{r['op']:<14} {r['case']:<28} {r['ms']:>8.3f} {r['gbps']:>7.0f} "
            f"{r['copy_gbps']:>7.0f} {r['vs_copy']:>6.2f} {r['graph_ms']:>8.3f} "
            f"{r['graph_vs_copy']:>6.2f}  {knobs}")


def _configs(tiles, row_words: int) -> list[CopyConfig | None]:
    """None (the launcher's default) or a (tile_words, num_warps) pair shaped for the rows."""
    return [None if t is None else CopyConfig.for_rows(row_words, *t) for t in tiles]


def _copy_ops(results: list[dict], tiles: list[tuple[int, int] | None]) -> None:
    row_words = KV_HEADS * HEAD_DIM * DTYPE.itemsize // 4
    for page_size in (16, 64):
        spec = KVCacheSpec(LAYERS, KV_HEADS, HEAD_DIM, DTYPE, page_size)
        req_pages = REQUEST_TOKENS // page_size
        num_pages = req_pages * 3 // 2
        pool = spec.alloc_pool(num_pages, DEVICE).normal_()
        pages = torch.randperm(num_pages, device=DEVICE)[:req_pages]  # scrambled
        locs = (pages[:, None] * page_size + torch.arange(page_size, device=DEVICE)).reshape(-1)
        k = torch.randn(REQUEST_TOKENS, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        v = torch.randn_like(k)
        want = pool.clone()
        store_kv_ref(k, v, want[LAYERS - 1, 0], want[LAYERS - 1, 1], locs)
        store_kv_triton(k, v, pool[LAYERS - 1, 0], pool[LAYERS - 1, 1], locs)
        if not _same(pool, want):
            raise RuntimeError(f"store_kv differs from the reference (page_size {page_size})")
        del want
        moved = 2 * 2 * k.numel() * k.element_size() + locs.numel() * 8
        copy_t = _copy_times(moved // 2)
        for cfg in _configs(tiles, row_words):
            t = _times(partial(store_kv_triton, k, v, pool[LAYERS - 1, 0], pool[LAYERS - 1, 1],
                               locs, config=cfg))
            _row(results, "store_kv", f"ps{page_size} T{REQUEST_TOKENS}", moved, t, copy_t,
                 config=None if cfg is None else cfg._asdict())

        buf = gather_pages_triton(pool, pages, page_size, 0, LAYERS)
        if not _same(buf, gather_pages_ref(pool, pages, page_size, 0, LAYERS)):
            raise RuntimeError(f"gather_pages differs from the reference (page_size {page_size})")
        moved = 2 * buf.numel() * buf.element_size() + pages.numel() * 8
        copy_t = _copy_times(moved // 2)
        for cfg in _configs(tiles, page_size * row_words):
            t = _times(partial(gather_pages_triton, pool, pages, page_size, 0, LAYERS, buf,
                               config=cfg))
            _row(results, "gather_pages", f"ps{page_size} {LAYERS}L {req_pages}p", moved, t,
                 copy_t, config=None if cfg is None else cfg._asdict())

        dst = spec.alloc_pool(num_pages + 7, DEVICE)
        dst_pages = torch.randperm(num_pages + 7, device=DEVICE)[:req_pages]
        scatter_pages_triton(buf, dst, dst_pages, page_size, 0, LAYERS)
        if not _same(buf, gather_pages_ref(dst, dst_pages, page_size, 0, LAYERS)):
            raise RuntimeError(f"scatter_pages lost bytes (page_size {page_size})")
        for cfg in _configs(tiles, page_size * row_words):
            t = _times(partial(scatter_pages_triton, buf, dst, dst_pages, page_size, 0, LAYERS,
                               config=cfg))
            _row(results, "scatter_pages", f"ps{page_size} {LAYERS}L {req_pages}p", moved, t,
                 copy_t, config=None if cfg is None else cfg._asdict())
        del pool, dst, buf, k, v
        torch.cuda.empty_cache()

    # rerange: rank-major all-gather of 8 ranks (padded) back to request order.
    for name, row_shape, dtype in [("k rows bf16", (KV_HEADS, HEAD_DIM), DTYPE),
                                   ("k rows fp8-as-uint8", (KV_HEADS, HEAD_DIM), torch.uint8),
                                   ("hidden 4096 bf16", (4096,), DTYPE)]:
        pad = 8 * (REQUEST_TOKENS // 8 + 5)
        if dtype == torch.uint8:
            src = torch.randint(0, 256, (pad, *row_shape), device=DEVICE, dtype=dtype)
        else:
            src = torch.randn(pad, *row_shape, device=DEVICE, dtype=dtype)
        index = torch.randperm(pad, device=DEVICE)[:REQUEST_TOKENS]
        out = rerange_triton(src, index)
        if not _same(out, rerange_ref(src, index)):
            raise RuntimeError(f"rerange differs from the reference ({name})")
        moved = 2 * out.numel() * out.element_size() + index.numel() * 8
        copy_t = _copy_times(moved // 2)
        words = out[0].numel() * out.element_size() // 4
        for cfg in _configs(tiles, words):
            t = _times(partial(rerange_triton, src, index, out, config=cfg))
            _row(results, "rerange", f"{name} T{REQUEST_TOKENS}", moved, t, copy_t,
                 config=None if cfg is None else cfg._asdict())
        del src, out


def _decode_problem(cache, batch, context, page_size):
    k_cache, v_cache = cache
    num_pages = k_cache.shape[0] // page_size
    per_req = context // page_size
    table = torch.randperm(num_pages, device=DEVICE)[: batch * per_req].view(batch, per_req)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    return q, k_cache, v_cache, table.to(torch.int32), seq_lens


def _decode(results: list[dict], shapes, variants) -> None:
    rows = max(b * c for b, c, _ in shapes) + 64 * 64
    cache = tuple(torch.randn(rows, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
                  for _ in range(2))
    scale = HEAD_DIM ** -0.5
    copy_cache: dict[int, tuple[float, float]] = {}
    for batch, context, page_size in shapes:
        args = _decode_problem(cache, batch, context, page_size)
        check = min(batch, 4)  # the reference is slow; check the first requests
        sub = (args[0][:check], *args[1:3], args[3][:check], args[4][:check])
        want = paged_decode_attention_ref(*sub, page_size, scale).float()
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
        if kv_bytes not in copy_cache:
            copy_cache[kv_bytes] = _copy_times(kv_bytes // 2)
        for cfg, num_splits in variants:
            got = paged_decode_attention_triton(*sub, page_size, scale, num_splits=num_splits,
                                                config=cfg).float()
            err = ((got - want).norm() / want.norm()).item()
            if not err < 1e-2:
                raise RuntimeError(f"decode B{batch} ctx{context} ps{page_size}: rel err {err}")
            t = _times(partial(paged_decode_attention_triton, *args, page_size, scale,
                               num_splits=num_splits, config=cfg))
            _row(results, "paged_decode", f"B{batch} ctx{context} ps{page_size}", kv_bytes, t,
                 copy_cache[kv_bytes], rel_err=err, num_splits=num_splits,
                 config=None if cfg is None else cfg._asdict())


def run(results: list[dict], sweep: bool = False) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("bench/kernels_copy.py needs a CUDA GPU")
    torch.manual_seed(0)
    _warm_gpu()
    tiles: list[tuple[int, int] | None] = [None]
    if sweep:  # the default is (8192 words, 8 warps); it is timed again last, for the spread
        tiles += [(2048, 4), (4096, 4), (4096, 8), (16384, 8), None]
    _copy_ops(results, tiles)
    shapes = [(b, c, ps) for b in (1, 16, 64) for c in (1024, 8192, 32768) for ps in (1, 16, 64)]
    _decode(results, shapes, [(None, None)])
    if sweep:
        variants = [(DecodeConfig(block_n=n, num_stages=s), None)
                    for n in (64, 128) for s in (2, 3, 4)]
        variants += [(DecodeConfig(num_warps=8), None)]
        _decode(results, [(64, 8192, 16), (1, 32768, 16)], variants)
        per_sm = [(DecodeConfig(programs_per_sm=n), None) for n in (1, 2, 4, 8)]
        per_sm += [(DecodeConfig(min_split_keys=128, programs_per_sm=4), None)]
        _decode(results, [(1, 8192, 16), (1, 32768, 16), (16, 8192, 16), (16, 1024, 16)],
                per_sm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--sweep", action="store_true", help="also sweep tiles, warps, splits")
    args = parser.parse_args()
    results: list[dict] = []
    run(results, sweep=args.sweep)
    print(f"{'op':<14} {'case':<28} {'ms':>8} {'GB/s':>7} {'copy':>7} {'x copy':>6} "
          f"{'graph ms':>8} {'x copy':>6}  config")
    for r in results:
        print(_format(r))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    triton=triton.__version__, machine=platform.machine())
        args.json.write_text(json.dumps(dict(info=info, results=results), indent=2))


if __name__ == "__main__":
    main()
