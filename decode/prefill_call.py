"""The decode daemon's calls to its prefill daemon: one ``PrefillStream`` per Generate.

``PrefillClient.stream`` starts ``PrefillService.PrefillStream``; the
``PrefillCall``'s ``started`` returns the first message (the pages, as soon as
every owner rank can stream them) and a thread of its own waits for the last
one (the first token), so the KV fetch runs while the prefill does;
``check_manifest`` holds the first message to our contract, the request and
the prefill topology. Every failure is a ``Refusal`` with the status the
Generate call ends with.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import grpc

from proto import lanekv_pb2, lanekv_pb2_grpc
from runtime.status import Refusal
from transfer.protocol.contract import Topology
from transfer.protocol.manifest import Manifest
from transfer.rank.service import EPOCH_METADATA_KEY

Code = grpc.StatusCode
# How long a failed fetch waits to learn whether the prefill failed (and report that instead).
_PREFILL_VERDICT_S = 5.0


@dataclass(frozen=True)
class PrefillClient:
    """The prefill daemon at ``endpoint``, over ``stub``'s channel (shared by every call)."""

    stub: lanekv_pb2_grpc.PrefillServiceStub
    endpoint: str

    def stream(self, request_id: str, token_ids: Sequence[int], sampling: lanekv_pb2.SamplingParams,
               timeout_s: float) -> PrefillCall:
        """Start the prefill of a prompt (``sampling`` forwarded as the client gave it)."""
        request = lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=token_ids), request_id=request_id)
        request.sampling.CopyFrom(sampling)
        return PrefillCall(self, request, timeout_s)


class PrefillCall:
    """One PrefillStream call of the decode daemon."""

    def __init__(self, client: PrefillClient, request: lanekv_pb2.PrefillRequest, timeout_s: float) -> None:
        self._endpoint = client.endpoint
        self._start = time.perf_counter()
        self.seconds = 0.0  # from the call to its last message
        self.epoch: str | None = None  # the prefill daemon start that pinned the pages
        self._done: Future = Future()
        self._stream = client.stub.PrefillStream(request, timeout=timeout_s)

    def started(self) -> lanekv_pb2.PrefillReply:
        """The first message: the request's pages, held by every owner rank for FetchKV."""
        first = self._next()
        self.epoch = next((v for k, v in self._stream.initial_metadata() or () if k == EPOCH_METADATA_KEY), None)
        if first.done:  # a daemon that answers once, at the end
            self._finish(first.reply)
        else:
            threading.Thread(target=self._wait_done, name="lanekv-prefill-call", daemon=True).start()
        return first.reply

    def done(self) -> lanekv_pb2.PrefillReply:
        """The last message: the whole reply, first token included (waits for it)."""
        return self._done.result()

    def answered(self) -> bool:
        """Whether the last message came (then every rank has written every layer:
        the prefill daemon answers once each rank's device is done)."""
        return self._done.done() and self._done.exception() is None

    def raise_if_failed(self) -> None:
        """Raise the prefill's own failure, if it fails within a few seconds."""
        try:
            self._done.result(timeout=_PREFILL_VERDICT_S)
        except FutureTimeout:
            pass

    def close(self) -> None:
        self._stream.cancel()  # after the last message: does nothing

    def _wait_done(self) -> None:
        try:
            last = self._next()
            if not last.done:
                raise Refusal(Code.INTERNAL, f"prefill daemon {self._endpoint} sent two messages that are not done")
            self._finish(last.reply)
        except Refusal as refusal:
            self._done.set_exception(refusal)
        except Exception as err:  # noqa: BLE001 - handed to the waiting handler thread
            self._done.set_exception(Refusal(Code.INTERNAL, f"prefill call failed: {err}"))

    def _finish(self, reply: lanekv_pb2.PrefillReply) -> None:
        self.seconds = time.perf_counter() - self._start
        self._done.set_result(reply)

    def _next(self) -> lanekv_pb2.PrefillProgress:
        try:
            return next(self._stream)
        except grpc.RpcError as err:
            raise Refusal(err.code(), f"prefill daemon {self._endpoint}: {err.details()}") from err
        except StopIteration:
            raise Refusal(Code.INTERNAL, f"prefill daemon {self._endpoint} ended the call without "
                          "its last message") from None


def check_manifest(reply: lanekv_pb2.PrefillReply, request_id: str, num_tokens: int, fingerprint: str,
                   page_size: int, topology: Topology) -> Manifest:
    """The manifest of a PrefillStream's first message, checked against our contract
    (``fingerprint``, ``page_size``), the request and the prefill ``topology``."""
    if reply.contract_fingerprint != fingerprint:
        raise Refusal(
            Code.FAILED_PRECONDITION,
            f"prefill answered with contract {reply.contract_fingerprint[:16]!r}, ours is "
            f"{fingerprint[:16]!r}; restart this daemon to handshake again",
        )
    try:
        manifest = Manifest.decode(reply.manifest)
    except ValueError as err:
        raise Refusal(Code.INTERNAL, f"prefill daemon sent a bad manifest: {err}") from err
    if manifest.page_size != page_size:
        raise Refusal(Code.FAILED_PRECONDITION, f"manifest page_size={manifest.page_size}, ours is {page_size}")
    if manifest.request_id != request_id or manifest.num_tokens != num_tokens:
        raise Refusal(
            Code.INTERNAL,
            f"manifest is for {manifest.request_id!r} with {manifest.num_tokens} tokens, asked for "
            f"{request_id!r} with {num_tokens}",
        )
    try:
        if len(reply.endpoints) != topology.cp_size:
            raise ValueError(f"{len(reply.endpoints)} endpoints for cp_size {topology.cp_size}")
        topology.check((p.page, p.owner) for p in manifest.pages)
    except ValueError as err:
        raise Refusal(Code.FAILED_PRECONDITION, f"prefill topology: {err}") from err
    return manifest
