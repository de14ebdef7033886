"""Counting Triton kernel compilations (``triton.knobs.runtime.jit_cache_hook``:
called whenever a launch finds no compiled kernel in memory for its
specialisation, before it compiles or loads one from the disk cache). The
no-compile tests and ``bench/first_prefill.py`` use it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def recording_compiles() -> Iterator[list[str]]:
    """Yields a list that collects a description of every compile inside the block."""
    import triton

    runtime = triton.knobs.runtime
    seen: list[str] = []
    previous = runtime.jit_cache_hook

    def hook(*, repr: str, **_: object) -> bool:  # noqa: A002 (the hook's own keyword)
        seen.append(repr)
        return False  # go on and compile

    runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        runtime.jit_cache_hook = previous
