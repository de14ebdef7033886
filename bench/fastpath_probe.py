"""Where the transfer of one prefilled request spends its time (fast path and FetchKV), piece by piece.

    python bench/fastpath_probe.py --llama3-8b --tokens 32768 [--profile-dir DIR]

One prefill daemon (cp=2) and two decode daemons (auto, grpc), one request
prefilled; then, each the best of ``--repeat``:

- fast: the whole fast path of both ranks at once (``FastPath.fetch``, the
  copies starting before the ranks' announcements, as the decode daemon
  does once the prefill has answered; "announced": waiting for them), of
  each rank alone, with copies in groups of 8 (the default), 32 and 8 layers
  again, with the CUDA runtime called letting the GIL go, and with the copies
  on the destination's stream ("pull") instead of the source's, with the
  descriptors on the channel of the bulk path, with the ranks preparing in
  any order, and with the last group of layers whole; the phases
  of each (first announcement, copies queued, seal, copies done), the wall
  time of each step of one rank's fetch alone, and a cProfile of it;
- rpc all / rpc 1 layer: FetchKV with descriptors only (no copy): the round
  trip and the rank's seal of every layer (a sum of the digests taken as the
  prefill wrote them), and of one layer; of one rank alone;
- copies (push / pull): ``copy_pages`` of both ranks' pages at once, nothing else;
- digest: ``page_digest`` of the copied pages on the decode GPU;
- ceiling: each rank's share as one plain contiguous copy into GPU 0;
- placement: ways to move received chunk bytes to the GPU, in 1, 2, 4 threads;
- grpc / grpc (not placed) / raw gRPC, as bench/ttft.py measures them, and
  placing only part of a chunk (the memmove into pinned memory; that and the
  host-to-device copy), 16 MiB chunks against raw 16 MiB messages, and the
  round trip of a tiny raw server-streaming call (the floor of a FetchKV).
  ``--fast-only`` stops before the gRPC figures.

It prints one line per figure (ms and GB/s) and writes them all as JSON.
With ``--profile-dir``: a torch profiler trace of one fast-path fetch and
py-spy recordings (raw collapsed stacks, this process and its children) of
the gRPC fetches, of the threads holding the GIL during them (``--gil``, this
process) and of descriptor round trips.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import json
import os
import pstats
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent import futures
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import lanekv.transfer.fastpath.poolcopy as poolcopy  # noqa: E402
import lanekv.transfer.fastpath.rangecopy as rangecopy  # noqa: E402
import lanekv.transfer.fastpath.rankfetch as rankfetch  # noqa: E402
import lanekv.transfer.fastpath.sidestreams as sidestreams  # noqa: E402
import lanekv.transfer.protocol.descriptors as fastpath_module  # noqa: E402
import torch  # noqa: E402
from lanekv.decode.config import DecodeConfig  # noqa: E402
from lanekv.decode.daemon import DecodeDaemon  # noqa: E402
from lanekv.kernels.page_digest import page_digest  # noqa: E402
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon  # noqa: E402
from lanekv.prefill.engine_config import EngineConfig  # noqa: E402
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc  # noqa: E402
from lanekv.runtime.status import DEFAULT_CHUNK_BYTES, grpc_options  # noqa: E402
from lanekv.transfer.connector.placement import place_chunk  # noqa: E402
from lanekv.transfer.fastpath.copyorder import CopyOrder  # noqa: E402
from lanekv.transfer.fastpath.poolcopy import copy_pages  # noqa: E402
from lanekv.transfer.fastpath.rankfetch import FastRequest, RankPages  # noqa: E402
from lanekv.transfer.fastpath.sidestreams import streams_for  # noqa: E402
from lanekv.transfer.fastpath.tuning import DEFAULT_COPY, DEFAULT_FAST_PATH  # noqa: E402
from lanekv.transfer.grpcfetch.client import FETCH_METHOD  # noqa: E402
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY, access_ticket  # noqa: E402
from lanekv.transfer.protocol.descriptors import Descriptor  # noqa: E402
from lanekv.transfer.protocol.manifest import Manifest  # noqa: E402

from bench.prefill import LLAMA3_8B, TINY, add_model_args  # noqa: E402
from bench.raw_grpc import RAW_METHOD, raw_server, run_raw, start, stop  # noqa: E402
from bench.ttft import copy_ceiling, prompt, release  # noqa: E402


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat + 1):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


_WORKERS = futures.ThreadPoolExecutor(max_workers=8)


def in_threads(fns) -> None:
    for f in [_WORKERS.submit(fn) for fn in fns]:
        f.result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--profile-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--fast-only", action="store_true", help="only the fast-path figures (no gRPC)")
    args = ap.parse_args()
    model_cfg = LLAMA3_8B if args.llama3_8b else TINY
    dtype = "bfloat16" if args.llama3_8b else "float32"
    pages = -(-(args.tokens + 2) // args.page_size) + 16
    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(model_cfg))
        prefill = PrefillDaemon(
            EngineConfig(d, cp_size=args.cp, page_size=args.page_size, dtype=dtype, load_format="dummy",
                         pages_per_lane=2 * pages // args.cp + 16, start_timeout_s=900),
            DaemonConfig(lease_s=600, max_batch_tokens=args.tokens, prefix_cache=False),
        )
        decoders = {}
        try:
            for name, transport in (("fast", "auto"), ("grpc", "grpc")):
                decoders[name] = DecodeDaemon(DecodeConfig(d, prefill.endpoint, page_size=args.page_size,
                                                           dtype=dtype, load_format="dummy", pool_pages=pages,
                                                           transport=transport, request_timeout_s=900,
                                                           prefix_cache=False))
            out = probe(prefill, decoders, model_cfg["vocab_size"], args)
        finally:
            for dec in decoders.values():
                dec.stop()
            prefill.stop()
    gb = out["bytes"] / 1e9
    print(f"\n{args.tokens} tokens, {out['bytes'] / 2**30:.2f} GiB, best of {args.repeat + 1}")
    for key, value in out.items():
        if key.endswith("_s"):
            print(f"{key:>28} {value * 1e3:9.2f} ms {gb / value:9.2f} GB/s")
    for key in [k for k in out if k.endswith("_phases")]:
        for rank, st in out[key].items():
            print(f"{key} rank {rank}: " + " ".join(f"{k}={v * 1e3:.2f}ms" for k, v in st.items() if k.endswith("_s")))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


def probe(prefill: PrefillDaemon, decoders: dict, vocab: int, args) -> dict:
    stub = lanekv_pb2_grpc.PrefillServiceStub(grpc.insecure_channel(prefill.endpoint, options=grpc_options()))
    reply, call = stub.Prefill.with_call(lanekv_pb2.PrefillRequest(
        token_ids=lanekv_pb2.TokenIds(ids=prompt(vocab, args.tokens, 7)), request_id=f"probe-{uuid.uuid4().hex[:8]}"),
        timeout=900)
    epoch = access_ticket(dict(call.trailing_metadata() or ()).get(EPOCH_METADATA_KEY), reply.capability)
    metadata = ((EPOCH_METADATA_KEY, epoch),)
    manifest = Manifest.decode(reply.manifest)
    endpoints = list(reply.endpoints)
    owners = sorted({p.owner for p in manifest.pages})
    pages = {r: manifest.pages_of_owner(r) for r in owners}
    slot = {p.page: i for i, p in enumerate(manifest.pages)}
    fast, grpc_decode = decoders["fast"], decoders["grpc"]
    pool = fast.pool.tensor
    ps = manifest.page_size
    dst = torch.empty((pool.shape[0], 2, len(manifest.pages) * ps, *pool.shape[3:]), dtype=pool.dtype,
                      device=pool.device)
    nbytes = dst.numel() * dst.element_size()
    shared = {r: fast.fastpath.pool(endpoints[r], epoch, 30.0) for r in owners}
    out: dict = dict(tokens=args.tokens, bytes=nbytes, transports=[fast.fastpath.transport(endpoints[r]) for r in owners])
    phases: dict = {}
    physical_of = fast.prefill_contract.topology.physical_of
    early = [True]  # the prefill answered: copies start before the rank's announcement
    tuned = [DEFAULT_FAST_PATH]  # how the fast path calls and copies, per measurement

    def fetch_rank(rank, order=None) -> None:
        expect = [physical_of(p) for p in pages[rank]] if early[0] else None
        request = FastRequest(reply.request_id, reply.contract_fingerprint, dst, lambda p: [slot[q] for q in p],
                              lambda *a: None, epoch, time.monotonic() + 600)
        part = RankPages(rank, endpoints[rank], shared[rank], tuple(pages[rank]), None if expect is None else tuple(expect))
        phases[rank] = fast.fastpath.fetch(request, part, order=order, tuning=tuned[0])._asdict()

    def fast_once(ranks=tuple(owners), order_by=None) -> None:
        order = None
        if order_by != "none":
            kw = {} if order_by is None else dict(away_first=order_by == "away")
            order = CopyOrder.for_pools({r: shared[r] for r in ranks}, dst.device, **kw)
        in_threads([lambda r=r: fetch_rank(r, order) for r in ranks])

    out["fast_s"] = timed(fast_once, args.repeat)
    out["fast_phases"] = dict(phases)
    early[0] = False
    out["fast_announced_s"] = timed(fast_once, args.repeat)
    out["fast_announced_phases"] = dict(phases)
    early[0] = True
    for order_by in ("none", "away", "local"):
        out[f"fast_order_{order_by}_s"] = timed(lambda o=order_by: fast_once(order_by=o), args.repeat)
        out[f"fast_order_{order_by}_phases"] = dict(phases)
    for rank in owners:
        phases.clear()
        out[f"fast_rank{rank}_alone_s"] = timed(lambda r=rank: fast_once((r,)), args.repeat)
        out[f"fast_rank{rank}_alone_phases"] = dict(phases)

    def tuned_once(**changes) -> None:
        """One fast fetch of every rank, with ``changes`` to the default tuning."""
        copy = replace(DEFAULT_COPY, **changes.pop("copy", {}))
        tuned[0] = replace(DEFAULT_FAST_PATH, copy=copy, **changes)
        try:
            fast_once()
        finally:
            tuned[0] = DEFAULT_FAST_PATH

    for layers in (32, 8):
        out[f"fast_group{layers}_s"] = timed(lambda n=layers: tuned_once(copy=dict(group_layers=n)), args.repeat)
    out["fast_bulk_channel_s"] = timed(lambda: tuned_once(direct_descriptors=False), args.repeat)
    out["fast_bulk_channel_phases"] = dict(phases)
    out["fast_any_prepare_order_s"] = timed(lambda: tuned_once(prepare_in_order=False), args.repeat)
    out["fast_any_prepare_order_phases"] = dict(phases)
    out["fast_last_group_whole_s"] = timed(lambda: tuned_once(copy=dict(last_group_min_layers=1 << 10)),
                                           args.repeat)
    # The CUDA runtime bound a second time, letting the GIL go during its calls.
    out["fast_gil_released_s"] = timed(lambda: tuned_once(copy=dict(keep_gil=False)), args.repeat)
    out["fast_gil_released_phases"] = dict(phases)
    out["host_ms_per_call"] = host_times(fetch_rank, owners[-1])
    print(json.dumps(out["host_ms_per_call"], indent=1))
    profiler = cProfile.Profile()  # host time of one rank's fetch, in this thread
    profiler.enable()
    fetch_rank(owners[-1])
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    if args.profile_dir and torch.cuda.is_available():
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fast_once()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(args.profile_dir / "fast_trace.json"))

    def rpc(layer_end: int, ranks=owners, direct: bool = True) -> None:
        def one(rank):
            request = lanekv_pb2.FetchRequest(request_id=reply.request_id, fingerprint=reply.contract_fingerprint,
                                              layer_start=0, layer_end=layer_end, pages=pages[rank],
                                              descriptors=True)
            stream = fast.kv.channel(endpoints[rank], direct=direct).unary_stream(
                FETCH_METHOD, request_serializer=lanekv_pb2.FetchRequest.SerializeToString,
                response_deserializer=lanekv_pb2.KVChunk.FromString)
            for _ in stream(request, timeout=60, metadata=metadata):
                pass
        in_threads([lambda r=r: one(r) for r in ranks])

    out["rpc_all_layers_s"] = timed(lambda: rpc(pool.shape[0]), args.repeat)
    out["rpc_one_layer_s"] = timed(lambda: rpc(1), args.repeat)
    out["rpc_one_layer_one_rank_s"] = timed(lambda: rpc(1, owners[:1]), args.repeat)
    out["rpc_one_layer_one_rank_bulk_channel_s"] = timed(lambda: rpc(1, owners[:1], direct=False), args.repeat)
    physical = {r: [p for _, p in prefill_pages(fast, endpoints[r], reply, r, pages[r], epoch)] for r in owners}

    def copies(push: bool = True) -> None:
        def one(rank):
            with streams_for(shared[rank].device, dst.device) as streams:
                copy_pages(shared[rank], physical[rank], dst, [slot[q] for q in pages[rank]], ps, 0, pool.shape[0],
                           tuning=replace(DEFAULT_COPY, push=push))
            streams.sync()
        in_threads([lambda r=r: one(r) for r in owners])

    out["copies_push_s"] = timed(copies, args.repeat)
    out["copies_pull_s"] = timed(lambda: copies(push=False), args.repeat)
    out["fast_pull_s"] = timed(lambda: tuned_once(copy=dict(push=False)), args.repeat)
    index = torch.arange(len(manifest.pages), device=dst.device)
    out["digest_decode_gpu_s"] = timed(lambda: page_digest(dst, index, ps, 0, pool.shape[0]).item(), args.repeat)
    out["ceiling_s"] = copy_ceiling(dst, len(owners), args.repeat)

    if args.fast_only:
        release(prefill, reply, call)
        return out

    def grpc_once(drop: bool, how: str = "place", chunk_bytes: int = 0):
        def place(header, payload):
            if drop:
                return
            if how == "place":
                place_chunk(dst, [slot[p] for p in header.pages], payload, ps, header.layer_start,
                            header.layer_end)
                return
            staged = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
            ctypes.memmove(staged.data_ptr(), payload.data_ptr(), payload.numel() * payload.element_size())
            if how == "h2d":
                staged.to(dst.device, non_blocking=True)
        grpc_decode.kv.fetch({r: endpoints[r] for r in owners}, reply.request_id, reply.contract_fingerprint,
                             place, timeout=600, layer_end=pool.shape[0], epoch=epoch, pages=pages,
                             max_chunk_bytes=chunk_bytes)

    if dst.is_cuda:
        out["placement"] = placement_variants(dst.device)
    out["grpc_s"] = timed(lambda: grpc_once(False), args.repeat)
    out["grpc_not_placed_s"] = timed(lambda: grpc_once(True), args.repeat)
    if dst.is_cuda:
        out["grpc_memmove_only_s"] = timed(lambda: grpc_once(False, "memmove"), args.repeat)
        out["grpc_memmove_h2d_s"] = timed(lambda: grpc_once(False, "h2d"), args.repeat)
    out["grpc_16mib_s"] = timed(lambda: grpc_once(False, chunk_bytes=16 << 20), args.repeat)
    if args.profile_dir and shutil.which("py-spy"):
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        spy(args.profile_dir / "grpc_fetch.txt", lambda: grpc_once(False), idle=False)
        spy(args.profile_dir / "grpc_fetch_gil.txt", lambda: grpc_once(False), idle=False, gil=True)
        spy(args.profile_dir / "rpc.txt", lambda: rpc(pool.shape[0]), idle=True)
    release(prefill, reply, call)
    procs, conns, ports = start(raw_server, [() for _ in owners])
    try:
        out["raw_grpc_s"] = min(run_raw(ports, nbytes, DEFAULT_CHUNK_BYTES)["seconds"] for _ in range(args.repeat + 1))
        out["raw_grpc_16mib_s"] = min(run_raw(ports, nbytes, 16 << 20)["seconds"] for _ in range(args.repeat + 1))
        channels = [grpc.insecure_channel(f"127.0.0.1:{p}", options=grpc_options()) for p in ports]
        tiny = [ch.unary_stream(RAW_METHOD) for ch in channels]

        def floor(which) -> None:
            in_threads([lambda i=i: sum(1 for _ in tiny[i](struct.pack("<QQ", 2, 256), timeout=60)) for i in which])

        out["rpc_floor_one_s"] = timed(lambda: floor([0]), args.repeat + 4)
        out["rpc_floor_s"] = timed(lambda: floor(range(len(ports))), args.repeat + 4)
        for ch in channels:
            ch.close()
    finally:
        stop(procs, conns)
    return out


def host_times(fetch_rank, rank, repeat: int = 5) -> dict:
    """Wall ms per call of the steps of one rank's fast-path fetch (alone, this thread)."""
    spent: dict = {}
    targets = [(poolcopy.PlannedCopy, "plan"), (poolcopy.PlannedCopy, "issue"),
               (fastpath_module.Descriptor, "decode"), (fastpath_module.Descriptor, "sealed_by"),
               (rankfetch, "copy_range"), (rankfetch.RankFetch, "finish"),
               (rankfetch, "Prepared"), (rankfetch.RankFetch, "_mismatch"),
               (rangecopy.PageDigest, "add"), (rangecopy.PageDigest, "total"),
               (sidestreams.Streams, "digesting"), (sidestreams.Streams, "sync")]
    fetch_rank(rank)  # once untimed: what a first call loads (the CUDA runtime's binding) is not counted
    saved = [(owner, name, owner.__dict__[name]) for owner, name in targets]

    def wrap(name, fn):
        def timed_call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                calls, total = spent.get(name, (0, 0.0))
                spent[name] = (calls + 1, total + time.perf_counter() - t0)
        return timed_call

    for owner, name, fn in saved:
        raw = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
        wrapped = wrap(name, raw)
        setattr(owner, name, classmethod(wrapped) if isinstance(fn, classmethod)
                else staticmethod(wrapped) if isinstance(fn, staticmethod) else wrapped)
    try:
        for _ in range(repeat):
            fetch_rank(rank)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return {name: dict(calls=calls / repeat, ms=total / repeat * 1e3) for name, (calls, total) in spent.items()}


