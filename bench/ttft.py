"""Time to first token: colocated prefill vs disaggregated over gRPC, NIXL and the same-host fast path.

GPU (prefill cp=2 on GPUs 0 and 1, both decode daemons on GPU 0; Llama-3-8B shapes, dummy bf16):
    python bench/ttft.py --llama3-8b --cp 2 --tokens 8192 32768 65536 --json out.json
One H200, cp=1, the cross-host paths beside colocated and the fast path (fewer decode
daemons: each holds the model's 16 GB):
    python bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --paths grpc fast nixl nixl_tcp \
        --fetch-streams 1 2 4 --json out.json
The same, gRPC to the ranks beside gRPC through 4 sender relays per rank (grpc_relay_s<n>):
    python bench/ttft.py --llama3-8b --cp 1 --tokens 8192 32768 --transfer-tokens 8192 --paths grpc fast \
        --fetch-streams 1 2 4 --fetch-relays 4 --json out.json
CPU (the tiny model; also the smoke test, tests/test_bench_ttft.py):
    python bench/ttft.py --tiny --cp 2 --tokens 256 1024

Every path computes the whole prompt: the prefix caches are off on every
daemon here (the same prompt goes to each path in turn, and a cache would
turn all but the first into a hit; bench/prefix_cache.py measures those).

One prefill daemon and four decode daemons against it, one reading every rank
over gRPC (``transport="grpc"``), three taking the fast path (``"auto"``: CUDA
IPC between processes of one host, /dev/shm pools on the CPU). Per prompt
length, median of ``--repeat`` after one warm-up, with the min and max:

- (a) colocated: the prefill daemon's own Prefill call, first token out (the
  KV stays where it was written: what a colocated server pays);
- (b) grpc_s<n>: layer-wise FetchKV under the prefill with ``n`` streams per
  owner rank (``--fetch-streams``; one decode daemon, its streams set per row);
  with ``--fetch-relays N`` also grpc_relay_s<n>, the same streams sent by each
  rank's N sender relays (``transfer.rank.relay``) instead of the rank process,
  (c) fast (the daemons' default: the decode daemon calls the ranks
  once the prefill has answered and copies every layer at once), (d) "fast,
  streamed" (it calls the ranks at once, each sends a descriptor pair per layer
  during the prefill, and copies at the end), (e) "fast, per layer" (it copies
  each layer as its descriptor comes, during the prefill): Generate on a decode
  daemon with max_new_tokens=1, prompt sent to the first token received; the
  decode daemon answers once the whole KV is in its pool, so this is the
  prefill plus what of the transfer did not overlap it (layer-wise streaming).
  Beside each: the prefill call as the decode daemon timed it, the slowest
  rank's own prefill time in it, and the transfer.

Then the transfer alone, of one request already prefilled, at each of ``--transfer-tokens``:
the fast path (as the decode daemon runs it once the prefill has answered:
each rank's copies start from where the owner-lane rule puts its pages,
before its announcement; and, "announced", waiting for it) and FetchKV
(placing into a pool on GPU 0), each beside its
ceiling measured in the same run: raw gRPC streams of the same bytes from
as many server processes as owner ranks (``bench/transfer.py``'s; and with
each ``--fetch-streams`` count of streams per server beside FetchKV with as
many streams per rank), received
in threads of one process ("raw, 1 proc") and each in a process of its own
("raw, proc/stream": the layout of the decode daemon's receiver processes),
and the copies the fast path makes with nothing else in the way (rank 0's
share GPU 0 -> GPU 0 and rank 1's GPU 1 -> GPU 0 at once; on the CPU a copy
out of a /dev/shm file). FetchKV is measured through the decode daemon's
receiver processes and again with every stream in a thread of this process.
With lanekv[nixl] installed, the NIXL paths too: ``nixl`` (the decode pool
registered where it is: GPU memory on a GPU, UCX's own transports) and
``nixl_tcp`` (UCX over TCP only), in the TTFT table and alone, each beside a
raw NIXL read of the same bytes with the same UCX transports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
import uuid
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
from lanekv.runtime.status import DEFAULT_CHUNK_BYTES, grpc_options  # noqa: E402
from lanekv.transfer.connector.placement import place_chunk  # noqa: E402
from lanekv.transfer.fastpath.copyorder import CopyOrder  # noqa: E402
from lanekv.transfer.fastpath.rankfetch import FastRequest, RankPages  # noqa: E402
from lanekv.transfer.grpcfetch.client import KVClient  # noqa: E402
from lanekv.transfer.grpcfetch.layerwise import check_streams  # noqa: E402
from lanekv.transfer.nixl.agent import available as nixl_available  # noqa: E402
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY, access_ticket  # noqa: E402
from lanekv.transfer.protocol.descriptors import SHM_DIR, remove_shared_pool, shared_cpu_pool  # noqa: E402
from lanekv.transfer.protocol.manifest import Manifest  # noqa: E402
from lanekv.transfer.rank.relay import check_relays  # noqa: E402

from bench.nixl_transfer import nixl_alone, raw_nixl_gbps, ucx_tls  # noqa: E402
from bench.prefill import LLAMA3_8B, TINY, add_model_args  # noqa: E402
from bench.raw_grpc import raw_server, run_raw, run_raw_processes, start, stop  # noqa: E402


def prompt(vocab: int, tokens: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (tokens,), generator=g).tolist()


def colocated(prefill: PrefillDaemon, stub, ids: list[int]) -> tuple[float, dict[str, float]]:
    """Seconds of one Prefill call, and its timings (the slowest rank's own prefill, until
    its host had queued it, its garbage collections); its pages are released at once."""
    t0 = time.perf_counter()
    reply, call = stub.Prefill.with_call(lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=ids)),
                                         timeout=900)
    seconds = time.perf_counter() - t0
    release(prefill, reply, call)
    return seconds, dict(reply.timings)


def release(prefill: PrefillDaemon, reply, call) -> None:
    epoch = access_ticket(dict(call.trailing_metadata() or ()).get(EPOCH_METADATA_KEY), reply.capability)
    with KVClient() as kv:
        kv.release(dict(enumerate(reply.endpoints)), reply.request_id, reply.contract_fingerprint, epoch=epoch)


def generate(stub, ids: list[int]) -> tuple[float, dict]:
    """Seconds to the first token of a Generate call, and its trailing metadata."""
    req = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=1)
    t0 = time.perf_counter()
    call = stub.Generate(req, timeout=900)
    first = None
    for _ in call:
        first = first or time.perf_counter() - t0
    return first, dict(call.trailing_metadata() or ())


# The decode daemons of the TTFT table: (name, transport), and what each does differently.
PATHS = (("grpc", "grpc"), ("fast", "auto"), ("fast_streamed", "auto"), ("fast_layer", "auto"))
# The decode daemons every run needs (the transfer alone measures both).
REQUIRED_PATHS = ("grpc", "fast")
# With lanekv[nixl] installed (``--nixl``): NIXL with the decode pool registered where it is
# (GPU memory on a GPU; UCX picks its transports), and NIXL over UCX TCP only.
NIXL_PATHS = (("nixl", "nixl"), ("nixl_tcp", "nixl"))
# UCX transports of each NIXL path's agents (None: UCX's own choice).
NIXL_TLS = {"nixl": None, "nixl_tcp": "tcp,cuda_copy,self" if torch.cuda.is_available() else "tcp,self"}


def row_names(paths, fetch_streams, relays: int = 0) -> list[str]:
    """The TTFT table's rows after colocated: the gRPC daemon once per stream count, and with
    ``relays`` (the prefill's sender relays per rank) once more per count through them."""
    names = []
    for name, _ in paths:
        if name == "grpc":
            names += [f"grpc_s{n}" for n in fetch_streams]
            names += [f"grpc_relay_s{n}" for n in fetch_streams] if relays else []
        else:
            names.append(name)
    return names


def ttft(prefill, stubs: dict, vocab: int, tokens: int, repeat: int, paths=PATHS, grpc_transport=None,
         fetch_streams=(1,), relays: int = 0) -> dict:
    """Medians over ``repeat`` prompts of ``tokens`` (after one warm-up) of each path's TTFT,
    prefill call, transfer and ranks' own compute seconds, with each TTFT's min and max.
    ``grpc_transport``: the gRPC daemon's transport, set to each of ``fetch_streams`` in turn,
    to the ranks themselves (grpc_s<n>) and, with ``relays``, through them (grpc_relay_s<n>)."""
    rows = []
    names = row_names(paths, fetch_streams, relays)
    for i in range(repeat + 1):  # the first is a warm-up
        ids = prompt(vocab, tokens, tokens * 100 + i)
        seconds, timings = colocated(prefill, stubs["prefill"], ids)
        row = dict(colocated_s=seconds, **{f"colocated_{k}": timings[k] for k in ("compute_s", "queued_s", "gc_s")})
        for name in names:
            stub = stubs["grpc" if name.startswith("grpc_") else name]
            if name.startswith("grpc_"):
                grpc_transport.streams_per_rank = int(name.rpartition("_s")[2])
                grpc_transport.use_relays = name.startswith("grpc_relay_s")
            seconds, meta = generate(stub, ids)
            row[f"{name}_s"] = seconds
            for key, field in (("transfer", "transfer_s"), ("prefill", "prefill_s"), ("prefill-compute", "compute_s")):
                row[f"{name}_{field}"] = float(meta.get(f"lanekv-{key}-seconds", "nan"))
            row["bytes"] = int(meta.get("lanekv-transfer-bytes", "0"))
        rows.append(row)
    out = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[0]}
    out["tokens"] = tokens
    # Each colocated prefill: where its time went (the spread between identical requests).
    out["colocated_samples_ms"] = [
        {part: r[key] * 1e3 for part, key in (("call", "colocated_s"), ("compute", "colocated_compute_s"),
                                              ("queued", "colocated_queued_s"), ("gc", "colocated_gc_s"))}
        for r in rows[1:]]
    for name in ("colocated", *names):
        out[f"{name}_min_s"] = min(r[f"{name}_s"] for r in rows[1:])
        out[f"{name}_max_s"] = max(r[f"{name}_s"] for r in rows[1:])
        if name != "colocated":
            out[f"{name}_over_colocated"] = out[f"{name}_s"] / out["colocated_s"]
    return out


