"""A receiver process: runs one owner rank's part of a fetch at a time (``transfer.grpcfetch.receivers``).

Started as ``python -m transfer.grpcfetch.receiver_main FD SLOTS_PATH SLOTS SLOT_BYTES``
with ``FD`` one end of a socket pair. The first message on it is the
client's ``SecurityConfig``; the process then maps the slots' file (the
client mapped it first), removes it, and says ``("ready",)``. Then, per fetch:

- in: ``("fetch", RankJob)`` (``transfer.grpcfetch.receivers.RankJob``); every slot is free at the start of a fetch
  (the client hands a receiver a new fetch only after it placed, or dropped,
  every chunk of the last);
- out: ``("chunk", header, slot)`` for each verified chunk, its payload in
  that slot, or ``("inline", header, payload)`` when it does not fit one;
- in: ``("free", slot)`` once the client is done with a slot;
- out: ``("end", retries)`` or ``("failed", error, retries)``, and
  ``("alive",)`` every half second meanwhile;
- in at any time: ``("stop",)`` ends the fetch under way (it answers
  ``("stopped", retries)``); ``("close",)``, or the client's end of the
  socket closing, ends the process (a fetch under way answers
  ``("stopped", retries)`` first).

The process ignores SIGINT and SIGTERM: a signal to the whole process
group (Ctrl-C, a service stop) must not cut fetches the daemon is still
draining; the daemon closes it, and it ends when the daemon's end of the
socket closes.

Streams, checks, XXH3 verification, retries and the stall watchdog are the
same as in the client's own threads (``transfer.grpcfetch.fetch.RankFetch``); this
process only adds the copy of each payload into a slot.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

from lanekv.transfer.errors import TransferError
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.grpcfetch.fetch import ByteBudget, Item, Job, RankFetch
from lanekv.transfer.grpcfetch.receivers import RankJob

ALIVE_EVERY_S = 0.5  # how often a fetch under way says so when it has nothing else to say
RANK_JOIN_S = 5.0  # how long a stopped fetch waits for its rank's thread (the client waits 10 s)


class _Tagged:
    """The queue a rank's thread puts its items on: the inbox, each item marked as this fetch's."""

    def __init__(self, inbox: queue.Queue, tag: object) -> None:
        self._inbox, self._tag = inbox, tag

    def put(self, item: Item) -> None:
        self._inbox.put((self._tag, item))


def error_state(err: TransferError) -> tuple[str, str, dict[str, Any]]:
    """What rebuilds ``err`` in the client (``transfer.grpcfetch.remotefetch.rebuild``): exceptions whose
    constructors take more than a message do not pickle back."""
    return type(err).__name__, str(err), dict(vars(err))


class _Receiver:
    def __init__(self, conn: Connection, ring: mmap.mmap, slots: int, slot_bytes: int) -> None:
        self.conn, self.slots, self.slot_bytes = conn, slots, slot_bytes
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(ring))
        self.client: KVClient | None = None
        self.inbox: queue.Queue = queue.Queue()  # the client's messages, and the rank's items

    def serve(self) -> None:
        self.client = KVClient(self.conn.recv())
        self.conn.send(("ready",))
        threading.Thread(target=self._pump, name="receiver-pump", daemon=True).start()
        try:
            while True:
                message = self.inbox.get()
                if message[0] == "close":
                    return
                if message[0] == "fetch":
                    self._fetch(message[1])
                # anything else belongs to a fetch that has ended
        finally:
            self.client.close()

    def _pump(self) -> None:
        try:
            while True:
                self.inbox.put(self.conn.recv())
        except (EOFError, OSError):
            self.inbox.put(("close",))

    def _fetch(self, spec: RankJob) -> None:
        budget = ByteBudget(self.slots * self.slot_bytes)
        job = Job(spec.request_id, spec.fingerprint, spec.max_chunk_bytes or self.slot_bytes, spec.policy,
                  spec.timeout_s, self.client.stream_opener(spec.epoch), budget)
        tag = object()
        job.ready = _Tagged(self.inbox, tag)  # the rank's items come in among the client's messages
        part = RankFetch(job, spec.rank, spec.endpoint, spec.span, fallback=spec.fallback)
        thread = threading.Thread(target=part.run, name=f"receive-rank{spec.rank}", daemon=True)
        thread.start()
        free, waiting = deque(range(self.slots)), deque()
        tick = min(0.25, spec.policy.stall_s / 4)
        ended, failed, stopped = False, None, False
        said = time.monotonic()
        try:
            while True:
                try:
                    message = self.inbox.get(timeout=tick)
                except queue.Empty:
                    message = None
                now = time.monotonic()
                part.cut_if_stalled(now)
                if now - said >= ALIVE_EVERY_S:
                    self.conn.send(("alive",))
                    said = now
                if message is None:
                    continue
                if message[0] is tag:
                    item = message[1]
                    if item.error is not None:
                        failed = error_state(item.error)
                        break
                    if item.header is None:
                        ended = True
                    else:
                        waiting.append(item)
                elif message[0] == "free":
                    free.append(message[1])
                elif message[0] == "stop":
                    stopped = True
                    break
                elif message[0] == "close":
                    self.inbox.put(message)  # for serve, once this fetch is stopped
                    stopped = True
                    break
                while waiting and (free or waiting[0].header.nbytes > self.slot_bytes):
                    self._send(waiting.popleft(), free, budget)
                    said = time.monotonic()
                if ended and not waiting:
                    break
        except Exception as err:  # noqa: BLE001 - a fault of ours ends the fetch, not the process
            failed = error_state(TransferError(f"rank {spec.rank}: receiver failed: {err!r}"))
        finally:
            job.stopping.set()
            budget.close()
            part.cancel()
            thread.join(RANK_JOIN_S)
        # Said once the rank's thread is done: nothing of this fetch comes after it.
        if failed is not None:
            self.conn.send(("failed", failed, part.retries))
        else:
            self.conn.send(("stopped" if stopped else "end", part.retries))

    def _send(self, item: Item, free: deque, budget: ByteBudget) -> None:
        header, payload = item.header, item.tensor
        if header.nbytes > self.slot_bytes:
            self.conn.send(("inline", header, ctypes.string_at(payload.data_ptr(), header.nbytes)))
        else:
            slot = free.popleft()
            ctypes.memmove(self.base + slot * self.slot_bytes, payload.data_ptr(), header.nbytes)
            self.conn.send(("chunk", header, slot))
        budget.release(header.nbytes)


def main(argv: list[str]) -> None:
    fd, path, slots, slot_bytes = int(argv[0]), argv[1], int(argv[2]), int(argv[3])
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the client ends it (see above)
    conn = Connection(socket.socket(fileno=fd).detach())
    with open(path, "r+b") as file:
        ring = mmap.mmap(file.fileno(), slots * slot_bytes)
    os.unlink(path)  # both processes map it now; nothing is left behind if either dies
    try:
        _Receiver(conn, ring, slots, slot_bytes).serve()
    except (EOFError, OSError):
        pass  # the client is gone: nobody is left to tell


if __name__ == "__main__":
    main(sys.argv[1:])
