"""Where a group of rank processes on one host meets: a store its starter holds.

Picking a free port and handing it to the ranks races with every other process on
the host: the port is free when it is picked and may be taken before rank 0 binds it
(EADDRINUSE at start-up). So the process that starts the group listens first, on a
port the OS gives it (``host_store``), keeps that store for the group's life, and
hands only the bound port to the ranks, which join it as clients (``join_store``)
and pass the store to ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

HOST = "127.0.0.1"  # the ranks of a group share the starter's host


def host_store(port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """The group's store, listening on ``port`` (0: one the OS picks; read ``.port``).

    The caller keeps the returned object while the ranks live: dropping it closes the
    listening socket."""
    return dist.TCPStore(HOST, port, None, True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """A rank's client of the store its starter holds on ``port``."""
    return dist.TCPStore(HOST, port, None, False, timeout=timedelta(seconds=timeout_s))
