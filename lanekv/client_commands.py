"""``lanekv generate`` and ``lanekv handshake``: thin gRPC clients of the daemons.

``handshake`` reads each daemon's contract through the one RPC every daemon
serves, ``KVTransfer.Handshake``: it sends a probe agreement that no real
model can match, and the refusal carries the server's contract in its
trailing metadata (``runtime.status.CONTRACT_METADATA_KEY``). Then it
compares the two agreements here.

Both speak TLS and send the token as the security options say
(``runtime.security.add_security_args``).

Exit codes: ``generate`` 0 after a finished stream, 1 when the call failed
(the status is printed), 2 for bad arguments; ``handshake`` 0 compatible,
1 incompatible (the diff is printed), 2 when a contract could not be read.
"""

from __future__ import annotations

import argparse
import socket
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.security import SecurityConfig, open_channel
from lanekv.runtime.status import CONTRACT_METADATA_KEY, TRANSFER_SERVICE
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.contract import LayoutContract
from lanekv.transfer.protocol.fielddiff import diff, format_diff

PREFILL_SERVICE = lanekv_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
_PROBE_TIMEOUT_S = 2.0  # what generate spends finding out what a wrong --decode port is

# A well-formed agreement that differs from every real one (its digests name no code or weights).
_PROBE = Agreement(
    architecture="lanekv-handshake-probe", model_config={}, rope={}, num_layers=1, num_kv_heads=1,
    head_dim=1, weights_digest="probe", kv_dtype="float32", page_size=1, pool_layout="probe",
    wire_version=1, source_digest="probe",
)


class CommandError(Exception):
    """A problem to report on stderr, with the exit code to return."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def generate(args: argparse.Namespace) -> int:
    try:
        request = _generate_request(args)
        security = _security(args)
    except CommandError as err:
        print(f"lanekv generate: {err}", file=sys.stderr)
        return err.exit_code
    out = sys.stdout
    tokens: list[int] = []
    printed_text = False
    with open_channel(args.decode, security) as channel:
        call = lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=args.timeout)
        finish_reason = ""
        try:
            for reply in call:
                tokens.extend(reply.token_ids)
                if args.print_ids:
                    for token in reply.token_ids:
                        out.write(f"{token} ")
                elif reply.text:
                    out.write(reply.text)
                    printed_text = True
                out.flush()
                finish_reason = reply.finish_reason or finish_reason
        except grpc.RpcError as err:
            out.write("\n")
            print(f"lanekv generate: {err.code().name}: {err.details()}", file=sys.stderr)
            what = _what_is(args.decode, channel, err.code())
            if what:
                print(f"lanekv generate: {args.decode} {what}; --decode takes a decode daemon's "
                      "gRPC port (lanekv decode --port)", file=sys.stderr)
            return 1
        if not args.print_ids and not printed_text and tokens:
            out.write(" ".join(map(str, tokens)))  # the model has no tokenizer: ids are all there is
        out.write("\n")
        stats = dict(call.trailing_metadata() or ())
    print(_summary(len(tokens), finish_reason, stats), file=sys.stderr)
    return 0


def _what_is(endpoint: str, channel: grpc.Channel, code: grpc.StatusCode) -> str | None:
    """What serves ``endpoint`` when a Generate there failed with ``code`` as no decode
    daemon's would: a prefill daemon or rank (gRPC without DecodeService) or an HTTP
    server (the OpenAI front); None when it cannot tell."""
    if code == grpc.StatusCode.UNIMPLEMENTED:
        health = health_pb2_grpc.HealthStub(channel)
        for service, what in ((PREFILL_SERVICE, "is a prefill daemon (its Prefill port)"),
                              (TRANSFER_SERVICE, "is a prefill rank's KVTransfer port")):
            try:
                health.Check(health_pb2.HealthCheckRequest(service=service), timeout=_PROBE_TIMEOUT_S)
                return what
            except grpc.RpcError:
                continue
        return "serves gRPC but no DecodeService"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) \
            and _speaks_http(endpoint):
        return "is an HTTP server (lanekv serve's OpenAI API? use curl or an OpenAI client there)"
    return None


def _speaks_http(endpoint: str) -> bool:
    """Whether ``endpoint`` answers a plain HTTP/1.0 request with an HTTP status line."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT_S) as sock:
            sock.sendall(b"GET /health HTTP/1.0\r\nHost: lanekv\r\n\r\n")
            return sock.recv(5) == b"HTTP/"
    except (OSError, ValueError):
        return False


