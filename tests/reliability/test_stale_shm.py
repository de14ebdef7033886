"""Shared-memory files of dead daemons are reclaimed when a daemon starts.

A prefill rank's /dev/shm pool and a receiver's ring carry their owner
daemon's pid in their names. A daemon killed with SIGKILL (or a whole host
of them) left its files behind: /dev/shm is memory. ``reclaim_stale`` removes
the files whose owner is gone and keeps every live owner's and every file
that is not lanekv's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.shmfiles import owner_of, pool_file_name, receiver_prefix, reclaim_stale

pytestmark = pytest.mark.timeout(60)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_reclaim_removes_only_files_of_dead_owners(tmp_path: Path):
    dead = _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [pool_file_name("0a1b2c", 0, "deadbeef", pid=dead), pool_file_name("0a1b2c", 1, "cafe0123", pid=dead),
                 receiver_prefix(dead) + "x_8kq2"]
        live = [pool_file_name("ffee", 0, "01234567", pid=sleeper.pid), receiver_prefix(sleeper.pid) + "abc",
                pool_file_name("ffee", 1, "01234567")]  # ours
        other = ["lanekv-notes", f"something-{dead}-else", f"lanekv-{dead}", "lanekv-receiver-start"]
        for name in stale + live + other:
            (tmp_path / name).write_bytes(b"\0" * 4096)
        reclaimed = reclaim_stale(tmp_path)
        assert sorted(path.name for path in reclaimed.paths) == sorted(stale)
        assert reclaimed.bytes == 3 * 4096
        assert sorted(os.listdir(tmp_path)) == sorted(live + other)
        assert reclaim_stale(tmp_path).paths == ()  # nothing more to do
    finally:
        sleeper.kill()
        sleeper.wait()
    assert owner_of(live[0]) == sleeper.pid and owner_of("lanekv-receiver-start") is None


def test_a_missing_directory_reclaims_nothing(tmp_path: Path):
    assert reclaim_stale(tmp_path / "absent").paths == ()
