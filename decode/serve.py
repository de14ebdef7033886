"""``lanekv decode``: start the daemon, serve until SIGINT/SIGTERM, drain, shut down.

After start-up and the heap freeze, and before the ready file, one warm-up
request goes through each prefill daemon (``DecodeDaemon.warm_up``; on CUDA by
default, ``--[no-]warm-up-request``).

Exit codes: 0 after a clean shutdown, 1 when start-up fails (a refused layout
contract prints the field-by-field diff to stderr first), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import STOP_GRACE_S, DecodeDaemon
from lanekv.decode.tp.group import RankFailed
from lanekv.model.config import ModelConfig
from lanekv.model.dtypes import DTYPES, resolve_dtype
from lanekv.model.parallel.ep import ep_weight_bytes
from lanekv.model.parallel.tp import shard_config
from lanekv.model.pool_sizing import GIB, PoolSize, page_bytes, pool_line, size_pool, weight_bytes
from lanekv.runtime.daemon import serve_until_signal
from lanekv.runtime.security import SecurityConfig
from lanekv.transfer.grpcfetch.client import ContractMismatch, TransferError
from lanekv.transfer.protocol.fielddiff import format_diff

log = logging.getLogger("lanekv.decode")
# The decode loop shares this process's GIL with one gRPC thread per open stream.
# At Python's default switch interval (5 ms) a loop that is ready for its next
# step can wait that long behind stream threads. A 0.5 ms interval hands the GIL
# over sooner (BENCHMARKS.md, issue 18: ITL through the daemons at 64 streams).
GIL_SWITCH_INTERVAL_S = 0.0005
# Optional flags of ``lanekv decode``: None (not given) leaves DecodeConfig's default.
_CONFIG_FLAGS = ("page_wait_s", "connect_timeout_s", "transport", "fetch_processes", "fetch_streams",
                 "graph_batch_sizes", "prefill_health_interval_s", "tp_size")


def config_from_args(args: argparse.Namespace, size: PoolSize | None = None) -> DecodeConfig:
    optional = {
        name: getattr(args, name) for name in _CONFIG_FLAGS if getattr(args, name, None) is not None
    }
    if "graph_batch_sizes" in optional:
        optional["graph_batch_sizes"] = tuple(optional["graph_batch_sizes"])
    prefills = args.prefill if isinstance(args.prefill, list) else [args.prefill]
    dtype = resolve_dtype(args.dtype, args.model)
    return DecodeConfig(
        model_path=args.model, prefill_endpoint=prefills[0], extra_prefill_endpoints=tuple(prefills[1:]),
        page_size=args.page_size,
        dtype=dtype, device=args.device, pool_pages=(size or pool_size(args, dtype)).pages, host=args.host,
        max_model_len=getattr(args, "max_model_len", None),
        port=args.port, load_format=args.load_format, max_batch_size=args.max_batch_size,
        index_cache_dtype=args.index_cache_dtype,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        metrics_port=getattr(args, "metrics_port", None), security=SecurityConfig.from_args(args),
        advertise_host=getattr(args, "advertise_host", None),
        prefix_cache=getattr(args, "prefix_cache", True),
        prefix_cache_share=getattr(args, "prefix_cache_share", 1.0), **optional,
    )


def pool_size(args: argparse.Namespace, dtype: str) -> PoolSize:
    """Pages of the decode pool (``model.pool_sizing.size_pool``); the device must be there first."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no GPU is visible (torch.cuda.is_available() is False); "
                         "give --device cpu or auto")
    # A TP rank holds 1/tp of each page's KV heads and about 1/tp of the weights.
    model = shard_config(ModelConfig.from_dir(args.model), getattr(args, "tp_size", None) or 1)
    torch_dtype = DTYPES[dtype]
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    utilization = getattr(args, "gpu_memory_utilization", None)
    return size_pool(
        page_bytes(model, torch_dtype, args.page_size, args.index_cache_dtype,
                   getattr(args, "kv_cache_dtype", "auto")),
        pool_pages=getattr(args, "pool_pages", None), kv_cache_memory=getattr(args, "kv_cache_memory", None),
        gpu_memory_utilization=utilization, default_pages=DecodeConfig.__dataclass_fields__["pool_pages"].default,
        memory=(lambda: [torch.cuda.mem_get_info()]) if cuda else None,
        weights=_rank_weights(model, torch_dtype, getattr(args, "tp_size", None) or 1)
        if cuda and utilization is not None else 0)


def _rank_weights(shard: ModelConfig, dtype: torch.dtype, tp_size: int) -> int:
    """One decode rank's weights: its shard's, the routed experts divided over the ranks."""
    if shard.moe is not None and tp_size > 1:
        return ep_weight_bytes(shard, dtype, tp_size)
    return weight_bytes(shard, dtype)


def main(args: argparse.Namespace) -> int:
    try:
        size = pool_size(args, resolve_dtype(args.dtype, args.model))
        config = config_from_args(args, size)
    except (ValueError, TypeError) as err:
        print(f"lanekv decode: {err}", file=sys.stderr)
        return 2
    model = shard_config(ModelConfig.from_dir(config.model_path), config.tp_size)
    log.info("%s", pool_line("decode", config.pool_pages, config.page_size,
                             page_bytes(model, config.torch_dtype, config.page_size, config.index_cache_dtype,
                                        config.kv_cache_dtype),
                             1, size.how))
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # the process's own entry point: nobody else's setting
    if config.resolved_device == "cuda":
        torch.set_num_threads(1)  # the host builds small tensors only (see prefill.cp.rank_worker)
    try:
        daemon = DecodeDaemon(config)
    except ContractMismatch as err:
        detail = format_diff(err.diffs, ours="decode", theirs="prefill") if err.diffs else str(err)
        which = (f"the prefill daemon at {config.prefill_endpoint}" if not config.extra_prefill_endpoints
                 else f"each of the prefill daemons at {', '.join(config.prefill_endpoints)}")
        print(f"lanekv decode: {which} and this decode daemon disagree on the layout contract; "
              f"nothing was served.\n{detail}", file=sys.stderr)
        return 1
    except (OSError, TransferError, ValueError, RankFailed) as err:
        print(f"lanekv decode: could not start: {err}", file=sys.stderr)
        return 1
    if config.resolved_device == "cuda":  # what the sizing's allowance left, after weights, pool and graphs
        free, total = torch.cuda.mem_get_info()
        log.info("GPU memory after start-up: %.2f GiB free of %.2f GiB", free / GIB, total / GIB)
    grace_s = getattr(args, "grace_s", None)
    warm = getattr(args, "warm_up_request", None)
    if warm is None:
        warm = daemon.warms_up_by_default
    banner = daemon.rpc.banner("lanekv decode", f"prefill: {', '.join(config.prefill_endpoints)}")
    return serve_until_signal(daemon, banner, args.ready_file, STOP_GRACE_S if grace_s is None else grace_s,
                              log, "finishing open streams", prog="lanekv decode",
                              settle=daemon.warm_up if warm else None)
