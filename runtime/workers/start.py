"""How a daemon starts its worker processes (CP prefill ranks, decode TP followers).

A spawned process imports torch, Triton and the model code before it runs a line of
its own: several seconds of CPU per rank, paid again by every rank of every daemon
start. On CPU the workers come from multiprocessing's fork server instead: one
process per daemon process that imports the worker's module once (``preload``) and
forks each worker from there, so a rank starts with everything imported.

A forked worker must be what a spawned one was, so ``worker_process`` hands it the
environment and the stdout/stderr of the moment it is started (the fork server kept
those of its own start): a variable set since (a test hook, UCX settings) and the
output a caller captures reach the worker as they reached a spawned one. Its parent
is the fork server, which exits when this process does (a worker lets go of the
server's liveness pipe), so a worker's check for an orphaned start (``os.getppid()``
changed) still fires when the daemon is gone.

CUDA workers are still spawned: the fork server's imports may touch the driver
(``torch.cuda.is_available``), and a CUDA runtime does not survive a fork.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

START_ENV = "LANEKV_WORKER_START"  # forkserver (the default on CPU) or spawn


def worker_context(device_type: str, preload: str) -> Any:
    """The multiprocessing context of a daemon's workers on ``device_type`` ("cpu" or
    "cuda"); ``preload``: the module the fork server imports once (the workers' target's).
    ``LANEKV_WORKER_START=spawn`` spawns CPU workers too: each then runs its interpreter's
    start-up (``sitecustomize``, ``PYTHONSTARTUP``-style hooks) as a process of its own."""
    method = os.environ.get(START_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_ENV} must be forkserver or spawn, got {method!r}")
    if device_type != "cpu" or method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Read when the server starts (a running one keeps its own); runtime.workers.server: the
    # server outlives a SIGTERM to the process group, so the workers' exit codes reach us.
    ctx.set_forkserver_preload(["lanekv.runtime.workers.server", preload])
    return ctx


def worker_process(ctx: Any, target: Callable[..., Any], args: tuple, name: str) -> mp.process.BaseProcess:
    """A daemonic process of ``ctx`` running ``target(*args)`` with this process's
    environment and fds 1 and 2 as they are at ``start()``."""
    return ctx.Process(target=_run_as_started, args=(target, args, _AsStarted()), name=name, daemon=True)


class _AsStarted:
    """Pickled by ``Process.start``: the environment then and, for the fork server, fds 1
    and 2 (a spawned child inherits them); unpickled in the worker as what it received."""

    def __reduce__(self):
        from multiprocessing import context

        forked = getattr(context.get_spawning_popen(), "method", None) == "forkserver"
        fds = tuple(reduction.DupFd(fd) if forked and _is_open(fd) else None for fd in (1, 2))
        return (_received, (forked, fds, dict(os.environ)))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _received(forked: bool, fds: tuple, environ: dict[str, str]) -> tuple[bool, tuple, dict[str, str]]:
    return forked, tuple(None if dup is None else dup.detach() for dup in fds), environ


def _leave_fork_server() -> None:
    """Close the fork server's liveness pipe, which multiprocessing hands every forked child
    so that the server outlives it: only the daemon's process holds it then, so the server
    exits with that process and a worker's parent changes (its orphan check fires)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the one server of the module, as multiprocessing keeps it
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None


def _run_as_started(target: Callable[..., Any], args: tuple, started: tuple) -> Any:
    forked, fds, environ = started
    if forked:
        _leave_fork_server()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ignores it (runtime.workers.server)
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    for number, (fd, stream) in enumerate(zip(fds, (sys.stdout, sys.stderr)), start=1):
        if fd is not None:
            stream.flush()
            os.dup2(fd, number)
            os.close(fd)
    return target(*args)
