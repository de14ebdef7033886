"""Which implementation of a kernel runs for a given tensor.

CUDA tensors run the Triton kernels. CPU tensors run the plain-torch
references, except when the Triton interpreter is on (``TRITON_INTERPRET=1``,
read by ``triton.jit`` when the kernel modules are imported) and the caller
asked for it with ``LANEKV_CPU_KERNELS=triton``: then the interpreted Triton
kernels run on CPU tensors too. End-to-end tests use that to push a small run
through the real kernels without a GPU.

``env_choice`` reads the kernels' switches (``LANEKV_PDL``, ``LANEKV_DSA_TOPK``,
``LANEKV_FP8_MOE_GEMV``) the same strict way.

``recording_compiles`` counts the Triton compiles of a block
(``triton.knobs.runtime.jit_cache_hook``: called whenever a launch finds no
compiled kernel in memory for its specialisation, before it compiles or loads
one from the disk cache); the no-compile tests and ``bench/first_prefill.py``
use it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(tensor: torch.Tensor) -> bool:
    if tensor.is_cuda:
        return True
    return interpreter_enabled() and os.environ.get("LANEKV_CPU_KERNELS") == "triton"


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """A kernel switch read strictly: the variable's value (unset or empty: ``default``),
    or a one-line error naming it and the values it takes."""
    value = os.environ.get(name, "") or default
    if value not in choices:
        allowed = f"{', '.join(choices[:-1])} or {choices[-1]}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Kernels launched inside run on ``device`` (CUDA); a no-op for the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Raise ValueError naming the argument whose device differs from the first."""
    device = None
    first = None
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if device is None:
            device, first = tensor.device, name
        elif tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but {first} is on {device}")
    if device is None:
        raise ValueError("no tensor given")
    return device


@contextlib.contextmanager
def recording_compiles() -> Iterator[list[str]]:
    """Yields a list that collects a description of every compile inside the block."""
    import triton

    runtime = triton.knobs.runtime
    seen: list[str] = []
    previous = runtime.jit_cache_hook

    def hook(*, repr: str, **_: object) -> bool:  # noqa: A002 (the hook's own keyword)
        seen.append(repr)
        return False  # go on and compile

    runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        runtime.jit_cache_hook = previous
