"""CPU seconds per GiB of each stage of a FetchKV chunk, sender and receiver, on CPU pools.

    python bench/fetch_cpu.py [--tokens 4096] [--chunk-mib 8] [--repeats 3] [--e2e] [--json out.json]

A many-stream fetch is limited by what each side does per byte while it holds
the GIL (or another lock): that work cannot spread over streams in threads of
one process. So this measures the work per byte of one stream, stage by stage,
in this process (the 8B layout of ``bench/transfer.py``, one request in a CPU
pool, 8 MiB chunks), with ``time.thread_time``:

- sender: ``read`` (the page source's gather), ``encode`` (the header and the
  XXH3-64 checksum, ``wire.encode_chunk``), ``frame`` (the KVChunk message,
  ``wire.frame_chunk``: the payload's one copy into it);
- receiver: ``split`` (``wire.split_chunk`` and ``ChunkHeader.decode``),
  ``verify`` (the checksum again), ``view`` (``wire.payload_to_tensor``: no
  copy), ``place`` (``connector.placement.place_chunk`` into a CPU pool).

Which of them hold the GIL: the primitives the stages are made of, each over
one 64 MiB buffer, with ``free``: how far a pure-Python spinner thread got
while it ran, against how far it gets in a ``time.sleep`` of the same length
(near 1: it drops the GIL; near 0: it holds it throughout). A stage of one
8 MiB chunk is too short for that measure (the spinner's wake-ups dominate),
so the stages are timed without the spinner. On a loaded 2-core machine the
spinner also loses the CPU now and then (memory-bound copies read about 0.5):
read it as "held" / "free", not to two digits.

The process tunes glibc malloc as the daemons do (``runtime.hostmem``), so a
chunk buffer reuses freed pages instead of faulting in new ones.

``--e2e`` adds one stream over loopback, raw gRPC against FetchKV (server in a
process of its own, ``bench/transfer.py``'s): CPU seconds per GiB of each
process (``getrusage``), which include gRPC's own copies of every message.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import resource
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lanekv.runtime.hostmem import keep_freed_buffers  # noqa: E402
from lanekv.transfer.connector.placement import place_chunk  # noqa: E402
from lanekv.transfer.protocol.wire import (  # noqa: E402
    ChunkHeader,
    checksum,
    encode_chunk,
    frame_chunk,
    payload_to_tensor,
    plan_chunks,
    split_chunk,
)
from lanekv.transfer.rank.sources import TensorPageSource  # noqa: E402

from bench.transfer import HEAD_DIM, KV_HEADS, LAYERS, PAGE_SIZE, agreement  # noqa: E402

SENDER = ("read", "encode", "frame")
RECEIVER = ("split", "verify", "view", "place")
GIB = float(1 << 30)


class Stages:
    """CPU seconds (``time.thread_time``) and wall seconds per stage: ``with stages("read"): ...``."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.thread_time()
        yield
        self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - cpu
        self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - wall


