"""Warm-up of the decode daemon's kernels before it serves.

``DecodeEngine.capture_graphs`` compiles the step's kernels for the captured
sizes and captures the graphs. ``warm_up_kernels`` compiles what is left:

- the eager paged decode attention at every launch shape an eager step (a
  batch above the ladder) can pick: the model's attention kind says which
  (``AttentionKind.warm_up_decode``: for GQA every merge block of the split
  counts up to the most the pool allows, for MLA and DSA the latent-space
  kernel with and without partials);
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
from lanekv.decode.pool import PagePool
from lanekv.kernels.page_copy import scatter_pages
from lanekv.kernels.page_digest import PageDigest
from lanekv.model.attention import kind_of
from lanekv.model.config import ModelConfig

log = logging.getLogger("lanekv.decode")


def warm_up_kernels(pool: PagePool, config: ModelConfig) -> float:
    """Compile the kernels no captured graph compiled for ``config``'s model on ``pool``
    (seconds taken; 0 on the CPU)."""
    if pool.device.type != "cuda":
        return 0.0
    start = time.perf_counter()
    kind_of(config).warm_up_decode(config, pool)
    if pool.num_pages >= 2:
        _warm_up_transfer(pool)
    torch.cuda.synchronize(pool.device)
    seconds = time.perf_counter() - start
    log.info("decode warm-up: eager attention and transfer kernels compiled in %.2f s", seconds)
    return seconds


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
