"""FP8 KV against model-dtype KV: KV bytes per token, and TTFT over gRPC and over the fast path.

GPU (one H200: prefill cp=1 and both decode daemons on GPU 0; Llama-3-8B shapes, dummy bf16):
    python bench/fp8_kv.py --llama3-8b --tokens 8192 32768 --json bench/results/fp8_kv.json
CPU (the tiny model):
    python bench/fp8_kv.py --tiny --tokens 256 1024

For each ``--kv-cache-dtype`` in turn (``auto``: the model dtype; ``fp8_e4m3``: e4m3 K/V
with a float32 scale per token and head, ``model/attention/rows.py``), one prefill daemon
and two decode daemons against it, one reading the ranks over gRPC, one taking the
fast path (CUDA IPC on a GPU, /dev/shm on the CPU); the prefix caches are off. Per
prompt length, median of ``--repeat`` after one warm-up: the prefill daemon's own
Prefill call (colocated: no transfer), and Generate with ``max_new_tokens=1`` on each
decode daemon (prompt sent to first token: the prefill and what of the transfer did
not overlap it), with the bytes the decode daemon fetched and its transfer seconds.
Printed: KV bytes per token (the pool's rows, every layer) and each path's TTFT, and
FP8 over the model dtype for both. The issue's target: gRPC TTFT at 32k with FP8 KV
at most 0.6x the bf16 one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402
from lanekv.decode.config import DecodeConfig  # noqa: E402
from lanekv.decode.daemon import DecodeDaemon  # noqa: E402
from lanekv.model.config import ModelConfig  # noqa: E402
from lanekv.model.dtypes import DTYPES  # noqa: E402
from lanekv.model.pool_sizing import page_bytes  # noqa: E402
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon  # noqa: E402
from lanekv.prefill.engine_config import EngineConfig  # noqa: E402
from lanekv.proto import lanekv_pb2_grpc  # noqa: E402
from lanekv.runtime.status import grpc_options  # noqa: E402

from bench.prefill import LLAMA3_8B, TINY, add_model_args  # noqa: E402
from bench.ttft import colocated, generate, prompt  # noqa: E402

KV_DTYPES = ("auto", "fp8_e4m3")
PATHS = (("grpc", "grpc"), ("fast", "auto"))


def measure(model_dir: str, kv: str, args: argparse.Namespace, dtype: str, vocab: int) -> list[dict]:
    pages = -(-(max(args.tokens) + 2) // args.page_size) + 16
    prefill = PrefillDaemon(
        EngineConfig(model_dir, cp_size=args.cp, page_size=args.page_size, dtype=dtype,
                     load_format="dummy", pages_per_lane=2 * pages // args.cp + 16,
                     start_timeout_s=900, kv_cache_dtype=kv),
        DaemonConfig(lease_s=600, max_batch_tokens=max(args.tokens), prefix_cache=False))
    decoders: dict[str, DecodeDaemon] = {}
    channels = []
    try:
        for name, transport in PATHS:
            decoders[name] = DecodeDaemon(DecodeConfig(
                model_dir, prefill.endpoint, page_size=args.page_size, dtype=dtype,
                load_format="dummy", pool_pages=pages, transport=transport, request_timeout_s=900,
                prefix_cache=False, kv_cache_dtype=kv))
        stubs = {}
        for name, dec in decoders.items():
            channels.append(grpc.insecure_channel(dec.endpoint, options=grpc_options()))
            stubs[name] = lanekv_pb2_grpc.DecodeServiceStub(channels[-1])
        channels.append(grpc.insecure_channel(prefill.endpoint, options=grpc_options()))
        prefill_stub = lanekv_pb2_grpc.PrefillServiceStub(channels[-1])
        transports = sorted({decoders["fast"].fastpath.transport(e) for e in prefill.topology.endpoints})
        rows = []
        for tokens in args.tokens:
            samples = []
            for i in range(args.repeat + 1):  # the first is a warm-up
                ids = prompt(vocab, tokens, tokens * 100 + i)
                sample = {"colocated_s": colocated(prefill, prefill_stub, ids)[0]}
                for name, _ in PATHS:
                    seconds, meta = generate(stubs[name], ids)
                    sample[f"{name}_s"] = seconds
                    sample[f"{name}_transfer_s"] = float(meta.get("lanekv-transfer-seconds", "nan"))
                    sample[f"{name}_bytes"] = int(meta.get("lanekv-transfer-bytes", "0"))
                samples.append(sample)
            row = {k: statistics.median(s[k] for s in samples[1:]) for k in samples[0]}
            row.update(kv_cache_dtype=kv, tokens=tokens, transports=transports)
            rows.append(row)
        return rows
    finally:
        for ch in channels:
            ch.close()
        for dec in decoders.values():
            dec.stop()
        prefill.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model_cfg = LLAMA3_8B if args.llama3_8b else TINY
    dtype = "bfloat16" if args.llama3_8b else "float32"
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(model_cfg))
        config = ModelConfig.from_dir(d)
        per_token = {kv: page_bytes(config, DTYPES[dtype], args.page_size, kv_cache_dtype=kv)
                     // args.page_size for kv in KV_DTYPES}
        rows = []
        for kv in KV_DTYPES:  # one set of daemons at a time: each gives its GPU memory back
            rows += measure(d, kv, args, dtype, model_cfg["vocab_size"])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    by = {(r["kv_cache_dtype"], r["tokens"]): r for r in rows}
    for r in rows:
        base = by[("auto", r["tokens"])]
        for name in ("colocated", *(n for n, _ in PATHS)):
            r[f"{name}_over_auto"] = r[f"{name}_s"] / base[f"{name}_s"]
        r["kv_bytes_per_token"] = per_token[r["kv_cache_dtype"]]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"\nFP8 KV vs {dtype} KV, prefill cp={args.cp}, "
          f"{'Llama-3-8B shapes' if args.llama3_8b else 'tiny'}, page {args.page_size}, {device}; "
          f"fast path: {rows[0]['transports'] if rows else '-'}")
    print(f"KV bytes per token (every layer): {dtype} {per_token['auto']}, fp8_e4m3 "
          f"{per_token['fp8_e4m3']} ({per_token['fp8_e4m3'] / per_token['auto']:.3f}x)")
    print("TTFT median ms (over the model-dtype KV's); transfer ms as the decode daemon timed it; MiB fetched")
    print(f"{'tokens':>7} {'kv':>9} {'colocated':>10} {'grpc':>9} {'/auto':>6} {'xfer':>7} {'MiB':>7} "
          f"{'fast':>9} {'/auto':>6} {'xfer':>7} {'MiB':>7}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['kv_cache_dtype']:>9} {r['colocated_s'] * 1e3:>10.1f} "
              f"{r['grpc_s'] * 1e3:>9.1f} {r['grpc_over_auto']:>6.3f} {r['grpc_transfer_s'] * 1e3:>7.1f} "
              f"{r['grpc_bytes'] / 2**20:>7.0f} {r['fast_s'] * 1e3:>9.1f} {r['fast_over_auto']:>6.3f} "
              f"{r['fast_transfer_s'] * 1e3:>7.1f} {r['fast_bytes'] / 2**20:>7.0f}")
    if args.json:
        args.json.write_text(json.dumps(dict(device=device, date=time.strftime("%Y-%m-%d"), cp_size=args.cp,
                                             page_size=args.page_size, dtype=dtype,
                                             kv_bytes_per_token=per_token, rows=rows), indent=2))


if __name__ == "__main__":
    main()
