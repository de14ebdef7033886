"""Shared-memory files of dead daemons are reclaimed when a daemon starts.

A prefill rank's /dev/shm pool and a receiver's ring carry their owner
daemon's pid in their names. A daemon killed with SIGKILL (or a whole host
of them) left its files behind: /dev/shm is memory. ``reclaim_stale`` removes
the files whose owner is gone and keeps every live owner's and every file
that is not lanekv's.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lanekv.runtime.daemon import DaemonServer
from lanekv.runtime.security import SecurityConfig
from lanekv.runtime.shmfiles import (
    SHM_DIR,
    owner_of,
    pool_file_name,
    receiver_prefix,
    reclaim_stale,
)

from tests.checkpoints import write_llama

pytestmark = pytest.mark.timeout(180)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_reclaim_removes_only_files_of_dead_owners(tmp_path: Path):
    dead = _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [pool_file_name("0a1b2c", 0, "deadbeef", pid=dead), pool_file_name("0a1b2c", 1, "cafe0123", pid=dead),
                 receiver_prefix(dead) + "x_8kq2",
                 pool_file_name("0a1b2c", 0, "stage1_0badf00d", pid=dead)]  # a staged relay's (transfer.rank.staging)
        live = [pool_file_name("ffee", 0, "01234567", pid=sleeper.pid), receiver_prefix(sleeper.pid) + "abc",
                pool_file_name("ffee", 1, "01234567")]  # ours
        other = ["lanekv-notes", f"something-{dead}-else", f"lanekv-{dead}", "lanekv-receiver-start"]
        for name in stale + live + other:
            (tmp_path / name).write_bytes(b"\0" * 4096)
        reclaimed = reclaim_stale(tmp_path)
        assert sorted(path.name for path in reclaimed.paths) == sorted(stale)
        assert reclaimed.bytes == 4 * 4096
        assert sorted(os.listdir(tmp_path)) == sorted(live + other)
        assert reclaim_stale(tmp_path).paths == ()  # nothing more to do
    finally:
        sleeper.kill()
        sleeper.wait()
    assert owner_of(live[0]) == sleeper.pid and owner_of("lanekv-receiver-start") is None


def test_a_missing_directory_reclaims_nothing(tmp_path: Path):
    assert reclaim_stale(tmp_path / "absent").paths == ()


def test_the_pool_file_a_sigkilled_rank_left_is_reclaimed_by_the_next_daemon(tmp_path: Path, caplog):
    """A real ``lanekv prefill`` (CP 2, CPU ranks with /dev/shm pools): rank 1 is SIGKILLed
    while its parent is stopped, then the parent; rank 0, orphaned, removes its own
    pool. Rank 1's file stays behind until a daemon starts: then it is reclaimed, and
    a file of a live owner is kept."""
    if not SHM_DIR.is_dir():
        pytest.skip("needs /dev/shm")
    checkpoint = write_llama(tmp_path / "llama")
    ready, log = tmp_path / "ready", tmp_path / "stderr"
    repo = Path(__file__).resolve().parents[2]
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lanekv.cli", "prefill", "--model", str(checkpoint), "--cp-size", "2",
             "--page-size", "4", "--pool-pages", "16", "--device", "cpu", "--ready-file", str(ready)],
            cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.DEVNULL, stderr=err)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = SHM_DIR / pool_file_name("ab12", 0, "0badcafe", pid=sleeper.pid)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        pids = {int(r): int(p) for r, p in re.findall(r"rank (\d) pid (\d+)", log.read_text())}
        pools = sorted(name for name in os.listdir(SHM_DIR) if owner_of(name) == proc.pid)
        assert len(pools) == 2 and [f"-rank{r}-" in name for r, name in enumerate(pools)] == [True, True], pools
        live.write_bytes(b"\0" * 4096)
        os.kill(proc.pid, signal.SIGSTOP)  # the launcher cannot clean up after rank 1
        os.kill(pids[1], signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10  # rank 0 sees its parent gone within a second
        while (SHM_DIR / pools[0]).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = sorted(name for name in os.listdir(SHM_DIR) if owner_of(name) == proc.pid)
        # Rank 1's file stays behind; a daemon that another test (make test runs files in
        # parallel) starts now may reclaim it before ours does, and only then is it gone here.
        assert set(left) <= {pools[1]}, (left, pools)
        with caplog.at_level(logging.INFO, logger="lanekv.runtime.shmfiles"):
            server = DaemonServer(SecurityConfig(), "127.0.0.1", 0, 2, None)  # what both daemons start with
            server.close()
        assert not (SHM_DIR / pools[1]).exists() and live.exists()
        if left:  # it was there when this daemon started: this daemon removed it
            assert pools[1] in caplog.text, caplog.text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sleeper.kill()
        sleeper.wait()
        live.unlink(missing_ok=True)
