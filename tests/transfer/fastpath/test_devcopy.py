"""lanekv.transfer.fastpath.devcopy: strided block copies between pools through the CUDA runtime.

CPU: which views are blocks at one pitch, and that CPU tensors are left to
torch. GPU: a run of pages over layers copied in one 2-D copy, in groups of
blocks, and block by block when a pitch exceeds the device's limit, within a
GPU and between two.
"""

from __future__ import annotations

import pytest
import torch
from lanekv.kernels.page_copy import scatter_pages
from lanekv.transfer.fastpath import devcopy
from lanekv.transfer.fastpath.devcopy import BlockCopy

from tests.markers import GPU_CASE, requires_gpu


def _pool(device="cpu", layers=3, rows=40):
    return torch.arange(layers * 2 * rows * 2 * 4, dtype=torch.float32, device=device).view(layers, 2, rows, 2, 4)


def test_a_run_of_rows_over_layers_is_blocks_at_one_pitch():
    pool = _pool()
    view = pool[1:3, :, 8:16]
    count, width, pitch = devcopy._blocks(view)
    assert (count, width, pitch) == (4, 8 * 2 * 4 * 4, 40 * 2 * 4 * 4)
    assert devcopy._blocks(pool[:, :, :, 0]) is None  # rows not dense
    assert devcopy._blocks(pool[:, 0]) is None  # not [A, B, ...] blocks


def test_cpu_tensors_are_left_to_torch():
    src, dst = _pool(), torch.zeros(3, 2, 40, 2, 4)
    assert BlockCopy.plan(dst[:, :, :8], src[:, :, :8]) is None


@requires_gpu
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("small_pitch_limit", [False, True])
def test_block_copies_between_pools_on_gpus(monkeypatch, cross, small_pitch_limit):
    if cross and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs for a copy between GPUs")
    if small_pitch_limit:  # every 2-D copy is refused: block by block
        monkeypatch.setattr(devcopy._Runtime, "max_pitch", lambda self, device: 1)
    src = _pool("cuda:0")
    dst = torch.zeros(3, 2, 40, 2, 4, device=f"cuda:{1 if cross else 0}")
    whole = BlockCopy.plan(dst[:, :, 16:24], src[:, :, 8:16])
    assert whole is not None
    whole.issue()
    torch.cuda.synchronize()
    assert torch.equal(dst[:, :, 16:24].cpu(), src[:, :, 8:16].cpu())
    assert torch.count_nonzero(dst[:, :, :16]) == 0
    plan = BlockCopy.plan(dst[:, :, 0:8], src[:, :, 30:38])
    plan.issue(2, 2)  # layer 1's K and V only
    torch.cuda.synchronize()
    assert torch.equal(dst[1, :, 0:8].cpu(), src[1, :, 30:38].cpu())
    assert torch.count_nonzero(dst[0, :, 0:8]) == 0 and torch.count_nonzero(dst[2, :, 0:8]) == 0
    with pytest.raises(ValueError, match="not within"):
        plan.issue(5, 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=GPU_CASE)])
@pytest.mark.parametrize("physical", [[5, 6, 7, 2], [1, 3, 5, 7, 9, 0], [4]], ids=["runs", "scattered", "one"])
def test_place_chunk_puts_each_page_of_a_host_chunk_in_its_place(monkeypatch, device, physical):
    """lanekv.transfer.connector.placement: a few runs of pages go by 2-D copies on a GPU and by one
    torch copy each on the CPU, scattered ones (more than MAX_RUN_COPIES runs) by scatter_pages.
    Same pool either way."""
    from lanekv.transfer.connector import placement
    from lanekv.transfer.connector.placement import place_chunk

    scattered = []
    monkeypatch.setattr(placement, "scatter_pages", lambda *a: (scattered.append(1), scatter_pages(*a)))

    ps, layers = 4, (1, 3)
    pool = torch.zeros(4, 2, 10 * ps, 2, 4, device=device)
    payload = torch.randn(layers[1] - layers[0], 2, len(physical) * ps, 2, 4)
    place_chunk(pool, physical, payload, ps, *layers)
    want = torch.zeros(4, 2, 10 * ps, 2, 4)
    for i, page in enumerate(physical):
        want[layers[0]:layers[1], :, page * ps:(page + 1) * ps] = payload[:, :, i * ps:(i + 1) * ps]
    assert torch.equal(pool.cpu(), want)
    assert bool(scattered) == (len(physical) == 6)  # [1, 3, 5, 7, 9, 0]: six runs
    with pytest.raises(ValueError):
        place_chunk(pool, physical + [8], payload, ps, *layers)  # a page more than the payload holds
    with pytest.raises(ValueError):
        place_chunk(pool, [page + 6 for page in physical], payload, ps, *layers)  # pages past the pool
    with pytest.raises(ValueError):
        place_chunk(pool, physical, payload.to(torch.float64), ps, *layers)  # another dtype
