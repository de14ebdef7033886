"""Pool handles and descriptors (round trips, hostile bytes refused with ValueError)
and ``LayerProgress`` (waits until a layer is written, fails, times out)."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import msgpack
import pytest
from lanekv.transfer.protocol.descriptors import (
    SHM,
    SHM_DIR,
    Descriptor,
    PoolHandle,
)
from lanekv.transfer.rank.progress import LayerProgress, PrefillFailed

Code = grpc.StatusCode
U64 = (1 << 64) - 1




def test_handle_and_descriptor_round_trip():
    handle = PoolHandle(SHM, (2, 2, 8, 2, 4), "float16", path=str(SHM_DIR / "lanekv-x"))
    assert PoolHandle.decode(handle.encode()) == handle
    d = Descriptor("req", 1, 3, 0, 2, (4, 6), (1, 0), U64)
    assert Descriptor.decode(d.encode()) == d
    announced = dataclasses.replace(d, digest=None)
    assert Descriptor.decode(announced.encode()) == announced
    # A seal is the announcement's exact encoding with a digest, nothing else.
    assert announced.sealed_by(d.encode()) == d
    for other in (dataclasses.replace(d, physical=(0, 1)), dataclasses.replace(d, seq=4), announced):
        assert announced.sealed_by(other.encode()) is None
    assert announced.sealed_by(b"\xc1 not msgpack") is None


@pytest.mark.parametrize("changes,match", [
    (dict(transport="nvlink"), "transport"),
    (dict(path="/etc/passwd"), "path"),
    (dict(shape=[1, 2, 3]), "shape"),
    (dict(dtype="int4"), "dtype"),
    (dict(storage_offset=-1), "storage_offset"),
])
def test_hostile_handles_are_refused(changes, match):
    raw = dict(transport=SHM, shape=[2, 2, 8, 2, 4], dtype="float16", path=str(SHM_DIR / "lanekv-x"),
               device_uuid="", ipc=[], storage_offset=0)
    raw.update(changes)
    with pytest.raises(ValueError, match=match):
        PoolHandle.decode(msgpack.packb(raw))


@pytest.mark.parametrize("changes,match", [
    (dict(pages=[1, 2], physical=[0]), "physical"),
    (dict(layer_end=0), "layer_end"),
    (dict(digest=-1), "digest"),
    (dict(pages=[]), "pages"),
    (dict(extra=1), "unknown keys"),
])
def test_hostile_descriptors_are_refused(changes, match):
    raw = dict(request_id="r", rank=0, seq=0, layer_start=0, layer_end=1, pages=[1], physical=[0], digest=5)
    raw.update(changes)
    with pytest.raises(ValueError, match=match):
        Descriptor.decode(msgpack.packb(raw))


def test_layer_progress_waits_fails_and_times_out():
    progress = LayerProgress(3)
    with pytest.raises(TimeoutError, match="layer 0 not written"):
        progress.wait(1, 0.05)
    got = []
    waiter = threading.Thread(target=lambda: got.append(progress.wait(2, 5.0)))
    waiter.start()
    progress.layer_written(0)
    time.sleep(0.05)
    assert got == []  # layer 1 is not written yet
    progress.layer_written(1)
    waiter.join(5)
    assert got == [(2, None)]  # two layers written, no device event on the CPU
    with pytest.raises(ValueError, match="in order"):
        progress.layer_written(0)
    with pytest.raises(PrefillFailed, match="released"):
        progress.wait(3, 5.0, alive=lambda: False)
    progress.fail("rank 1: boom")
    with pytest.raises(PrefillFailed, match="boom"):
        progress.wait(3, 5.0)
    assert progress.wait(2, 0.0) == (2, None)  # written layers stay readable
