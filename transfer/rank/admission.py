"""What a caller of a rank's KVTransfer proves before the rank moves or frees anything.

- The agreement: ``contract`` is the source's, read at every call (UNAVAILABLE
  until the topology is complete); ``agreed`` checks the caller's fingerprint
  against it, and that the request id is sane.
- The start: ``same_start`` refuses a caller naming another start of the prefill
  daemon, and (with a request id) one without the capability the request was
  pinned with; such an id gets the unknown id's answer word for word, so a caller
  without the capability cannot tell which request ids are live.
- The attach: a descriptors fetch is for a same-host peer that called AttachPool
  first (``attach`` remembers its host, at most ``MAX_ATTACHED_PEERS``), or for a
  staged relay of this rank (``RELAY_METADATA_KEY``).
- The pages: ``owned`` is NOT_FOUND naming the request once it is released;
  checked again after a read, it proves the pages were held throughout.

One ``Admission`` per servicer (``service.py``); its only state is the attached
hosts, under a lock (many calls run at once).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import grpc
from lanekv.runtime.limits import peer_host
from lanekv.runtime.status import Refusal
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.contract import LayoutContract
from lanekv.transfer.protocol.wire import MAX_REQUEST_ID_LEN
from lanekv.transfer.rank.sources import PageSource
from lanekv.transfer.rank.staging import RELAY_METADATA_KEY, RankStaging

Code = grpc.StatusCode
# Attached peers remembered per rank (a descriptors fetch needs an AttachPool first).
MAX_ATTACHED_PEERS = 1024
UNKNOWN = "unknown request"  # what a source's KeyError says of an id it never held


class Admission:
    def __init__(self, source: PageSource, epoch: str | None, relay_staging: RankStaging | None) -> None:
        self._source = source
        self._epoch = epoch  # this start of the prefill daemon, or None: no check
        self._relay_staging = relay_staging  # the staged relays' files, or None
        self._attached: OrderedDict[str, None] = OrderedDict()  # peer hosts that called AttachPool
        self._attached_lock = threading.Lock()

    def contract(self) -> LayoutContract:
        try:
            return self._source.contract()
        except RuntimeError as err:  # the topology is not complete yet
            raise Refusal(Code.UNAVAILABLE, str(err)) from err

    def agreed(self, request_id: str, fingerprint: str) -> Agreement:
        """Our agreement, if the caller's fingerprint is its fingerprint and the request id is sane."""
        agreement = self.contract().agreement
        if fingerprint != agreement.fingerprint:
            raise Refusal(
                Code.FAILED_PRECONDITION,
                f"contract fingerprint {fingerprint!r:.80} is not this server's {agreement.fingerprint}; handshake again",
            )
        if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
            raise Refusal(
                Code.INVALID_ARGUMENT,
                f"request_id must be 1..{MAX_REQUEST_ID_LEN} characters, got {request_id!r:.80}",
            )
        return agreement

    def same_start(self, context: grpc.ServicerContext, request_id: str | None = None) -> None:
        """Refuse a caller that names another start of the prefill daemon than ours, and
        (with ``request_id``) one without the capability the request was pinned with."""
        capability = None
        for key, value in context.invocation_metadata() or ():
            if key != EPOCH_METADATA_KEY:
                continue
            epoch, _, capability = value.partition(":")
            if self._epoch is not None and epoch and epoch != self._epoch:
                raise Refusal(
                    Code.FAILED_PRECONDITION,
                    f"the request was prefilled by prefill daemon start {epoch!r:.40}, this is start "
                    f"{self._epoch!r}: the daemon restarted and the request's pages are gone",
                )
        if request_id is not None and not self._source.admits(request_id, capability or None):
            # The answer an unknown id gets, word for word: a caller without the
            # capability cannot tell which request ids are live.
            raise Refusal(Code.NOT_FOUND, _unknown_message(request_id))

    def attach(self, context: grpc.ServicerContext) -> None:
        """Remember the caller's host as attached (its AttachPool has succeeded)."""
        with self._attached_lock:
            self._attached[peer_host(context.peer() or "")] = None
            while len(self._attached) > MAX_ATTACHED_PEERS:
                self._attached.popitem(last=False)

    def check_attached(self, context: grpc.ServicerContext) -> None:
        """Descriptors are for a same-host peer that attached the pool first, or a staged relay of ours."""
        if self._relay_staging is not None and any(
                key == RELAY_METADATA_KEY and self._relay_staging.knows(value)
                for key, value in context.invocation_metadata() or ()):
            return
        with self._attached_lock:
            attached = peer_host(context.peer() or "") in self._attached
        if not attached:
            raise Refusal(Code.FAILED_PRECONDITION,
                          f"descriptors=true needs an AttachPool on rank {self._source.rank} first; "
                          "fetch the bytes (descriptors=false) or attach")

    def holds(self, request_id: str) -> bool:
        try:
            self._source.pages_of(request_id)
        except KeyError:
            return False
        return True

    def owned(self, request_id: str) -> list[tuple[int, int]]:
        """The request's (logical, physical) pages on this rank; NOT_FOUND once released."""
        try:
            return self._source.pages_of(request_id)
        except KeyError as err:
            raise Refusal(Code.NOT_FOUND, key_message(request_id, err)) from err


def key_message(request_id: str, err: KeyError) -> str:
    """What a caller is told of a ``KeyError`` of the page source for ``request_id``."""
    detail = err.args[0] if err.args else UNKNOWN
    return _unknown_message(request_id) if detail == UNKNOWN else f"request {request_id!r:.80}: {detail}"


def _unknown_message(request_id: str) -> str:
    return (f"request {request_id!r:.80}: {UNKNOWN} here, or not yours: present the capability its prefill "
            f"returned ('{EPOCH_METADATA_KEY}: <epoch>:<capability>' metadata)")
