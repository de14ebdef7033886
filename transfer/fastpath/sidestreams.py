"""The side streams of a fast-path fetch: copies on a stream of each device of
the pair, digests of what they copied on a stream of their own after them.

``FastPath`` keeps one ``StreamSet`` per rank (the caching allocator reuses
the buffers it keeps for a stream); ``streams_for`` makes them current for a
fetch, and ``Streams.digesting`` runs work on the digest stream after the
copies queued so far, or after those before a ``Streams.mark``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch


class StreamSet(NamedTuple):
    """Side streams for fetches from one rank: a copy stream on each CUDA device of the
    pair, and a digest stream on the destination's (None on the CPU)."""

    copy: dict
    digest: Any

    @classmethod
    def make(cls, src: torch.device, dst: torch.device) -> StreamSet:
        devices = [dev for dev in (src, dst) if dev.type == "cuda"]
        return cls({dev: torch.cuda.Stream(dev) for dev in devices},
                   torch.cuda.Stream(dst) if dst.type == "cuda" else None)


class Streams:
    """The streams of one fetch: copies on the current ones, digests after them on their own."""

    def __init__(self, dst: torch.device, made: StreamSet) -> None:
        self._dst = dst
        self._copy = made.copy
        self._digest = made.digest

    @contextlib.contextmanager
    def digesting(self, *, wait: bool = True) -> Iterator[Callable[[list | None], None]]:
        """Work inside runs on the digest stream (on a GPU), after every copy queued so far
        on either device's stream (``wait`` False: after none of them). The callable it
        gives makes the digest stream wait for the copies before ``marks`` (``mark``)."""
        if self._digest is None:
            yield lambda marks: None
            return

        def after(marks: list | None) -> None:
            for event in marks or ():
                self._digest.wait_event(event)

        with torch.cuda.device(self._dst), torch.cuda.stream(self._digest):
            if wait:
                for stream in self._copy.values():
                    self._digest.wait_stream(stream)
            yield after

    def mark(self) -> list | None:
        """Events at the end of the copies queued so far on each copy stream (None on the CPU)."""
        if self._digest is None:
            return None
        marks = []
        for stream in self._copy.values():
            event = torch.cuda.Event()
            event.record(stream)
            marks.append(event)
        return marks

    def sync(self) -> None:
        for stream in self._copy.values():
            stream.synchronize()
        if self._digest is not None:
            self._digest.synchronize()


@contextlib.contextmanager
def streams_for(src: torch.device, dst: torch.device, made: StreamSet | None = None) -> Iterator[Streams]:
    """Side streams on both devices (CUDA) for one fetch (``made``: the rank's, else new
    ones), so the copies of several ranks' fetches overlap.

    They do not wait for the devices' other streams: the destination pages
    were free before this fetch (a finished request's pages are freed after
    its last step's tokens reached the host) and the source pages were
    written on the device before the rank announced them, or before the
    prefill answered (copies made before the announcement; the rank's digest
    checks either).
    """
    made = StreamSet.make(src, dst) if made is None else made
    # Entering a stream also makes its device current: the destination's goes last,
    # so what runs unguarded inside runs on the destination's stream.
    with contextlib.ExitStack() as stack:
        for dev in dict.fromkeys(made.copy):
            stack.enter_context(torch.cuda.stream(made.copy[dev]))
        yield Streams(dst, made)
