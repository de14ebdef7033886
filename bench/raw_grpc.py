"""Raw gRPC streams, the transport's ceiling beside FetchKV (bench/transfer.py, bench/ttft.py).

A trivial servicer streams preallocated bytes in chunks (no protobuf, no header, no
checksum, nothing placed); clients drain them in threads of this process or in processes
of their own. The server and drainer processes import gRPC alone: this module is their
spawned target's, and it imports no torch, so each starts in a fraction of a second
rather than after the several seconds torch's import takes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import threading
import time
from concurrent import futures

import grpc
from lanekv.runtime.status import grpc_options

RAW_METHOD = "/lanekv.bench.Raw/Stream"


def raw_server(conn) -> None:
    def stream(request: bytes, context):
        count, size = struct.unpack("<QQ", request)
        block = os.urandom(size)
        for _ in range(count):
            yield block

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=grpc_options())
    handler = grpc.method_handlers_generic_handler(
        "lanekv.bench.Raw", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(port)
    conn.recv()
    server.stop(None)


def start(target, args_list) -> tuple[list, list, list]:
    """Processes running ``target(*args, conn)``, and the first message of each (a port, say)."""
    ctx = mp.get_context("spawn")
    procs, conns, ports = [], [], []
    for args in args_list:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(*args, child), daemon=True)
        proc.start()
        procs.append(proc)
        conns.append(parent)
    for conn in conns:
        if not conn.poll(300):
            raise TimeoutError("a bench server did not start within 300 s")
        ports.append(conn.recv())
    return procs, conns, ports


def stop(procs, conns) -> None:
    for conn in conns:
        conn.send("stop")
    for proc in procs:
        proc.join(30)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def run_raw(ports: list[int], total_bytes: int, chunk_bytes: int, streams_per_server: int = 1) -> dict:
    """Raw streams of ``total_bytes`` from every server at once, ``streams_per_server`` each
    (each on a connection of its own), received in threads of this process."""
    share = total_bytes // len(ports) // streams_per_server
    count = -(-share // chunk_bytes)
    per_rank: dict[int, tuple[int, float]] = {}
    lock = threading.Lock()
    # A channel per stream, each with its own connection (gRPC shares one among channels otherwise).
    channels = [grpc.insecure_channel(f"127.0.0.1:{p}", options=[*grpc_options(), ("grpc.use_local_subchannel_pool", 1)])
                for p in ports for _ in range(streams_per_server)]
    streams = [ch.unary_stream(RAW_METHOD) for ch in channels]
    t0 = time.perf_counter()

    def drain(i: int) -> None:
        got = sum(len(m) for m in streams[i](struct.pack("<QQ", count, chunk_bytes), timeout=600))
        rank = i // streams_per_server
        with lock:
            before = per_rank.get(rank, (0, 0.0))[0]
            per_rank[rank] = (before + got, time.perf_counter() - t0)

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(streams))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - t0
    for ch in channels:
        ch.close()
    return dict(
        bytes=sum(b for b, _ in per_rank.values()), seconds=seconds,
        per_rank={r: dict(bytes=b, seconds=s, gbps=gbps(b, s)) for r, (b, s) in sorted(per_rank.items())},
    )  # fmt: skip


def raw_drainer(port: int, conn) -> None:
    """One raw stream's receiver in a process of its own: drains a stream at each "go"."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_options())
    stream = channel.unary_stream(RAW_METHOD)
    conn.send("ready")
    while (asked := conn.recv()) != "stop":
        t0 = time.perf_counter()
        got = sum(len(m) for m in stream(struct.pack("<QQ", *asked), timeout=600))
        conn.send((got, time.perf_counter() - t0))
    channel.close()


def run_raw_processes(ports: list[int], total_bytes: int, chunk_bytes: int, tries: int) -> dict:
    """As ``run_raw``, each stream received in a process of its own (one GIL each); best of ``tries``."""
    count = -(-(total_bytes // len(ports)) // chunk_bytes)
    procs, conns, _ = start(raw_drainer, [(p,) for p in ports])
    try:
        best = None
        for _ in range(tries):
            t0 = time.perf_counter()
            for conn in conns:
                conn.send((count, chunk_bytes))
            got = [conn.recv() for conn in conns]
            seconds = time.perf_counter() - t0
            if best is None or seconds < best["seconds"]:
                best = dict(bytes=sum(b for b, _ in got), seconds=seconds,
                            per_rank={r: dict(bytes=b, seconds=s, gbps=gbps(b, s)) for r, (b, s) in enumerate(got)})
        return best
    finally:
        stop(procs, conns)
