"""A TCP proxy on loopback for fault tests: it forwards both ways until told
to stall or cut connections after some more bytes towards the client.

A stalled connection stays open and forwards nothing either way: what
arrives is held (and sent on ``thaw``), as on a frozen network path. It still
reads, so a peer that closes its end is seen and the other end is closed
too: a killed client frees the server's handler, a killed server breaks the
client's connection. A cut connection is reset at once (a broken path).
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from dataclasses import dataclass, field

_READ = 65536
_POLL_S = 0.05


@dataclass(eq=False)
class _Conn:
    client: socket.socket
    server: socket.socket
    budget: int | None = None  # bytes towards the client still forwarded; None: no limit
    action: str = "stall"  # what happens when the budget runs out: "stall" or "cut"
    stalled: bool = False
    closed: bool = False
    held: dict[bool, bytearray] = field(default_factory=lambda: {True: bytearray(), False: bytearray()})


class FaultProxy:
    """Listens on ``endpoint`` and forwards every connection to ``target`` ("host:port")."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.faulted = threading.Event()  # a connection stalled or was cut
        self.accepted = 0
        self._rule: tuple[str, int] | None = None  # (action, budget) of connections opened from now on
        self._conns: list[_Conn] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._spawn(self._accept_loop)

    def stall_after(self, nbytes: int, *, new_connections: bool = False) -> None:
        """Forward ``nbytes`` more bytes towards the client on every open connection (and on each
        later one when ``new_connections``), then stall it."""
        self._arm("stall", nbytes, new_connections)

    def cut_after(self, nbytes: int, *, new_connections: bool = False) -> None:
        """As ``stall_after``, but reset the connection instead."""
        self._arm("cut", nbytes, new_connections)

    def spare_new_connections(self) -> None:
        """Connections opened from now on forward freely; open ones keep their fault."""
        with self._lock:
            self._rule = None

    def thaw(self) -> None:
        """Forget every fault: stalled connections forward again, held bytes first."""
        with self._lock:
            self._rule = None
            for conn in self._conns:
                conn.budget, conn.stalled = None, False
        self.faulted.clear()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            self._close(conn)
        for thread in self._threads:
            thread.join(5.0)
        self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _arm(self, action: str, nbytes: int, new_connections: bool) -> None:
        with self._lock:
            self._rule = (action, nbytes) if new_connections else None
            for conn in self._conns:
                if not conn.closed:
                    conn.action, conn.budget = action, nbytes

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="fault-proxy")
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self._target, timeout=2.0)
            except OSError:  # nothing there: the client sees its connection closed
                client.close()
                continue
            for sock in (client, server):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(client, server)
            with self._lock:
                self.accepted += 1
                if self._rule is not None:
                    conn.action, conn.budget = self._rule
                self._conns.append(conn)
            self._spawn(self._pump, conn, server, client, True)
            self._spawn(self._pump, conn, client, server, False)

    def _pump(self, conn: _Conn, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        held = conn.held[downstream]
        while not conn.closed and not self._stop.is_set():
            if held and not conn.stalled:  # thawed: what was held goes first
                if not self._send(conn, dst, bytes(held)):
                    break
                held.clear()
            try:
                readable, _, _ = select.select([src], [], [], _POLL_S)
                if not readable:
                    continue
                data = src.recv(_READ)
            except (OSError, ValueError):
                break
            if not data:
                break
            if conn.stalled or held:  # held bytes keep their place in the stream
                held.extend(data)
                continue
            if downstream and conn.budget is not None:
                data, rest = data[: conn.budget], data[conn.budget:]
                conn.budget -= len(data)
                if data and not self._send(conn, dst, data):
                    break
                if conn.budget == 0:
                    self.faulted.set()
                    if conn.action == "cut":
                        self._close(conn, reset=True)
                        break
                    conn.stalled = True
                    held.extend(rest)
                continue
            if not self._send(conn, dst, data):
                break
        self._close(conn)

    def _send(self, conn: _Conn, dst: socket.socket, data: bytes) -> bool:
        try:
            dst.sendall(data)
            return True
        except OSError:
            return False

    def _close(self, conn: _Conn, reset: bool = False) -> None:
        with self._lock:
            if conn.closed:
                return
            conn.closed = True
        for sock in (conn.client, conn.server):
            try:
                if reset:  # RST instead of FIN: the peer sees a broken connection
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
            except OSError:
                pass
