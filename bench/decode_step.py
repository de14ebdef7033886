"""Decode step time of the continuous-batching engine, with no transfer in the way.

Requests start with a random KV context already in the pool and decode
together, so tokens/s here is batch / step time. Also prints where the host
time of one step goes (torch profiler, top ops) at the smallest batch.

    python bench/decode_step.py --llama3-8b --batches 1 16 64 --context 1024 --json out.json
    python bench/decode_step.py --tiny --batches 1 16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.prefill import LLAMA3_8B, TINY  # noqa: E402
from decode.engine import DecodeEngine  # noqa: E402
from decode.pool import PagePool, PageTable  # noqa: E402
from model.checkpoint import load_dummy_model  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--llama3-8b", action="store_true")
    which.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cfg_json = LLAMA3_8B if args.llama3_8b else TINY
    dtype = torch.bfloat16 if args.llama3_8b else torch.float32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg_json))
        loaded = load_dummy_model(d, dtype=dtype, device=device)
    cfg = loaded.config
    per_req = -(-(args.context + args.steps + 8) // args.page_size)
    pool = PagePool.for_model(cfg, max(args.batches) * per_req + 8, args.page_size, dtype, device)
    pool.tensor.normal_()
    rows = []
    for batch in args.batches:
        engine = DecodeEngine(loaded.model, pool, max_batch_size=batch, eos_token_ids=())
        for i in range(batch):
            table = PageTable.allocate(pool, args.context)
            engine.add(f"r{i}", table, 11 + i, SamplingParams(), args.steps + 4)
        engine.step()  # admit + warm up (kernel compilation)
        engine.step()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync(device)
        step_s = (time.perf_counter() - t0) / args.steps
        rows.append(dict(batch=batch, context=args.context, step_ms=step_s * 1e3, tokens_per_s=batch / step_s))
        if batch == min(args.batches):
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                engine.step()
                sync(device)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
        while engine.has_work:
            engine.step()
    # the ceiling: reading the weights once per step at the device-copy rate
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    if device.type == "cuda":
        src = torch.empty(weight_bytes // 2, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        sync(device)
        copy_s = (time.perf_counter() - t0) / 5
        floor_ms = copy_s / 2 * 1e3  # a read of the weights is half a copy's traffic
    else:
        floor_ms = None
    print(f"\ndecode step, {'Llama-3-8B shapes' if args.llama3_8b else 'tiny'}, context {args.context}, {device}")
    print(f"{'batch':>5} {'step ms':>8} {'tok/s':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['step_ms']:>8.2f} {r['tokens_per_s']:>9,.0f}")
    if floor_ms:
        print(f"floor: reading {weight_bytes / 2**30:.1f} GiB of weights at the device-copy rate = {floor_ms:.2f} ms/step")
    if args.json:
        args.json.write_text(json.dumps(dict(device=str(device), rows=rows, weight_read_floor_ms=floor_ms), indent=2))


if __name__ == "__main__":
    main()
