"""Shared-memory files of lanekv processes, and reclaiming those of dead ones.

A prefill daemon's CPU ranks keep their KV pools in /dev/shm files, and a
decode daemon's receiver processes their rings. Each name carries the pid of
the daemon process that owns it (``pool_file_name``, ``receiver_prefix``).
A daemon killed with SIGKILL removes nothing, and /dev/shm is memory: each
daemon therefore calls ``reclaim_stale`` when it starts, which removes every
such file whose owner pid is not a running process. A live daemon's files
are never touched (its pid is running); a pid reused by an unrelated process
keeps a stale file until that process ends too.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# lanekv-<epoch>-rank<r>-<pid>-<id> (a rank's pool, or a staged relay's file: <id> = stage<i>_<hex>),
# lanekv-receiver-<pid>-<random> (a ring).
_OWNED = re.compile(r"lanekv-(?:[0-9a-f]+-rank\d+|receiver)-(\d+)-[A-Za-z0-9_]+\Z")


def pool_file_name(epoch: str, rank: int, suffix: str, pid: int | None = None) -> str:
    """The /dev/shm name of rank ``rank``'s pool, owned by ``pid`` (default: this process)."""
    return f"lanekv-{epoch}-rank{rank}-{os.getpid() if pid is None else pid}-{suffix}"


def receiver_prefix(pid: int | None = None) -> str:
    """The prefix of a receiver ring's file name (``tempfile`` adds the rest)."""
    return f"lanekv-receiver-{os.getpid() if pid is None else pid}-"


def owner_of(name: str) -> int | None:
    """The owner pid a lanekv shared-memory file name carries; None for other names."""
    match = _OWNED.match(name)
    return int(match.group(1)) if match else None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: running
        return True
    return True


class Reclaimed(NamedTuple):
    paths: tuple[Path, ...]  # removed
    bytes: int  # their sizes together


def reclaim_stale(directory: Path = SHM_DIR) -> Reclaimed:
    """Remove the lanekv files in ``directory`` whose owner process is gone; log what went."""
    removed, total = [], 0
    try:
        entries = list(os.scandir(directory))
    except OSError:  # no /dev/shm here
        return Reclaimed((), 0)
    for entry in entries:
        pid = owner_of(entry.name)
        if pid is None or pid == os.getpid() or _running(pid):
            continue
        try:
            size = entry.stat(follow_symlinks=False).st_size
            os.unlink(entry.path)
        except FileNotFoundError:  # another daemon reclaimed it first
            continue
        except OSError as err:
            log.warning("cannot remove stale shared-memory file %s: %s", entry.path, err)
            continue
        removed.append(Path(entry.path))
        total += size
    if removed:
        log.info("removed %d stale shared-memory file(s) of dead lanekv processes (%d bytes): %s",
                 len(removed), total, ", ".join(path.name for path in removed[:8]))
    return Reclaimed(tuple(removed), total)
