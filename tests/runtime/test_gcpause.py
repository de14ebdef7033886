"""GC pauses: the clock adds up collections, and a frozen start-up is never walked again."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest
from lanekv.runtime.gcpause import GcClock, paused


def test_the_clock_counts_collections_and_their_time():
    clock = GcClock().install()
    try:
        before, seconds = clock.collections, clock.seconds
        cycle = []
        cycle.append(cycle)  # something for a full collection to find
        del cycle
        gc.collect()
        gc.collect()
        assert clock.collections >= before + 2
        assert clock.seconds > seconds
    finally:
        clock.uninstall()
    count = clock.collections
    gc.collect()
    assert clock.collections == count  # uninstalled: no longer counting
    clock.install().install()  # installing twice registers once
    try:
        gc.collect()
        assert clock.collections == count + 1
    finally:
        clock.uninstall()


def test_the_clock_counts_only_inside_installed():
    with GcClock().installed() as clock:
        gc.collect()
        assert clock.collections == 1
    gc.collect()
    assert clock.collections == 1
    assert clock._on_gc not in gc.callbacks


@pytest.mark.timeout(60)
def test_paused_collects_once_keeps_the_collector_off_and_restores_it():
    with GcClock().installed() as clock:
        with paused():
            assert not gc.isenabled() and clock.collections == 1  # its own collection, then none
            gc.collect()  # an explicit one still runs
        assert gc.isenabled() and clock.collections == 2
        gc.disable()
        try:
            with pytest.raises(RuntimeError), paused():
                raise RuntimeError("a failed capture")
            assert not gc.isenabled()  # as it was before the block
        finally:
            gc.enable()


def test_a_frozen_start_up_is_left_out_of_later_collections():
    # In a process of its own: freezing is for the whole process, as in a daemon.
    script = textwrap.dedent("""
        import gc
        from lanekv.runtime.gcpause import freeze_start_up
        junk = [[i] for i in range(200000)]  # what start-up leaves alive
        frozen = freeze_start_up()
        assert frozen >= 200000 and gc.get_freeze_count() == frozen, frozen
        tracked = len(gc.get_objects())
        assert tracked < 1000, tracked  # later collections walk only what came after
        print("ok", frozen)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("thawed", [True, False])
def test_a_thawed_process_exits_without_nanobind_reporting_leaks(thawed):
    """Frozen objects are not collected at exit: Triton's bindings then print a leak report
    on stderr (a daemon's stderr is one line when it fails). ``frozen`` thaws on the way out."""
    body = "with frozen():\n    pass" if thawed else "freeze_start_up()"
    script = f"import triton  # noqa: F401\nfrom runtime.gcpause import freeze_start_up, frozen\n{body}\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert ("leaked" in out.stderr) is not thawed, out.stderr[:300]
