"""The address a daemon tells its peers, which may differ from the one it binds.

A daemon bound to a wildcard (``0.0.0.0``, ``::``, empty) listens everywhere,
but ``0.0.0.0:PORT`` in a prefill daemon's topology sends a decode daemon on
another host to its own loopback. ``advertise_host`` picks what peers are
told: ``--advertise-host`` when given; else the bind host when it is not a
wildcard; else this host's primary address (the source address of a route
to a documentation address: a UDP socket is connected, no packet is sent;
IPv4 first, IPv6 too for ``::``). Without a default route: an address
its host name resolves to that is one of this host's own; else this host's
only non-loopback address; else nothing can be told for sure, and
``advertise_host`` raises ValueError with the hint to pass ``--advertise-host``
(a name that resolves elsewhere, or to nothing, would send peers astray).
Every choice comes back with why, for the start-up log.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
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


def resolved_addresses(hostname: str) -> list[str]:
    """The non-loopback addresses ``hostname`` resolves to, IPv4 first."""
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    out: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for info_family, *_, sockaddr in infos:
            address = sockaddr[0]
            if info_family == family and _usable(address) and address not in out:
                out.append(address)
    return out


_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_IF_INET6 = Path("/proc/net/if_inet6")


def host_addresses() -> list[str]:
    """This host's own non-loopback addresses (IPv4 by interface, then global IPv6; Linux)."""
    out: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            address = socket.inet_ntoa(packed[20:24])
            if _usable(address) and address not in out:
                out.append(address)
    try:
        lines = _IF_INET6.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 4 and fields[3] == "00":  # scope global (not link-local: it needs a zone)
            address = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
            if _usable(address) and address not in out:
                out.append(address)
    return out


def advertise_host(bind_host: str, advertise: str | None = None, *,
                   primary: Callable[[int], str | None] = primary_address,
                   resolve: Callable[[str], Sequence[str]] = resolved_addresses,
                   hostname: Callable[[], str] = socket.gethostname,
                   interfaces: Callable[[], Sequence[str]] = host_addresses) -> Advertised:
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
    name, own = hostname(), list(interfaces())
    resolved = list(resolve(name))
    for address in resolved:
        if address in own:
            return Advertised(address, f"the address host name {name!r} resolves to (no default route)")
    if len(own) == 1:
        return Advertised(own[0], "this host's only non-loopback address (no default route)")
    named = f"resolves to {', '.join(resolved)}, not an address of this host" if resolved \
        else "resolves to no other address"
    raise ValueError(f"cannot tell which address peers can reach: no default route, host name {name!r} "
                     f"{named}, and this host has {len(own)} non-loopback addresses "
                     f"({', '.join(own) or 'none'}); pass --advertise-host")


def _usable(address: str) -> bool:
    return not _is_loopback(address) and not _is_unspecified(address)


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
