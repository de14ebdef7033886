"""Warm-up of the decode daemon's kernels before it serves.

``DecodeEngine.capture_graphs`` compiles the step's kernels and captures the
graphs. What is left to compile on a request's way in is the transfer side:
``scatter_pages`` (a fetched chunk placed in pages) and the page digest (a
fast-path copy checked). ``warm_up_transfer`` runs each once on two pages it
takes from the pool and gives back; pages are never read past a request's
tokens, so what it writes there is never seen. On the CPU nothing compiles.
"""

from __future__ import annotations

import logging
import time

import torch

from decode.pool import PagePool
from kernels.page_copy import scatter_pages
from kernels.page_digest import PageDigest

log = logging.getLogger("lanekv.decode")


def warm_up_transfer(pool: PagePool) -> float:
    """Run the transfer kernels once on CUDA (seconds taken; 0 on the CPU)."""
    if pool.device.type != "cuda" or pool.num_pages < 2:
        return 0.0
    start = time.perf_counter()
    pages = pool.allocate(2)
    try:
        spec, tensor = pool.spec, pool.tensor
        index = torch.tensor(pages, dtype=torch.int64, device=pool.device)
        layers = spec.num_layers
        buf = torch.zeros((layers, 2, 2 * spec.page_size, *spec.row_shape), dtype=spec.dtype,
                          device=pool.device)
        scatter_pages(buf, tensor, index, spec.page_size, 0, layers)
        scatter_pages(buf[layers - 1:], tensor, index, spec.page_size, layers - 1, layers)
        digest = PageDigest(tensor, index, spec.page_size, 0, layers, first_layer=0)
        digest.add(0, layers)
        digest.total().item()
    finally:
        torch.cuda.synchronize(pool.device)
        pool.free(pages)
    seconds = time.perf_counter() - start
    log.info("decode warm-up: transfer kernels compiled in %.2f s", seconds)
    return seconds
