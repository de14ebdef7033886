"""Where a staged sender relay's time goes: a rank, its staged relays, a FetchKV client.

    python bench/relay_staged_probe.py [--relays 1 2 4] [--tokens 4096] [--repeats 3]
        [--profile] [--json out.json]
    python bench/relay_staged_probe.py --stages   # a relay's CPU work per chunk, alone

The rank runs in a process of its own (a CPU pool of Llama-3-8B shapes by default:
32 layers x ``--tokens`` x 8 heads x 128, bfloat16, pages of 64; staged relays forced
with ``LANEKV_RELAY_STAGED=1``, staging files as ``RankStaging`` makes them) and
starts N relay processes as a prefill rank does (``RelayProcesses``). This process
pulls one request through them: stream i asks relay i for its share of the pages,
all layers, 8 MiB chunks, counting the bytes it receives without placing them.
Rows:

- ``rank_sN``: N FetchKV streams straight from the rank (threads of the rank's process);
- ``relay_sN``: N streams, one per relay process;
- ``inproc_s1`` (``--profile``): one relay in this process (``RelayService``), each
  per-chunk stage of its producer timed (``time.perf_counter`` spans, and
  ``time.thread_time``, the CPU of the calling thread): the StageKV round trip,
  ``encode_chunk`` (header + XXH3), ``frame_chunk`` (the copy into the message; with
  per-block seals, ``SealSum``, also their sums), the check of the bytes as framed where
  it is a pass of its own; and cProfile's top functions of that thread.

``relays CPU s/GB``: CPU seconds all relay processes spent per GB moved (/proc): what
one relay moves on one core's worth of work is its inverse. ``rank CPU s/GB``: the
same for the rank process (on a CPU pool its gather and seal run on its CPU; a rank
with a GPU pool does them on the GPU). GB/s is the payload over the wall time of the
whole pull (each row after one warm-up pull, whose range seals the rank keeps: see
``_numpy_range_seal``); ``steady`` counts from each stream's first chunk, and ``first
chunk`` is how long that took. On a machine of few cores the rank, the relays and this
client share them: repeat, and read the CPU columns before the GB/s ones.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lanekv.proto import lanekv_pb2  # noqa: E402
from lanekv.runtime.status import TRANSFER_SERVICE, grpc_options  # noqa: E402

FETCH = f"/{TRANSFER_SERVICE}/FetchKV"
RID = "probe"


def _rank(args: argparse.Namespace, relays: int, conn) -> None:
    """The rank process: pool, staging, server, relays; says its endpoints, serves until told."""
    os.environ["LANEKV_RELAY_STAGED"] = "1"
    import torch
    from lanekv.runtime.hostmem import keep_freed_buffers
    from lanekv.runtime.security import SecurityConfig
    from lanekv.transfer.protocol.contract import Topology
    from lanekv.transfer.rank.relay import RelayProcesses, RelaySpec
    from lanekv.transfer.rank.server import serve
    from lanekv.transfer.rank.sources import TensorPageSource
    from lanekv.transfer.rank.staging import RankStaging

    from tests.reliability.kv_cluster import make_agreement

    keep_freed_buffers()  # as a rank process does
    torch.set_num_threads(args.rank_threads)
    seals: dict[tuple, int] = {}  # the warm-up pull of each row takes them, the timed pulls reuse them

    def sealed(self, physical_pages, layer_start, layer_end, after=None, *, heads=None) -> int:
        key = (tuple(physical_pages), layer_start, layer_end, heads)
        if key not in seals:
            seals[key] = _numpy_range_seal(self, physical_pages, layer_start, layer_end, heads=heads)
        return seals[key]

    TensorPageSource.fresh_digest = sealed
    agreement = make_agreement(num_layers=args.layers, num_kv_heads=args.heads, head_dim=args.dim,
                               kv_dtype="bfloat16", page_size=args.page)
    pool = torch.randn(args.layers, 2, args.tokens, args.heads, args.dim).to(torch.bfloat16)
    pages = args.tokens // args.page
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(1)).tolist()
    source = TensorPageSource(agreement, 0, pool)
    source.add(RID, list(enumerate(order)))
    staging = RankStaging(uuid.uuid4().hex[:8], 0, max(1, relays), pool.device)  # 0: one for an in-process relay
    served = serve(source, relay_staging=staging, max_workers=32)
    endpoint = f"127.0.0.1:{served.port}"
    source.set_topology(Topology(1, "in_seq", "page_mod_cp", (endpoint,)))
    procs = None
    try:
        if relays:
            spec = RelaySpec(0, endpoint, agreement.encode(), SecurityConfig(), "127.0.0.1", "127.0.0.1", "cpu")
            procs = RelayProcesses(spec, relays, staging)
        conn.send((endpoint, agreement.fingerprint, pages, [] if procs is None else procs.endpoints, staging.areas,
                   [] if procs is None else [p.pid for p in procs.processes]))
        conn.recv()  # told to stop
    finally:
        if procs is not None:
            procs.close()
        served.server.stop(None)
        staging.close()


def _numpy_range_seal(self, physical_pages, layer_start: int, layer_end: int, after=None, *, heads=None) -> int:
    """The rank's range seal (``kv_digest`` of the gathered range at its place among all layers)
    on numpy: torch's CPU integer ops take ~10 s for this pool's 0.5 GiB, which no GPU rank
    pays (``page_digest`` there, or sums taken as the layers were written) and which would
    hide everything else in the rows; the rank process keeps each seal for the timed pulls."""
    import numpy as np
    import torch
    from lanekv.kernels.page_digest import DIGEST_WEIGHT

    if heads is not None:
        raise ValueError("the probe seals whole rows only")
    payload = self.read(physical_pages, layer_start, layer_end)  # [layers, planes, rows, heads, dim]
    words = payload.reshape(-1).view(torch.int32).numpy().astype(np.int64)
    position = payload.shape[1] * layer_start * payload.shape[2] * payload[0, 0, 0].numel() * payload.element_size() // 4
    total, row = 0, 1 << 20
    for start in range(0, words.size, row):
        part = words[start:start + row]
        weights = (np.arange(position + start, position + start + part.size, dtype=np.int64) * DIGEST_WEIGHT) | 1
        total += int((part * weights).sum())
    return total & ((1 << 64) - 1)


def _pull(endpoints: list[str], fingerprint: str, pages: int, layers: int, chunk_bytes: int) -> dict:
    """One stream per endpoint, each its share of the pages; GB/s over the whole pull and steady."""
    share = -(-pages // len(endpoints))
    results: list[dict] = [{} for _ in endpoints]

    def stream(i: int) -> None:
        with grpc.insecure_channel(endpoints[i], options=grpc_options()) as channel:
            call = channel.unary_stream(FETCH, request_serializer=lanekv_pb2.FetchRequest.SerializeToString)
            request = lanekv_pb2.FetchRequest(request_id=RID, fingerprint=fingerprint, layer_start=0,
                                              layer_end=layers, pages=list(range(i * share, min(pages, (i + 1) * share))),
                                              max_chunk_bytes=chunk_bytes)
            nbytes, first, start = 0, None, time.perf_counter()
            for message in call(request, timeout=300):
                if first is None:
                    first, after_first = time.perf_counter(), 0
                else:
                    after_first += len(message)
                nbytes += len(message)
            results[i] = {"bytes": nbytes, "start": start, "first": first, "end": time.perf_counter(),
                          "after_first": after_first}

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(endpoints))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(r["bytes"] for r in results)
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    steady = statistics.median(r["after_first"] / max(1e-9, r["end"] - r["first"]) for r in results)
    return {"gbps": total / wall / 1e9, "per_stream_steady_gbps": steady / 1e9, "bytes": total, "wall_s": wall,
            "first_chunk_s": statistics.median(r["first"] - r["start"] for r in results)}


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (all their threads) so far, from /proc."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


class _Spans:
    """Per-chunk stage times of the in-process relay: wraps the functions its producer calls."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)
        self._lock = threading.Lock()
        self._originals: list[tuple[object, str, object]] = []

    def restore(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def wrap(self, owner: object, name: str, label: str) -> None:
        self._originals.append((owner, name, vars(owner)[name]))
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                with self._lock:
                    self.times[label].append(time.perf_counter() - start)
                    self.times[f"{label} (cpu)"].append(time.thread_time() - cpu)

        setattr(owner, name, staticmethod(timed) if isinstance(owner.__dict__.get(name), staticmethod) else timed)


def _inproc(rank: tuple, args: argparse.Namespace) -> dict:
    """One relay in this process over the rank's first staging file, each stage timed and profiled."""
    import lanekv.transfer.rank.relay as relay_module
    import lanekv.transfer.rank.relay_staged as staged
    from lanekv.transfer.rank.relay import RelayService, serve_relay

    endpoint, fingerprint, pages, area, agreement = rank
    spans = _Spans()
    spans.wrap(staged.StagingSlots, "stage", "stage_rpc")
    spans.wrap(staged, "encode_chunk", "encode_xxh3")
    spans.wrap(staged, "frame_chunk", "frame_copy")
    # The check of the bytes as framed: the range digest's runs (StagingSlots.digest, before
    # chunk seals) or the chunk seal (seal_bytes).
    for owner, name in ((staged.StagingSlots, "digest"), (staged, "seal_bytes")):
        if name in vars(owner):
            spans.wrap(owner, name, f"check_{name}")
    profile = cProfile.Profile()
    produce = relay_module.RelayService._produce

    def profiled(self, *a, **k):
        return profile.runcall(produce, self, *a, **k)

    relay_module.RelayService._produce = profiled
    served = serve_relay(RelayService(0, endpoint, agreement, staging=area))
    try:
        result = _pull([f"127.0.0.1:{served.port}"], fingerprint, pages, args.layers, args.chunk_mib << 20)
    finally:
        served.stop(0.5)
        relay_module.RelayService._produce = produce
        spans.restore()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(12)
    result["stages_ms"] = {k: {"median": 1e3 * statistics.median(v), "count": len(v), "total_s": sum(v)}
                           for k, v in spans.times.items()}
    result["profile"] = out.getvalue()
    return result


def _old_run_digest(run, position: int) -> int:
    """A relay's check before chunk seals (``StagingSlots.digest``, commit fbf360f): ``kv_digest``
    of one (layer, plane) run on numpy, int32 words widened to int64 in two passes."""
    import numpy as np
    from lanekv.kernels.page_digest import DIGEST_WEIGHT

    row = 1024
    words = run.view(np.int32)
    rows = words.size // row
    body, tail = words[:rows * row].reshape(rows, row), words[rows * row:].astype(np.int64)
    columns = body.sum(0, dtype=np.int64)
    firsts = body.sum(1, dtype=np.int64) @ np.arange(0, rows * row, row, dtype=np.int64)
    at = np.arange(rows * row, words.size, dtype=np.int64)
    weighted = int(columns @ np.arange(row, dtype=np.int64)) + int(firsts) + int(tail @ at)
    total = int(columns.sum()) + int(tail.sum())
    even = int(columns[position % 2::2].sum()) + int(tail[position % 2::2].sum())
    return (DIGEST_WEIGHT * (position * total + weighted) + even) & ((1 << 64) - 1)


def stages(args: argparse.Namespace, repeats: int = 30) -> dict[str, float]:
    """The relay's CPU work per chunk on one thread, no rank and no gRPC: ``time.thread_time``
    medians (ms) of each way to frame and check one chunk of ``--chunk-mib`` from a slot."""
    import numpy as np
    import torch
    from lanekv.transfer.protocol.chunkseal import SealSum, seal_bytes
    from lanekv.transfer.protocol.wire import encode_chunk, frame_chunk, split_chunk

    nbytes = args.chunk_mib << 20
    slot = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    rows = nbytes // (2 * args.heads * args.dim * 2)
    part = slot.view(torch.bfloat16).view(1, 2, rows, args.heads, args.dim)
    pages = tuple(range(rows // args.page))
    chunk, data = encode_chunk("r", 0, 0, 0, pages, part)
    header = chunk.encode()

    def before() -> None:  # frame, then the range digest's two runs of the chunk, widened
        message = frame_chunk(header, data)
        runs = np.frombuffer(split_chunk(message)[1], dtype=np.uint8).reshape(2, -1)
        for plane in range(2):
            _old_run_digest(runs[plane], 12345 + plane)

    def after() -> None:  # frame, each block summed as copied
        total = SealSum(nbytes)
        frame_chunk(header, data, each_block=total.add)
        total.value()

    work = {
        "encode_xxh3": lambda: encode_chunk("r", 0, 0, 0, pages, part),
        "frame_copy": lambda: frame_chunk(header, data),
        "range_digest_runs (before)": lambda: [_old_run_digest(r, 1) for r in slot.numpy().reshape(2, -1)],
        "seal_two_passes": lambda: seal_bytes(slot.numpy()),
        "frame + range digest (before)": before,
        "frame + blocked seal (after)": after,
    }
    out = {}
    for name, fn in work.items():
        fn()
        times = []
        for _ in range(repeats):
            start = time.thread_time()
            fn()
            times.append(time.thread_time() - start)
        out[name] = 1e3 * statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--relays", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=64)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank-threads", type=int, default=1, help="torch threads of the rank process")
    parser.add_argument("--profile", action="store_true", help="also one relay in this process, stages timed")
    parser.add_argument("--stages", action="store_true", help="only the relay's CPU work per chunk, one thread")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.stages:
        from lanekv.runtime.hostmem import keep_freed_buffers

        keep_freed_buffers()  # as a relay process does
        table = stages(args)
        print(f"a relay's CPU work per {args.chunk_mib} MiB chunk, one thread (thread CPU time, median of 30):")
        for name, ms in table.items():
            print(f"  {name:>30} {ms:7.2f} ms  {(args.chunk_mib << 20) / ms / 1e6:6.2f} GB/s")
        if args.json is not None:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "stages_ms": table}, indent=1))
        return
    from lanekv.runtime.hostmem import keep_freed_buffers

    from tests.reliability.kv_cluster import make_agreement
    keep_freed_buffers()
    ctx = mp.get_context("spawn")
    rows, profiles = [], {}
    for relays in sorted(set(args.relays)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank, args=(args, relays, child), daemon=True)
        proc.start()
        endpoint, fingerprint, pages, relay_endpoints, _, relay_pids = parent.recv()
        chunk = args.chunk_mib << 20
        try:
            for name, endpoints in ((f"rank_s{relays}", [endpoint] * relays), (f"relay_s{relays}", relay_endpoints)):
                _pull(endpoints, fingerprint, pages, args.layers, chunk)  # warm-up: the rank's seals
                runs = []
                for _ in range(args.repeats):
                    before = {"rank": _cpu_s([proc.pid]), "relays": _cpu_s(relay_pids)}
                    runs.append(_pull(endpoints, fingerprint, pages, args.layers, chunk))
                    for who, was in before.items():
                        spent = _cpu_s([proc.pid] if who == "rank" else relay_pids) - was
                        runs[-1][f"{who}_cpu_s_per_gb"] = spent / (runs[-1]["bytes"] / 1e9)
                rows.append({"row": name, "streams": relays, "runs": runs,
                             "rank_cpu_s_per_gb": statistics.median(r["rank_cpu_s_per_gb"] for r in runs),
                             "relays_cpu_s_per_gb": statistics.median(r["relays_cpu_s_per_gb"] for r in runs),
                             "gbps": statistics.median(r["gbps"] for r in runs),
                             "steady_gbps": statistics.median(r["per_stream_steady_gbps"] for r in runs),
                             "first_chunk_s": statistics.median(r["first_chunk_s"] for r in runs)})
        finally:
            parent.send("stop")
            proc.join(30)
    if args.profile:  # a rank with one staging file and no relay process: the relay runs here
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank, args=(args, 0, child), daemon=True)
        proc.start()
        endpoint, fingerprint, pages, _, areas, _ = parent.recv()
        try:
            agreement = make_agreement(num_layers=args.layers, num_kv_heads=args.heads, head_dim=args.dim,
                                       kv_dtype="bfloat16", page_size=args.page)
            runs = [_inproc((endpoint, fingerprint, pages, areas[0], agreement), args) for _ in range(args.repeats + 1)][1:]
        finally:
            parent.send("stop")
            proc.join(30)
        best = sorted(runs, key=lambda r: r["gbps"])[len(runs) // 2]
        rows.append({"row": "inproc_s1", "streams": 1, "runs": [{k: v for k, v in r.items() if k != "profile"}
                                                                for r in runs],
                     "gbps": best["gbps"], "steady_gbps": best["per_stream_steady_gbps"],
                     "first_chunk_s": best["first_chunk_s"], "stages_ms": best["stages_ms"]})
        profiles["inproc_s1"] = best["profile"]
    gib = args.layers * 2 * args.tokens * args.heads * args.dim * 2 / (1 << 30)
    print(f"staged relays, CPU pool {args.layers} layers x {args.tokens} tokens x {args.heads} x {args.dim} bf16 "
          f"({gib:.2f} GiB), pages of {args.page}, {args.chunk_mib} MiB chunks, {os.cpu_count()} cores; "
          f"median of {args.repeats}")
    print(f"{'row':>10} {'streams':>7} {'GB/s':>7} {'steady/stream':>13} {'first chunk ms':>14} "
          f"{'rank CPU s/GB':>13} {'relays CPU s/GB':>15}")
    for row in rows:
        cpu = "".join(f" {row[k]:>{w}.2f}" if k in row else f" {'-':>{w}}"
                      for k, w in (("rank_cpu_s_per_gb", 13), ("relays_cpu_s_per_gb", 15)))
        print(f"{row['row']:>10} {row['streams']:>7} {row['gbps']:>7.2f} {row['steady_gbps']:>13.2f} "
              f"{1e3 * row['first_chunk_s']:>14.1f}{cpu}")
    for row in rows:
        if "stages_ms" in row:
            print(f"{row['row']} per-chunk stages (ms, median; count; total s):")
            for k, v in sorted(row["stages_ms"].items()):
                print(f"  {k:>20} {v['median']:8.2f} {v['count']:6d} {v['total_s']:8.3f}")
    for name, text in profiles.items():
        print(f"{name} producer thread, cProfile by tottime:")
        print("\n".join(line for line in text.splitlines()[:40] if line.strip()))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                         "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
