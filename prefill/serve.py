"""``lanekv prefill``: start the daemon, serve until SIGINT/SIGTERM, shut down cleanly.

Exit codes: 0 after a clean shutdown, 1 when start-up fails (a busy port, a
rank that failed to start) or a rank dies while serving (one line naming it),
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch
from lanekv.model.config import ModelConfig
from lanekv.model.dtypes import DTYPES, resolve_dtype
from lanekv.model.parallel.ep import ep_weight_bytes
from lanekv.model.pool_sizing import (
    PoolSize,
    check_max_model_len,
    cuda_memory,
    page_bytes,
    pool_line,
    size_pool,
    weight_bytes,
)
from lanekv.prefill.cp.launcher import RankDiedError
from lanekv.prefill.daemon import STOP_GRACE_S, DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.runtime.daemon import serve_until_signal
from lanekv.runtime.security import SecurityConfig

log = logging.getLogger("lanekv.prefill")
_DEFAULT_PAGES = EngineConfig.__dataclass_fields__["pages_per_lane"].default


def _unit_bytes(engine: EngineConfig) -> int:
    model = ModelConfig.from_dir(engine.model_path)
    return page_bytes(model, engine.torch_dtype, engine.page_size, engine.index_cache_dtype,
                      engine.kv_cache_dtype)


def _rank_weight_bytes(args: argparse.Namespace, model: ModelConfig, dtype: torch.dtype) -> int:
    """One rank's weights: the whole model, less the routed experts other ranks hold with --ep."""
    if getattr(args, "ep", False) and model.moe is not None and args.cp_size > 1:
        return ep_weight_bytes(model, dtype, args.cp_size)
    return weight_bytes(model, dtype)


def _pool_size(args: argparse.Namespace, dtype: str) -> PoolSize:
    """Pages in each rank's pool (``model.pool_sizing.size_pool``), checked against --max-model-len."""
    model = ModelConfig.from_dir(args.model)
    torch_dtype = DTYPES[dtype]
    unit = page_bytes(model, torch_dtype, args.page_size, args.index_cache_dtype,
                      getattr(args, "kv_cache_dtype", "auto"))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    utilization = getattr(args, "gpu_memory_utilization", None)
    size = size_pool(
        unit, pool_pages=getattr(args, "pool_pages", None), kv_cache_memory=getattr(args, "kv_cache_memory", None),
        gpu_memory_utilization=utilization, default_pages=_DEFAULT_PAGES,
        memory=(lambda: cuda_memory(args.cp_size)) if cuda else None,
        weights=_rank_weight_bytes(args, model, torch_dtype) if cuda and utilization is not None else 0)
    # A prompt's pages spread over the ranks' owner lanes: the pool holds cp_size lanes.
    check_max_model_len(getattr(args, "max_model_len", None), model.max_position_embeddings,
                        size.pages * args.page_size * args.cp_size)
    return size


def main(args: argparse.Namespace) -> int:
    try:
        dtype = resolve_dtype(args.dtype, args.model)
        size = _pool_size(args, dtype)
        engine = EngineConfig(
            model_path=args.model, cp_size=args.cp_size, page_size=args.page_size,
            pages_per_lane=size.pages, dtype=dtype, device=args.device,
            load_format=args.load_format, index_cache_dtype=args.index_cache_dtype,
            kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
            graph_max_rows=args.graph_max_rows, ep=getattr(args, "ep", False),
            ep_dispatch=getattr(args, "ep_dispatch", "sized"),
            fetch_relays=getattr(args, "fetch_relays", 0),
        )
        config = DaemonConfig(host=args.host, port=args.port, transfer_port_base=args.transfer_port_base,
                              lease_s=args.lease_s, batch_wait_ms=args.batch_wait_ms,
                              prefix_cache=getattr(args, "prefix_cache", True),
                              prefix_cache_share=getattr(args, "prefix_cache_share", 1.0),
                              metrics_port=getattr(args, "metrics_port", None),
                              advertise_host=getattr(args, "advertise_host", None),
                              security=SecurityConfig.from_args(args))
    except (ValueError, TypeError) as err:
        print(f"lanekv prefill: {err}", file=sys.stderr)
        return 2
    log.info("%s", pool_line("prefill", engine.pages_per_lane, engine.page_size, _unit_bytes(engine),
                             engine.cp_size, size.how))
    if engine.resolved_device == "cuda":
        torch.set_num_threads(1)  # as in each rank: this process builds small host tensors only
    try:
        daemon = PrefillDaemon(engine, config)
    except (OSError, RankDiedError, ValueError) as err:
        print(f"lanekv prefill: could not start: {err}", file=sys.stderr)
        return 1
    banner = daemon.rpc.banner("lanekv prefill", f"ranks: {', '.join(daemon.topology.endpoints)}")
    return serve_until_signal(daemon, banner, args.ready_file, STOP_GRACE_S, log,
                              "draining queued prefills, stopping ranks", prog="lanekv prefill",
                              settle=daemon.settle)
