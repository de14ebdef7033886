"""One owner rank's part of a fetch, run by a receiver process (``transfer.grpcfetch.receivers``).

``RemoteRankFetch`` has the face of ``transfer.grpcfetch.fetch.RankFetch`` that
``KVClient.fetch`` sees (``run`` in a thread, ``cancel``, ``close``): it
asks its receiver for the rank's part, relays each chunk onto the fetch's
queue with its payload a view of a slot (freed once placed), and rebuilds
the receiver's errors as their own classes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import lanekv.transfer.errors as errors_module
from lanekv.transfer.grpcfetch.fetch import Item, Job, RankFetch
from lanekv.transfer.grpcfetch.receivers import RankJob, Receiver, ReceiverPool
from lanekv.transfer.grpcfetch.spans import Cells, Span
from lanekv.transfer.protocol.wire import payload_to_tensor

log = logging.getLogger("lanekv.transfer")
# How long a stopped receiver may take to answer.
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


class RemoteRankFetch:
    """One owner rank's part of a fetch, run by a receiver process (``run`` relays it here).

    The same face as ``transfer.grpcfetch.fetch.RankFetch`` to ``KVClient.fetch``: each
    chunk goes on ``job.ready`` (its payload a view of a slot, freed once
    placed), then the end or the error. A receiver that ends or stops
    answering (no message for ``SILENT_S``; a busy one says it is alive
    every half second) is killed, and the rest of the rank's part goes on in
    this thread as a ``RankFetch`` asking for the cells not yet relayed (a
    retry in the rank's stats). A receiver closed under the fetch (the
    client is closing) fails the rank's part with a ``TransferError``.
    """

    def __init__(self, job: Job, rank: int, endpoint: str, span: Span, epoch: str | None,
                 receiver: Receiver, pool: ReceiverPool, fallback: str | None = None) -> None:
        self.job, self.rank, self.endpoint, self.fallback = job, rank, endpoint, fallback
        self.retries = 0
        self._span, self._epoch, self._receiver, self._pool = span, epoch, receiver, pool
        self._lock = threading.Lock()  # orders our stop after our fetch message
        self._sent = self._stopped = False
        self._cells = Cells()  # relayed to the placer
        self._local: RankFetch | None = None  # the rest of the part, after the receiver failed

    def run(self) -> None:
        job, receiver = self.job, self._receiver
        try:
            with self._lock:
                if self._stopped:
                    return  # the fetch ended before this part began: the receiver never heard of it
                receiver.clean = False
                receiver.send(("fetch", RankJob(self.rank, self.endpoint, self._span, job.request_id,
                                                job.fingerprint, job.max_chunk_bytes, job.policy, job.remaining(),
                                                self._epoch, self.fallback)))
                self._sent = True
            self._relay()
        except (EOFError, OSError) as err:
            self._go_local(f"the receiver process ended (exit status {receiver.process.poll()}): {err!r}")
        except Exception as err:  # noqa: BLE001 - a fault of ours must end the fetch now, not at its deadline
            self._go_local(f"receiving failed: {err!r}")

    def _go_local(self, why: str) -> None:
        """Go on here with what the failed receiver had not relayed (the fetch still runs)."""
        receiver = self._receiver
        receiver.clean = False  # replaced, not reused
        if receiver.process.poll() is None:
            receiver.process.kill()  # a frozen one must not wake up and go on
        with self._lock:
            if self._stopped or self.job.stopping.is_set():
                return  # the fetch is over: nobody waits for this part
            log.warning("rank %d: %s; receiving the rest in a thread", self.rank, why,
                        extra={"request_id": self.job.request_id})
            self._local = RankFetch(self.job, self.rank, self.endpoint, self._span, received=self._cells,
                                   fallback=self.fallback)
        try:
            self._local.run()
        finally:
            self.retries += self._local.retries + 1

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
                self._cells.add(header)
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
            local = self._local
            if not self._sent:
                return
        if local is not None:
            local.cancel()
        try:
            self._receiver.send(("stop",))
        except OSError:
            pass

    def cut_if_stalled(self, now: float) -> None:
        """The receiver watches its own streams; ``run`` watches the receiver."""
        local = self._local
        if local is not None:
            local.cut_if_stalled(now)

    def close(self) -> None:
        """Hand the receiver back (the fetch has placed or dropped all its chunks)."""
        self._pool.give_back(self._receiver)


def _freer(receiver: Receiver, slot: int) -> Callable[[], None]:
    return lambda: receiver.free(slot)
