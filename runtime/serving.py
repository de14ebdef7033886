"""What both daemons' command lines do once started: announce, serve until
SIGINT/SIGTERM, then hand over to the daemon's own drain."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Readers polling for the file never see it half written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def serve_until_signal(endpoint: str, banner: str, ready_file: str | None) -> None:
    """Write ``endpoint`` to ``ready_file``, print ``banner`` and block until
    SIGINT or SIGTERM (the caller then stops the daemon)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if ready_file:
        write_atomically(Path(ready_file), endpoint)
    print(banner, flush=True)
    stop.wait()
