"""Staged sender relays (``transfer.rank.staging``, ``relay_staged``): the rank reads each chunk
into a relay's slot (StageKV), the relay digests the bytes as framed on the CPU, frames and sends
them; a damaged slot and a killed relay hand the stream to the rank, and no file is left."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch
from lanekv.kernels.page_digest import kv_digest
from lanekv.proto import lanekv_pb2
from lanekv.runtime.shmfiles import owner_of
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.protocol.chunkseal import seal
from lanekv.transfer.protocol.contract import Topology
from lanekv.transfer.protocol.wire import ChunkPlan
from lanekv.transfer.rank.progress import LayerProgress
from lanekv.transfer.rank.relay import RelayProcesses, RelayService, RelaySpec, serve_relay
from lanekv.transfer.rank.relay_staged import STAGE_METHOD, StagingSlots
from lanekv.transfer.rank.server import serve
from lanekv.transfer.rank.sources import TensorPageSource
from lanekv.transfer.rank.staging import DAMAGE_ENV, STAGED_ENV, RankStaging, staged_mode

from tests.markers import requires_gpu
from tests.reliability.kv_cluster import LAYERS, PAGE, make_agreement, placer, same_bits
from tests.transfer.fastpath.rig import fill

pytestmark = pytest.mark.timeout(60)
PAGES = [(0, 5), (1, 2), (2, 7), (3, 0), (4, 3)]  # (logical, physical)
ROW_BYTES = 2 * 8 * 2  # kv_heads x head_dim x float16
CHUNK = 2 * PAGE * 2 * ROW_BYTES  # two pages of one layer, K and V: several chunks per range


def _expected(pool: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(LAYERS, 2, len(PAGES) * PAGE, 2, 8, dtype=pool.dtype)
    for logical, physical in PAGES:
        out[:, :, logical * PAGE:(logical + 1) * PAGE] = pool[:, :, physical * PAGE:(physical + 1) * PAGE].cpu()
    return out


@contextlib.contextmanager
def _staged_rank(relays: int, device: str = "cpu", slot_bytes: int = 1 << 16):
    """A rank (CPU pool, or ``device``'s) serving KVTransfer with ``relays`` staging files."""
    agreement = make_agreement(kv_dtype="float16")
    cpu = torch.zeros(LAYERS, 2, 8 * PAGE, 2, 8, dtype=torch.float16)
    for layer in range(LAYERS):
        fill(cpu, [p for _, p in PAGES], layer, seed=layer + 11)
    pool = cpu.to(device)
    source = TensorPageSource(agreement, 0, pool)
    staging = RankStaging(uuid.uuid4().hex[:8], 0, relays, pool.device, slot_bytes=slot_bytes)
    served = serve(source, relay_staging=staging)
    endpoint = f"127.0.0.1:{served.port}"
    source.set_topology(Topology(1, "in_seq", "page_mod_cp", (endpoint,)))
    kv = KVClient()
    try:
        yield source, pool, endpoint, agreement, kv, staging
    finally:
        kv.close()
        served.server.stop(None)
        staging.close()


@contextlib.contextmanager
def _relays(endpoint, agreement, staging):
    served = [serve_relay(RelayService(0, endpoint, agreement, staging=area)) for area in staging.areas]
    try:
        yield served
    finally:
        for s in served:
            s.stop(0.5)


def _fetch(kv, endpoint, agreement, dest, relays, rid="r1", **kw):
    return kv.fetch({0: endpoint}, rid, agreement.fingerprint, placer(dest, []), timeout=20, layer_end=LAYERS,
                    pages={0: [p for p, _ in PAGES]}, streams_per_rank=2, relays={0: relays},
                    max_chunk_bytes=CHUNK, **kw)


def test_staged_mode_is_the_gpu_default_and_the_env_forces_either(monkeypatch):
    monkeypatch.delenv(STAGED_ENV, raising=False)
    assert staged_mode(True) and not staged_mode(False)
    monkeypatch.setenv(STAGED_ENV, "1")
    assert staged_mode(False)
    monkeypatch.setenv(STAGED_ENV, "0")
    assert not staged_mode(True)
    monkeypatch.setenv(STAGED_ENV, "yes")
    with pytest.raises(ValueError, match=STAGED_ENV):
        staged_mode(True)


def test_a_cpu_digest_of_runs_sums_to_the_ranks_digest_of_the_range():
    # kv_digest of each (layer, plane) run at its place sums to the rank's range seal.
    with _staged_rank(1) as (source, pool, _, _, _, _):
        source.add("r1", PAGES)
        physical = [p for _, p in PAGES]
        sealed = source.digest(physical, 1, 3, request_id="r1")
        payload = source.read(physical, 1, 3)  # [2, 2, 5 * PAGE, 2, 8]
        rows, words = len(PAGES) * PAGE, ROW_BYTES // 4
        total = sum(kv_digest(payload[layer, plane, :3 * PAGE].contiguous(), ((1 + layer) * 2 + plane) * rows * words)
                    + kv_digest(payload[layer, plane, 3 * PAGE:].contiguous(),
                                (((1 + layer) * 2 + plane) * rows + 3 * PAGE) * words)
                    for layer in range(2) for plane in range(2))
        assert total & ((1 << 64) - 1) == sealed


def test_stage_kv_answers_the_seal_of_the_bytes_it_put_in_the_slot():
    with _staged_rank(1) as (source, pool, endpoint, _, _, staging):
        source.add("r1", PAGES)
        with grpc.insecure_channel(endpoint) as channel:
            slots = StagingSlots(staging.areas[0], channel)
            staged = slots.stage(1, "r1", ChunkPlan(1, 3, (3, 0, 4)), timeout_s=5)
            read = source.read([0, 5, 3], 1, 3)  # the physical pages of logical 3, 0, 4
            assert staged.data.numel() == read.numel() * 2 and torch.equal(staged.data, read.reshape(-1).view(torch.uint8))
            assert staged.seal == seal(read.contiguous())


def test_staged_relays_carry_every_byte_and_the_rank_frames_none(monkeypatch):
    with _staged_rank(2) as (source, pool, endpoint, agreement, kv, staging):
        source.add("r1", PAGES, capability="cap")
        read = []
        monkeypatch.setattr(source, "read", lambda *a, **k: read.append(a))  # the rank's own FetchKV path
        with _relays(endpoint, agreement, staging) as served:
            dest = torch.zeros(LAYERS, 2, len(PAGES) * PAGE, 2, 8, dtype=pool.dtype)
            stats = _fetch(kv, endpoint, agreement, dest, [f"127.0.0.1:{s.port}" for s in served], epoch=":cap")
            assert same_bits(dest, _expected(pool))
            sent = [s.service.sent_bytes for s in served]
            assert all(n > 0 for n in sent) and sum(sent) == stats.bytes == dest.numel() * 2
            assert sum(s.service.sent_chunks for s in served) > 2  # several chunks, through both slots
            assert read == [] and stats.retries == 0


def test_a_damaged_slot_is_caught_before_a_byte_leaves_and_the_rank_sends_instead(monkeypatch):
    monkeypatch.setenv(DAMAGE_ENV, "r1")  # the rank flips a bit of each slot of r1 after its read
    with _staged_rank(1) as (source, pool, endpoint, agreement, kv, staging):
        source.add("r1", PAGES)
        with _relays(endpoint, agreement, staging) as served:
            dest = torch.zeros(LAYERS, 2, len(PAGES) * PAGE, 2, 8, dtype=pool.dtype)
            stats = _fetch(kv, endpoint, agreement, dest, [f"127.0.0.1:{served[0].port}"])
            assert served[0].service.sent_bytes == 0
            assert stats.retries >= 1  # the fall back to the rank
            assert same_bits(dest, _expected(pool))


def test_a_chunk_damaged_mid_range_stops_there_and_the_rank_sends_the_rest(monkeypatch):
    # Chunks leave one by one as each matches its seal: those before the damaged one are sent,
    # not one byte of it, and the stream goes on at the rank for the cells it lacks.
    monkeypatch.setenv(DAMAGE_ENV, "r1@2")  # the third staging of r1 only
    with _staged_rank(1) as (source, pool, endpoint, agreement, kv, staging):
        source.add("r1", PAGES)
        with _relays(endpoint, agreement, staging) as served:
            dest = torch.zeros(LAYERS, 2, len(PAGES) * PAGE, 2, 8, dtype=pool.dtype)
            stats = kv.fetch({0: endpoint}, "r1", agreement.fingerprint, placer(dest, []), timeout=20,
                             layer_end=LAYERS, pages={0: [p for p, _ in PAGES]}, streams_per_rank=1,
                             relays={0: [f"127.0.0.1:{served[0].port}"]}, max_chunk_bytes=CHUNK)
            assert served[0].service.sent_chunks == 2  # the two chunks staged before the damaged one
            assert served[0].service.sent_bytes == 2 * CHUNK
            assert stats.retries == 1 and same_bits(dest, _expected(pool))


def test_a_stage_reply_without_a_seal_sends_nothing(monkeypatch):
    # A rank that vouches for nothing: the relay cannot check the bytes, so none leave.
    with _staged_rank(1) as (source, pool, endpoint, agreement, kv, staging):
        source.add("r1", PAGES)
        real = lanekv_pb2.StageReply.FromString
        monkeypatch.setattr(lanekv_pb2.StageReply, "FromString",
                            staticmethod(lambda data: lanekv_pb2.StageReply(nbytes=real(data).nbytes)))
        with _relays(endpoint, agreement, staging) as served:
            dest = torch.zeros(LAYERS, 2, len(PAGES) * PAGE, 2, 8, dtype=pool.dtype)
            stats = _fetch(kv, endpoint, agreement, dest, [f"127.0.0.1:{served[0].port}"])
            assert served[0].service.sent_bytes == 0 and stats.retries >= 1
            assert same_bits(dest, _expected(pool))


def test_stage_kv_serves_only_its_relays_and_the_pages_they_hold():
    with _staged_rank(1) as (source, _, endpoint, agreement, _, staging):
        source.add("r1", PAGES)
        secret = staging.areas[0].secret
        with grpc.insecure_channel(endpoint) as channel:
            call = channel.unary_unary(STAGE_METHOD, request_serializer=lanekv_pb2.StageRequest.SerializeToString,
                                       response_deserializer=lanekv_pb2.StageReply.FromString)

            def stage(**kw):
                fields = dict(secret=secret, request_id="r1", layer_start=0, layer_end=1, pages=[0, 1], slot=0)
                return call(lanekv_pb2.StageRequest(**{**fields, **kw}), timeout=5)

            assert stage().nbytes == 2 * 2 * PAGE * ROW_BYTES
            for bad, code in (({"secret": "x" * 32}, grpc.StatusCode.PERMISSION_DENIED),
                              ({"slot": 4}, grpc.StatusCode.INVALID_ARGUMENT),
                              ({"pages": [0, 9]}, grpc.StatusCode.INVALID_ARGUMENT),
                              ({"pages": [0, 0]}, grpc.StatusCode.INVALID_ARGUMENT),
                              ({"layer_end": LAYERS + 1}, grpc.StatusCode.INVALID_ARGUMENT),
                              ({"request_id": "r2"}, grpc.StatusCode.NOT_FOUND)):
                with pytest.raises(grpc.RpcError) as err:
                    stage(**bad)
                assert err.value.code() == code, (bad, err.value.details())
            source.release("r1")
            with pytest.raises(grpc.RpcError) as err:
                stage()
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.timeout(90)
def test_a_staged_relay_killed_mid_stream_falls_back_and_its_files_go():
    with _staged_rank(1) as (source, pool, endpoint, agreement, kv, staging):
        progress = LayerProgress(LAYERS)  # a prefill still running: layer 0 written only
        progress.layer_written(0)
        source.add("r1", PAGES, progress=progress)
        spec = RelaySpec(0, endpoint, agreement.encode(), kv.security, "127.0.0.1", "127.0.0.1", "cpu")
        relays = RelayProcesses(spec, 1, staging)  # both streams go to it
        try:
            dest = torch.zeros(LAYERS, 2, len(PAGES) * PAGE, 2, 8, dtype=pool.dtype)
            box = {}
            fetch = threading.Thread(target=lambda: box.update(stats=_fetch(kv, endpoint, agreement, dest,
                                                                             relays.endpoints)))
            fetch.start()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not dest[0].any():  # layer 0 arrived through the relays
                time.sleep(0.05)
            assert dest[0].any()
            relays.processes[0].send_signal(signal.SIGKILL)
            relays.processes[0].wait(10)
            for layer in range(1, LAYERS):
                progress.layer_written(layer)
            fetch.join(30)
            assert same_bits(dest, _expected(pool))
            assert box["stats"].retries >= 1  # the dead relay's stream went on at the rank
        finally:
            relays.close()
        assert all(p.poll() is not None for p in relays.processes)
    # Named as the rank's own (its pid): a SIGKILLed rank's are reclaimed (runtime.shmfiles).
    assert all(owner_of(Path(area.path).name) == os.getpid() for area in staging.areas)
    assert not any(glob.glob(area.path) for area in staging.areas)  # unlinked by close


@requires_gpu
@pytest.mark.timeout(120)
def test_a_staged_relay_moves_a_gpu_pools_pages():
    # The rank gathers on its read streams and DMAs into its relays' slots, pinned by
    # cudaHostRegister; the relays never touch CUDA.
    from lanekv.prefill.cp.page_source import RankPageSource

    agreement = make_agreement(kv_dtype="float16")
    cpu = torch.zeros(LAYERS, 2, 8 * PAGE, 2, 8, dtype=torch.float16)
    for layer in range(LAYERS):
        fill(cpu, [p for _, p in PAGES], layer, seed=layer + 11)
    pool = cpu.to("cuda:0")
    source = RankPageSource(agreement, 0, pool, lambda *_: None)
    staging = RankStaging(uuid.uuid4().hex[:8], 0, 2, pool.device)
    served = serve(source, relay_staging=staging)
    endpoint = f"127.0.0.1:{served.port}"
    source.set_topology(Topology(1, "in_seq", "page_mod_cp", (endpoint,)))
    source.add("g1", PAGES)
    kv = KVClient()
    relays = RelayProcesses(RelaySpec(0, endpoint, agreement.encode(), kv.security, "127.0.0.1", "127.0.0.1",
                                      "cuda:0"), 2, staging)
    try:
        dest = torch.zeros(LAYERS, 2, len(PAGES) * PAGE, 2, 8, dtype=torch.float16)
        stats = _fetch(kv, endpoint, agreement, dest, relays.endpoints, rid="g1")
        assert same_bits(dest, _expected(cpu)) and stats.retries == 0
    finally:
        relays.close()
        kv.close()
        served.server.stop(None)
        staging.close()
    assert not any(glob.glob(area.path) for area in staging.areas)
