"""Warm-up of a prefill engine before its daemon serves: every kernel compiles now.

Triton compiles a kernel on first use for each set of compile-time values, and
integer arguments that vary per request (lengths, counts, offsets, widths) are
declared ``do_not_specialize`` in the kernels, so the set left is bounded: the
dtypes, the head shapes, the page size, the power of two above a batch's
segment count, and the tiles of the two launchers that pick them by a batch's
rows (``prefill.cp.tile_rows``). ``warm_up`` prefills prompts that reach each
of those: one request of a few lengths, then batches of 2, 3, 5, 9, ...
requests, then one request and those batches again with every rank's rows past
each row count where tiles change. It frees their pages and has the ranks
forget them. The GEMMs depend on the rows too: before those prefills, every
rank runs its model's GEMMs over a ladder of row counts up to the longest
prompt it takes (``prefill.cp.gemm_warmup``), so a new prompt length finds its
cuBLAS kernels loaded; then every rank captures its prefill's CUDA graphs
(``prefill.cp.graphs``), which the prefills after it replay. On the CPU there is
nothing to compile or capture.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

from lanekv.prefill.cp.gemm_warmup import GemmWarmUp
from lanekv.prefill.cp.launcher import PrefillEngine, PrefillInput

log = logging.getLogger("lanekv.prefill")
# Requests per warm-up batch: each reaches the next power of two of segments.
_BATCH_SIZES = (2, 3, 5, 9, 17, 33)
_SINGLE_LENGTHS = (1, 17, 300, 2048)
_BATCH_PROMPT = 8


class WarmUp(NamedTuple):
    prefills: int
    seconds: float
    gemm_calls: int = 0  # on the busiest rank (prefill.cp.gemm_warmup)
    gemm_seconds: float = 0.0  # the slowest rank's
    graphs: int = 0  # CUDA graphs captured on the busiest rank (prefill.cp.graphs)
    graph_seconds: float = 0.0  # the slowest rank's capture
    graph_bytes: int = 0  # device memory the busiest rank's graphs and their buffers take


def warm_up(engine: PrefillEngine, vocab_size: int, max_tokens: int, max_batch_tokens: int,
            forget: Callable[[str], None] | None = None, *, gemm_ladder: bool = True) -> WarmUp:
    """Prefill the warm-up shapes on ``engine``; returns how many batches and how long.
    ``forget(request_id)`` has ranks that serve pages drop a warm-up request
    before its pages go back (None: the ranks serve no pages). ``gemm_ladder=False``
    leaves the GEMM ladder out (``bench/first_prefill.py`` measures what it buys)."""
    start = time.perf_counter()
    batches: list[list[PrefillInput]] = []
    limit = min(max_tokens - 1, max_batch_tokens)
    gemms = engine.warm_gemms(_max_rows(engine, limit)) if gemm_ladder else [GemmWarmUp(0, 0, 0, 0.0)]
    graphs = engine.capture_graphs(engine.config.graph_max_rows)
    for length in _SINGLE_LENGTHS:
        if length <= limit:
            batches.append([_input(length, 0, vocab_size)])
    for size in _BATCH_SIZES:
        if size * _BATCH_PROMPT <= max_batch_tokens and _BATCH_PROMPT <= limit:
            # lengths differ so segments end at different places in their pages
            batches.append([_input(_BATCH_PROMPT - i % 3, i, vocab_size) for i in range(size)])
    for rows in engine.tile_switch_rows():
        # One request and the batches again, every rank's rows past the switch: the
        # kernels' other tiles, with each count of segments.
        for size in (1, *_BATCH_SIZES):
            length = _tokens_past(engine, -(-rows // size))
            if length + 2 <= limit and size * (length + 2) <= max_batch_tokens:
                batches.append([_input(length + i % 3, i, vocab_size) for i in range(size)])
    planned = len(batches)
    batches = [inputs for inputs in batches if _fits(engine, inputs)]
    for inputs in batches:
        _prefill_and_drop(engine, inputs, forget)
    done = WarmUp(len(batches), time.perf_counter() - start, max(g.calls for g in gemms),
                  max(g.seconds for g in gemms), max(g.graphs for g in graphs),
                  max(g.seconds for g in graphs), max(g.memory_bytes for g in graphs))
    log.info("prefill warm-up in %.2f s: %d GEMM calls (%d shapes, up to %d rows) in %.2f s, %d CUDA "
             "graphs (up to %d rows, %.1f MiB) in %.2f s, then %d batches (kernels compiled before "
             "serving)", done.seconds, done.gemm_calls, gemms[0].shapes, min(g.max_rows for g in gemms),
             done.gemm_seconds, done.graphs, min(g.max_rows for g in graphs), done.graph_bytes / 2**20,
             done.graph_seconds, done.prefills)
    if planned > len(batches):  # a pool too small for them cannot serve such batches either
        log.info("prefill warm-up: %d batch(es) larger than the pool left out", planned - len(batches))
    return done


def settle_after_freeze(engine: PrefillEngine, vocab_size: int, forget: Callable[[str], None] | None = None) -> None:
    """One short prefill, to run after the heap is frozen (``runtime.gcpause``): the
    first prefill after a collect-and-freeze runs slow (on an H200, a 2k-token one
    took 17 ms longer, in starting its rank thread and building its index; the
    next ones did not), so this takes that instead of the first request."""
    _prefill_and_drop(engine, [_input(1, 0, vocab_size)], forget)


def _prefill_and_drop(engine: PrefillEngine, inputs: list[PrefillInput],
                      forget: Callable[[str], None] | None) -> None:
    for res in engine.prefill(inputs):
        if forget is not None:
            forget(res.request_id)  # the ranks drop it, then its pages go back
        engine.free(res.new_pages)


def _max_rows(engine: PrefillEngine, limit: int) -> int:
    """The most rows a GEMM of a one-prompt prefill multiplies: the prompt's tokens in
    whole pages (a rank computes its share of them; an MLA model decompresses the
    prompt's whole latent), no more than the pool holds. A batch of many short
    prompts pads each to a page per rank and may go past it (then cuBLAS may load
    a kernel on it)."""
    cfg = engine.config
    return max(1, min(limit, cfg.cp_size * cfg.pages_per_lane * cfg.page_size))


def _tokens_past(engine: PrefillEngine, rows: int) -> int:
    """The tokens of a prompt that gives every rank at least ``rows`` rows: a rank's
    share of a request's pages is within one page of an even split."""
    cfg = engine.config
    return cfg.cp_size * (-(-rows // cfg.page_size) + 1) * cfg.page_size


def _fits(engine: PrefillEngine, inputs: list[PrefillInput]) -> bool:
    """Whether the batch's pages fit in every lane's free pages: a request of P pages takes
    about ceil(P / cp_size) pages of each lane, plus one where its segments end unevenly."""
    ps, cp = engine.config.page_size, engine.config.cp_size
    per_lane = sum(-(-max(-(-len(i.token_ids) // ps), cp) // cp) + 1 for i in inputs)
    return per_lane <= min(engine.allocator.free_counts())


def _input(length: int, seed: int, vocab_size: int) -> PrefillInput:
    ids = [(7 + 31 * (seed + t)) % vocab_size for t in range(length)]
    return PrefillInput(ids, request_id=f"warmup-{uuid.uuid4().hex}")
