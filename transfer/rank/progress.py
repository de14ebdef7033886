"""How far a request's prefill has written its KV, layer by layer.

The prefill runner calls ``layer_written(l)`` right after it queued layer
``l``'s K/V store (on CUDA it records an event on the compute stream there);
the transfer service calls ``wait(layer_end)`` before it reads layers
``< layer_end`` and gets back how many layers are written by then and the
event that marks them written on the device (None on the CPU, where the
store has finished when the call returns). Layers
are written in order on one stream, so the event of layer ``layer_end - 1``
covers every earlier layer too.

A prefill that fails calls ``fail``; a waiter then raises ``PrefillFailed``.
Waiters that would wait past their deadline raise ``TimeoutError``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch


class PrefillFailed(RuntimeError):
    """The prefill that was to write these layers failed or was dropped."""


class LayerProgress:
    def __init__(self, num_layers: int, device: torch.device | str = "cpu") -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive integer, got num_layers={num_layers!r}")
        self.num_layers = num_layers
        self._cuda = torch.device(device).type == "cuda"
        self._events: list[Any] = [None] * num_layers
        self._written = 0  # layers [0, written) are queued (CPU: done)
        self._error: str | None = None
        self._cond = threading.Condition()

    @classmethod
    def done(cls, num_layers: int) -> LayerProgress:
        """Progress of a prefill that has finished already (every layer readable)."""
        progress = cls(num_layers)
        progress._written = num_layers
        return progress

    def layer_written(self, layer: int) -> None:
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        with self._cond:
            if layer != self._written:
                raise ValueError(f"layer {layer} written after {self._written} layers: layers go in order")
            self._events[layer] = event
            self._written = layer + 1
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        with self._cond:
            if self._error is None:
                self._error = why
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter to ask its ``alive`` again (one of the requests this prefill
        writes was released: the others it writes go on)."""
        with self._cond:
            self._cond.notify_all()

    def wait(self, layer_end: int, timeout_s: float,
             alive: Callable[[], bool] = lambda: True, *, exact: bool = False) -> tuple[int, Any]:
        """Block until layers ``< layer_end`` are queued; how many layers are queued by
        then (``>= layer_end``) and the device event that marks all of those written
        (None on CPU). ``exact``: the event of layer ``layer_end - 1`` instead, which
        marks only the layers asked for: the host queues a prefill's layers well
        ahead of the device, and a read of an early layer must not wait for the
        event of the last one queued (layer-wise streaming).

        ``alive`` is polled while waiting: once it says False the wait raises
        ``PrefillFailed`` (the caller went away, or the request was released).
        """
        if not 1 <= layer_end <= self.num_layers:
            raise ValueError(f"layer_end must be in [1, {self.num_layers}], got {layer_end}")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._written < layer_end:
                if self._error is not None:
                    raise PrefillFailed(self._error)
                if not alive():
                    raise PrefillFailed("the request was released or its caller went away")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"layer {layer_end - 1} not written within {timeout_s:.1f}s "
                        f"({self._written} of {self.num_layers} layers written)"
                    )
                self._cond.wait(min(left, 0.5))
            return self._written, self._events[(layer_end if exact else self._written) - 1]
