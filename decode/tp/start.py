"""The decode daemon's tensor-parallel parts, built at its start-up (``tp_size > 1``).

``start_group`` starts the group (rank 0's shard and pool in the daemon's
process) with each rank's pool as large as ``config.pool_pages``; ``tp_fetcher``
wraps the daemon's gRPC fetcher so every rank fetches its KV heads
(``decode.tp.fetch``). What each rank holds is logged by the ranks
(``decode.tp.rank.build_rank``) and, in one line per rank, here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from lanekv.decode.tp.fetch import FetchSetup, TPFetcher
from lanekv.decode.tp.group import TPGroup
from lanekv.decode.tp.rank import TPSpec
from lanekv.transfer.connector.fetcher import KVFetcher
from lanekv.transfer.protocol.agreement import Agreement

if TYPE_CHECKING:
    from lanekv.decode.config import DecodeConfig

log = logging.getLogger("lanekv.decode")


def start_group(config: DecodeConfig, on_death: Callable[[int, str], None]) -> TPGroup:
    spec = TPSpec(config.model_path, config.tp_size, config.torch_dtype, config.resolved_device,
                  config.pool_pages, config.page_size, kv_cache_dtype=config.kv_cache_dtype,
                  index_cache_dtype=config.index_cache_dtype)
    log.info("tp_size=%d: every decode rank fetches its KV heads (%s)", config.tp_size,
             " or ".join(config.transports))
    group = TPGroup(spec, on_death=on_death)
    for ready in group.ready:
        log.info("decode rank %d (pid %d): %.1f MiB of weights, %.1f MiB of KV pool (%d pages)", ready.rank,
                 ready.pid, ready.weight_bytes / 2**20, ready.pool_bytes / 2**20, config.pool_pages)
    return group


def tp_fetcher(config: DecodeConfig, fetcher: KVFetcher, group: TPGroup, agreement: Agreement) -> TPFetcher:
    setup = FetchSetup(config.security, config.fetch_retry, agreement, config.max_inflight_bytes,
                       config.fetch_chunk_bytes, config.resolved_fetch_streams, config.transports)
    return TPFetcher(fetcher, group, setup)
