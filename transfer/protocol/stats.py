"""What a fetch reports, whatever the transport: per rank and in all.

Every transport (``transfer.connector``) fills ``RankStats`` for the ranks it
fetched; ``KVFetcher.fetch`` sums them into one ``FetchStats`` per request,
which the decode daemon counts and sends back in a Generate's trailing metadata.
"""

from __future__ import annotations

from typing import NamedTuple


class RankStats(NamedTuple):
    bytes: int
    chunks: int
    seconds: float  # from the start of the fetch to this rank's last placed chunk
    retries: int = 0  # streams of this rank asked again after a failure


class FetchStats(NamedTuple):
    bytes: int
    chunks: int
    seconds: float
    per_rank: dict[int, RankStats]
    retries: int = 0
