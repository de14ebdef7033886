"""A prefill daemon and a decode daemon paired in this process, for end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from decode.config import DecodeConfig
from decode.daemon import DecodeDaemon
from prefill.daemon import DaemonConfig, PrefillDaemon
from prefill.engine_config import EngineConfig

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
            **{"device": "cpu", "index_cache_dtype": engine.index_cache_dtype, **decode}))
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