def transfer_alone(prefill: PrefillDaemon, fast: DecodeDaemon, grpc_decode: DecodeDaemon, vocab: int,
                   tokens: int, repeat: int, fetch_streams=(1,)) -> dict:
    """The fast path and FetchKV of one prefilled request, nothing overlapping them; FetchKV
    and raw gRPC also with each of ``fetch_streams`` streams per rank (threads of this process)."""
    stub = lanekv_pb2_grpc.PrefillServiceStub(grpc.insecure_channel(prefill.endpoint, options=grpc_options()))
    reply, call = stub.Prefill.with_call(lanekv_pb2.PrefillRequest(
        token_ids=lanekv_pb2.TokenIds(ids=prompt(vocab, tokens, 7)), request_id=f"alone-{uuid.uuid4().hex[:8]}"),
        timeout=900)
    epoch = access_ticket(dict(call.trailing_metadata() or ()).get(EPOCH_METADATA_KEY), reply.capability)
    manifest = Manifest.decode(reply.manifest)
    endpoints = list(reply.endpoints)
    owners = sorted({p.owner for p in manifest.pages})
    pages = {r: manifest.pages_of_owner(r) for r in owners}
    slot = {p.page: i for i, p in enumerate(manifest.pages)}
    pool = fast.pool.tensor
    dst = torch.empty((pool.shape[0], 2, len(manifest.pages) * manifest.page_size, *pool.shape[3:]),
                      dtype=pool.dtype, device=pool.device)
    nbytes = dst.numel() * dst.element_size()
    sync = torch.cuda.synchronize if dst.is_cuda else (lambda: None)

    physical_of = fast.prefill_contract.topology.physical_of

    def fast_once(early: bool = True) -> float:
        """Both ranks' fast path; ``early``: copies start before the ranks' announcements,
        as the decode daemon does once the prefill has answered."""
        shared = {r: fast.fastpath.pool(endpoints[r], epoch, 30.0) for r in owners}
        if any(v is None for v in shared.values()):
            raise RuntimeError(f"the fast path does not reach every rank: {shared}")
        errors = []
        order = CopyOrder.for_pools(shared, dst.device)

        def one(rank: int) -> None:
            try:
                request = FastRequest(reply.request_id, reply.contract_fingerprint, dst,
                                      lambda ps: [slot[p] for p in ps], lambda *a: None, epoch, time.monotonic() + 600)
                part = RankPages(rank, endpoints[rank], shared[rank], tuple(pages[rank]),
                                 tuple(physical_of(p) for p in pages[rank]) if early else None)
                phases[rank] = fast.fastpath.fetch(request, part, order=order)._asdict()
            except Exception as err:  # noqa: BLE001 - raised below
                errors.append(err)

        sync()
        t0 = time.perf_counter()
        list(workers.map(one, owners))  # threads kept from one try to the next, as a server keeps them
        sync()
        if errors:
            raise errors[0]
        return time.perf_counter() - t0

    relays = {r: tuple(reply.relays[r].endpoints) for r in owners} if reply.relays else None

    def grpc_once(drop: bool = False, kv: KVClient = grpc_decode.kv, streams: int = 1,
                  relayed: bool = False) -> float:
        def place(header, payload):
            if drop:  # receive and verify only
                return
            place_chunk(dst, [slot[p] for p in header.pages], payload, manifest.page_size, header.layer_start,
                        header.layer_end)

        sync()
        t0 = time.perf_counter()
        kv.fetch({r: endpoints[r] for r in owners}, reply.request_id, reply.contract_fingerprint,
                 place, timeout=600, layer_end=pool.shape[0], epoch=epoch, pages=pages, streams_per_rank=streams,
                 relays=relays if relayed else None)
        sync()
        return time.perf_counter() - t0

    phases: dict[int, dict] = {}
    with futures.ThreadPoolExecutor(max_workers=len(owners)) as workers:
        fast_s = min(fast_once() for _ in range(repeat + 1))
        fast_phases = dict(phases)
        announced_s = min(fast_once(early=False) for _ in range(repeat + 1))
        phases.clear()
        phases.update(fast_phases)
    receivers = grpc_decode.kv.receivers
    if receivers is not None and not receivers.wait_started(len(owners), 120):
        raise RuntimeError("the decode daemon's receiver processes did not start")
    grpc_s = min(grpc_once() for _ in range(repeat + 1))
    dropped_s = min(grpc_once(drop=True) for _ in range(repeat + 1))
    with KVClient() as threads_only:  # every rank's stream received in a thread of this process
        threads_s = min(grpc_once(kv=threads_only) for _ in range(repeat + 1))
        streams_s = {n: min(grpc_once(kv=threads_only, streams=n) for _ in range(repeat + 1))
                     for n in fetch_streams}
        relay_s = {n: min(grpc_once(kv=threads_only, streams=n, relayed=True) for _ in range(repeat + 1))
                   for n in fetch_streams} if relays else {}
    release(prefill, reply, call)
    procs, conns, ports = start(raw_server, [() for _ in owners])
    try:
        raw = min((run_raw(ports, nbytes, DEFAULT_CHUNK_BYTES) for _ in range(repeat + 1)),
                  key=lambda r: r["seconds"])
        raw_procs = run_raw_processes(ports, nbytes, DEFAULT_CHUNK_BYTES, repeat + 1)
        raw_streams_s = {n: min(run_raw(ports, nbytes, DEFAULT_CHUNK_BYTES, n)["seconds"] for _ in range(repeat + 1))
                         for n in fetch_streams}
    finally:
        stop(procs, conns)
    ceiling_s = copy_ceiling(dst, len(owners), repeat)
    gb = nbytes / 1e9
    return dict(tokens=tokens, bytes=nbytes, fast_gbps=gb / fast_s, grpc_gbps=gb / grpc_s,
                fast_announced_gbps=gb / announced_s, fast_announced_over_ceiling=ceiling_s / announced_s,
                grpc_dropped_gbps=gb / dropped_s, fast_phases_last=phases,
                grpc_placed_over_not_placed=dropped_s / grpc_s,
                raw_grpc_gbps=gb / raw["seconds"], copy_ceiling_gbps=gb / ceiling_s,
                fast_over_ceiling=ceiling_s / fast_s, grpc_over_raw=raw["seconds"] / grpc_s,
                receiver_parts=0 if receivers is None else receivers.taken,
                grpc_threads_gbps=gb / threads_s, grpc_threads_over_raw=raw["seconds"] / threads_s,
                raw_grpc_processes_gbps=gb / raw_procs["seconds"],
                grpc_streams={n: dict(gbps=gb / streams_s[n], raw_gbps=gb / raw_streams_s[n],
                                      over_raw=raw_streams_s[n] / streams_s[n],
                                      **(dict(relay_gbps=gb / relay_s[n], relay_over_raw=raw_streams_s[n] / relay_s[n])
                                         if relay_s else {})) for n in fetch_streams},
                grpc_over_raw_processes=raw_procs["seconds"] / grpc_s,
                shm_copy_gbps=shm_copy_gbps(nbytes // len(owners)))


def copy_ceiling(dst: torch.Tensor, ranks: int, repeat: int) -> float:
    """Seconds of the copies the fast path makes, alone: each rank's share from its GPU into ``dst``."""
    share = dst.numel() // ranks
    flat = dst.view(-1)
    if not dst.is_cuda:
        src = torch.empty_like(flat)
        return min(_timed(lambda: flat.copy_(src), None) for _ in range(repeat + 1))
    srcs = [torch.empty(share, dtype=dst.dtype, device=torch.device("cuda", r % torch.cuda.device_count()))
            for r in range(ranks)]
    streams = [torch.cuda.Stream(s.device) for s in srcs]

    def copies() -> None:
        for r, (src, stream) in enumerate(zip(srcs, streams)):
            with torch.cuda.stream(stream):
                flat[r * share:(r + 1) * share].copy_(src, non_blocking=True)
        for stream in streams:
            stream.synchronize()

    return min(_timed(copies, torch.cuda.synchronize) for _ in range(repeat + 1))


def shm_copy_gbps(nbytes: int) -> float | None:
    """A copy out of a /dev/shm file into private memory (the CPU fast path's ceiling)."""
    if not SHM_DIR.is_dir():
        return None
    path = SHM_DIR / f"lanekv-bench-{uuid.uuid4().hex}"
    try:
        src = shared_cpu_pool(path, (nbytes,), torch.uint8, 1)
        dst = torch.empty_like(src)
        seconds = min(_timed(lambda: dst.copy_(src), None) for _ in range(3))
    finally:
        remove_shared_pool(path)
    return nbytes / seconds / 1e9


def _timed(fn, sync) -> float:
    if sync:
        sync()
    t0 = time.perf_counter()
    fn()
    if sync:
        sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 65536])
    ap.add_argument("--transfer-tokens", type=int, nargs="+", default=None, help="default: --tokens")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--skip-ttft", action="store_true", help="measure the transfer alone")
    ap.add_argument("--nixl", action=argparse.BooleanOptionalAction, default=None,
                    help="also the NIXL paths (default: when lanekv[nixl] is installed)")
    every = [name for name, _ in PATHS + NIXL_PATHS]
    ap.add_argument("--paths", nargs="+", choices=every, default=None,
                    help="the decode daemons to start (each holds the model; default: all; grpc and fast always)")
    ap.add_argument("--fetch-streams", type=int, nargs="+", default=[1, 2, 4],
                    help="gRPC streams per owner rank: a TTFT row and a transfer-alone figure each")
    ap.add_argument("--fetch-relays", type=int, default=0,
                    help="sender relays per prefill rank: with N > 0, a grpc_relay_s<n> TTFT row per stream "
                         "count (the streams through the relays) beside grpc_s<n> (to the ranks themselves)")
    args = ap.parse_args()
    try:
        check_relays(args.fetch_relays)
    except ValueError as err:
        ap.error(f"--fetch-relays: {err}")
    for n in args.fetch_streams:
        try:
            check_streams(n)
        except ValueError as err:
            ap.error(f"--fetch-streams: {err}")
    use_nixl = nixl_available() if args.nixl is None else args.nixl
    wanted = set(every if args.paths is None else args.paths) | set(REQUIRED_PATHS)
    if not use_nixl:
        wanted -= {name for name, _ in NIXL_PATHS}
    paths = tuple(p for p in PATHS + NIXL_PATHS if p[0] in wanted)
    nixl_paths = tuple(p for p in NIXL_PATHS if p[0] in wanted)
    use_nixl = bool(nixl_paths)
    model_cfg = LLAMA3_8B if args.llama3_8b else TINY
    dtype = "bfloat16" if args.llama3_8b else "float32"
    transfer_tokens = args.transfer_tokens or args.tokens
    pages = -(-(max(args.tokens + transfer_tokens) + 2) // args.page_size) + 16
    vocab = model_cfg["vocab_size"]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(model_cfg))
        prefill = PrefillDaemon(
            EngineConfig(d, cp_size=args.cp, page_size=args.page_size, dtype=dtype, load_format="dummy",
                         pages_per_lane=2 * pages // args.cp + 16, start_timeout_s=900,
                         fetch_relays=args.fetch_relays),
            DaemonConfig(lease_s=600, max_batch_tokens=max(args.tokens), prefix_cache=False),
        )
        decoders = {}
        # The gRPC rows set the streams per rank after start; the daemon sizes its receiver
        # processes for the most they set (DecodeConfig.fetch_processes_for).
        try:
            for name, transport in paths:
                decoders[name] = DecodeDaemon(DecodeConfig(d, prefill.endpoint, page_size=args.page_size,
                                                           dtype=dtype, load_format="dummy", pool_pages=pages,
                                                           transport=transport, request_timeout_s=900,
                                                           prefix_cache=False,
                                                           fetch_streams=max(args.fetch_streams) if name == "grpc"
                                                           else None))
                if transport == "nixl":
                    with ucx_tls(NIXL_TLS[name]):  # its agent starts now, with these transports
                        decoders[name].nixl._agent_here()
            if "fast_streamed" in decoders:
                # Calls the ranks at once, copies at the end (the ranks send a descriptor pair per layer).
                streamed = decoders["fast_streamed"].fastpath
                streamed.tuning = dataclasses.replace(streamed.tuning, wait_for_answer=False)
            if "fast_layer" in decoders:
                decoders["fast_layer"].fastpath.copy_at_end = False  # copies each layer as it comes
            grpc_transport = decoders["grpc"].fetcher.transport("grpc")
            channels = {name: grpc.insecure_channel(dec.endpoint, options=grpc_options())
                        for name, dec in decoders.items()}
            channels["prefill"] = grpc.insecure_channel(prefill.endpoint, options=grpc_options())
            stubs = {name: lanekv_pb2_grpc.DecodeServiceStub(ch) for name, ch in channels.items()}
            stubs["prefill"] = lanekv_pb2_grpc.PrefillServiceStub(channels["prefill"])
            rows = [] if args.skip_ttft else [ttft(prefill, stubs, vocab, n, args.repeat, paths, grpc_transport,
                                                   args.fetch_streams, args.fetch_relays) for n in args.tokens]
            grpc_transport.use_relays = False  # the transfer alone: to the ranks themselves
            alone = [transfer_alone(prefill, decoders["fast"], decoders["grpc"], vocab, n, args.repeat,
                                    args.fetch_streams) for n in transfer_tokens]
            if use_nixl:  # each NIXL path alone, beside a raw NIXL read of the same bytes, same transports
                device = decoders["grpc"].pool.tensor.device
                for a, n in zip(alone, transfer_tokens):
                    for name, _ in nixl_paths:
                        got = nixl_alone(prefill, decoders[name], prompt(vocab, n, 11), args.repeat)
                        raw = raw_nixl_gbps(got["nixl_bytes"], device, args.repeat, NIXL_TLS[name])
                        a.update({f"{name}_{k[5:]}": v for k, v in got.items()})
                        a[f"{name}_raw_gbps"] = raw
                        a[f"{name}_over_raw"] = got["nixl_gbps"] / raw if raw else 0.0
                    # UCX TCP between host-memory buffers: the TCP transport's own rate, no GPU
                    # staging. On a GPU host UCX refuses a NIXL backend without cuda_copy.
                    a["nixl_tcp_raw_host_gbps"] = raw_nixl_gbps(a.get("nixl_tcp_bytes") or a["bytes"],
                                                                torch.device("cpu"), args.repeat,
                                                                NIXL_TLS["nixl_tcp"])
            transports = sorted({decoders["fast"].fastpath.transport(e) for e in prefill.topology.endpoints})
            for ch in channels.values():
                ch.close()
        finally:
            for dec in decoders.values():
                dec.stop()
            prefill.stop()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"\nTTFT, prefill cp={args.cp}, {'Llama-3-8B shapes' if args.llama3_8b else 'tiny'}, {dtype}, "
          f"page {args.page_size}, {device}; fast path: {transports}")
    print("(a) colocated: the prefill daemon's own Prefill call; (b) grpc_s<n>: layer-wise FetchKV, n streams "
          "per rank (grpc_relay_s<n>: the same through the ranks' sender relays); nixl: NIXL, pool registered where it is; nixl_tcp: NIXL over UCX TCP; (c) fast: called once the prefill "
          "answered; (d) fast, streamed: called at once, copied at the end; (e) fast, per layer: copied as "
          "each layer comes. Median ms [min-max], and over (a)")
    print(f"{'tokens':>7} {'path':>14} {'TTFT ms':>9} {'min':>7} {'max':>7} {'/a':>6} {'prefill call':>13} "
          f"{'rank compute':>13} {'transfer':>9}")
    for r in rows:
        for name in ("colocated", *row_names(paths, args.fetch_streams, args.fetch_relays)):
            over = "" if name == "colocated" else f"{r[f'{name}_over_colocated']:.3f}"
            call = "" if name == "colocated" else f"{r[f'{name}_prefill_s'] * 1e3:.1f}"
            compute = r[f"{name}_compute_s"] * 1e3
            transfer = "" if name == "colocated" else f"{r[f'{name}_transfer_s'] * 1e3:.1f}"
            print(f"{r['tokens']:>7} {name:>14} {r[f'{name}_s'] * 1e3:>9.1f} {r[f'{name}_min_s'] * 1e3:>7.1f} "
                  f"{r[f'{name}_max_s'] * 1e3:>7.1f} {over:>6} {call:>13} {compute:>13.1f} {transfer:>9}")
        print(f"{'':>7} {'KV MiB':>14} {r['bytes'] / 2**20:>9.0f}")
        print("colocated, each: call / rank compute / rank host queued / rank GC ms: " + "; ".join(
            f"{c['call']:.1f}/{c['compute']:.1f}/{c['queued']:.1f}/{c['gc']:.1f}"
            for c in r["colocated_samples_ms"]))
    print("\ntransfer alone (one request already prefilled), GB/s:")
    print("(fast: copies start before the ranks' announcements, as once the prefill has answered; "
          "announced: each rank's copies wait for its announcement)")
    print(f"{'tokens':>7} {'GiB':>5} {'fast':>8} {'announced':>10} {'copy ceiling':>13} {'fast/ceil':>10} "
          f"{'annc/ceil':>10} {'shm copy':>9}")
    for a in alone:
        shm = f"{a['shm_copy_gbps']:.1f}" if a["shm_copy_gbps"] else "-"
        print(f"{a['tokens']:>7} {a['bytes'] / 2**30:>5.1f} {a['fast_gbps']:>8.1f} {a['fast_announced_gbps']:>10.1f} "
              f"{a['copy_ceiling_gbps']:>13.1f} {a['fast_over_ceiling']:>10.2f} "
              f"{a['fast_announced_over_ceiling']:>10.2f} {shm:>9}")
    print("\nFetchKV (receivers: processes receiving the ranks' streams; threads: all in the daemon), GB/s:")
    print(f"{'tokens':>7} {'receivers':>10} {'(not placed)':>13} {'threads':>8} {'raw, 1 proc':>12} "
          f"{'raw, proc/stream':>17} {'recv/raw1':>10} {'recv/rawN':>10} {'threads/raw1':>13} {'placed/not':>11}")
    for a in alone:
        print(f"{a['tokens']:>7} {a['grpc_gbps']:>10.2f} {a['grpc_dropped_gbps']:>13.2f} "
              f"{a['grpc_threads_gbps']:>8.2f} {a['raw_grpc_gbps']:>12.2f} {a['raw_grpc_processes_gbps']:>17.2f} "
              f"{a['grpc_over_raw']:>10.2f} {a['grpc_over_raw_processes']:>10.2f} {a['grpc_threads_over_raw']:>13.2f} "
              f"{a['grpc_placed_over_not_placed']:>11.2f}")
    print("\nFetchKV with n streams per rank (threads of this process) against n raw gRPC streams per server, GB/s:")
    print(f"{'tokens':>7} {'streams':>7} {'FetchKV':>8} {'raw':>8} {'/raw':>6} {'relayed':>8} {'/raw':>6}")
    for a in alone:
        for n, g in a["grpc_streams"].items():
            relayed = f"{g['relay_gbps']:>8.2f} {g['relay_over_raw']:>6.2f}" if "relay_gbps" in g else ""
            print(f"{a['tokens']:>7} {n:>7} {g['gbps']:>8.2f} {g['raw_gbps']:>8.2f} {g['over_raw']:>6.2f} {relayed}")
    if use_nixl:
        print("\nNIXL (the transport alone: descriptor streams, NIXL reads into the pool, digest checks) "
              "against a raw NIXL read of the same bytes, same UCX transports, GB/s:")
        print(f"{'tokens':>7} {'path':>9} {'transport':>10} {'raw':>8} {'/raw':>6}")
        for a in alone:
            for name, _ in nixl_paths:
                print(f"{a['tokens']:>7} {name:>9} {a[f'{name}_gbps']:>10.2f} {a[f'{name}_raw_gbps']:>8.2f} "
                      f"{a[f'{name}_over_raw']:>6.2f}")
            print(f"{a['tokens']:>7} {'(raw NIXL, UCX TCP, host memory)':>36} {a['nixl_tcp_raw_host_gbps']:>8.2f}")
    for a in alone:
        for rank, ph in sorted(a["fast_phases_last"].items()):
            print(f"{a['tokens']} tokens, fast path, rank {rank} (last try): {ph['seconds'] * 1e3:.1f} ms = "
                  f"called {ph['called_s'] * 1e3:.2f}, first descriptor {ph['first_s'] * 1e3:.2f}, "
                  f"copies queued {ph['issued_s'] * 1e3:.2f}, "
                  f"last descriptor {ph['received_s'] * 1e3:.2f}, then {ph['copy_s'] * 1e3:.2f}; "
                  f"{ph['chunks']} range(s), {ph['runs']} run(s) of pages")
    if args.json:
        args.json.write_text(json.dumps(dict(device=device, date=time.strftime("%Y-%m-%d"), cp_size=args.cp,
                                             page_size=args.page_size, dtype=dtype, transports=transports,
                                             paths=[name for name, _ in paths], fetch_streams=args.fetch_streams,
                                             fetch_relays=args.fetch_relays,
                                             ttft=rows, transfer_alone=alone), indent=2))


if __name__ == "__main__":
    main()
