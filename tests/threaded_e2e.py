"""Prefill on rank threads -> the pages copied as the wire carries them -> decode, in
one process: the greedy tokens of each prompt, for end-to-end tests of a model family."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from lanekv.decode.engine import DecodeEngine
from lanekv.decode.pool import PagePool, PageTable
from lanekv.kernels.page_copy import scatter_pages
from lanekv.model.sampling import SamplingParams
from lanekv.prefill.cp.launcher import PrefillInput
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.engine_config import EngineConfig

PROMPT_TOKENS_BOUND = 200  # the prompts' and outputs' tokens, together, stay below this


def threaded_generate(checkpoint: Path, cp_size: int, page_size: int, prompts: Sequence[Sequence[int]],
                      max_new_tokens: int, device: str = "auto", **cache: str) -> list[list[int]]:
    """Every prompt prefilled in one batch (concurrent prompts) on ``cp_size`` rank threads,
    its pages read in the wire's order and scattered into a decode pool, then decoded
    greedily together; both sides' pages are checked back at the end. ``cache``:
    ``index_cache_dtype`` for DSA models, ``kv_cache_dtype``. The decode pool is on the
    model's device (``device``: the engine's)."""
    engine = ThreadedPrefillEngine(EngineConfig(
        str(checkpoint), cp_size=cp_size, page_size=page_size,
        pages_per_lane=-(-PROMPT_TOKENS_BOUND // page_size), pool_fill=math.nan, device=device,
        **cache))
    loaded = engine.loaded
    pool = PagePool.for_model(loaded.config, -(-2 * PROMPT_TOKENS_BOUND // page_size), page_size,
                              torch.float32, next(loaded.model.parameters()).device, **cache)
    decode = DecodeEngine(loaded.model, pool)
    outputs: dict[str, list[int]] = {}
    for i, res in enumerate(engine.prefill([PrefillInput(p) for p in prompts])):
        pages = [p.page for p in res.pages]
        table = PageTable.remap(pool, pages, res.num_tokens)
        payload = engine.read_pages(pages)  # the wire order: [layers, planes, rows, heads, row]
        assert payload.shape[1] == pool.tensor.shape[1] and payload.shape[-1] == pool.tensor.shape[-1]
        scatter_pages(payload.to(pool.device), pool.tensor,
                      torch.tensor(table.physical_pages_for(pages), device=pool.device),
                      page_size, 0, loaded.config.num_layers)
        engine.free(res.new_pages)
        decode.add(f"r{i}", table, res.first_token, SamplingParams(), max_new_tokens)
        outputs[f"r{i}"] = [res.first_token]
    while decode.has_work:
        for event in decode.step():
            if event.token_id is not None:
                outputs[event.request_id].append(event.token_id)
    assert pool.free_count == pool.num_pages
    assert engine.allocator.free_counts() == [-(-PROMPT_TOKENS_BOUND // page_size)] * cp_size
    return [outputs[f"r{i}"] for i in range(len(prompts))]
