"""What one owner rank's stream of a fetch covers, and what it may send.

A ``Span`` is a layer range x a page list of one rank; ``Cells`` are the
(layer, page) cells received of it; ``leftovers`` is what of a span a
broken stream did not bring, for the retry to ask again. ``StreamCheck``
holds each stream to its span: chunk ``seq`` 0, 1, ... in order, checksums
that match, cells asked for, each once.
"""

from __future__ import annotations

from typing import NamedTuple

from lanekv.proto import lanekv_pb2
from lanekv.transfer.errors import ChecksumError, CorruptChunk, TransferError
from lanekv.transfer.protocol.wire import ChunkHeader, checksum, split_chunk


class Span(NamedTuple):
    """Layers ``[layer_start, layer_end)`` x ``pages`` of one rank."""

    layer_start: int
    layer_end: int | None  # None: up to the server's last layer
    pages: tuple[int, ...] | None  # None: every page the rank holds of the request

    def request(self, request_id: str, fingerprint: str, max_chunk_bytes: int,
                heads: tuple[int, int] | None = None) -> lanekv_pb2.FetchRequest:
        """The FetchRequest of this span; ``heads``: (first KV head, count) of each row."""
        request = lanekv_pb2.FetchRequest(
            request_id=request_id,
            fingerprint=fingerprint,
            layer_start=self.layer_start,
            pages=list(self.pages or ()),
            max_chunk_bytes=max_chunk_bytes,
        )
        if self.layer_end is not None:
            request.layer_end = self.layer_end
        if heads is not None:
            request.head_start, request.head_count = heads
        return request


class Cells:
    """Cells (layer, page) received, by layer."""

    def __init__(self) -> None:
        self._by_layer: dict[int, set[int]] = {}
        self.count = 0

    def of(self, layer: int) -> set[int]:
        return self._by_layer.get(layer, set())

    def layers(self) -> list[int]:
        return sorted(self._by_layer)

    def has_all(self, header: ChunkHeader) -> bool:
        return all(self.of(layer).issuperset(header.pages) for layer in range(header.layer_start, header.layer_end))

    def has_any(self, header: ChunkHeader) -> bool:
        return any(not self.of(layer).isdisjoint(header.pages) for layer in range(header.layer_start, header.layer_end))

    def add(self, header: ChunkHeader) -> None:
        for layer in range(header.layer_start, header.layer_end):
            got = self._by_layer.setdefault(layer, set())
            self.count -= len(got)
            got.update(header.pages)
            self.count += len(got)


def leftovers(span: Span, cells: Cells) -> list[Span]:
    """What of ``span`` is not in ``cells``, as few spans as the shape allows (layer-major order)."""
    seen = [
        layer for layer in cells.layers()
        if layer >= span.layer_start and (span.layer_end is None or layer < span.layer_end)
    ]
    if not seen:
        return [span]
    pages = span.pages
    if pages is None:
        if seen[-1] == span.layer_start:
            return [span]  # the first layer may be short, and only it would tell the rank's pages
        # Chunks come layer-major (``_StreamCheck`` holds the server to it), so once
        # a later layer arrived the first one is whole: its pages are all the rank's.
        pages = tuple(sorted(cells.of(span.layer_start)))
    top = seen[-1] + 1
    if span.layer_end is None:
        # Without the layer count a span must not start past the last layer: ask
        # again for the last layer seen in full (its chunks already here are dropped).
        top -= 1
    out: list[Span] = []
    for layer in range(span.layer_start, top):
        have = cells.of(layer)
        missing = tuple(page for page in pages if page not in have)
        if missing:
            _append(out, Span(layer, layer + 1, missing))
    if span.layer_end is None or top < span.layer_end:
        _append(out, Span(top, span.layer_end, pages))
    return out


