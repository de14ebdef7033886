"""A relay process (``python -m lanekv.transfer.rank.relay_main``; see ``transfer.rank.relay``).

Reads its ``RelaySpec`` pickled on stdin (from the rank that started it: one
process, one owner), maps the rank's pool (mapped) or its staging file (staged:
no CUDA in this process, ``relay_staged``), binds a free port, writes
``port <n>`` on stdout and serves until SIGTERM/SIGINT or until its parent
exits (the kernel's parent-death signal where there is one, and a poll of the
parent's pid either way), so a rank never leaves a relay behind.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import threading

import torch
from lanekv.runtime.hostmem import keep_freed_buffers
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.rank.relay import RelayService, RelaySpec, serve_relay

PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.5


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the poll below still ends the relay


def main() -> int:
    parent = os.getppid()
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec: RelaySpec = pickle.loads(sys.stdin.buffer.read())  # from our parent, the rank: trusted
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if os.getppid() != parent:
        return 0
    # One torch thread: a staged relay's CPU work (the seal check, numpy's) is single-threaded, and
    # four relays of a rank with a thread per core each would only contend on the host's cores.
    torch.set_num_threads(1)
    keep_freed_buffers()  # a multi-MiB message per chunk: reuse freed ones, do not fault in fresh pages
    if spec.device.startswith("cuda") and spec.staging is None:  # a staged relay never touches CUDA
        torch.cuda.set_device(torch.device(spec.device))
    try:
        service = RelayService(spec.rank, spec.rank_endpoint, Agreement.decode(spec.agreement), spec.security,
                               staging=spec.staging)
        served = serve_relay(service, spec.host)  # a mapped relay maps the pool at the first fetch
    except Exception as err:  # noqa: BLE001 - the rank reads our stdout and reports the failure
        logging.getLogger("lanekv.transfer").error("relay of rank %d failed to start: %s", spec.rank, err)
        return 1
    index = os.environ.get("LANEKV_RELAY_INDEX", "?")
    logging.getLogger("lanekv.transfer").info("relay %s of rank %d serves FetchKV on port %d (pid %d)", index,
                                              spec.rank, served.port, os.getpid())
    sys.stdout.write(f"port {served.port}\n")
    sys.stdout.flush()
    if service.staging is None:
        threading.Thread(target=service.attach_when_served, args=(stop,), name="relay-attach", daemon=True).start()
    while not stop.wait(PARENT_POLL_S):
        if os.getppid() != parent:
            break
    served.stop(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
