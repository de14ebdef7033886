"""FetchKV throughput (GB/s) on loopback, against a raw gRPC stream of the same bytes.

    python bench/transfer.py [--tokens 32768] [--servers 1,2] [--streams 1,2,4] [--chunk-mib 8] [--json out.json]

One request of an 8B-shaped KV layout (32 layers, 8 kv heads, head_dim 128,
bf16, page 64: 128 KiB per token, 4 GiB at 32k tokens) is held by 1 or N
``TensorPageSource`` servers, each in its own process and owning the pages
``P mod N`` (owner-lane). The client process fetches from all owners at once:

- ``raw``: a trivial gRPC servicer streaming preallocated bytes in chunks of
  the same size (no protobuf, no header, no checksum, nothing placed): the
  transport's ceiling in this run;
- ``fetch``: ``fetch_kv`` with a ``place`` that drops each verified chunk;
- ``fetch+place``: ``fetch_kv`` placing every chunk by logical page into a
  destination tensor with the decode daemon's ``place_chunk`` (then every page is checked).

Each mode runs with every count of ``--streams`` per server: raw streams each
on a channel (a connection) of its own, each carrying a share of the bytes;
FetchKV with ``streams_per_rank`` (``transfer.grpcfetch.layerwise``: each
stream a run of the rank's pages, every layer), received in threads of this
process. On loopback the streams share the cores with the servers.

GB/s is payload bytes over wall time; per rank it is that rank's bytes over the
time to its last chunk. Best of ``--repeats``. The processes share the
machine's cores, so on a small CPU box servers and client compete.

glibc hands freed multi-MiB chunk buffers back to the kernel, so every chunk
page-faults fresh memory on both sides (about one fault per 4 KiB moved). Run
with ``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296``
(inherited by the server processes) to see the transfer without that cost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lanekv.transfer.connector.placement import place_chunk  # noqa: E402
from lanekv.transfer.grpcfetch.client import KVClient  # noqa: E402
from lanekv.transfer.protocol.agreement import POOL_LAYOUT, Agreement  # noqa: E402
from lanekv.transfer.protocol.contract import Topology  # noqa: E402
from lanekv.transfer.protocol.wire import WIRE_VERSION  # noqa: E402
from lanekv.transfer.rank.server import serve  # noqa: E402
from lanekv.transfer.rank.sources import TensorPageSource  # noqa: E402

from bench.raw_grpc import gbps, raw_server, run_raw, start, stop  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 64
REQUEST = "bench"


def agreement() -> Agreement:
    return Agreement(
        architecture="LlamaForCausalLM", model_config={"hidden_size": 4096}, rope={"theta": 500000.0},
        num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, weights_digest="bench",
        kv_dtype="bfloat16", page_size=PAGE_SIZE, pool_layout=POOL_LAYOUT,
        wire_version=WIRE_VERSION, source_digest="bench",
    )  # fmt: skip


def page_value(page: int, layer: int) -> int:
    """The int16 pattern every row of (page, layer) holds, so the client can check placement."""
    return (page * 131 + layer * 7) % 32749


def _kv_server(rank: int, cp_size: int, num_pages: int, conn) -> None:
    owned = [p for p in range(num_pages) if p % cp_size == rank]
    pool = torch.empty(
        (LAYERS, 2, len(owned) * PAGE_SIZE, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16
    )
    bits = pool.view(torch.int16)
    for physical, page in enumerate(owned):
        for layer in range(LAYERS):
            bits[layer, :, physical * PAGE_SIZE : (physical + 1) * PAGE_SIZE] = page_value(
                page, layer
            )
    source = TensorPageSource(agreement(), rank, pool)
    source.add(REQUEST, [(page, physical) for physical, page in enumerate(owned)])
    served = serve(source)
    conn.send(served.port)
    source.set_topology(conn.recv())
    conn.send("ready")
    conn.recv()  # stop
    served.server.stop(None)


def run_fetch(endpoints: dict[int, str], dest: torch.Tensor | None, chunk_bytes: int, num_pages: int,
              streams: int = 1) -> dict:
    """FetchKV of the request from every server, ``streams`` per server (each a run of its pages)."""
    def place(header, tensor) -> None:
        if dest is not None:  # as the decode daemon places a chunk (one copy per run of pages on a host pool)
            place_chunk(dest, list(header.pages), tensor, PAGE_SIZE, header.layer_start, header.layer_end)

    with KVClient() as client:
        fingerprint = client.handshake(endpoints[0], agreement(), timeout=30).fingerprint
        pages = {r: [p for p in range(num_pages) if p % len(endpoints) == r] for r in endpoints}
        stats = client.fetch(
            endpoints, REQUEST, fingerprint, place, max_chunk_bytes=chunk_bytes,
            max_inflight_bytes=4 * chunk_bytes * streams, timeout=600, pages=pages, streams_per_rank=streams,
        )  # fmt: skip
    return dict(
        bytes=stats.bytes, seconds=stats.seconds,
        per_rank={r: dict(bytes=s.bytes, seconds=s.seconds, gbps=gbps(s.bytes, s.seconds)) for r, s in sorted(stats.per_rank.items())},
    )  # fmt: skip


def check_placed(dest: torch.Tensor, num_pages: int) -> None:
    bits = dest.view(torch.int16)
    for page in range(num_pages):
        for layer in range(LAYERS):
            block = bits[layer, :, page * PAGE_SIZE : (page + 1) * PAGE_SIZE]
            if not torch.all(block == page_value(page, layer)):
                raise RuntimeError(f"page {page} layer {layer} was not placed correctly")


def best(runs: list[dict]) -> dict:
    out = min(runs, key=lambda r: r["seconds"])
    return {
        **out,
        "gbps": gbps(out["bytes"], out["seconds"]),
        "runs_s": [r["seconds"] for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--servers", default="1,2", help="comma-separated owner-rank counts")
    parser.add_argument("--streams", default="1", help="comma-separated stream counts per server")
    parser.add_argument("--chunk-mib", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    num_pages = -(-args.tokens // PAGE_SIZE)
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    total = LAYERS * 2 * num_pages * PAGE_SIZE * KV_HEADS * HEAD_DIM * 2
    print(
        f"{args.tokens} tokens, {num_pages} pages, {total / 2**30:.2f} GiB, chunks of {chunk_bytes / 2**20:g} MiB"
    )
    stream_counts = [int(s) for s in args.streams.split(",")]
    results = []
    for cp_size in (int(s) for s in args.servers.split(",")):
        procs, conns, ports = start(raw_server, [() for _ in range(cp_size)])
        for streams in stream_counts:
            runs = [run_raw(ports, total, chunk_bytes, streams) for _ in range(args.repeats)]
            results.append(dict(mode="raw", servers=cp_size, streams=streams, **best(runs)))
        stop(procs, conns)
        procs, conns, ports = start(_kv_server, [(r, cp_size, num_pages) for r in range(cp_size)])
        endpoints = {r: f"127.0.0.1:{p}" for r, p in enumerate(ports)}
        topology = Topology(cp_size, "in_seq", "page_mod_cp", tuple(endpoints.values()))
        for conn in conns:
            conn.send(topology)
        for conn in conns:
            conn.recv()
        for streams in stream_counts:
            runs = [run_fetch(endpoints, None, chunk_bytes, num_pages, streams) for _ in range(args.repeats)]
            results.append(dict(mode="fetch", servers=cp_size, streams=streams, **best(runs)))
        dest = torch.zeros(
            (LAYERS, 2, num_pages * PAGE_SIZE, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16
        )
        for streams in stream_counts:
            dest.zero_()
            runs = [run_fetch(endpoints, dest, chunk_bytes, num_pages, streams) for _ in range(args.repeats)]
            check_placed(dest, num_pages)
            results.append(dict(mode="fetch+place", servers=cp_size, streams=streams, **best(runs)))
        del dest
        stop(procs, conns)
    print(f"{'mode':<12} {'servers':>7} {'streams':>7} {'GiB':>6} {'seconds':>8} {'GB/s':>6}  per rank GB/s")
    for r in results:
        ranks = " ".join(f"{k}:{v['gbps']:.2f}" for k, v in r["per_rank"].items())
        print(
            f"{r['mode']:<12} {r['servers']:>7} {r['streams']:>7} {r['bytes'] / 2**30:>6.2f} {r['seconds']:>8.2f} "
            f"{r['gbps']:>6.2f}  {ranks}"
        )
    if args.json:
        config = dict(tokens=args.tokens, layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                      page_size=PAGE_SIZE, dtype="bfloat16", chunk_bytes=chunk_bytes, repeats=args.repeats,
                      streams=stream_counts)  # fmt: skip
        machine = dict(
            machine=platform.machine(),
            cpus=os.cpu_count(),
            torch=torch.__version__,
            grpc=grpc.__version__,
        )
        args.json.write_text(
            json.dumps(dict(config=config, host=machine, results=results), indent=2)
        )


if __name__ == "__main__":
    main()
