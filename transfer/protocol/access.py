"""Who may fetch a request's pages: the epoch key and the access ticket.

Request metadata of FetchKV, Release and AttachPool (``EPOCH_METADATA_KEY``):
the start of the prefill daemon that pinned the pages, and for one request
its capability, ``<epoch>:<capability>`` (``access_ticket``; the prefill
daemon hands the epoch out in Prefill's and PrefillStream's metadata, and the
capability in PrefillReply). A rank server of another start refuses, so a
restarted daemon that reuses ports, and maybe request ids, never serves its
pages for old ones; a request pinned with a capability is served only to a
caller that presents it (NOT_FOUND otherwise, as for an id never held: knowing,
or guessing, a request id is not enough, and the answer does not tell whether
it is live). Clients and the rank server both take these from here.
"""

from __future__ import annotations

import secrets

EPOCH_METADATA_KEY = "lanekv-epoch"


def access_ticket(epoch: str | None, capability: str | None) -> str | None:
    """The ``EPOCH_METADATA_KEY`` value for one request: its daemon start and capability
    (an empty start names none; None: nothing to send)."""
    if not capability:
        return epoch or None
    return f"{epoch or ''}:{capability}"


def start_of(ticket: str | None) -> str | None:
    """The daemon start an ``access_ticket`` names (what AttachPool needs), or None."""
    return (ticket or "").partition(":")[0] or None


def epoch_metadata(ticket: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that presents ``ticket`` (a start or an ``access_ticket``); None: nothing."""
    return ((EPOCH_METADATA_KEY, ticket),) if ticket else None


def new_capability() -> str:
    """An unguessable capability for one request (256 random bits)."""
    return secrets.token_urlsafe(32)
