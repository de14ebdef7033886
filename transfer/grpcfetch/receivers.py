"""Receiver processes: FetchKV streams received outside the client's GIL.

Python gRPC copies every received message into a bytes object with the GIL
held. With every owner rank's stream received in one process, those copies,
the fetch's own checks and the placement of chunks all take turns at one
GIL, which became the limit (BENCHMARKS.md: the py-spy recording).

``KVClient(receivers=N)`` keeps N processes (``transfer.grpcfetch.receiver_main``),
each of which runs one owner rank's part of a fetch at a time: its streams,
checks, XXH3 verification, retries and stall watchdog, as a thread of the
client would (``transfer.grpcfetch.fetch.RankFetch``). It copies each verified payload
into one of ``slots`` slots of a file in /dev/shm that both processes map,
and sends the chunk's header over a socket; the client places the payload
straight from the slot and frees the slot. A rank gets a receiver when one
is idle, else a thread of the client as before, so a busy daemon never
waits for one.

A payload handed to ``place`` lives in a slot: it is valid only until
``place`` returns. ``transfer.grpcfetch.remotefetch.RemoteRankFetch`` is a rank's
part of a fetch as a receiver runs it.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import lanekv.transfer.errors as errors_module
from lanekv.runtime.security import SecurityConfig
from lanekv.runtime.shmfiles import receiver_prefix
from lanekv.runtime.status import DEFAULT_CHUNK_BYTES
from lanekv.transfer.grpcfetch.fetch import RetryPolicy
from lanekv.transfer.grpcfetch.spans import Span
from lanekv.transfer.protocol.descriptors import SHM_DIR

log = logging.getLogger("lanekv.transfer")
SLOTS = 4
# How long a receiver may take to start (import torch and grpc).
START_TIMEOUT_S = 120.0
class RankJob(NamedTuple):
    """One owner rank's part of a fetch, as a receiver process is asked for it."""

    rank: int
    endpoint: str
    span: Span
    request_id: str
    fingerprint: str
    max_chunk_bytes: int
    policy: RetryPolicy
    timeout_s: float
    epoch: str | None
    fallback: str | None = None  # the rank's own endpoint when ``endpoint`` is a relay of it


class Receiver:
    """One receiver process, its socket and its slots."""

    def __init__(self, security: SecurityConfig, slots: int, slot_bytes: int) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self.clean = False  # idle, and every message of its last fetch read
        directory = SHM_DIR if SHM_DIR.is_dir() else None
        fd, path = tempfile.mkstemp(prefix=receiver_prefix(), dir=directory)
        self._path = path
        ours = None
        try:
            try:
                os.ftruncate(fd, slots * slot_bytes)
                self._ring = mmap.mmap(fd, slots * slot_bytes)
            finally:
                os.close(fd)
            ours, theirs = socket.socketpair()
            try:
                # Finds lanekv's packages wherever this process was started from.
                paths = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "lanekv.transfer.grpcfetch.receiver_main", str(theirs.fileno()), path, str(slots),
                     str(slot_bytes)], pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
            finally:
                theirs.close()
            self._conn = Connection(ours.detach())
            self._send_lock = threading.Lock()
            self.send(security)
        except BaseException:
            if hasattr(self, "process"):
                self.process.kill()
                self.process.wait()
            if hasattr(self, "_conn"):
                self._conn.close()
            elif ours is not None:
                ours.close()
            Path(path).unlink(missing_ok=True)
            raise

    def wait_ready(self, timeout: float) -> bool:
        """True once the process has mapped the slots (their file is then removed)."""
        try:
            ready = self._conn.poll(timeout) and self._conn.recv() == ("ready",)
        except (EOFError, OSError):
            ready = False
        finally:
            Path(self._path).unlink(missing_ok=True)
        self.clean = ready
        return ready

    def send(self, message: Any) -> None:
        with self._send_lock:
            self._conn.send(message)

    def free(self, slot: int) -> None:
        try:
            self.send(("free", slot))
        except OSError:
            pass  # the process is gone; its fetch learns that from the socket

    def recv(self, timeout: float) -> Any:
        """The next message, or None if none came within ``timeout``; EOFError/OSError when the process is gone."""
        return self._conn.recv() if self._conn.poll(timeout) else None

    def slot(self, index: int, nbytes: int) -> memoryview:
        if not 0 <= index < self.slots or nbytes > self.slot_bytes:
            raise errors_module.TransferError(f"receiver named slot {index} of {self.slots} for {nbytes} bytes")
        offset = index * self.slot_bytes
        return memoryview(self._ring)[offset:offset + nbytes]

    def close(self, timeout: float = 5.0) -> None:
        try:
            self.send(("close",))
        except OSError:
            pass
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._conn.close()
        Path(self._path).unlink(missing_ok=True)
        try:
            self._ring.close()
        except BufferError:
            pass  # a payload view is still held somewhere; the mapping goes with it


