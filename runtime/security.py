"""TLS, mutual TLS and a shared bearer token for every lanekv gRPC server and channel.

One ``SecurityConfig`` per process serves both of its roles: the daemons are
servers (Prefill, Decode, KVTransfer) and clients (the decode daemon calls the
prefill daemon and its ranks), so ``tls_cert``/``tls_key`` is the certificate
a process serves with and, when the peer asks for one, presents as a client.
With mutual TLS on, that certificate needs both the serverAuth and clientAuth
extended key usages.

TLS is on when ``tls_cert`` or ``tls_ca`` is given. A client verifies servers
against ``tls_ca`` (the system roots when only ``tls_cert`` is given); a server
verifies client certificates against ``tls_ca`` only when
``require_client_cert``. The token travels in ``authorization: Bearer <token>``
metadata; without TLS anyone on the path can read it, hence the warning that
``bind`` logs for a non-loopback address.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import hmac
import ipaddress
import logging
import os
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from lanekv.runtime.limits import CallLimits, CallLimitsInterceptor
from lanekv.runtime.reflection import ReflectingServer
from lanekv.runtime.requests import MalformedRequestInterceptor
from lanekv.runtime.status import grpc_options

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
# Liveness probes (kubelet, grpc_health_probe) carry no token, and the health
# service says only SERVING or NOT_SERVING, so it stays open.
OPEN_SERVICES = ("grpc.health.v1.Health",)
# gRPC refuses metadata larger than 8 KiB by default; a token this long still fits.
MAX_TOKEN_LEN = 4096


@dataclass(frozen=True)
class SecurityConfig:
    tls_cert: str | None = None  # PEM certificate chain this process serves with
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_ca: str | None = None  # PEM CA bundle that verifies the peer
    require_client_cert: bool = False  # mutual TLS: servers refuse clients without a certificate
    tls_server_name: str | None = None  # name checked in server certificates instead of the host
    token: str | None = field(default=None, repr=False)  # shared secret: never in a repr or a log

    def __post_init__(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_ca", "tls_server_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"{name} must be a non-empty str or None, got {name}={value!r}")
        if not isinstance(self.require_client_cert, bool):
            raise TypeError(
                f"require_client_cert must be a bool, got require_client_cert={self.require_client_cert!r}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = ("tls_cert", "tls_key") if self.tls_key is None else ("tls_key", "tls_cert")
            raise ValueError(f"{missing} is required with {given}={getattr(self, given)!r}")
        if self.require_client_cert and (self.tls_ca is None or self.tls_cert is None):
            raise ValueError(
                "require_client_cert=True needs tls_cert and tls_key (the server's own) and tls_ca "
                f"(the CA of client certificates), got tls_cert={self.tls_cert!r}, tls_ca={self.tls_ca!r}"
            )
        if self.tls_server_name is not None and not self.tls:
            raise ValueError(f"tls_server_name={self.tls_server_name!r} needs TLS (tls_ca or tls_cert)")
        _check_pem("tls_cert", self.tls_cert, b"CERTIFICATE")
        _check_pem("tls_key", self.tls_key, b"PRIVATE KEY")
        _check_pem("tls_ca", self.tls_ca, b"CERTIFICATE")
        if self.token is not None:
            _check_token(self.token)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None or self.tls_ca is not None

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None
    ) -> SecurityConfig:
        """The config of ``add_security_args`` options; options a parser lacks count as absent.

        The token comes from ``--api-key`` (as OpenAI-compatible servers take it;
        it wins over the other two, and since ``ps`` shows a command line a
        warning is logged), else ``--auth-token-file`` (surrounding whitespace
        stripped) or the environment variable named by ``--auth-token-env``
        (give one of these two).
        """
        environ = os.environ if environ is None else environ
        token_file = getattr(args, "auth_token_file", None)
        token_env = getattr(args, "auth_token_env", None)
        if token_file is not None and token_env is not None:
            raise ValueError(
                f"give one of auth_token_file={token_file!r} and auth_token_env={token_env!r}"
            )
        token = None
        if token_file is not None:
            try:
                with open(token_file, encoding="ascii") as f:
                    token = f.read().strip()
            except (OSError, UnicodeDecodeError) as err:
                raise ValueError(f"auth_token_file={token_file!r} is not readable: {err}") from err
            if not token:
                raise ValueError(f"auth_token_file={token_file!r} is empty")
        if token_env is not None:
            token = environ.get(token_env, "")
            if not token:
                raise ValueError(f"auth_token_env={token_env!r} names an unset or empty variable")
        api_key = getattr(args, "api_key", None)
        if api_key is not None:
            ignored = [name for name, value in (("--auth-token-file", token_file), ("--auth-token-env", token_env))
                       if value is not None]
            log.warning("--api-key: the token is visible to every user of this host in the process list (ps); "
                        "--auth-token-file or --auth-token-env keep it out%s",
                        f" ({' and '.join(ignored)} ignored: --api-key wins)" if ignored else "")
            token = api_key
        return cls(
            tls_cert=getattr(args, "tls_cert", None),
            tls_key=getattr(args, "tls_key", None),
            tls_ca=getattr(args, "tls_ca", None),
            require_client_cert=bool(getattr(args, "tls_require_client_cert", False)),
            tls_server_name=getattr(args, "tls_server_name", None),
            token=token,
        )


def add_security_args(parser: argparse.ArgumentParser) -> None:
    """The options ``SecurityConfig.from_args`` reads, in their own help group."""
    g = parser.add_argument_group("security")
    g.add_argument("--tls-cert", default=None, help="PEM certificate chain to serve (and present) with")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default=None, help="PEM CA bundle that verifies peers")
    g.add_argument("--tls-require-client-cert", action="store_true",
                   help="mutual TLS: refuse clients without a certificate signed by --tls-ca")
    g.add_argument("--tls-server-name", default=None,
                   help="name to expect in server certificates instead of the endpoint's host")
    g.add_argument("--auth-token-file", default=None,
                   help="file holding the shared token every call must carry")
    g.add_argument("--auth-token-env", default=None,
                   help="environment variable holding the shared token")
    g.add_argument("--api-key", default=None,
                   help="the shared token itself, as OpenAI-compatible servers take it (wins over "
                        "--auth-token-file/--auth-token-env; visible in ps, so a warning is logged)")


def _check_pem(name: str, path: str | None, marker: bytes) -> None:
    if path is None:
        return
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ValueError(f"{name}={path!r} is not a readable file: {err}") from err
    if b"-----BEGIN " not in data or marker not in data:
        raise ValueError(f"{name}={path!r} holds no PEM {marker.decode()}")


def _check_token(token: object) -> None:
    # The messages never echo the token: they end up in logs.
    if not isinstance(token, str):
        raise TypeError(f"token must be a str, got a {type(token).__name__}")
    if not token:
        raise ValueError("token must not be empty")
    if len(token) > MAX_TOKEN_LEN:
        raise ValueError(f"token is {len(token)} characters, more than {MAX_TOKEN_LEN}")
    bad = [i for i, ch in enumerate(token) if not "!" <= ch <= "~"]
    if bad:
        # Metadata values are printable ASCII, and a space would make
        # 'Bearer <token>' ambiguous.
        raise ValueError(f"token must be printable ASCII without whitespace; character {bad[0]} is not")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# -- servers ----------------------------------------------------------------


def bind(server: grpc.Server, host: str, port: int, config: SecurityConfig) -> int:
    """Add a TLS (or, without TLS in ``config``, a plaintext) port; return the bound port.

    Raises ``OSError`` naming ``host:port`` when it cannot be bound and
    ``ValueError`` when TLS is asked for without a server certificate.
    """
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    if config.tls and config.tls_cert is None:
        raise ValueError(
            f"serving TLS on {address} needs tls_cert and tls_key; only tls_ca={config.tls_ca!r} is given"
        )
    try:
        if config.tls:
            credentials = grpc.ssl_server_credentials(
                [(_read(config.tls_key), _read(config.tls_cert))],
                root_certificates=_read(config.tls_ca) if config.require_client_cert else None,
                require_client_auth=config.require_client_cert,
            )
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as err:  # grpcio raises this when the port cannot be bound
        raise OSError(f"cannot bind {address} (in use, or not an address of this host): {err}") from err
    if bound == 0:  # older grpcio returns 0 instead
        raise OSError(f"cannot bind {address} (in use, or not an address of this host)")
    if not config.tls and not _is_loopback(host):
        log.warning(
            "serving %s without TLS: prompts, KV pages%s cross the network in clear text",
            address, " and the auth token" if config.token else "",
        )
    return bound


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def server_interceptors(config: SecurityConfig) -> list[grpc.ServerInterceptor]:
    """What a server of ``config`` needs installed: the token check when a token is set."""
    return [TokenInterceptor(config.token)] if config.token else []


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses with UNAUTHENTICATED every call whose ``authorization`` metadata is not
    ``Bearer <token>``, except the health service (``OPEN_SERVICES``).

    An unknown method is left to gRPC (UNIMPLEMENTED): the method names are
    public in the proto, and answering for them would let a caller grow the
    per-method metrics without limit.
    """

    def __init__(self, token: str) -> None:
        _check_token(token)
        self._expected = _digest(f"Bearer {token}")

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").partition("/")[0]
        if handler is None or service in OPEN_SERVICES:
            return handler
        problem = self._problem(handler_call_details.invocation_metadata)
        if problem is None:
            return handler
        return _refusal(handler, f"{handler_call_details.method}: {problem}")

    def accepts(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        """Whether ``metadata`` carries the token (one ``authorization`` entry, the right one)."""
        return self._problem(metadata) is None

    def _problem(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        values = [v for k, v in metadata or () if k == AUTH_METADATA_KEY]
        if not values:
            problem = f"missing '{AUTH_METADATA_KEY}: Bearer <token>' metadata"
        elif len(values) > 1:
            problem = f"{len(values)} '{AUTH_METADATA_KEY}' metadata entries; send one"
        elif not hmac.compare_digest(_digest(values[0]), self._expected):
            problem = "wrong token" if values[0].startswith("Bearer ") else "not a 'Bearer <token>' value"
        else:
            return None
        return problem


def _digest(value: str | bytes) -> bytes:
    # Comparing fixed-length digests keeps the time independent of the token's length too.
    data = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
    return hashlib.sha256(data).digest()


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED without reading."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    return kinds[bool(handler.request_streaming), bool(handler.response_streaming)](refuse)


def make_server(
    config: SecurityConfig,
    max_workers: int,
    options: Sequence[tuple[str, Any]] | None = None,
    *,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    limits: CallLimits | None = None,
) -> grpc.Server:
    """A gRPC server with ``interceptors`` (outermost first), the malformed-request
    check, the token check and then the call limits (``runtime.limits``;
    default ``CallLimits.for_workers(max_workers)``).

    Metrics interceptors go in ``interceptors`` so that they also count the
    calls the token check and the limits refuse. ``options`` defaults to ``grpc_options()``.
    The thread pool holds a thread for every call the limits admit
    (``limits.total + limits.open_total``, made as calls come): an admitted call
    runs at once, never queued behind streams that hold their threads (a
    health check queued behind 64 waiting PrefillStream calls timed out, and
    its caller took a busy daemon for a dead one), and a call past the limits
    is refused at once instead of waiting.
    SO_REUSEPORT is off unless ``options`` says otherwise: with it, a second
    daemon started on a busy port would silently share its connections. The
    server answers gRPC reflection for the services added to it (``runtime.reflection``).
    """
    options = list(grpc_options() if options is None else options)
    if not any(key == "grpc.so_reuseport" for key, _ in options):
        options.append(("grpc.so_reuseport", 0))
    limits = CallLimits.for_workers(max_workers) if limits is None else limits
    token_check = server_interceptors(config)
    accepts = token_check[0].accepts if token_check else None
    return ReflectingServer(grpc.server(
        futures.ThreadPoolExecutor(max_workers=limits.total + limits.open_total),
        # Calls counted first, then bytes that do not parse refused with
        # INVALID_ARGUMENT (gRPC alone answers INTERNAL), then the token
        # check, then the bounds on calls at once.
        interceptors=[*interceptors, MalformedRequestInterceptor(), *token_check,
                      CallLimitsInterceptor(limits, OPEN_SERVICES, accepts)],
        options=options,
    ))


# -- clients ----------------------------------------------------------------


def open_channel(
    endpoint: str, config: SecurityConfig, options: Sequence[tuple[str, Any]] | None = None
) -> grpc.Channel:
    """A channel to ``endpoint`` that speaks TLS when ``config`` does and carries its token.

    ``options`` defaults to ``grpc_options()``.
    """
    options = list(grpc_options() if options is None else options)
    if not config.tls:
        channel = grpc.insecure_channel(endpoint, options=options)
        # gRPC sends call credentials only over secure channels, so a token
        # without TLS rides in an interceptor instead.
        return grpc.intercept_channel(channel, _TokenMetadata(config.token)) if config.token else channel
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(config.tls_ca) if config.tls_ca else None,
        private_key=_read(config.tls_key) if config.tls_key else None,
        certificate_chain=_read(config.tls_cert) if config.tls_cert else None,
    )
    if config.token:
        # Sends 'authorization: Bearer <token>' with every call.
        credentials = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials(config.token)
        )
    if config.tls_server_name:
        options.append(("grpc.ssl_target_name_override", config.tls_server_name))
    return grpc.secure_channel(endpoint, credentials, options=options)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _TokenMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a plaintext channel."""

    def __init__(self, token: str) -> None:
        self._entry = (AUTH_METADATA_KEY, f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._entry]
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
