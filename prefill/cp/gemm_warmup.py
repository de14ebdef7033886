"""A rank's GEMMs at the row counts its prefills run them with, before the daemon serves.

A prefill's matrix products are cuBLAS calls whose shape is the model's weight
by the rank's rows, and the rows change with every prompt length (page units:
``k * page_size``). cuBLAS picks its kernel by that shape, and CUDA loads a
kernel's code the first time it is launched (lazy module loading, the default),
so the first prompt whose rows pick a kernel not used before waits for it.
(The Triton kernels change only at a few row counts, which the warm-up's
prefills cover: ``prefill.cp.tile_rows``.) This module runs each distinct GEMM
of the model once per row count of a ladder:

- every multiple of the page size up to ``FINE_ROWS`` rows, where one row count
  to the next changes the kernel choice most;
- then every multiple of ``COARSE_STEP`` rows (rounded down to whole pages) up
  to ``LINEAR_ROWS``;
- above that, rungs ``1 / GROWTH`` apart (rounded up to whole pages), up to the
  rows of the longest prompt the daemon takes: start-up stays bounded (every
  128 rows to 128k rows would cost most of a minute of GEMMs per rank, 8B shapes), and a row count
  between two rungs may still load a kernel on first use.

A rung that runs out of device memory ends the ladder there (logged; the
answer's ``max_rows`` says how far it got): the daemon still starts, as it did
before, and a prompt that long would not fit either. Afterwards the caching
allocator gives back what the ladder cached, so the device's free memory is
what it was without it.

The GEMMs are the modules the forward multiplies with: ``nn.Linear`` and
``FusedLinear`` (a linear whose weight is a slice of a larger tensor runs as
part of that one: fused q/k/v or gate/up, stacked MoE experts) and the MoE
routers, each with inputs in its weight's dtype. The vocabulary projection
runs on one row per request, so it gets ``1 .. LOGIT_ROWS`` rows. Block-FP8
layers (``Fp8Linear``, fused e4m3 projections) take inputs in the model dtype. On the CPU it
runs too (nothing loads lazily there; the tests check what it calls).
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch
from lanekv.model.attention import AnyCausalLM
from lanekv.model.deepseek import Router
from lanekv.model.llama import FusedLinear
from lanekv.model.quant.linear import Fp8Linear
from torch import nn

log = logging.getLogger("lanekv.prefill")
# Row counts up to this get every multiple of the page size ...
FINE_ROWS = 2048
# ... then multiples of COARSE_STEP rounded down to whole pages (at least one) to LINEAR_ROWS ...
COARSE_STEP = 128
LINEAR_ROWS = 16384
# ... and above it, each rung at least 1/GROWTH more rows than the one before.
GROWTH = 16
# The vocabulary projection: one row per request whose last token the rank holds.
LOGIT_ROWS = 64


class GemmWarmUp(NamedTuple):
    calls: int  # GEMM calls made (distinct shapes x row counts, plus the logits')
    shapes: int  # distinct GEMM shapes of the model
    max_rows: int  # the ladder's last rung run (lower than asked when the device ran out of memory)
    seconds: float


def row_ladder(page_size: int, max_rows: int) -> list[int]:
    """The row counts warmed: see the module docstring. ``max_rows`` is rounded up
    to a page; the ladder always ends there."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got page_size={page_size}")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got max_rows={max_rows}")
    top = -(-max_rows // page_size) * page_size
    rows = list(range(page_size, min(top, FINE_ROWS) + 1, page_size))
    coarse = page_size * max(1, COARSE_STEP // page_size)  # still whole pages
    last = rows[-1] if rows else 0
    rows += range(last - last % coarse + coarse, min(top, LINEAR_ROWS) + 1, coarse)
    rows = rows or [top]
    while rows[-1] < top:  # the rest, in growing rungs
        grown = rows[-1] + max(coarse, rows[-1] // GROWTH)
        rows.append(min(top, -(-grown // page_size) * page_size))
    return sorted(set(rows))


def model_gemms(model: AnyCausalLM) -> list[nn.Module]:
    """One module of each distinct GEMM the forward runs (type, weight shape and
    dtype, bias), the vocabulary projection left out."""
    head = getattr(model, "lm_head", None)
    seen: dict[tuple, nn.Module] = {}
    for module in model.modules():
        if module is head or not isinstance(module, (nn.Linear, FusedLinear, Router, Fp8Linear)):
            continue
        weight = module.weight
        if weight is None or weight.dim() != 2:
            continue  # an unfused FusedLinear: its parts run instead
        if isinstance(module, nn.Linear | Fp8Linear) and _is_slice(weight):
            continue  # runs as part of the fused or stacked tensor it is a view of
        bias = getattr(module, "bias", None) is not None
        seen.setdefault((type(module), tuple(weight.shape), weight.dtype, bias), module)
    return list(seen.values())


def _is_slice(weight: torch.Tensor) -> bool:
    return weight.untyped_storage().nbytes() > weight.numel() * weight.element_size()


@torch.inference_mode()
def warm_gemms(model: AnyCausalLM, page_size: int, max_rows: int) -> GemmWarmUp:
    """Run every GEMM of ``model`` at every row count of ``row_ladder``, fewest rows
    first; on CUDA, waits for the device before it answers."""
    start = time.perf_counter()
    gemms = model_gemms(model)
    device = model.model.embed_tokens.weight.device
    calls, done = 0, 0
    hidden = torch.zeros((LOGIT_ROWS, model.config.hidden_size), dtype=model.dtype, device=device)
    for rows in range(1, LOGIT_ROWS + 1):
        model.compute_logits(hidden[:rows])
        calls += 1
    inputs: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # grown to each rung
    for rows in row_ladder(page_size, max_rows):
        try:
            for module in gemms:
                weight = module.weight
                dtype = model.dtype if weight.dtype == torch.float8_e4m3fn else weight.dtype
                key = (weight.shape[1], dtype)
                if key not in inputs or inputs[key].shape[0] < rows:
                    inputs.pop(key, None)
                    inputs[key] = torch.zeros((rows, weight.shape[1]), dtype=dtype, device=device)
                module(inputs[key][:rows])
                calls += 1
        except torch.OutOfMemoryError:
            inputs.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log.warning("prefill warm-up: GEMMs at %d rows ran out of device memory; the GEMM ladder "
                        "stops at %d rows (a longer prompt may load a kernel on first use)", rows, done)
            break
        done = rows
    inputs.clear()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # The ladder's top rungs cached blocks as large as the longest prompt's
        # activations: give them back, so the pool beside this one (a decode daemon
        # on the same GPU) finds the memory it found before the ladder existed.
        torch.cuda.empty_cache()
    return GemmWarmUp(calls, len(gemms), done, time.perf_counter() - start)