def _generate_request(args: argparse.Namespace) -> lanekv_pb2.GenerateRequest:
    if (args.prompt is None) == (args.ids is None):
        raise CommandError("give either a prompt text or --ids", 2)
    if args.max_new_tokens < 0:
        raise CommandError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}", 2)
    request = lanekv_pb2.GenerateRequest(max_new_tokens=args.max_new_tokens)
    if args.ids is not None:
        request.token_ids.ids.extend(_int_list("--ids", args.ids))
    else:
        request.text = args.prompt
    if args.stop_ids:
        request.stop_token_ids.extend(_int_list("--stop-ids", args.stop_ids))
    if args.request_id is not None:
        request.request_id = args.request_id
    s = request.sampling
    s.temperature, s.top_k, s.top_p = args.temperature, args.top_k, args.top_p
    if args.seed is not None:
        s.seed, s.has_seed = args.seed, True
    return request


def _security(args: argparse.Namespace) -> SecurityConfig:
    try:
        return SecurityConfig.from_args(args)
    except (ValueError, TypeError) as err:
        raise CommandError(str(err), 2) from err


def _int_list(flag: str, text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise CommandError(f"{flag} must be comma-separated integers, got {text!r}", 2) from err


def _summary(num_tokens: int, finish_reason: str, stats: dict) -> str:
    line = f"[{num_tokens} tokens, finish: {finish_reason or '?'}"
    if "lanekv-transfer-bytes" in stats:
        nbytes = int(stats["lanekv-transfer-bytes"])
        seconds = float(stats.get("lanekv-transfer-seconds", 0.0))
        rate = f", {nbytes / seconds / 1e9:.3f} GB/s" if seconds > 0 else ""
        line += f"; KV transfer {nbytes} bytes in {seconds * 1e3:.1f} ms{rate}"
        line += f"; prefill {float(stats.get('lanekv-prefill-seconds', 0.0)) * 1e3:.1f} ms"
    return line + "]"


def handshake(args: argparse.Namespace) -> int:
    try:
        security = _security(args)
        prefill = fetch_contract(args.prefill, args.timeout, security)
        decode = fetch_contract(args.decode, args.timeout, security)
    except CommandError as err:
        print(f"lanekv handshake: {err}", file=sys.stderr)
        return err.exit_code
    topology = prefill.topology
    print(f"prefill {args.prefill}: fingerprint {prefill.fingerprint[:16]}, cp_size {topology.cp_size}, "
          f"ranks {', '.join(topology.endpoints)}")
    print(f"decode  {args.decode}: fingerprint {decode.fingerprint[:16]}")
    diffs = diff(prefill.agreement, decode.agreement)
    if not diffs:
        print("compatible")
        return 0
    print(f"incompatible: {len(diffs)} field(s) differ")
    print(format_diff(diffs, ours="prefill", theirs="decode"))
    return 1


def fetch_contract(endpoint: str, timeout: float, security: SecurityConfig | None = None) -> LayoutContract:
    """The contract a daemon serves at ``endpoint`` (read from a refused probe handshake)."""
    request = lanekv_pb2.HandshakeRequest(contract=_PROBE.encode())
    with open_channel(endpoint, SecurityConfig() if security is None else security) as channel:
        stub = lanekv_pb2_grpc.KVTransferStub(channel)
        try:
            encoded = stub.Handshake(request, timeout=timeout).contract  # only a twin of the probe says yes
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise CommandError(f"{endpoint}: {err.code().name}: {err.details()}", 2) from err
            found = [v for k, v in err.trailing_metadata() or () if k == CONTRACT_METADATA_KEY]
            if not found:
                raise CommandError(f"{endpoint} refused the handshake without saying its contract", 2) from err
            encoded = found[0]
    try:
        return LayoutContract.decode(encoded)
    except ValueError as err:
        raise CommandError(f"{endpoint} sent an undecodable contract: {err}", 2) from err
