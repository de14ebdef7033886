"""Arrival counters: a split reduction finished by the split that arrives last.

A split-K GEMV has several programs write float32 partials of one output, and a second
launch add them. In a batch-1 decode step that launch (1-3 us on an H200: its ramp and
the tail of the kernel before it) lasts as long as the work it does, and a Llama-3-8B
FP8 layer ran four of them. Here the programs of one split group finish it themselves:
each stores its partial, waits for all of its threads (``tl.debug_barrier``), and
increments the group's counter with one atomic (acquire-release, GPU scope, so every
store before it is visible to whichever program reads after a later increment). The
program whose increment returns ``splits - 1`` arrives last and sees every partial: it
adds them in split order (the same float32 operations in the same order as the separate
launch, so the result is the same bit for bit), writes the output and puts the counter
back to 0 for the next launch (a CUDA graph replays the same counters). Its loads bypass
L1 (``.cg``), which is not kept coherent with the other SMs' stores.

The counters are one zeroed int32 tensor per device, made only outside a CUDA graph
capture (by the first eager call there; the decode engine runs every batch size it
captures eagerly first, so its graphs find them made). A launch takes slots ``[0,
groups)``: two launches that share them must not run at the same time. Every launch of
these kernels in a lanekv process is on one stream per device (the decode step's, or the
stream a prefill rank runs its forward on, whose only GEMVs are one-row products: the
logits of a single request and a one-token prompt's linears; a colocated prefill runs on
the decode step's stream, between steps), and under PDL a kernel touches no
memory before the kernel ahead of it has completed (``kernels.pdl``). ``counters``
answers ``None`` where it cannot give them (during a capture before any exist, more
groups than ``SLOTS``): the launcher then adds the partials with the separate
launch, as before. (The GQA decode attention's merge done this way was slower in a
batch-1 Llama-3-8B step on an H200, 19.9 us against 7.2 for the kernel and its merge
launch: BENCHMARKS.md, thirteenth session.) On a CPU (the Triton interpreter, which runs a
launch's programs one after another) each call gets zeroed counters of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Groups one launch may count (a GEMV's column tiles): 256 KiB of int32 per device.
SLOTS = 1 << 16

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, groups: int) -> torch.Tensor | None:
    """The device's arrival counters (int32, zero between launches) for ``groups`` split
    groups, or ``None`` (module docstring) for the separate reduction launch."""
    if groups > SLOTS:
        return None
    if device.type != "cuda":
        return torch.zeros(groups, dtype=torch.int32, device=device)
    made = _COUNTERS.get(device)
    if made is None:
        if torch.cuda.is_current_stream_capturing():
            return None  # memory taken in a capture belongs to its graph's pool
        made = torch.zeros(SLOTS, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)  # zero before a launch on any stream reads them
        _COUNTERS[device] = made
    return made


@triton.jit
def arrived_last(count_ptr, group, splits):
    """Called by every program of a split group once its partial is stored: true in the
    one whose arrival completes the group, which then sees every partial (module
    docstring) and calls ``reset`` once it has read them."""
    tl.debug_barrier()  # every thread's stores before this program's one increment
    arrived = tl.atomic_add(count_ptr + group, 1, sem="acq_rel", scope="gpu")
    return arrived == splits - 1


@triton.jit
def reset(count_ptr, group):
    """Put the group's counter back to 0 for the next launch (no program of this launch
    touches it again; the next launch's come after this one in the stream)."""
    tl.store(count_ptr + group, 0)