def run_stages(tokens: int, chunk_bytes: int, repeats: int) -> dict:
    """Every chunk of one request through the sender's and the receiver's stages, ``repeats`` times."""
    num_pages = -(-tokens // PAGE_SIZE)
    shape = (LAYERS, 2, num_pages * PAGE_SIZE, KV_HEADS, HEAD_DIM)
    pool = torch.randn(shape).to(torch.bfloat16)
    dest = torch.zeros_like(pool)
    source = TensorPageSource(agreement(), 0, pool)
    pages = list(range(num_pages))
    plans = plan_chunks(LAYERS, pages, 2 * PAGE_SIZE * KV_HEADS * HEAD_DIM * 2, chunk_bytes)
    moved, st = 0, Stages()
    for _ in range(repeats):
        for seq, plan in enumerate(plans):
            with st("read"):
                payload = source.read(list(plan.pages), plan.layer_start, plan.layer_end)
            with st("encode"):
                header, data = encode_chunk("bench", 0, seq, plan.layer_start, plan.pages, payload)
            with st("frame"):
                message = frame_chunk(header.encode(), data)
            del payload, data
            with st("split"):
                header_bytes, data = split_chunk(message)
                header = ChunkHeader.decode(header_bytes)
            with st("verify"):
                ok = checksum(data) == header.checksum
            if not ok:
                raise RuntimeError(f"chunk {seq} failed its checksum")
            with st("view"):
                tensor = payload_to_tensor(header, data)
            with st("place"):
                place_chunk(dest, list(header.pages), tensor, PAGE_SIZE, header.layer_start, header.layer_end)
            moved += header.nbytes
            del message, data, tensor
    if not torch.equal(dest, pool):
        raise RuntimeError("placed pool differs from the source pool")
    stages = {}
    for name in (*SENDER, *RECEIVER):
        stages[name] = dict(side="sender" if name in SENDER else "receiver",
                            cpu_s_per_gib=st.cpu[name] / moved * GIB, ns_per_byte=st.cpu[name] / moved * 1e9,
                            wall_s_per_gib=st.wall[name] / moved * GIB,
                            us_per_chunk=st.cpu[name] / (len(plans) * repeats) * 1e6)
    return dict(bytes=moved, chunks=len(plans) * repeats, stages=stages)


def primitives(nbytes: int = 64 << 20) -> dict[str, dict]:
    """CPU ns per byte of the primitives the stages use, and how free they leave the GIL."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    message = bytes(src.numpy())
    dst = torch.empty(nbytes, dtype=torch.uint8)
    rows = src.view(1024, -1)
    order = torch.arange(1023, -1, -1)
    cases = {
        "xxh3_64_intdigest (wire.checksum)": lambda: checksum(memoryview(message)),
        "ctypes.memmove": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes),
        "torch copy_": lambda: dst.copy_(src),
        "torch index_select (1024 blocks)": lambda: rows.index_select(0, order),
        "bytes(memoryview)": lambda: bytes(memoryview(message)),
        "b''.join": lambda: b"".join((b"x", memoryview(message))),
        "torch.frombuffer (a view)": lambda: torch.frombuffer(message, dtype=torch.uint8),
    }
    count, done = [0], threading.Event()

    def spin() -> None:
        while not done.is_set():
            count[0] += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    out = {}
    try:
        for name, fn in cases.items():
            fn()
            best, cpu_best = 0.0, float("inf")
            for _ in range(3):
                before, wall, cpu = count[0], time.perf_counter(), time.thread_time()
                fn()
                cpu, wall, during = time.thread_time() - cpu, time.perf_counter() - wall, count[0] - before
                before = count[0]
                time.sleep(wall)
                idle = count[0] - before
                best, cpu_best = max(best, during / max(idle, 1)), min(cpu_best, cpu)
            out[name] = dict(ns_per_byte=cpu_best / nbytes * 1e9, free=min(best, 1.0))
    finally:
        done.set()
        thread.join()
    return out


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_server(kind: str, num_pages: int, conn) -> None:
    """``bench/transfer.py``'s raw or FetchKV server, answering "cpu" with its CPU seconds so far."""
    from bench.raw_grpc import raw_server
    from bench.transfer import _kv_server

    class Relay:  # the transfer server's pipe, with "cpu" answered here
        def send(self, value: object) -> None:
            conn.send(value)

        def recv(self) -> object:
            while (asked := conn.recv()) == "cpu":
                conn.send(_cpu())
            return asked

    keep_freed_buffers()  # as a rank process does
    torch.set_num_threads(1)
    if kind == "raw":
        raw_server(Relay())
    else:
        _kv_server(0, 1, num_pages, Relay())


def run_e2e(tokens: int, chunk_bytes: int, repeats: int) -> list[dict]:
    """One stream over loopback, raw and FetchKV: GB/s and each process's CPU seconds per GiB."""
    from lanekv.transfer.protocol.contract import Topology

    from bench.transfer import run_fetch, run_raw, start, stop

    num_pages = -(-tokens // PAGE_SIZE)
    total = LAYERS * 2 * num_pages * PAGE_SIZE * KV_HEADS * HEAD_DIM * 2
    rows = []
    for kind in ("raw", "fetch", "fetch+place"):
        procs, conns, ports = start(_cpu_server, [("raw" if kind == "raw" else "kv", num_pages)])
        try:
            endpoints = {0: f"127.0.0.1:{ports[0]}"}
            dest = torch.zeros((LAYERS, 2, num_pages * PAGE_SIZE, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16) \
                if kind == "fetch+place" else None
            if kind != "raw":
                conns[0].send(Topology(1, "in_seq", "page_mod_cp", (endpoints[0],)))
                conns[0].recv()

            def once(kind: str = kind, ports: list = ports, endpoints: dict = endpoints, dest=dest) -> int:
                if kind == "raw":
                    return run_raw(ports, total, chunk_bytes, 1)["bytes"]
                return run_fetch(endpoints, dest, chunk_bytes, num_pages, 1)["bytes"]

            once()  # warm: channels, the server's first chunks
            conns[0].send("cpu")
            server0, client0, wall0 = conns[0].recv(), _cpu(), time.perf_counter()
            moved = sum(once() for _ in range(repeats))
            wall, client = time.perf_counter() - wall0, _cpu() - client0
            conns[0].send("cpu")
            server = conns[0].recv() - server0
        finally:
            stop(procs, conns)
        rows.append(dict(mode=kind, gbps=moved / wall / 1e9, server_cpu_s_per_gib=server / moved * GIB,
                         client_cpu_s_per_gib=client / moved * GIB))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk-mib", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--e2e", action="store_true", help="also one stream over loopback, raw against FetchKV")
    parser.add_argument("--no-primitives", dest="primitives", action="store_false",
                        help="skip the GIL table of the primitives")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in a rank and the decode daemon (one thread per stream's work)
    keep_freed_buffers()
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    runs = [run_stages(args.tokens, chunk_bytes, 1) for _ in range(args.repeats)]
    stages = {name: {key: statistics.median(r["stages"][name][key] for r in runs) if key != "side"
                     else runs[0]["stages"][name][key] for key in runs[0]["stages"][name]}
              for name in runs[0]["stages"]}
    print(f"{args.tokens} tokens, {runs[0]['bytes'] / GIB:.2f} GiB in {runs[0]['chunks']} chunks of "
          f"{args.chunk_mib:g} MiB; median of {args.repeats}")
    print(f"{'side':<9} {'stage':<7} {'CPU s/GiB':>9} {'ns/B':>6} {'wall s/GiB':>10} {'us/chunk':>8}")
    for side in ("sender", "receiver"):
        rows = [(name, s) for name, s in stages.items() if s["side"] == side]
        for name, s in rows:
            print(f"{side:<9} {name:<7} {s['cpu_s_per_gib']:>9.3f} {s['ns_per_byte']:>6.3f} "
                  f"{s['wall_s_per_gib']:>10.3f} {s['us_per_chunk']:>8.0f}")
        total = sum(s["cpu_s_per_gib"] for _, s in rows)
        chunk_us = sum(s["us_per_chunk"] for _, s in rows)
        print(f"{side:<9} {'total':<7} {total:>9.3f} {total / GIB * 1e9:>6.3f} {'':>10} {chunk_us:>8.0f}")
    prims = primitives() if args.primitives else {}
    if prims:
        print(f"\n{'primitive (64 MiB)':<34} {'ns/B':>6} {'free':>5}")
    for name, p in prims.items():
        print(f"{name:<34} {p['ns_per_byte']:>6.3f} {p['free']:>5.2f}")
    e2e = run_e2e(args.tokens, chunk_bytes, args.repeats) if args.e2e else []
    if e2e:
        print("\none stream over loopback (CPU seconds per GiB of each process, gRPC's copies included):")
        print(f"{'mode':<12} {'GB/s':>6} {'server CPU s/GiB':>17} {'client CPU s/GiB':>17}")
        for row in e2e:
            print(f"{row['mode']:<12} {row['gbps']:>6.2f} {row['server_cpu_s_per_gib']:>17.3f} "
                  f"{row['client_cpu_s_per_gib']:>17.3f}")
    if args.json:
        config = dict(tokens=args.tokens, layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE_SIZE,
                      dtype="bfloat16", chunk_bytes=chunk_bytes, repeats=args.repeats)
        host = dict(machine=platform.machine(), cpus=os.cpu_count(), torch=torch.__version__,
                    load=os.getloadavg()[0])
        args.json.write_text(json.dumps(dict(config=config, host=host, stages=stages, primitives=prims, e2e=e2e), indent=2))


if __name__ == "__main__":
    main()
