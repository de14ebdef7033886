"""Prefix caching on a multi-turn workload: cache on against cache off, per transport.

GPU (one H200: prefill cp=1 and decode on the same GPU; Llama-3-8B shapes, dummy bf16):
    python bench/prefix_cache.py --llama3-8b --json bench/results/prefix_cache/h200.json
CPU smoke test (the tiny model):
    python bench/prefix_cache.py --tiny

``--conversations`` conversations of ``--turns`` turns run at ``--concurrency``
at once, each as a user's client sends them: turn 1 is a shared
``--system-tokens`` system prompt plus a ``--user-tokens`` user turn; each
later turn's prompt is the previous prompt, plus the reply the daemons
generated (exactly ``--reply-tokens``: ``ignore_eos``), plus a new user turn. Each setting
(``prefix_cache`` on/off x ``--transports``) starts its own pair of daemons
in this process (``bench/serving.py``'s way), so no cache carries over.

Per setting: TTFT p50/p99 (Generate sent to its first token), prompt tokens
the prefill daemon computed (its ``lanekv_tokens_total{kind="prompt"}``), KV
bytes moved (the calls' ``lanekv-transfer-bytes``), output tok/s (all
generated tokens over the wall time of the workload) and the hit rate
(``cached_tokens`` over prompt tokens). JSON: ``{"rows": [...], ...}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from concurrent import futures
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
from bench.stats import percentiles  # noqa: E402

TRANSPORTS = {"fast": "auto", "grpc": "grpc"}


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


def _start(workdir: str, args, cache: bool, transport: str) -> tuple[PrefillDaemon, DecodeDaemon]:
    prefill = PrefillDaemon(
        EngineConfig(workdir, cp_size=1, page_size=args.page_size, dtype=args.dtype, load_format="dummy",
                     pages_per_lane=args.pool_pages, start_timeout_s=900),
        DaemonConfig(lease_s=600, prefix_cache=cache))
    try:
        decode = DecodeDaemon(DecodeConfig(workdir, prefill.endpoint, page_size=args.page_size, dtype=args.dtype,
                                           load_format="dummy", pool_pages=args.pool_pages,
                                           max_batch_size=max(8, args.concurrency), transport=TRANSPORTS[transport],
                                           prefix_cache=cache))
        if decode.warms_up_by_default:
            decode.warm_up()
    except BaseException:
        prefill.stop()
        raise
    return prefill, decode


def _turn(stub, ids: list[int], reply_tokens: int) -> dict:
    # ignore_eos: every reply has exactly reply_tokens tokens (checked below), so the
    # prompts and output tok/s of the settings compared are of the same lengths.
    request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=reply_tokens,
                                         sampling=lanekv_pb2.SamplingParams(ignore_eos=True))
    sent, first, out, cached = time.perf_counter(), None, [], 0
    call = stub.Generate(request, timeout=600)
    for reply in call:
        if first is None and reply.token_ids:
            first = time.perf_counter()
            cached = reply.cached_tokens
        out += reply.token_ids
    if len(out) != reply_tokens:
        raise RuntimeError(f"a reply had {len(out)} tokens, not the {reply_tokens} asked with ignore_eos: "
                           "the output length is not fixed, so no figure is reported")
    meta = dict(call.trailing_metadata() or ())
    return {"ttft_s": first - sent, "out": out, "cached": cached, "prompt": len(ids),
            "moved": int(meta.get("lanekv-transfer-bytes", 0))}


def run_setting(workdir: str, args, vocab: int, cache: bool, transport: str) -> dict:
    prefill, decode = _start(workdir, args, cache, transport)
    try:
        computed0 = prefill.metrics.tokens.labels(kind="prompt").value
        channel = grpc.insecure_channel(decode.endpoint, options=grpc_options())
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
        system = _ids(vocab, args.system_tokens, 1)

        def conversation(c: int) -> list[dict]:
            ids, turns = list(system), []
            for t in range(args.turns):
                ids = ids + _ids(vocab, args.user_tokens, 1000 * c + t + 2)
                done = _turn(stub, ids, args.reply_tokens)
                turns.append(done)
                ids = ids + done["out"]
            return turns

        start = time.perf_counter()
        with futures.ThreadPoolExecutor(args.concurrency) as pool:
            results = [t for conv in pool.map(conversation, range(args.conversations)) for t in conv]
        wall = time.perf_counter() - start
        channel.close()
        computed = prefill.metrics.tokens.labels(kind="prompt").value - computed0
    finally:
        decode.stop(grace_s=5.0)
        prefill.stop()
        del decode, prefill
        gc.collect()  # the next setting's daemons start in this process: give its pool back first
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    ttft = [r["ttft_s"] * 1e3 for r in results]
    prompt = sum(r["prompt"] for r in results)
    return {
        "prefix_cache": "on" if cache else "off",
        "transport": transport,
        "requests": len(results),
        **percentiles("ttft_ms", ttft, (50, 99)),  # interpolated, with ttft_ms_n
        "prefill_tokens_computed": int(computed),
        "prompt_tokens": prompt,
        "kv_bytes_moved": sum(r["moved"] for r in results),
        "output_tokens": sum(len(r["out"]) for r in results),
        "output_tokens_per_s": sum(len(r["out"]) for r in results) / wall,
        "hit_rate": sum(r["cached"] for r in results) / prompt,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--system-tokens", type=int, default=None)
    ap.add_argument("--user-tokens", type=int, default=None)
    ap.add_argument("--reply-tokens", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=None, help="pages of each daemon's pool")
    ap.add_argument("--transports", nargs="+", choices=sorted(TRANSPORTS), default=["fast", "grpc"])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    # The issue's workload on the GPU; a few seconds' worth on the CPU.
    # 1,024 pages of 64 tokens: 8 GiB of 8B-shaped KV per daemon, as the recorded H200 run
    # (BENCHMARKS.md); 12,288 pages (96 GiB each) do not fit both daemons on one GPU.
    big = dict(conversations=8, turns=8, system_tokens=2048, user_tokens=256, reply_tokens=64, concurrency=8,
               pool_pages=1024, dtype="bfloat16")
    tiny = dict(conversations=3, turns=3, system_tokens=24, user_tokens=6, reply_tokens=4, concurrency=2,
                pool_pages=256, dtype="float32")
    for name, value in (big if args.llama3_8b else tiny).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tiny:
        args.page_size = min(args.page_size, 4)
    cfg = LLAMA3_8B if args.llama3_8b else TINY
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        (Path(workdir) / "config.json").write_text(json.dumps(cfg))
        for transport in args.transports:
            for cache in (True, False):
                rows.append(run_setting(workdir, args, cfg["vocab_size"], cache, transport))
                r = rows[-1]
                print(f"{transport:5s} cache {r['prefix_cache']:3s}  ttft p50 {r['ttft_ms_p50']:9.1f} ms  "
                      f"p99 {r['ttft_ms_p99']:9.1f} ms  computed {r['prefill_tokens_computed']:8d}  "
                      f"moved {r['kv_bytes_moved'] / 1e6:10.1f} MB  out {r['output_tokens_per_s']:8.1f} tok/s  "
                      f"hit {r['hit_rate']:.3f}", flush=True)
    for transport in args.transports:
        on, off = (next(r for r in rows if r["transport"] == transport and r["prefix_cache"] == c)
                   for c in ("on", "off"))
        print(f"{transport}: ttft p50 {off['ttft_ms_p50'] / on['ttft_ms_p50']:.2f}x lower, "
              f"bytes moved {off['kv_bytes_moved'] / max(on['kv_bytes_moved'], 1):.2f}x fewer, "
              f"output tok/s {on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "workload": {
            k: getattr(args, k) for k in ("conversations", "turns", "system_tokens", "user_tokens", "reply_tokens",
                                          "concurrency", "page_size", "pool_pages", "dtype")},
            "model": "llama3-8b" if args.llama3_8b else "tiny",
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}, indent=1))


if __name__ == "__main__":
    main()
