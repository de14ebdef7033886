"""End to end through prefill -> transfer -> decode: time to first token split
into prefill, transfer and the first decode step, and decode tokens/s at
several batch sizes.

GPU (prefill cp=2 on GPUs 0 and 1, decode on GPU 0; Llama-3-8B shapes, dummy bf16):
    python bench/e2e.py --llama3-8b --cp 2 --prompt-tokens 8192 32768 --batches 1 16 64 --json out.json
CPU (the tiny model):
    python bench/e2e.py --tiny --cp 2 --prompt-tokens 256 1024 --batches 1 16 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402
from lanekv.decode.config import DecodeConfig  # noqa: E402
from lanekv.decode.daemon import DecodeDaemon  # noqa: E402
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon  # noqa: E402
from lanekv.prefill.engine_config import EngineConfig  # noqa: E402
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc  # noqa: E402
from lanekv.runtime.status import grpc_options  # noqa: E402

from bench.prefill import LLAMA3_8B, TINY, add_model_args  # noqa: E402


def generate(stub, ids: list[int], max_new: int) -> tuple[list[float], dict[str, str]]:
    """Stream one generation; the arrival time of every token and the trailing metadata."""
    req = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=max_new)
    call = stub.Generate(req, timeout=900)
    times = []
    for reply in call:
        now = time.perf_counter()
        times.extend([now] * len(reply.token_ids))
    return times, dict(call.trailing_metadata() or ())


def ttft(stub, vocab: int, tokens: int, repeat: int) -> dict:
    g = torch.Generator().manual_seed(tokens)
    rows = []
    for _ in range(repeat + 1):  # the first is a warm-up
        ids = torch.randint(10, vocab - 10, (tokens,), generator=g).tolist()
        t0 = time.perf_counter()
        times, meta = generate(stub, ids, 2)
        rows.append(dict(
            ttft_s=times[0] - t0,
            prefill_s=float(meta.get("lanekv-prefill-seconds", "nan")),
            transfer_s=float(meta.get("lanekv-transfer-seconds", "nan")),
            transfer_bytes=int(meta.get("lanekv-transfer-bytes", "0")),
            first_decode_step_s=times[1] - times[0],
        ))
    rows = rows[1:]
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["tokens"] = tokens
    out["transfer_gbps"] = out["transfer_bytes"] / out["transfer_s"] / 1e9 if out["transfer_s"] > 0 else None
    return out


def decode_rate(stub, vocab: int, batch: int, prompt: int, max_new: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, vocab - 10, (prompt,), generator=g).tolist() for _ in range(batch)]
    results: list = [None] * batch

    def run(i: int) -> None:
        results[i] = generate(stub, prompts[i], max_new)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Decode tokens (after each request's first, which prefill sampled) over the
    # time from the first request's first token to the last request's last one.
    # Requests start decoding as their transfers finish, so this is throughput
    # under a staggered load; a per-step figure would need in-engine timing.
    start = min(times[0] for times in results)
    end = max(times[-1] for times in results)
    count = sum(len(times) - 1 for times in results)
    return dict(batch=batch, prompt_tokens=prompt, max_new_tokens=max_new,
                window_s=end - start, decode_tokens_per_s=count / (end - start) if end > start else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model_cfg = LLAMA3_8B if args.llama3_8b else TINY
    dtype = "bfloat16" if args.llama3_8b else "float32"
    longest = max(args.prompt_tokens)
    decode_pages = max(args.batches) * -(-(args.decode_prompt + args.max_new_tokens) // args.page_size)
    pool_pages = max(decode_pages, -(-(longest + 2) // args.page_size)) + 64
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(model_cfg))
        prefill = PrefillDaemon(
            EngineConfig(d, cp_size=args.cp, page_size=args.page_size, dtype=dtype, load_format="dummy",
                         pages_per_lane=pool_pages // args.cp + 64, start_timeout_s=900),
            DaemonConfig(lease_s=600, prefix_cache=False),
        )
        try:
            decode = DecodeDaemon(DecodeConfig(d, prefill.endpoint, page_size=args.page_size, dtype=dtype,
                                               load_format="dummy", pool_pages=pool_pages, prefix_cache=False))
            try:
                channel = grpc.insecure_channel(decode.endpoint, options=grpc_options())
                stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
                vocab = model_cfg["vocab_size"]
                ttfts = [ttft(stub, vocab, n, args.repeat) for n in args.prompt_tokens]
                rates = [decode_rate(stub, vocab, b, args.decode_prompt, args.max_new_tokens) for b in args.batches]
                channel.close()
            finally:
                decode.stop()
        finally:
            prefill.stop()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"\nprefill (cp={args.cp}) -> transfer -> decode, {'Llama-3-8B shapes' if args.llama3_8b else 'tiny'}, {dtype}, page {args.page_size}, {device}")
    print(f"{'tokens':>7} {'TTFT ms':>9} {'prefill ms':>11} {'transfer ms':>12} {'GB/s':>6} {'1st step ms':>12}")
    for r in ttfts:
        gbps = f"{r['transfer_gbps']:.2f}" if r["transfer_gbps"] else "-"
        print(f"{r['tokens']:>7} {r['ttft_s'] * 1e3:>9.1f} {r['prefill_s'] * 1e3:>11.1f} {r['transfer_s'] * 1e3:>12.1f} "
              f"{gbps:>6} {r['first_decode_step_s'] * 1e3:>12.1f}")
    print(f"{'batch':>7} {'decode tok/s':>13}")
    for r in rates:
        rate = f"{r['decode_tokens_per_s']:,.0f}" if r["decode_tokens_per_s"] else "-"
        print(f"{r['batch']:>7} {rate:>13}")
    if args.json:
        args.json.write_text(json.dumps(dict(device=device, date=time.strftime("%Y-%m-%d"), cp_size=args.cp,
                                             page_size=args.page_size, ttft=ttfts, decode=rates), indent=2))


if __name__ == "__main__":
    main()