def placement_variants(device: torch.device, chunks: int = 48, chunk_bytes: int = 8 << 20) -> dict:
    """Seconds per chunk to move received message bytes to the device, several ways."""
    import numpy as np
    data = [torch.randint(0, 255, (chunk_bytes,), dtype=torch.uint8).numpy().tobytes() for _ in range(chunks)]

    def pageable(b):
        torch.frombuffer(b, dtype=torch.uint8).to(device)

    def pinned_torch(b):
        staged = torch.empty(len(b), dtype=torch.uint8, pin_memory=True)
        staged.copy_(torch.frombuffer(b, dtype=torch.uint8))
        staged.to(device, non_blocking=True)

    def pinned_memmove(b):
        staged = torch.empty(len(b), dtype=torch.uint8, pin_memory=True)
        ctypes.memmove(staged.data_ptr(), b, len(b))
        staged.to(device, non_blocking=True)

    def pinned_numpy(b):
        staged = torch.empty(len(b), dtype=torch.uint8, pin_memory=True)
        np.copyto(staged.numpy(), np.frombuffer(b, dtype=np.uint8))
        staged.to(device, non_blocking=True)

    out = {}
    for name, fn in (("pageable", pageable), ("pinned_torch", pinned_torch), ("pinned_memmove", pinned_memmove),
                     ("pinned_numpy", pinned_numpy)):
        for threads in (1, 2, 4):
            def work(part, fn=fn):
                for b in part:
                    fn(b)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            in_threads([lambda i=i, n=threads: work(data[i::n]) for i in range(threads)])
            torch.cuda.synchronize()
            out[f"{name}_x{threads}_ms_per_chunk"] = (time.perf_counter() - t0) / chunks * 1e3
    print(json.dumps(out, indent=1))
    return out


