"""Warm-up of the decode daemon's kernels before it serves.

``DecodeEngine.capture_graphs`` compiles the step's kernels for the captured
sizes and captures the graphs. ``warm_up_kernels`` compiles what is left:

- paged decode attention at every split count an eager step (a batch above
  the ladder) can choose: the split count decides two compile-time values
  (whether partials are written, and the merge's block), so each power of two
  up to the most splits the pool allows runs once, reading nothing
  (``seq_lens`` 0) and writing only its own output; for an MLA pool the
  latent-space kernel, whose split count decides only whether partials are
  written (one split and two);
- the transfer side: ``scatter_pages`` (a fetched chunk placed in pages) and
  the page digest (a fast-path copy checked), once each on two pages taken
  from the pool and given back (pages are never read past a request's
  tokens, so what is written there is never seen).

On the CPU nothing compiles.
"""

from __future__ import annotations

import logging
import time

import torch
import triton
from lanekv.decode.pool import PagePool
from lanekv.kernels.decode_attention import DecodeConfig, paged_decode_attention
from lanekv.kernels.mla_decode import paged_mla_decode_attention
from lanekv.kernels.page_copy import scatter_pages
from lanekv.kernels.page_digest import PageDigest

log = logging.getLogger("lanekv.decode")


def warm_up_kernels(pool: PagePool, num_q_heads: int, max_positions: int,
                    kv_lora_rank: int | None = None) -> float:
    """Compile the kernels no captured graph compiled (seconds taken; 0 on the CPU).
    ``kv_lora_rank``: the pool holds MLA latent rows of that rank."""
    if pool.device.type != "cuda":
        return 0.0
    start = time.perf_counter()
    if kv_lora_rank is None:
        _warm_up_attention(pool, num_q_heads, max_positions)
    else:
        _warm_up_mla_attention(pool, num_q_heads, max_positions, kv_lora_rank)
    if pool.num_pages >= 2:
        _warm_up_transfer(pool)
    torch.cuda.synchronize(pool.device)
    seconds = time.perf_counter() - start
    log.info("decode warm-up: eager attention and transfer kernels compiled in %.2f s", seconds)
    return seconds


def _warm_up_attention(pool: PagePool, num_q_heads: int, max_positions: int) -> None:
    spec = pool.spec
    width = max(1, min(pool.num_pages, -(-max_positions // spec.page_size)))
    # The most splits the launcher picks: enough programs for every SM, and no
    # more than one per key block.
    cfg, sms = DecodeConfig(), torch.cuda.get_device_properties(pool.device).multi_processor_count
    most = max(1, min(triton.cdiv(width * spec.page_size, cfg.block_n),
                      triton.cdiv(sms * cfg.programs_per_sm, spec.kv_heads)))
    k_cache, v_cache = pool.k_cache(0), pool.v_cache(0)
    q = torch.zeros((1, num_q_heads, spec.head_dim), dtype=spec.dtype, device=pool.device)
    table = torch.zeros((1, width), dtype=torch.int32, device=pool.device)
    lens = torch.zeros(1, dtype=torch.int32, device=pool.device)
    splits = 1
    while True:  # 1, 2, 3, 5, 9, ...: every merge block size, and no merge at all
        paged_decode_attention(q, k_cache, v_cache, table, lens, spec.page_size, 1.0,
                               num_splits=splits)
        if splits >= most:
            break
        splits = min(most, 2 * splits - 1 if splits > 1 else 2)


def _warm_up_mla_attention(pool: PagePool, num_q_heads: int, max_positions: int,
                           kv_lora_rank: int) -> None:
    spec = pool.spec
    width = max(1, min(pool.num_pages, -(-max_positions // spec.page_size)))
    latent = pool.latent_cache(0)  # a DSA row is wider than its latent
    q = torch.zeros((1, num_q_heads, latent.shape[1]), dtype=spec.dtype, device=pool.device)
    table = torch.zeros((1, width), dtype=torch.int32, device=pool.device)
    lens = torch.zeros(1, dtype=torch.int32, device=pool.device)
    for splits in (1, 2):  # without and with partials and their merge
        paged_mla_decode_attention(q, latent, table, lens, spec.page_size, 1.0,
                                   kv_lora_rank, num_splits=splits)


def _warm_up_transfer(pool: PagePool) -> None:
    pages = pool.allocate(2)
    try:
        spec, tensor = pool.spec, pool.tensor
        index = torch.tensor(pages, dtype=torch.int64, device=pool.device)
        layers = spec.num_layers
        buf = torch.zeros((layers, spec.kv, 2 * spec.page_size, *spec.row_shape), dtype=spec.dtype,
                          device=pool.device)
        scatter_pages(buf, tensor, index, spec.page_size, 0, layers)
        scatter_pages(buf[layers - 1:], tensor, index, spec.page_size, layers - 1, layers)
        digest = PageDigest(tensor, index, spec.page_size, 0, layers, first_layer=0)
        digest.add(0, layers)
        digest.total()
    finally:
        torch.cuda.synchronize(pool.device)
        pool.free(pages)