class ReceiverPool:
    """``count`` receiver processes, started in the background; ``take`` never waits for one."""

    def __init__(self, count: int, security: SecurityConfig, slot_bytes: int = DEFAULT_CHUNK_BYTES,
                 slots: int = SLOTS) -> None:
        self._security, self._slot_bytes, self._slots = security, slot_bytes, slots
        self._idle: list[Receiver] = []
        self._all: set[Receiver] = set()
        self._closed = False
        self.taken = 0  # rank parts handed to a receiver so far
        self.size = count  # processes kept: started, starting, or replacing a dropped one
        self._lock = threading.Lock()
        for _ in range(count):
            self._start()

    def grow_to(self, count: int) -> int:
        """Keep at least ``count`` processes (the new ones start in the background); the size."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got count={count!r}")
        with self._lock:
            if self._closed:
                return self.size
            extra, self.size = max(0, count - self.size), max(self.size, count)
        for _ in range(extra):
            self._start()
        return self.size

    def _start(self) -> None:
        threading.Thread(target=self._starting, name="lanekv-receiver-start", daemon=True).start()

    def _starting(self) -> None:
        try:
            receiver = Receiver(self._security, self._slots, self._slot_bytes)
        except (OSError, ValueError) as err:
            log.warning("receiver process: cannot start (%s); fetching in threads", err)
            with self._lock:
                self.size -= 1
            return
        with self._lock:
            closed = self._closed
            if not closed:
                self._all.add(receiver)
        if closed:  # the pool closed while this one started
            receiver.close(timeout=1.0)
            return
        if not receiver.wait_ready(START_TIMEOUT_S):
            log.warning("receiver process %d did not start; fetching in threads", receiver.process.pid)
            self._drop(receiver)
            with self._lock:
                self.size -= 1
            return
        self.give_back(receiver)

    def wait_started(self, count: int, timeout: float) -> bool:
        """True once ``count`` receivers are idle (for tests and benchmarks)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if len(self._idle) >= count:
                    return True
            time.sleep(0.02)
        return False

    def take(self) -> Receiver | None:
        """An idle receiver whose process is alive (a dead one is replaced), or None."""
        while True:
            with self._lock:
                if not self._idle or self._closed:
                    return None
                receiver = self._idle.pop()
                if receiver.process.poll() is None:
                    self.taken += 1
                    return receiver
            log.warning("receiver process %d ended while idle (exit status %s); starting another",
                        receiver.process.pid, receiver.process.returncode)
            receiver.clean = False
            self.give_back(receiver)

    def give_back(self, receiver: Receiver) -> None:
        """Idle again if its last fetch ended cleanly, else replaced by a new process."""
        if receiver.clean and receiver.process.poll() is None:
            with self._lock:
                if not self._closed:
                    self._idle.append(receiver)
                    return
        self._drop(receiver)
        with self._lock:
            if self._closed:
                return
        self._start()

    def _drop(self, receiver: Receiver) -> None:
        with self._lock:
            self._all.discard(receiver)
        receiver.close(timeout=1.0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            receivers, self._idle = list(self._all), []
            self._all.clear()
        for receiver in receivers:
            receiver.close()
