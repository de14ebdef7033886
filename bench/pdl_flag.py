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
from lanekv.kernels.pdl import ENV, pdl_status, requested

CHOICES = ("off", "on", "both")


def add_pdl_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pdl", choices=CHOICES, default=None,
                    help="the decode kernels' programmatic dependent launch (LANEKV_PDL): off, "
                         "on, or both (each step timed without, then with); default: as "
                         "LANEKV_PDL says")


def pdl_modes(flag: str | None) -> tuple[bool, ...]:
    """The switch's settings to time, in order."""
    if flag is None:
        return (requested(),)
    return {"off": (False,), "on": (True,), "both": (False, True)}[flag]


@contextlib.contextmanager
def pdl_env(on: bool) -> Iterator[None]:
    """``LANEKV_PDL`` set to ``on`` inside, as it was after."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before


def pdl_label(device: torch.device, on: bool) -> str:
    """What the kernels launched with on ``device`` (the switch asked ``on``), and why."""
    with pdl_env(on):
        return pdl_status(device).reason
