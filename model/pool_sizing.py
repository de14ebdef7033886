"""How many pages a daemon's KV pool gets, and the start-up line that says so.

A pool is sized by an explicit page count, by bytes for the pool, or by a
fraction of each GPU's memory (at most what is free) less the weights and an
allowance for activations and graphs (``size_pool`` says the precedence). The
bytes of one page come from the model's attention kind (``pool_rows``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from lanekv.model.attention import pool_rows
from lanekv.model.attention.rows import DEFAULT_INDEX_CACHE_DTYPE
from lanekv.model.config import ModelConfig

GIB = 1 << 30
# Kept out of a pool sized by --gpu-memory-utilization: activations, CUDA graphs,
# the warm-up request and the allocator's slack (not measured; an allowance).
GPU_RESERVE_BYTES = 2 * GIB


def page_bytes(config: ModelConfig, dtype: torch.dtype, page_size: int,
               index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE,
               kv_cache_dtype: str = "auto") -> int:
    """Bytes of one pool page (every layer, K and V or the latent) for ``config``."""
    rows = pool_rows(config, dtype, index_cache_dtype, kv_cache_dtype)
    return config.num_layers * page_size * rows.row_bytes


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the model's weights in ``dtype`` (its parameters, counted on the meta device)."""
    from lanekv.model.checkpoint import build_model

    model = build_model(config, dtype=dtype, device="meta")
    return sum(p.numel() * p.element_size() for p in model.parameters())


class PoolSize(NamedTuple):
    pages: int
    how: str  # the flag that decided, as a start-up line says it


def size_pool(unit_bytes: int, *, pool_pages: int | None, kv_cache_memory: int | None,
              gpu_memory_utilization: float | None, default_pages: int,
              memory: Callable[[], list[tuple[int, int]]] | None = None, weights: int = 0) -> PoolSize:
    """Pages of one pool of ``unit_bytes`` per page.

    Precedence: ``pool_pages`` (an explicit count), then ``kv_cache_memory``
    (bytes for the pool), then ``gpu_memory_utilization`` (the fraction of each
    GPU this daemon may use, as vLLM means it, per instance: the pool gets that
    share of the total, at most what is free now, less ``weights`` and
    ``GPU_RESERVE_BYTES``; ``memory`` says each GPU's ``(free, total)`` before
    the weights load, the fewest pages over the GPUs win), then
    ``default_pages``. Raises ``ValueError`` naming the flag when it leaves no page.
    """
    if pool_pages is not None:
        return PoolSize(pool_pages, "--pool-pages")
    if kv_cache_memory is not None:
        pages = kv_cache_memory // unit_bytes
        if pages < 1:
            raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes holds no page of {unit_bytes} bytes")
        return PoolSize(pages, f"--kv-cache-memory {kv_cache_memory / GIB:.2f} GiB")
    if gpu_memory_utilization is None:
        return PoolSize(default_pages, "the default page count")
    if memory is None:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} needs a GPU; on the CPU "
                         "give --kv-cache-memory or --pool-pages")
    room = []
    for free, total in memory():
        # This daemon's share, and no more than is free now (other processes on the GPU keep theirs).
        room.append(min(int(gpu_memory_utilization * total), free) - weights - GPU_RESERVE_BYTES)
    pages = min(room) // unit_bytes
    if pages < 1:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves no room for the KV pool: "
            f"{min(room) / GIB:.2f} GiB after {weights / GIB:.2f} GiB of weights, the memory others use and "
            f"{GPU_RESERVE_BYTES / GIB:.0f} GiB kept for activations and graphs")
    return PoolSize(pages, f"--gpu-memory-utilization {gpu_memory_utilization}")


def cuda_memory(count: int) -> list[tuple[int, int]]:
    """``(free, total)`` bytes of GPUs 0..count-1, read in a child process, so that
    this one makes no CUDA context of its own."""
    code = ("import json, torch; print(json.dumps([torch.cuda.mem_get_info(i) "
            f"for i in range({int(count)})]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"could not read the GPUs' free memory: {last}")
    return [tuple(pair) for pair in json.loads(out.stdout)]


def check_max_model_len(max_model_len: int | None, max_positions: int, pool_tokens: int) -> None:
    """``max_model_len`` must fit the model's positions and the pool's tokens."""
    if max_model_len is None:
        return
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive integer, got max_model_len={max_model_len!r}")
    if max_model_len > max_positions:
        raise ValueError(f"max_model_len={max_model_len} is more than the model's "
                         f"max_position_embeddings={max_positions}")
    if max_model_len > pool_tokens:
        raise ValueError(f"max_model_len={max_model_len} does not fit the KV pool's {pool_tokens} tokens")


def pool_line(role: str, pages: int, page_size: int, unit_bytes: int, ranks: int, how: str) -> str:
    """The start-up line that says what a daemon's pool holds."""
    return (f"{role} KV pool: {pages} pages x {page_size} tokens = {pages * page_size} tokens, "
            f"{pages * unit_bytes / GIB:.3f} GiB per rank x {ranks} rank(s) (sized by {how})")
