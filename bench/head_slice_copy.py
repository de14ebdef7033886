"""The fast path's copies and digests of a tensor-parallel decode rank's KV heads, against whole rows.

    python bench/head_slice_copy.py [--layers 32 --kv-heads 8 --head-dim 128 --tokens 32768
                                     --page-size 16 --tp 2,4,8 --repeat 5 --json out.json]

A prefill pool ``[layers, 2, pages * page_size, kv_heads, head_dim]`` (bfloat16 on
the first GPU) and, per decode layout ``tp``, a decode pool of ``kv_heads / tp``
heads (on the last GPU); a request's pages in one run. Each figure is the best of
``--repeat`` (ms, and GB/s of the bytes that rank receives):

- ``copy whole rows``: ``copy_pages`` of every head (the tp=1 fast path; one 2-D copy per run);
- ``copy heads tp=T``: ``copy_pages`` of rank 0's heads (``RowSliceCopy``: one 2-D copy per layer and plane);
- ``copy heads tp=T torch``: the same view copied by torch's ``copy_`` (what the copy was without it);
- ``digest whole rows (rank)``: ``page_digest`` of the pages on the prefill GPU;
- ``digest heads tp=T (rank)``: ``head_slice_digest`` of rank 0's heads on the prefill GPU;
- ``digest heads tp=T (decode)``: ``page_digest`` of the copied pages in the decode pool.

It prints a table and writes the figures as JSON (``--json``). On a machine without
a GPU it runs on the CPU (torch copies; figures of no interest but the path).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.kernels.page_digest import head_slice_digest, page_digest  # noqa: E402
from lanekv.transfer.fastpath.poolcopy import copy_pages  # noqa: E402


def _best(run: Callable[[], object], devices: list[torch.device], repeat: int) -> float:
    """Best wall seconds of ``run`` over ``repeat`` tries, each synchronized on ``devices``."""
    def sync() -> None:
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    run()  # warm: plans, kernels, peer access
    sync()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The copy moved the bytes it was timed for (a figure of a wrong copy is none)."""
    if not torch.equal(got.cpu(), want.cpu()):
        raise SystemExit(f"copy of {what}: the decode pool does not hold the prefill pool's rows")


def measure(args: argparse.Namespace) -> list[dict]:
    cuda = torch.cuda.is_available()
    src_device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dst_device = torch.device("cuda", torch.cuda.device_count() - 1) if cuda else torch.device("cpu")
    ps, layers, heads, dim = args.page_size, args.layers, args.kv_heads, args.head_dim
    pages = -(-args.tokens // ps)
    dtype = torch.bfloat16 if cuda else torch.float16
    src = torch.randn((layers, 2, (pages + 1) * ps, heads, dim), device=src_device).to(dtype)
    src_pages, dst_pages = list(range(1, pages + 1)), list(range(pages))
    index = torch.tensor(src_pages, device=src_device)
    devices = [src_device, dst_device]
    rows: list[dict] = []

    def add(name: str, seconds: float, nbytes: int) -> None:
        rows.append({"figure": name, "ms": seconds * 1e3, "bytes": nbytes, "gb_s": nbytes / seconds / 1e9})

    whole_bytes = src[:, :, :pages * ps].numel() * src.element_size()
    whole = torch.empty((layers, 2, pages * ps, heads, dim), dtype=dtype, device=dst_device)
    add("copy whole rows", _best(lambda w=whole: copy_pages(src, src_pages, w, dst_pages, ps, 0, layers),
                                 devices, args.repeat), whole_bytes)
    _check(whole, src[:, :, ps:], "whole rows")
    add("digest whole rows (rank)", _best(lambda: page_digest(src, index, ps, 0, layers, first_layer=0),
                                          devices, args.repeat), whole_bytes)
    del whole
    dst_index = torch.tensor(dst_pages, device=dst_device)
    for tp in args.tp:
        if heads % tp:
            raise SystemExit(f"--tp {tp} does not divide --kv-heads {heads}")
        count = heads // tp
        view = src[:, :, :, :count]
        mine = torch.empty((layers, 2, pages * ps, count, dim), dtype=dtype, device=dst_device)
        nbytes = whole_bytes // tp
        add(f"copy heads tp={tp}", _best(lambda v=view, m=mine: copy_pages(v, src_pages, m, dst_pages, ps, 0, layers),
                                         devices, args.repeat), nbytes)
        _check(mine, view[:, :, ps:], f"heads tp={tp}")
        add(f"copy heads tp={tp} torch",
            _best(lambda v=view, m=mine: m.copy_(v[:, :, ps:(pages + 1) * ps], non_blocking=True),
                  devices, args.repeat), nbytes)
        add(f"digest heads tp={tp} (rank)",
            _best(lambda c=count: head_slice_digest(src, index, ps, 0, layers, slice(0, c)), devices, args.repeat),
            nbytes)
        add(f"digest heads tp={tp} (decode)",
            _best(lambda m=mine: page_digest(m, dst_index, ps, 0, layers, first_layer=0), devices, args.repeat),
            nbytes)
        del mine
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in ("layers", "kv_heads", "head_dim", "tokens", "page_size", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    rows = measure(args)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"head-sliced fast path on {device}: {args.layers} layers, {args.kv_heads} KV heads x {args.head_dim}, "
          f"{args.tokens} tokens in pages of {args.page_size}")
    print(f"{'figure':36s} {'ms':>10s} {'MiB':>10s} {'GB/s':>10s}")
    for row in rows:
        print(f"{row['figure']:36s} {row['ms']:10.3f} {row['bytes'] / 2**20:10.1f} {row['gb_s']:10.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": device, "args": {k: v for k, v in vars(args).items()
                                                                     if k != "json"}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
