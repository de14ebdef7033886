"""Programmatic dependent launch (PDL): the opt-in switch of the decode step's kernels.

A batch-1 decode step is hundreds of short kernels; each one's ramp-up and the tail of
the one before are idle bandwidth. On Hopper (capability 9.0 and later) a kernel
launched with the programmatic-stream-serialization attribute (Triton's launch option
``launch_pdl=True``) may start while the kernel before it in the stream drains; it must
then execute ``griddepcontrol.wait`` (``tl.extra.cuda.gdc_wait``: blocks until the whole
prerequisite grid has completed and its writes are visible) before it touches memory the
earlier kernels read or write. ``griddepcontrol.launch_dependents``
(``tl.extra.cuda.gdc_launch_dependents``) lets the next kernel launch once every program
of this one has executed it or exited. Triton 3.6 (the device's) and later name both the
same way (3.6 emits them as inline asm, later versions as ops; the PTX is the same).

The switch: ``LANEKV_PDL`` is ``auto`` (unset or empty: the default), ``1`` (on for every
launch of a converted kernel) or ``0`` (off); any other value is an error naming the
variable. ``auto`` turns it on inside ``decode_graph(batch)`` for batches of at most
``AUTO_MAX_BATCH`` rows, the scope the decode daemon captures its CUDA graphs in, and
nowhere else: on an H200 it shortened the batch-1 steps and was no faster, for Llama
slower, at batches 16 and 64 (BENCHMARKS.md, tenth session: off against on, CUDA
graphs, in one run). It is on for a launch only on a CUDA tensor of capability 9.0
or later, and never under the Triton interpreter (it has no grid dependency control).
It is read at each launch, so a CUDA graph keeps what was on when it was captured.

The kernel pattern (every converted kernel, for every launch of it, prefill included):

    USE_PDL: tl.constexpr = False          # the kernel's last parameter
    pdl_wait(USE_PDL)                      # first statement: before any load or store
    pdl_launch_dependents(USE_PDL)         # then let the next kernel launch

and its launcher passes ``**pdl_args(tensor)`` (``USE_PDL`` always, ``launch_pdl`` only
when on). The wait comes before every load and store, not only those of data produced
on the device: a kernel that wrote early could overwrite what the draining kernel still
reads. Letting dependents launch right after the wait is safe wherever it stands,
because every converted kernel waits before it touches memory, and the trigger fires
only once all of this kernel's programs are resident, so the next kernel cannot crowd
out this one's later programs. Nothing is prefetched before the wait (CUTLASS prefetches
weights there): a load into registers would oblige every caller never to hand in a
tensor the previous kernel wrote. A request that L2 fetch the bytes would not (L2 is where
every SM's stores land), but measured it did not pay: the FP8 GEMV asking for its weight
slice with ``cp.async.bulk.prefetch.L2`` before the wait made the batch-1 Llama-3-8B FP8
step slower at every amount tried, and so did triggering the dependents before the wait
(BENCHMARKS.md, fourteenth session).

A kernel not converted is never launched with ``launch_pdl``. A converted kernel after a
kernel launched without PDL (cuBLAS, torch elementwise ops, copies) is still correct:
the attribute only relaxes the edge into the kernel that carries it, and the wait covers
the whole prerequisite grid; the kernel without PDL waits for its predecessor in full.

(A package of this one file: kernels/ keeps to 12 modules, tests/test_layers.py.)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import env_choice, interpreter_enabled

ENV = "LANEKV_PDL"
MIN_CAPABILITY = (9, 0)  # Hopper: the first with grid dependency control


class PDLStatus(NamedTuple):
    """Whether launches on a device use PDL, and why (a line a benchmark prints)."""

    on: bool
    reason: str


AUTO_MAX_BATCH = 4  # auto: the largest decode graph captured with PDL on
_IN_SMALL_GRAPH = contextvars.ContextVar("lanekv_pdl_small_decode_graph", default=False)


def mode() -> str:
    """``LANEKV_PDL`` read strictly: ``"auto"`` (unset, empty or ``auto``), ``"on"`` (``1``)
    or ``"off"`` (``0``)."""
    return {"0": "off", "1": "on", "auto": "auto"}[env_choice(ENV, ("0", "1", "auto"), "auto")]


def requested() -> bool:
    """Whether launches here ask for PDL: ``1``, or ``auto`` inside a small decode graph."""
    m = mode()
    return _IN_SMALL_GRAPH.get() if m == "auto" else m == "on"


@contextlib.contextmanager
def decode_graph(batch: int) -> Iterator[None]:
    """The scope a decode step of ``batch`` rows is captured (and warmed) in: under
    ``auto``, PDL is on inside it when ``batch <= AUTO_MAX_BATCH``."""
    token = _IN_SMALL_GRAPH.set(batch <= AUTO_MAX_BATCH)
    try:
        yield
    finally:
        _IN_SMALL_GRAPH.reset(token)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # fixed per device: asked once


def device_supports(device: torch.device) -> bool:
    """A CUDA device of capability 9.0 or later."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= MIN_CAPABILITY


def pdl_status(device: torch.device | str) -> PDLStatus:
    device = torch.device(device)
    if not requested():
        if mode() == "auto":
            return PDLStatus(False, f"off: {ENV}=auto, on only in decode graphs of batch "
                                    f"<= {AUTO_MAX_BATCH}")
        return PDLStatus(False, f"off: {ENV}=0")
    if interpreter_enabled():
        return PDLStatus(False, "off: the Triton interpreter is on (no grid dependency control)")
    if not device_supports(device):
        return PDLStatus(False, f"off: {device} is not a CUDA device of capability >= 9.0")
    why = f"{ENV}=1" if mode() == "on" else f"{ENV}=auto in a decode graph of batch <= {AUTO_MAX_BATCH}"
    return PDLStatus(True, f"on: {why} on {device}")


def pdl_enabled(device: torch.device) -> bool:
    # the cheap checks first: this runs at every launch of a converted kernel
    return requested() and not interpreter_enabled() and device_supports(device)


def pdl_args(tensor: torch.Tensor) -> dict[str, Any]:
    """The launch keywords of a converted kernel whose inputs live beside ``tensor``."""
    if pdl_enabled(tensor.device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel in the stream to complete (a PDL launch's first act)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one got here or exited."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
