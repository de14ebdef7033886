"""The decode benchmarks' ``--pdl`` flag: time the step with ``kernels.pdl``'s switch off,
on, or both side by side in one run.

The switch is ``LANEKV_PDL``, read at each launch, so a captured graph keeps what was
on at its capture: a benchmark builds, captures and times each engine inside
``pdl_env(on)``. Without the flag the environment decides, as in the daemons.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

import torch
from lanekv.kernels.pdl import ENV, decode_graph, mode, pdl_status

CHOICES = ("off", "on", "auto", "both")
_VALUE = {"off": "0", "on": "1", "auto": "auto"}


def add_pdl_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pdl", choices=CHOICES, default=None,
                    help="the decode kernels' programmatic dependent launch (LANEKV_PDL): off, "
                         "on, auto (on in decode graphs of small batches, the daemons' "
                         "default), or both (each step timed off, then on); default: as "
                         "LANEKV_PDL says")


def pdl_modes(flag: str | None) -> tuple[str, ...]:
    """The switch's settings to time, in order: ``"off"``, ``"on"`` or ``"auto"``."""
    if flag is None:
        return (mode(),)
    return ("off", "on") if flag == "both" else (flag,)


@contextlib.contextmanager
def scoped_env(name: str, value: str) -> Iterator[None]:
    """The environment variable ``name`` set to ``value`` inside, as it was after."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def pdl_env(setting: str) -> contextlib.AbstractContextManager[None]:
    """``LANEKV_PDL`` set to ``setting`` (off, on or auto) inside, as it was after."""
    return scoped_env(ENV, _VALUE[setting])


def pdl_label(device: torch.device, setting: str, batch: int) -> str:
    """What a decode graph of ``batch`` rows launched with on ``device``, and why."""
    with pdl_env(setting), decode_graph(batch):
        return pdl_status(device).reason
