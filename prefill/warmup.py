"""Warm-up of a prefill engine before its daemon serves: every kernel compiles now.

Triton compiles a kernel on first use for each set of compile-time values, and
integer arguments that vary per request (lengths, counts, offsets, widths) are
declared ``do_not_specialize`` in the kernels, so the set left is bounded: the
dtypes, the head shapes, the page size, and the power of two above a batch's
segment count. ``warm_up`` prefills prompts that reach each of those (one
request of a few lengths, then batches of 2, 3, 5, 9, ... requests), then frees
their pages and has the ranks forget them. The cuBLAS handles and the caching
allocator warm up on the way. On the CPU there is nothing to compile.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

from prefill.cp.launcher import PrefillEngine, PrefillInput

log = logging.getLogger("lanekv.prefill")
# Requests per warm-up batch: each reaches the next power of two of segments.
_BATCH_SIZES = (2, 3, 5, 9, 17, 33)
_SINGLE_LENGTHS = (1, 17, 300, 2048)
_BATCH_PROMPT = 8


class WarmUp(NamedTuple):
    prefills: int
    seconds: float


def warm_up(engine: PrefillEngine, vocab_size: int, max_tokens: int, max_batch_tokens: int,
            forget: Callable[[str], None] | None = None) -> WarmUp:
    """Prefill the warm-up shapes on ``engine``; returns how many batches and how long.
    ``forget(request_id)`` has ranks that serve pages drop a warm-up request
    before its pages go back (None: the ranks serve no pages)."""
    start = time.perf_counter()
    batches: list[list[PrefillInput]] = []
    limit = min(max_tokens - 1, max_batch_tokens)
    for length in _SINGLE_LENGTHS:
        if length <= limit:
            batches.append([_input(length, 0, vocab_size)])
    for size in _BATCH_SIZES:
        if size * _BATCH_PROMPT <= max_batch_tokens and _BATCH_PROMPT <= limit:
            # lengths differ so segments end at different places in their pages
            batches.append([_input(_BATCH_PROMPT - i % 3, i, vocab_size) for i in range(size)])
    skipped = [inputs for inputs in batches if not _fits(engine, inputs)]
    batches = [inputs for inputs in batches if _fits(engine, inputs)]
    for inputs in batches:
        for res in engine.prefill(inputs):
            if forget is not None:
                forget(res.request_id)  # the ranks drop it, then its pages go back
            engine.free(res.new_pages)
    done = WarmUp(len(batches), time.perf_counter() - start)
    log.info("prefill warm-up: %d batches in %.2f s (kernels compiled before serving)",
             done.prefills, done.seconds)
    if skipped:  # a pool too small for them cannot serve such batches either
        log.info("prefill warm-up: %d batch(es) larger than the pool left out", len(skipped))
    return done


def _fits(engine: PrefillEngine, inputs: list[PrefillInput]) -> bool:
    """Whether the batch's pages fit in every lane's free pages: a request of P pages takes
    about ceil(P / cp_size) pages of each lane, plus one where its segments end unevenly."""
    ps, cp = engine.config.page_size, engine.config.cp_size
    per_lane = sum(-(-max(-(-len(i.token_ids) // ps), cp) // cp) + 1 for i in inputs)
    return per_lane <= min(engine.allocator.free_counts())


def _input(length: int, seed: int, vocab_size: int) -> PrefillInput:
    ids = [(7 + 31 * (seed + t)) % vocab_size for t in range(length)]
    return PrefillInput(ids, request_id=f"warmup-{uuid.uuid4().hex}")
