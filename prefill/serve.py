"""``lanekv prefill``: start the daemon, serve until SIGINT/SIGTERM, shut down cleanly."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from prefill.daemon import DaemonConfig, PrefillDaemon
from prefill.engine_config import EngineConfig
from prefill.launcher import RankDiedError

log = logging.getLogger("lanekv.prefill")


def main(args: argparse.Namespace) -> int:
    try:
        engine = EngineConfig(
            model_path=args.model, cp_size=args.cp_size, page_size=args.page_size,
            pages_per_lane=args.pool_pages, dtype=args.dtype, device=args.device,
            load_format=args.load_format,
        )
        config = DaemonConfig(host=args.host, port=args.port, transfer_port_base=args.transfer_port_base,
                              lease_s=args.lease_s, batch_wait_ms=args.batch_wait_ms)
    except ValueError as err:
        print(f"lanekv prefill: {err}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s without TLS: anyone who reaches this address can read KV pages", args.host)
    try:
        daemon = PrefillDaemon(engine, config)
    except (OSError, RankDiedError, ValueError) as err:
        print(f"lanekv prefill: could not start: {err}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.ready_file:
        Path(args.ready_file).write_text(daemon.endpoint)
    print(f"lanekv prefill serving on {daemon.endpoint} (ranks: {', '.join(daemon.topology.endpoints)})", flush=True)
    stop.wait()
    log.info("shutting down: draining queued prefills, stopping ranks")
    daemon.stop()
    return 0
