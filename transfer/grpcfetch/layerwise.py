"""Layer-wise streaming over gRPC: one owner rank's part of a fetch cut into several streams.

A rank sends each chunk of a FetchKV stream as soon as its layers are
written (``transfer.rank.progress``; on a GPU the read waits for the event of
the chunk's own last layer only), so a fetch started at the prefill's first
message runs under the prefill, and every chunk is placed into the decode
pool while later layers are still in flight (``transfer.grpcfetch.placers``).

One stream is one connection and one sending thread at the rank: where that
is the limit, a rank's span is cut into ``streams`` spans of consecutive
pages, each of every layer (``split_span``). Cut by pages, not by layers,
every stream still goes layer by layer under the prefill, and each keeps the
guarantees of one stream: chunks checked against their checksums and held to
their span (``spans.StreamCheck``), and a broken stream retried for only the
cells it lacks (``fetch.RankFetch``).
"""

from __future__ import annotations

from lanekv.transfer.grpcfetch.spans import Span

# More streams than this per rank buy nothing a rank's sending threads could feed.
MAX_STREAMS_PER_RANK = 8


def check_streams(streams: object) -> int:
    """``streams`` if it is a valid count of streams per rank; ValueError naming it otherwise."""
    if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= MAX_STREAMS_PER_RANK:
        raise ValueError(f"streams_per_rank must be an integer in [1, {MAX_STREAMS_PER_RANK}], "
                         f"got streams_per_rank={streams!r}")
    return streams


def split_span(span: Span, streams: int) -> list[Span]:
    """``span`` as up to ``streams`` spans of consecutive runs of its pages, every layer each.

    A span that does not name its pages (the rank's own choice) cannot be cut:
    it stays one. No span is empty; sizes differ by at most one page.
    """
    check_streams(streams)
    pages = span.pages
    if pages is None or streams == 1 or len(pages) < 2:
        return [span]
    count = min(streams, len(pages))
    size, extra = divmod(len(pages), count)
    out, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        out.append(Span(span.layer_start, span.layer_end, pages[start:end]))
        start = end
    return out
