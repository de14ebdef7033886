"""A prefill daemon and a decode daemon paired in this process, for end-to-end tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc

# Leases long enough that no test's pages expire under it.
LONG_LEASE = DaemonConfig(lease_s=600)


def start_pair(engine: EngineConfig, daemon: DaemonConfig = LONG_LEASE,
               **decode: Any) -> tuple[PrefillDaemon, DecodeDaemon]:
    """Start the prefill daemon, then a CPU decode daemon against it
    (``decode`` holds DecodeConfig fields; page size and model come from ``engine``)."""
    prefill = PrefillDaemon(engine, daemon)
    try:
        decode_daemon = DecodeDaemon(DecodeConfig(
            engine.model_path, prefill.endpoint, page_size=engine.page_size,
            **{"device": "cpu", "index_cache_dtype": engine.index_cache_dtype,
               "kv_cache_dtype": engine.kv_cache_dtype, **decode}))
    except BaseException:
        prefill.stop()
        raise
    return prefill, decode_daemon


def stop_pair(prefill: PrefillDaemon, decode: DecodeDaemon) -> None:
    decode.stop(grace_s=1.0)
    prefill.stop()


@contextmanager
def running_pair(engine: EngineConfig, daemon: DaemonConfig = LONG_LEASE,
                 **decode: Any) -> Iterator[tuple[PrefillDaemon, DecodeDaemon]]:
    pair = start_pair(engine, daemon, **decode)
    try:
        yield pair
    finally:
        stop_pair(*pair)


def generate_concurrently(endpoint: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          id_prefix: str | None = None) -> list[list[int] | None]:
    """Every prompt's Generate at once, each in a thread; each call's output ids, in
    prompt order (None where a call did not end within 150 s). ``id_prefix``: the
    requests are named ``<prefix>-<i>`` (default: the daemon names them)."""
    results: list[list[int] | None] = [None] * len(prompts)
    with grpc.insecure_channel(endpoint) as channel:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)

        def run(i: int) -> None:
            named = {} if id_prefix is None else {"request_id": f"{id_prefix}-{i}"}
            request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=prompts[i]),
                                                 max_new_tokens=max_new_tokens, **named)
            results[i] = [t for reply in stub.Generate(request, timeout=120) for t in reply.token_ids]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(150)
    return results
