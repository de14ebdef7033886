"""The digest and the page copies of the fast path, on CPU.

- ``kv_digest`` against a plain-Python sum, across block boundaries, and what
  it must notice (one changed word, two swapped pages);
- ``page_runs``, ``copy_groups`` and ``copy_pages`` against ``gather_pages``/``scatter_pages``;
- a rank's digests taken as layers are written seal any range as a fresh digest would.
"""

from __future__ import annotations

import grpc
import lanekv.kernels.page_digest as page_digest_module
import lanekv.transfer.protocol.descriptors as fastpath
import pytest
import torch
from lanekv.kernels.page_copy import gather_pages, scatter_pages
from lanekv.kernels.page_digest import kv_digest
from lanekv.transfer.fastpath.poolcopy import copy_pages, page_runs
from lanekv.transfer.fastpath.rangecopy import copy_groups
from lanekv.transfer.protocol.descriptors import (
    SHM_DIR,
)
from lanekv.transfer.rank.progress import LayerProgress
from lanekv.transfer.rank.sources import TensorPageSource

from tests.markers import GPU_CASE
from tests.reliability.kv_cluster import LAYERS, PAGE, make_agreement

Code = grpc.StatusCode
U64 = (1 << 64) - 1




def _python_digest(t: torch.Tensor) -> int:
    words = t.reshape(-1).view(torch.uint8).view(torch.int32).tolist()
    weight = 0x9E3779B97F4A7C15
    return sum(w * (((i * weight) & U64) | 1) for i, w in enumerate(words)) & U64


def test_kv_digest_is_the_weighted_word_sum_across_blocks(monkeypatch):
    t = torch.randint(-(2**31), 2**31 - 1, (1000,), dtype=torch.int32)
    want = _python_digest(t)
    assert kv_digest(t) == want
    monkeypatch.setattr(page_digest_module, "_DIGEST_BLOCK", 96)  # many blocks, a ragged last one
    assert kv_digest(t) == want
    assert kv_digest(t.view(torch.bfloat16)) == want  # bytes, not values


def test_kv_digest_notices_one_word_and_swapped_pages():
    pages = torch.randn(4, 2, 8, dtype=torch.float16)
    base = kv_digest(pages)
    flipped = pages.clone()
    flipped.view(torch.int16)[2, 1, 3] ^= 1
    assert kv_digest(flipped) != base
    assert kv_digest(pages[[1, 0, 2, 3]].contiguous()) != base
    with pytest.raises(ValueError, match="contiguous"):
        kv_digest(pages.transpose(0, 1))


def test_shm_room_counts_free_bytes(tmp_path):
    assert fastpath.shm_room(SHM_DIR) > 0
    assert fastpath.shm_room(tmp_path / "missing") == 0


def test_page_runs_group_consecutive_pairs():
    assert page_runs([3, 4, 5, 9, 10], [0, 1, 7, 8, 9]) == [(3, 0, 2), (5, 7, 1), (9, 8, 2)]
    assert page_runs([], []) == []
    assert page_runs((7, 8, 9, 10), [0, 1, 2, 3]) == [(7, 0, 4)]  # one run, found without a loop
    assert page_runs([7, 8, 9, 10], [0, 1, 3, 4]) == [(7, 0, 2), (9, 3, 2)]
    assert page_runs([7, 9, 8, 10], [0, 1, 2, 3]) == [(7, 0, 1), (9, 1, 1), (8, 2, 1), (10, 3, 1)]


def test_copy_groups_cut_the_last_group_in_halves():
    assert copy_groups(0, 32, 8, 2) == [(0, 8), (8, 16), (16, 24), (24, 28), (28, 30), (30, 32)]
    assert copy_groups(0, 32, 8, 8) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert copy_groups(4, 7, 8, 2) == [(4, 7)]  # three layers: no half of two
    assert copy_groups(0, 9, 8, 1) == [(0, 8), (8, 9)]
    assert copy_groups(3, 3, 8, 2) == []
    for start, end, size, last_min in [(0, 32, 8, 2), (0, 61, 7, 3), (5, 6, 1, 1), (0, 40, 32, 1)]:
        groups = copy_groups(start, end, size, last_min)
        assert [a for a, _ in groups[1:]] == [b for _, b in groups[:-1]]  # contiguous, in order
        assert groups[0][0] == start and groups[-1][1] == end
    with pytest.raises(ValueError, match="size"):
        copy_groups(0, 8, 0, 2)


@pytest.mark.parametrize("src_pages,dst_pages", [
    ([0, 1, 2], [5, 6, 7]), ([4, 1, 3], [0, 2, 6]), ([2], [2]),
    ([9, 1, 7, 3, 5, 0], [0, 2, 4, 6, 8, 10]),  # more runs than are copied one by one
])
def test_copy_pages_equals_gather_then_scatter(src_pages, dst_pages):
    src = torch.randn(3, 2, 12 * PAGE, 2, 4)
    dst = torch.zeros(3, 2, 12 * PAGE, 2, 4)
    want = dst.clone()
    buf = gather_pages(src, torch.tensor(src_pages), PAGE, 1, 3)
    scatter_pages(buf, want, torch.tensor(dst_pages), PAGE, 1, 3)
    copy_pages(src, src_pages, dst, dst_pages, PAGE, 1, 3)
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="2 source pages but 1"):
        copy_pages(src, [0, 1], dst, [0], PAGE, 0, 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=GPU_CASE)])
def test_digests_taken_as_layers_are_written_seal_any_range(monkeypatch, device):
    """A large request's layers are digested as they are written; a range's digest is then
    their sum, equal to digesting it afresh (each layer at its place among all layers)."""
    from lanekv.kernels.page_digest import page_digest

    agreement = make_agreement(kv_dtype="float16")
    num_pages = TensorPageSource.DIGEST_AT_WRITE_MIN_PAGES + 4
    pool = torch.randn(LAYERS, 2, (num_pages + 3) * PAGE, 2, 8, device=device).half()
    source = TensorPageSource(agreement, 0, pool)
    physical = [(7 * i) % (num_pages + 3) for i in range(num_pages)]
    source.add("big", list(enumerate(physical)), LayerProgress(LAYERS, device))
    source.add("small", [(0, 1), (1, 2)], LayerProgress(LAYERS, device))
    for layer in range(LAYERS):
        source.digest_written(["big", "small", "unknown"], layer)
    index = torch.tensor(physical, device=device)

    def fresh(first, last, pages=index):
        return int(page_digest(pool, pages, PAGE, first, last, first_layer=0).item()) & U64

    ranges = [(0, LAYERS), (1, LAYERS - 1), (2, 3)]
    monkeypatch.setattr("lanekv.transfer.rank.sources.page_digest", lambda *a, **k: pytest.fail("digested afresh"))
    got = [source.digest(physical, a, b, request_id="big") for a, b in ranges]
    monkeypatch.undo()
    assert got == [fresh(a, b) for a, b in ranges]
    # Other pages, another order, or a request digested at fetch time: afresh, the same digest.
    assert source.digest(physical[::-1], 0, 2, request_id="big") == fresh(0, 2, index.flip(0))
    assert source.digest([1, 2], 0, LAYERS, request_id="small") == fresh(0, LAYERS, index.new_tensor([1, 2]))
    # A layer out of order only ends the digests taken as written: fetches digest afresh.
    source.digest_written(["big"], 1)
    assert source.written_digest(physical, 0, 2, None, "big") is None
    assert source.digest(physical, 0, 2, request_id="big") == fresh(0, 2)
    source.release("big")
    assert "big" not in source._written
