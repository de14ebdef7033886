"""Bounds on the calls a server runs at once: per peer host and in total.

Every lanekv server installs ``CallLimitsInterceptor`` (``runtime.security.make_server``).
A call beyond a bound is answered RESOURCE_EXHAUSTED at once, naming the
bound. The open services (health: no token) have bounds of their own, far
below the others', and an open health Watch (a stream) has bounds and a
lifetime of its own (``watch_timeout_s``; then it is cancelled and its caller
opens another): Watches cannot take the slots of unary health Checks, so a
probe's Check is answered however many Watches are open. The server's thread pool has a thread for every call the
bounds admit (``total + open_total``), so an admitted call never waits for a
thread: callers without the token cannot take the threads authenticated
calls run on, and a health check is answered however many streams hold
their threads. A health Watch holds no thread at all:
grpc_health's servicer is non-blocking, and every interceptor here keeps a
handler's blocking kind (``same_kind``); otherwise each open Watch would sit on
a worker thread for as long as its caller kept it open.

Invariant: a slot is taken when the handler starts and given back exactly
once when the call ends, however it ends (``context.add_callback``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import grpc

Code = grpc.StatusCode
# Attributes gRPC reads on a method handler's behavior: a non-blocking
# streaming behavior (grpc_health's Watch) gets a send_response_callback and
# returns at once instead of holding a thread while its stream is open.
_KIND_ATTRIBUTES = ("experimental_non_blocking", "experimental_thread_pool")


def same_kind(wrapper: Callable, behavior: Callable) -> Callable:
    """Give ``wrapper`` (which passes extra arguments through to ``behavior``) its blocking kind."""
    for name in _KIND_ATTRIBUTES:
        if hasattr(behavior, name):
            setattr(wrapper, name, getattr(behavior, name))
    return wrapper


def is_non_blocking(behavior: Callable) -> bool:
    return bool(getattr(behavior, "experimental_non_blocking", False))


@dataclass(frozen=True)
class CallLimits:
    total: int  # calls at once, streams included (beyond the worker threads, calls queue)
    per_peer: int  # of those, from one peer host
    open_total: int  # calls at once to the open services (no token needed)
    open_per_peer: int  # of those, from one peer host
    watch_total: int = 16  # open health Watches (streams, no token) at once; apart from open_total
    watch_per_peer: int = 4  # of those, from one peer host
    watch_timeout_s: float = 60.0  # an open Watch is cancelled after this (its caller opens another)

    def __post_init__(self) -> None:
        for name in ("total", "per_peer", "open_total", "open_per_peer", "watch_total", "watch_per_peer"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
        if isinstance(self.watch_timeout_s, bool) or not isinstance(self.watch_timeout_s, (int, float)) \
                or not 0 < self.watch_timeout_s < float("inf"):
            raise ValueError(f"watch_timeout_s must be a number > 0, got watch_timeout_s={self.watch_timeout_s!r}")
        if self.watch_per_peer > self.watch_total:
            raise ValueError(f"watch_per_peer={self.watch_per_peer} exceeds watch_total={self.watch_total}")
        if self.per_peer > self.total:
            raise ValueError(f"per_peer={self.per_peer} exceeds total={self.total}")
        if self.open_per_peer > self.open_total:
            raise ValueError(f"open_per_peer={self.open_per_peer} exceeds open_total={self.open_total}")

    @classmethod
    def for_workers(cls, max_workers: int) -> CallLimits:
        """Defaults for a server sized for ``max_workers`` busy calls: up to 8 calls at once
        per worker (most of them streams that wait: a Generate for its tokens, a
        PrefillStream for its batch), 4 per worker from one host; 16 open calls, 4
        from one host; as many open Watches besides, each for at most a minute."""
        if type(max_workers) is not int or max_workers < 1:
            raise ValueError(f"max_workers must be an int >= 1, got max_workers={max_workers!r}")
        return cls(total=8 * max_workers, per_peer=4 * max_workers, open_total=16, open_per_peer=4)


AUTHENTICATED, OPEN, WATCH = "authenticated", "open", "watch"  # the classes of calls ``Admission`` counts


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ('ipv4:10.0.0.1:5000' -> 'ipv4:10.0.0.1')."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rpartition(":")[0]
    return peer  # unix sockets and the like: the whole string


class Admission:
    """The counts behind ``CallLimits``: ``enter`` takes a slot or says why not."""

    def __init__(self, limits: CallLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._calls: Counter[tuple[str, str]] = Counter()  # (class, host) -> calls
        self._totals: Counter[str] = Counter()  # class -> calls

    def enter(self, host: str, kind: str | bool) -> str | None:
        """None when admitted (the caller must ``leave`` once), else the bound reached.
        ``kind``: AUTHENTICATED, OPEN or WATCH (True: OPEN, False: AUTHENTICATED)."""
        kind = _kind(kind)
        limits = self.limits
        total, per_peer, what = {
            AUTHENTICATED: (limits.total, limits.per_peer, "calls"),
            OPEN: (limits.open_total, limits.open_per_peer, "calls to open services"),
            WATCH: (limits.watch_total, limits.watch_per_peer, "open health Watches"),
        }[kind]
        with self._lock:
            if self._totals[kind] >= total:
                return f"this server runs {total} {what} at once already; retry later"
            if self._calls[kind, host] >= per_peer:
                return f"{host} has {per_peer} {what} open on this server already; retry later"
            self._totals[kind] += 1
            self._calls[kind, host] += 1
        return None

    def leave(self, host: str, kind: str | bool) -> None:
        kind = _kind(kind)
        with self._lock:
            self._totals[kind] -= 1
            self._calls[kind, host] -= 1
            if not self._calls[kind, host]:
                del self._calls[kind, host]

    def held(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._calls)


def _kind(kind: str | bool) -> str:
    return OPEN if kind is True else AUTHENTICATED if kind is False else kind


_MAKERS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class CallLimitsInterceptor(grpc.ServerInterceptor):
    """Admits a call only within its ``CallLimits``; RESOURCE_EXHAUSTED otherwise.

    Install it inside the token check, so that calls the token check refuses
    take no slot. ``open_services`` are the services served without a token;
    a call to one counts as open unless ``authenticated(metadata)`` says it
    carries the token.
    """

    def __init__(
        self,
        limits: CallLimits,
        open_services: Collection[str],
        authenticated: Callable[[Any], bool] | None = None,
    ) -> None:
        self.admission = Admission(limits)
        self._open = frozenset(open_services)
        self._authenticated = authenticated

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        open_service = method.lstrip("/").partition("/")[0] in self._open and not (
            self._authenticated is not None
            and self._authenticated(handler_call_details.invocation_metadata)
        )
        attribute, make = _MAKERS[bool(handler.request_streaming), bool(handler.response_streaming)]
        behavior = getattr(handler, attribute)
        admission = self.admission
        # An open stream (a health Watch) is counted apart from open unary calls, and timed out.
        kind = (WATCH if handler.response_streaming else OPEN) if open_service else AUTHENTICATED
        lifetime_s = admission.limits.watch_timeout_s

        def admitted(request: Any, context: grpc.ServicerContext, *args: Any, **kwargs: Any) -> Any:
            host = peer_host(context.peer() or "")
            refusal = admission.enter(host, kind)
            if refusal is not None:
                context.abort(Code.RESOURCE_EXHAUSTED, f"{method}: {refusal}")
            timer = None
            if kind == WATCH:
                timer = threading.Timer(lifetime_s, context.cancel)
                timer.daemon = True
                timer.start()

            def release() -> None:  # once, when the call ends, however it ends
                if timer is not None:
                    timer.cancel()
                admission.leave(host, kind)

            if not context.add_callback(release):  # it has ended already
                release()
            return behavior(request, context, *args, **kwargs)

        return make(
            same_kind(admitted, behavior),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
