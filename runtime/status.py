"""gRPC plumbing shared by every server and client: status refusals, message limits
and the health servicer every server installs (``HealthServicer``).

Service logic raises ``Refusal(code, message)`` for anything the caller got
wrong (bad contract, unknown request, bad layer range); the handler turns it
into that gRPC status with ``refusals(context)``. Untrusted input never reaches
an ``assert`` and never kills the server: the next call is served as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health

# A chunk's payload is capped by the server at MAX_CHUNK_BYTES_LIMIT; the
# message limit leaves room for the header (up to wire.MAX_HEADER_BYTES) and framing.
MAX_CHUNK_BYTES_LIMIT = 64 << 20
MAX_MESSAGE_BYTES = 2 * MAX_CHUNK_BYTES_LIMIT
# Chunk size when the client leaves it to the server: large enough that
# per-message overhead is small, small enough to pipeline a request's layers.
DEFAULT_CHUNK_BYTES = 8 << 20
# Trailing metadata of a refused handshake: the server's encoded LayoutContract,
# so the caller can compute the field diff itself.
CONTRACT_METADATA_KEY = "lanekv-contract-bin"
TRANSFER_SERVICE = "lanekv.v1.KVTransfer"
# A status message travels in trailing metadata, which gRPC limits to 8 KiB
# (soft; 16 KiB hard) together with the contract a refused Handshake sends
# back (at most contract.MAX_CONTRACT_BYTES, base64-encoded): messages are cut here.
MAX_DETAILS_CHARS = 2048
# A health check that times out says the peer is slow to answer (a daemon busy
# under load), not that it is gone: a peer leaves a rotation on timeouts only
# once this many checks in a row have timed out. An answer other than SERVING,
# or a refused connection, still counts at once.
SLOW_CHECKS_TO_LEAVE = 3


def slow_checks_after(code: grpc.StatusCode | None, before: int) -> int:
    """Health checks in a row that timed out, after one that ended with ``code``
    (None: it was answered) following ``before`` of them."""
    return before + 1 if code == grpc.StatusCode.DEADLINE_EXCEEDED else 0


def one_line(message: str) -> str:
    """``message`` on one line: its lines joined by '; ' (by a space after a colon)."""
    parts = [part.strip() for part in message.splitlines() if part.strip()]
    out = parts[0] if parts else ""
    for part in parts[1:]:
        out += f" {part}" if out.endswith(":") else f"; {part}"
    return out


def bounded(message: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """``message`` cut to ``limit`` characters, saying how much was cut."""
    if len(message) <= limit:
        return message
    keep = max(0, limit - 40)  # room for the note
    return f"{message[:keep]}... ({len(message) - keep} more characters)"[:limit]


class Refusal(Exception):
    """A request refused with a gRPC status code and a message for the caller: one
    line (``one_line``), cut to ``MAX_DETAILS_CHARS``. Never a traceback: those go
    to the log."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        message = bounded(one_line(message))
        super().__init__(message)
        self.code = code
        self.message = message


@contextmanager
def refusals(context: grpc.ServicerContext) -> Iterator[None]:
    """Abort the call with the refusal's code and message (``context.abort`` raises)."""
    try:
        yield
    except Refusal as refusal:
        code = refusal.code
        if code == grpc.StatusCode.CANCELLED:  # a handler's word for "the client left"
            code = left_code(context)  # which is an expiry when its deadline passed
        context.abort(code, refusal.message)


# A client's deadline reaches the server as a plain cancellation: the client's
# gRPC cancels the call when its own clock runs out, and the server's copy of the
# deadline started when the call arrived, so it passes a little later (under
# load, hundreds of milliseconds later). A client that leaves within this much
# of its deadline is counted as expired.
DEADLINE_SLACK_S = 1.0


def left_code(context: grpc.ServicerContext) -> grpc.StatusCode:
    """The code of a call its client left: DEADLINE_EXCEEDED once its deadline has passed
    (within ``DEADLINE_SLACK_S``), else CANCELLED.

    gRPC sets no code when a client leaves, for an expiry or a cancellation
    alike. The first verdict is written into the call's status (nothing is sent:
    the client is gone) and returned from then on, so every count (calls by code,
    the daemons' failures by cause, the logged status) agrees on the call even
    when each asks at its own moment. A code the handler set is kept; a handler's
    CANCELLED for a client that left takes this verdict (``refusals``).
    """
    code = context.code()
    if code is not None:
        return code
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= DEADLINE_SLACK_S
    verdict = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
    context.set_code(verdict)
    return verdict


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel and server options; both sides must allow the largest chunk message."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


class HealthServicer(health.HealthServicer):
    """grpc_health's servicer, with the end of a Watch handled off gRPC's polling thread.

    grpc_health sends a Watch's first status, and each later change, while it holds its
    lock, and each send waits until gRPC's polling thread has sent it. gRPC runs the
    callback of a Watch that ends on that polling thread, and grpc_health's callback
    takes the same lock. So a Watch that ends while another is answered leaves each
    waiting for the other, and the server answers nothing more (seen: a client opening
    and cancelling Watches in a loop; the server's stop then hung). Here the callback
    only hands that work to a thread of this servicer, which waits for the lock instead.
    """

    def __init__(self) -> None:
        super().__init__()
        self._closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lanekv-health-watch-end")

    def _on_close_callback(self, send_response_callback: Callable, service: str) -> Callable[[], None]:
        end = super()._on_close_callback(send_response_callback, service)

        def ended() -> None:  # on gRPC's polling thread: must not wait
            self._closer.submit(end)

        return ended
