"""``lanekv serve``: the OpenAI-compatible HTTP front, served by uvicorn until SIGINT/SIGTERM.

The port is bound here before uvicorn starts (port 0 picks a free one, and
``--ready-file`` then says which). TLS uses the security flags' certificate
and key; with ``--tls-require-client-cert`` clients need a certificate signed
by ``--tls-ca``. The same config speaks to the decode daemons.

SIGINT/SIGTERM drains open requests and logs the stop (``FrontServer``).

Exit codes: 0 after a clean shutdown (also on SIGTERM), 1 when start-up fails, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import sys
import threading
from pathlib import Path

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lanekv.http.app import build_app
from lanekv.http.config import FrontConfig
from lanekv.runtime.daemon import write_atomically
from lanekv.runtime.security import SecurityConfig

log = logging.getLogger("lanekv.http")


def config_from_args(args: argparse.Namespace) -> FrontConfig:
    return FrontConfig(
        model_path=args.model, decode_endpoints=tuple(args.decode), served_model_name=args.served_model_name,
        host=args.host, port=args.port, security=SecurityConfig.from_args(args),
        max_running_per_decode=args.max_running_per_decode, health_interval_s=args.health_interval_s,
        request_timeout_s=args.request_timeout_s, chat_template=getattr(args, "chat_template", None),
        log_requests=not getattr(args, "disable_log_requests", False), **_bounds_from_args(args),
    )


def _bounds_from_args(args: argparse.Namespace) -> dict:
    names = ("max_body_bytes", "header_timeout_s", "body_timeout_s", "keep_alive_s")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


# h11 buffers at most this much of an unfinished request line and headers.
MAX_HEADER_BYTES = 64 * 1024


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request's line and headers.

    uvicorn bounds idle kept-alive connections (``timeout_keep_alive``) but not a
    client that sends its headers a byte at a time; such a connection is closed
    once ``header_timeout_s`` passes, counted from when it opened or its last
    response ended. A request whose headers arrived is bounded by the app
    (``body_timeout_s``, ``request_timeout_s``).
    """

    header_timeout_s = 10.0  # set per server by ``uvicorn_config``

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._header_deadline.cancel()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._header_deadline.cancel()
        if not self.transport.is_closing():
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def connection_lost(self, exc) -> None:
        self._header_deadline.cancel()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closing %s: no request headers within %gs", self.client, self.header_timeout_s)
            self.transport.close()
class FrontServer(uvicorn.Server):
    """uvicorn's server, where SIGINT/SIGTERM is a requested stop: it drains (open
    requests get ``timeout_graceful_shutdown``) and ``serve`` returns. uvicorn's own
    handler raises the signal again after the drain, so a clean stop exited 143."""

    stop_signal: int | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self._stop_requested) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _stop_requested(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop without waiting
            return
        if self.stop_signal is None:
            log.info("lanekv serve: %s received, draining open requests (up to %ss)",
                     signal.Signals(sig).name, self.config.timeout_graceful_shutdown)
        self.stop_signal = sig
        self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot bind {host}:{port}: {err.strerror or err}") from err
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def uvicorn_config(app, config: FrontConfig) -> uvicorn.Config:
    security = config.security
    tls = {}
    if security.tls:
        if security.tls_cert is None:
            raise ValueError(f"serving TLS needs tls_cert and tls_key; only tls_ca={security.tls_ca!r} is given")
        tls = {"ssl_certfile": security.tls_cert, "ssl_keyfile": security.tls_key}
        if security.require_client_cert:
            tls.update(ssl_ca_certs=security.tls_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    protocol = type("FrontH11Protocol", (BoundedH11Protocol,), {"header_timeout_s": config.header_timeout_s})
    # The asyncio loop (not uvloop): grpc.aio runs on it.
    return uvicorn.Config(app, loop="asyncio", http=protocol, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=5, timeout_keep_alive=config.keep_alive_s,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, **tls)


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        app = build_app(config)
        server = FrontServer(uvicorn_config(app, config))
    except (ValueError, TypeError) as err:
        print(f"lanekv serve: {err}", file=sys.stderr)
        return 2
    try:
        sock = bind_socket(config.host, config.port)
    except OSError as err:
        print(f"lanekv serve: {err}", file=sys.stderr)
        return 1
    endpoint = f"{config.host}:{sock.getsockname()[1]}"
    scheme = "https" if config.security.tls else "http"
    if not config.security.tls and config.security.token and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving %s without TLS: the bearer token crosses the network in clear text", endpoint)

    async def run() -> None:
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            if args.ready_file:
                write_atomically(Path(args.ready_file), endpoint)
            print(f"lanekv serve on {scheme}://{endpoint}/v1 (model {config.model_name}; decode "
                  f"{', '.join(config.decode_endpoints)})", flush=True)
        await task

    try:
        asyncio.run(run())
    finally:
        sock.close()
    if not server.started:
        return 1
    how = "" if server.stop_signal is None else f" on {signal.Signals(server.stop_signal).name}"
    log.info("lanekv serve: stopped%s after draining; exit 0", how)
    return 0