def spy(path: Path, fn, idle: bool, gil: bool = False) -> None:
    """Record this process and its children with py-spy while ``fn`` runs again and again for 5 s
    (``gil``: only the threads holding the GIL, of this process alone)."""
    cmd = ["py-spy", "record", "--pid", str(os.getpid()), "--threads", "--nonblocking",
           "-r", "500", "-d", "6", "-f", "raw", "-o", str(path)] + (["--idle"] if idle else []) \
        + (["--gil"] if gil else ["--subprocesses"])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)
    t_end = time.perf_counter() + 4.5
    while time.perf_counter() < t_end:
        fn()
    _, err = proc.communicate(timeout=60)
    print(err.decode()[-500:])


def prefill_pages(fast, endpoint, reply, rank, pages, epoch):
    """(logical, physical) of a rank's pages, from one descriptor."""
    request = lanekv_pb2.FetchRequest(request_id=reply.request_id, fingerprint=reply.contract_fingerprint,
                                      layer_start=0, layer_end=1, pages=pages, descriptors=True)
    stream = fast.kv.channel(endpoint).unary_stream(
        FETCH_METHOD, request_serializer=lanekv_pb2.FetchRequest.SerializeToString,
        response_deserializer=lanekv_pb2.KVChunk.FromString)
    for message in stream(request, timeout=60, metadata=((EPOCH_METADATA_KEY, epoch),)):
        d = Descriptor.decode(message.header)
        return list(zip(d.pages, d.physical))
    raise RuntimeError("no descriptor")


if __name__ == "__main__":
    main()
