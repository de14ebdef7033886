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
from lanekv.prefill.cp.launcher import RankDiedError
from lanekv.prefill.daemon import STOP_GRACE_S, DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.runtime.daemon import serve_until_signal
from lanekv.runtime.security import SecurityConfig

log = logging.getLogger("lanekv.prefill")


def main(args: argparse.Namespace) -> int:
    try:
        engine = EngineConfig(
            model_path=args.model, cp_size=args.cp_size, page_size=args.page_size,
            pages_per_lane=args.pool_pages, dtype=args.dtype, device=args.device,
            load_format=args.load_format, index_cache_dtype=args.index_cache_dtype,
            graph_max_rows=args.graph_max_rows,
        )
        config = DaemonConfig(host=args.host, port=args.port, transfer_port_base=args.transfer_port_base,
                              lease_s=args.lease_s, batch_wait_ms=args.batch_wait_ms,
                              metrics_port=getattr(args, "metrics_port", None),
                              advertise_host=getattr(args, "advertise_host", None),
                              security=SecurityConfig.from_args(args))
    except (ValueError, TypeError) as err:
        print(f"lanekv prefill: {err}", file=sys.stderr)
        return 2
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
