"""Receiver processes: FetchKV streams received outside the client's GIL.

Python gRPC copies every received message into a bytes object with the GIL
held. With every owner rank's stream received in one process, those copies,
the fetch's own checks and the placement of chunks all take turns at one
GIL: on 2x H200 (``bench/fastpath_probe.py``, py-spy) a thread held it in
85% of the samples taken during a fetch, gRPC's threads in 70% of those.

``KVClient(receivers=N)`` keeps N processes (``transfer.receiver_main``),
each of which runs one owner rank's part of a fetch at a time: its streams,
checks, XXH3 verification, retries and stall watchdog, as a thread of the
client would (``transfer.fetch.RankFetch``). It copies each verified payload
into one of ``slots`` slots of a file in /dev/shm that both processes map,
and sends the chunk's header over a socket; the client places the payload
straight from the slot and frees the slot. A rank gets a receiver when one
is idle, else a thread of the client as before, so a busy daemon never
waits for one.

A payload handed to ``place`` lives in a slot: it is valid only until
``place`` returns.
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
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import transfer.errors as errors_module
from transfer.fastpath import SHM_DIR
from transfer.fetch import Item, Job
from transfer.receiver_main import RankJob
from transfer.security import SecurityConfig
from transfer.spans import Span
from transfer.status import DEFAULT_CHUNK_BYTES
from transfer.wire import payload_to_tensor

log = logging.getLogger("lanekv.transfer")
SLOTS = 4
# How long a receiver may take to start (import torch and grpc), and to answer a stop.
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
# A receiver running a fetch says something at least every half second; this long silent, it is dead to us.
SILENT_S = 5.0
_ERRORS = {cls.__name__: cls for cls in vars(errors_module).values()
           if isinstance(cls, type) and issubclass(cls, errors_module.TransferError)}


def rebuild(state: tuple[str, str, dict[str, Any]]) -> errors_module.TransferError:
    """The error a receiver sent (``receiver_main.error_state``), as its own class."""
    name, message, fields = state
    cls = _ERRORS.get(name, errors_module.TransferError)
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    vars(err).update(fields)
    return err


class Receiver:
    """One receiver process, its socket and its slots."""

    def __init__(self, security: SecurityConfig, slots: int, slot_bytes: int) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self.clean = False  # idle, and every message of its last fetch read
        directory = SHM_DIR if SHM_DIR.is_dir() else None
        fd, path = tempfile.mkstemp(prefix="lanekv-receiver-", dir=directory)
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
                paths = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "transfer.receiver_main", str(theirs.fileno()), path, str(slots),
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
        self._lock = threading.Lock()
        for _ in range(count):
            self._start()

    def _start(self) -> None:
        threading.Thread(target=self._starting, name="lanekv-receiver-start", daemon=True).start()

    def _starting(self) -> None:
        try:
            receiver = Receiver(self._security, self._slots, self._slot_bytes)
        except (OSError, ValueError) as err:
            log.warning("receiver process: cannot start (%s); fetching in threads", err)
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


class RemoteRankFetch:
    """One owner rank's part of a fetch, run by a receiver process (``run`` relays it here).

    The same face as ``transfer.fetch.RankFetch`` to ``KVClient.fetch``: each
    chunk goes on ``job.ready`` (its payload a view of a slot, freed once
    placed), then the end or the error. A receiver that ends, stops
    answering (no message for ``SILENT_S``; a busy one says it is alive
    every half second) or is closed under the fetch fails the rank's part
    with a ``TransferError``; it is not retried.
    """

    def __init__(self, job: Job, rank: int, endpoint: str, span: Span, epoch: str | None,
                 receiver: Receiver, pool: ReceiverPool) -> None:
        self.job, self.rank, self.endpoint = job, rank, endpoint
        self.retries = 0
        self._span, self._epoch, self._receiver, self._pool = span, epoch, receiver, pool
        self._lock = threading.Lock()  # orders our stop after our fetch message
        self._sent = self._stopped = False

    def run(self) -> None:
        job, receiver = self.job, self._receiver
        try:
            with self._lock:
                if self._stopped:
                    return  # the fetch ended before this part began: the receiver never heard of it
                receiver.clean = False
                receiver.send(("fetch", RankJob(self.rank, self.endpoint, self._span, job.request_id,
                                                job.fingerprint, job.max_chunk_bytes, job.policy, job.remaining(),
                                                self._epoch)))
                self._sent = True
            self._relay()
        except (EOFError, OSError) as err:
            self._fail(f"the receiver process ended (exit status {receiver.process.poll()}): {err!r}")
        except Exception as err:  # noqa: BLE001 - a fault of ours must end the fetch now, not at its deadline
            self._fail(f"receiving failed: {err!r}")

    def _fail(self, why: str) -> None:
        self._receiver.clean = False  # replaced, not reused
        self.job.ready.put(Item(self.rank, None, None, errors_module.TransferError(f"rank {self.rank}: {why}")))

    def _relay(self) -> None:
        job, receiver = self.job, self._receiver
        heard = time.monotonic()
        stopped_at = None
        while True:
            message = receiver.recv(0.25)
            now = time.monotonic()
            if message is None:
                if now - heard > SILENT_S:
                    raise OSError(f"the receiver said nothing for {now - heard:.1f}s")
                if self._stopped or now > job.deadline + STOP_TIMEOUT_S:
                    stopped_at = stopped_at or now
                    if now - stopped_at > STOP_TIMEOUT_S:
                        raise OSError("the receiver did not answer a stop")
                    self.cancel()
                continue
            heard = now
            kind = message[0]
            if kind in ("chunk", "inline"):
                header = message[1]
                done = _freer(receiver, message[2]) if kind == "chunk" else None
                if job.stopping.is_set() or not job.budget.acquire(header.nbytes):
                    if done is not None:
                        done()  # the fetch is over; the receiver is told to stop
                    continue
                payload = receiver.slot(message[2], header.nbytes) if kind == "chunk" else message[2]
                job.ready.put(Item(self.rank, header, payload_to_tensor(header, payload), None, done))
                continue
            if kind == "alive":
                continue
            receiver.clean = True
            if kind == "end":
                self.retries = message[1]
                job.ready.put(Item(self.rank, None, None, None))
            elif kind == "failed":
                self.retries = message[2]
                job.ready.put(Item(self.rank, None, None, rebuild(message[1])))
            elif not job.stopping.is_set():  # "stopped", and not by this fetch: closed under it
                job.ready.put(Item(self.rank, None, None, errors_module.TransferError(
                    f"rank {self.rank}: the receiver was stopped before the rank's part ended")))
            return

    def cancel(self) -> None:
        """Ask the receiver to end its stream (the fetch is over)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            if not self._sent:
                return
        try:
            self._receiver.send(("stop",))
        except OSError:
            pass

    def cut_if_stalled(self, now: float) -> None:
        """The receiver watches its own streams; ``run`` watches the receiver."""

    def close(self) -> None:
        """Hand the receiver back (the fetch has placed or dropped all its chunks)."""
        self._pool.give_back(self._receiver)


def _freer(receiver: Receiver, slot: int) -> Callable[[], None]:
    return lambda: receiver.free(slot)
