"""runtime.workers.start: a CPU worker forked from the fork server is what a spawned one was:
the environment and fds 1-2 of its start, not those of the server's start; its parent
(the server) goes once the starting process is gone; CUDA workers are spawned."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from lanekv.runtime.workers.start import START_ENV, worker_context, worker_process

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


def _report(path: str, name: str) -> None:
    """The worker's target: writes the variable and its parent's pid, says hello on fd 2."""
    Path(path).write_text(f"{os.environ.get(name, '<unset>')} {os.getppid()}")
    os.write(2, b"hello from the worker\n")


def _run(ctx, tmp_path: Path, name: str) -> list[str]:
    out = tmp_path / f"out-{time.monotonic_ns()}"
    proc = worker_process(ctx, _report, (str(out), name), name="lanekv-test-worker")
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    return out.read_text().split()


def test_the_context_follows_the_device_and_the_start_variable(monkeypatch):
    monkeypatch.delenv(START_ENV, raising=False)
    assert worker_context("cuda", __name__).get_start_method() == "spawn"
    assert worker_context("cpu", __name__).get_start_method() == "forkserver"
    monkeypatch.setenv(START_ENV, "spawn")
    assert worker_context("cpu", __name__).get_start_method() == "spawn"
    monkeypatch.setenv(START_ENV, "fork")
    with pytest.raises(ValueError, match="LANEKV_WORKER_START must be forkserver or spawn, got 'fork'"):
        worker_context("cpu", __name__)


def test_a_forked_worker_has_the_environment_and_stderr_of_its_start(tmp_path, monkeypatch, capfd):
    ctx = worker_context("cpu", __name__)
    name = "LANEKV_PROCSTART_TEST"
    monkeypatch.delenv(name, raising=False)
    assert _run(ctx, tmp_path, name)[0] == "<unset>"  # the server starts without the variable
    for value in ("first", "second"):  # set after the server started: the worker still sees it
        monkeypatch.setenv(name, value)
        value_seen, parent = _run(ctx, tmp_path, name)
        assert value_seen == value and int(parent) != os.getpid()  # forked by the server
    assert capfd.readouterr().err.count("hello from the worker") == 3


def test_a_spawned_worker_has_the_environment_of_its_start(tmp_path, monkeypatch):
    monkeypatch.setenv("LANEKV_PROCSTART_TEST", "spawned")
    value_seen, parent = _run(worker_context("cuda", __name__), tmp_path, "LANEKV_PROCSTART_TEST")
    assert value_seen == "spawned" and int(parent) == os.getpid()


def test_the_fork_server_and_an_orphaned_worker_end_with_the_starting_process(tmp_path):
    """A starter SIGKILLed with its worker alive: the server exits, so the worker's parent
    changes (what a rank's orphan check reads)."""
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from lanekv.runtime.workers.start import worker_context, worker_process
        from tests.runtime.test_procstart import _watch_parent
        if __name__ == "__main__":
            ctx = worker_context("cpu", "tests.runtime.test_procstart")
            worker_process(ctx, _watch_parent, ({str(tmp_path)!r},), name="w").start()
            time.sleep(600)
    """)
    starter = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert starter.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        starter.kill()
        starter.wait()
    deadline = time.monotonic() + 30
    while not (tmp_path / "orphaned").exists():
        assert time.monotonic() < deadline, "the worker's parent did not change"
        time.sleep(0.05)


def _watch_parent(folder: str) -> None:
    parent = os.getppid()
    Path(folder, "started").write_text(str(parent))
    deadline = time.monotonic() + 60
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.getppid() != parent:
        Path(folder, "orphaned").write_text(str(os.getppid()))