def _append(out: list[Span], span: Span) -> None:
    """Add ``span``, merged into the last one when it continues it with the same pages."""
    if out and out[-1].pages == span.pages and out[-1].layer_end == span.layer_start:
        out[-1] = Span(out[-1].layer_start, span.layer_end, span.pages)
    else:
        out.append(span)


class StreamCheck:
    """What one stream may send: chunk ``seq`` 0, 1, ... of cells of its span, layer-major, each once.

    The checksum covers a chunk's payload, not its header. With the pages
    named, the header is held to more: chunks must tile the span exactly as
    ``wire.plan_chunks`` cuts it (whole layers of every page, or one layer's
    pages in consecutive runs, in the order asked), so a damaged page id or
    layer number never passes. Without them a chunk must only lie in the span.
    """

    def __init__(self, request_id: str, rank: int, span: Span) -> None:
        self.request_id, self.rank, self.span = request_id, rank, span
        self._seq, self._layer, self._cursor = 0, span.layer_start, 0
        self._seen = Cells()  # only without named pages

    def chunk(self, message: bytes) -> tuple[ChunkHeader, memoryview]:
        seq = self._seq
        self._seq += 1
        try:
            header_bytes, data = split_chunk(message)
            header = ChunkHeader.decode(header_bytes)
        except ValueError as err:
            raise CorruptChunk(self.request_id, self.rank, seq, f"does not parse: {err}") from err
        if (header.request_id, header.rank, header.seq) != (self.request_id, self.rank, seq):
            raise CorruptChunk(
                self.request_id, self.rank, seq,
                f"is labelled ({header.request_id!r}, rank {header.rank}, seq {header.seq})",
            )
        if data.nbytes != header.nbytes or checksum(data) != header.checksum:
            raise ChecksumError(self.request_id, self.rank, seq)
        if not (self._tiles(header) if self.span.pages is not None else self._inside(header)):
            raise CorruptChunk(
                self.request_id, self.rank, seq,
                f"holds layers [{header.layer_start}, {header.layer_end}) of pages {list(header.pages)[:8]}:"
                " not what was asked, out of order, or sent before",
            )
        return header, data

    def _tiles(self, header: ChunkHeader) -> bool:
        pages, end = self.span.pages, self.span.layer_end
        if self._cursor == 0 and header.pages == pages:  # whole layers
            if header.layer_start != self._layer or (end is not None and header.layer_end > end):
                return False
            self._layer = header.layer_end
            return True
        run = pages[self._cursor:self._cursor + len(header.pages)]
        if (header.pages != run or header.layer_start != self._layer or header.layer_end != self._layer + 1
                or (end is not None and self._layer >= end)):
            return False
        self._cursor += len(run)
        if self._cursor == len(pages):
            self._cursor, self._layer = 0, self._layer + 1
        return True

    def _inside(self, header: ChunkHeader) -> bool:
        end = self.span.layer_end
        if header.layer_start < self._layer or (end is not None and header.layer_end > end):
            return False
        if self._seen.has_any(header):
            return False
        self._layer = header.layer_start
        self._seen.add(header)
        return True

    def finish(self) -> None:
        """The stream ended cleanly: it must have sent its whole span (a rank may hold no page)."""
        span = self.span
        if span.pages is not None:
            end = span.layer_end if span.layer_end is not None else max(self._layer, span.layer_start + 1)
            if self._cursor or self._layer != end:
                raise TransferError(
                    f"rank {self.rank} ended its stream of {self.request_id!r} at layer {self._layer}"
                    f" ({self._cursor} pages into it), short of layers [{span.layer_start}, {end})"
                )
            return
        layers = self._seen.layers()
        if not layers:
            return
        pages = self._seen.of(layers[0])
        last = span.layer_end if span.layer_end is not None else layers[-1] + 1
        short = [layer for layer in range(span.layer_start, last) if self._seen.of(layer) != pages]
        if short:
            raise TransferError(
                f"rank {self.rank} ended its stream of {self.request_id!r} without every page of layers {short[:8]}"
            )
