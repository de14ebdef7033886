"""The address a daemon tells its peers, which may differ from the one it binds.

A daemon bound to a wildcard (``0.0.0.0``, ``::``, empty) listens everywhere,
but ``0.0.0.0:PORT`` in a prefill daemon's topology sends a decode daemon on
another host to its own loopback. ``advertise_host`` picks what peers are
told: ``--advertise-host`` when given; else the bind host when it is not a
wildcard; else this host's primary address (the source address of a route
to a documentation address: a UDP socket is connected, no packet is sent;
IPv4 first, IPv6 too for ``::``),
then the first non-loopback address its host name resolves to, then the
host name itself. Every choice comes back with why, for the start-up log.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import NamedTuple

WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
MAX_HOST_LEN = 253
# Documentation addresses (RFC 5737, RFC 3849): connecting a UDP socket to one
# picks the outgoing interface and sends nothing.
_PROBE = {socket.AF_INET: "192.0.2.1", socket.AF_INET6: "2001:db8::1"}


class Advertised(NamedTuple):
    host: str  # what peers are told
    why: str  # how it was chosen, for the log


def is_wildcard(host: str) -> bool:
    return host.strip() in WILDCARDS


def check_advertise_host(value: str | None, field: str = "advertise_host") -> None:
    """ValueError naming ``field`` unless ``value`` is None or a host peers could dial."""
    if value is None:
        return
    if not isinstance(value, str) or is_wildcard(value) or len(value) > MAX_HOST_LEN \
            or any(c.isspace() or c in "/@?#" for c in value) or not value.isprintable():
        raise ValueError(f"{field} must be a host name or address peers can reach (not a wildcard), "
                         f"got {field}={value!r:.80}")


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def primary_address(family: int = socket.AF_INET) -> str | None:
    """The address this host would send from towards the outside, or None (no route)."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((_PROBE[family], 9))
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if _is_loopback(address) or _is_unspecified(address) else address


def resolved_address(hostname: str) -> str | None:
    """The first non-loopback address ``hostname`` resolves to, or None."""
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    for family in (socket.AF_INET, socket.AF_INET6):
        for info_family, *_, sockaddr in infos:
            if info_family == family and not _is_loopback(sockaddr[0]) and not _is_unspecified(sockaddr[0]):
                return sockaddr[0]
    return None


def advertise_host(bind_host: str, advertise: str | None = None, *,
                   primary: Callable[[int], str | None] = primary_address,
                   resolve: Callable[[str], str | None] = resolved_address,
                   hostname: Callable[[], str] = socket.gethostname) -> Advertised:
    """What peers are told for a daemon bound to ``bind_host`` (see the module docstring)."""
    check_advertise_host(advertise)
    if advertise is not None:
        return Advertised(advertise, "--advertise-host")
    if not is_wildcard(bind_host):
        return Advertised(bind_host, "the bind address")
    # IPv4 first (also for a dual-stack ``::``), then IPv6 where the bind takes it.
    families = (socket.AF_INET, socket.AF_INET6) if ":" in bind_host else (socket.AF_INET,)
    for family in families:
        address = primary(family)
        if address is not None:
            return Advertised(address, f"the primary address (bound to {bind_host or 'all interfaces'!r})")
    name = hostname()
    address = resolve(name)
    if address is not None:
        return Advertised(address, f"the address host name {name!r} resolves to (no default route)")
    return Advertised(name, "the host name (no default route, and it resolves to no other address)")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _is_unspecified(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_unspecified
    except ValueError:
        return False
