"""PagePool accounting and PageTable remapping (CPU, no kernels)."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from lanekv.decode.pool import PagePool, PageTable, PoolExhausted, batch_tables
from lanekv.kernels.kv_layout import KVCacheSpec


def make_pool(num_pages: int = 8, page_size: int = 4) -> PagePool:
    spec = KVCacheSpec(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32,
                       page_size=page_size)
    return PagePool(spec, num_pages)


def test_pool_tensor_layout():
    pool = make_pool(num_pages=5, page_size=3)
    assert pool.tensor.shape == (2, 2, 15, 2, 4)
    assert pool.k_cache(1).shape == (15, 2, 4)
    assert pool.k_cache(1).data_ptr() == pool.tensor[1, 0].data_ptr()
    assert pool.v_cache(0).data_ptr() == pool.tensor[0, 1].data_ptr()
    assert pool.num_pages == 5 and pool.free_count == 5 and pool.used_count == 0


def test_allocate_and_free_back_to_start():
    pool = make_pool(num_pages=8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8
    assert pool.free_count == 0 and pool.used_count == 8
    pool.free(a)
    assert pool.free_count == 3
    pool.free(reversed(b))
    assert pool.free_count == 8
    assert sorted(pool.allocate(8)) == list(range(8))


def test_exhaustion_changes_nothing():
    pool = make_pool(num_pages=4)
    held = pool.allocate(3)
    with pytest.raises(PoolExhausted, match="needed 2 pages, 1 free") as info:
        pool.allocate(2)
    assert (info.value.needed, info.value.free) == (2, 1)
    assert pool.free_count == 1
    last = pool.allocate(1)
    assert last[0] not in held
    assert pool.allocate(0) == []


def test_double_free_and_bad_pages_refused_atomically():
    pool = make_pool(num_pages=6)
    pages = pool.allocate(4)
    pool.free(pages[:1])
    with pytest.raises(ValueError, match=f"double free of page {pages[0]}"):
        pool.free([pages[1], pages[0]])
    assert pool.free_count == 3  # pages[1] was not freed either
    with pytest.raises(ValueError, match="double free"):
        pool.free([pages[2], pages[2]])
    with pytest.raises(ValueError, match="not a page of this pool"):
        pool.free([6])
    with pytest.raises(ValueError, match="not a page of this pool"):
        pool.free([-1])
    assert pool.free_count == 3
    with pytest.raises(ValueError, match="n must be a non-negative int"):
        pool.allocate(-1)


def test_concurrent_allocation_never_hands_out_a_page_twice():
    pool = make_pool(num_pages=64)
    taken: list[list[int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        mine: list[int] = []
        try:
            for _ in range(300):
                if mine and rng.random() < 0.4:
                    k = rng.randint(1, len(mine))
                    pool.free(mine[:k])
                    del mine[:k]
                else:
                    try:
                        mine.extend(pool.allocate(rng.randint(1, 4)))
                    except PoolExhausted:
                        pass
        except Exception as exc:  # surfaced to the main thread below
            errors.append(exc)
        with lock:
            taken.append(mine)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    held = [page for mine in taken for page in mine]
    assert len(held) == len(set(held)), "a page was handed to two owners"
    assert pool.free_count + len(held) == 64
    pool.free(held)
    assert pool.free_count == 64


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_remap_scattered_pages_in_any_logical_order(page_size: int):
    pool = make_pool(num_pages=40, page_size=page_size)
    # Only the odd pages are free, in descending order: the request gets
    # scattered, non-contiguous physical pages.
    pool.free(pool.allocate(40)[::-1][::2])
    rng = random.Random(page_size)
    seq_len = 5 * page_size - 1 if page_size > 1 else 5
    source = rng.sample(range(1000), 5)  # the prefill side's logical pages, any order/numbering
    table = PageTable.remap(pool, source, seq_len)
    assert table.source_pages == tuple(source)
    assert table.num_pages == 5 and table.seq_len == seq_len
    assert len(set(table.pages)) == 5
    # Received pages land where the table says; reading through locs gives them back in order.
    rows = torch.arange(seq_len, dtype=torch.float32)
    for i, src in enumerate(source):
        (dst,) = table.physical_pages_for([src])
        assert dst == table.pages[i]
        lo, hi = i * page_size, min((i + 1) * page_size, seq_len)
        pool.tensor[0, 0, dst * page_size: dst * page_size + hi - lo] = rows[lo:hi, None, None]
    locs = table.locs_for(range(seq_len))
    assert torch.equal(pool.tensor[0, 0, locs, 0, 0], rows)
    assert [table.loc(p) for p in range(seq_len)] == locs.tolist()
    with pytest.raises(ValueError, match="not a page of this request"):
        table.physical_pages_for([10_000])


def test_remap_checks_its_input():
    pool = make_pool(num_pages=8, page_size=4)
    with pytest.raises(ValueError, match="needs 2"):
        PageTable.remap(pool, [3, 1, 2], seq_len=8)
    with pytest.raises(ValueError, match="repeats a page"):
        PageTable.remap(pool, [3, 3], seq_len=8)
    with pytest.raises(PoolExhausted):
        PageTable.remap(pool, list(range(9)), seq_len=36)
    assert pool.free_count == 8


def test_append_slot_grows_by_page_and_release_frees_all():
    pool = make_pool(num_pages=3, page_size=4)
    table = PageTable.allocate(pool, seq_len=3)
    assert table.num_pages == 1
    assert table.append_slot() == table.pages[0] * 4 + 3
    assert table.num_pages == 1 and table.seq_len == 4
    loc = table.append_slot()  # the first page is full: a new one
    assert table.num_pages == 2 and loc == table.pages[1] * 4
    other = PageTable.allocate(pool, seq_len=1)
    for _ in range(3):
        table.append_slot()
    assert table.seq_len == 8 and pool.free_count == 0
    with pytest.raises(PoolExhausted):
        table.append_slot()
    assert table.seq_len == 8 and table.num_pages == 2  # unchanged
    with pytest.raises(ValueError, match="outside"):
        table.locs_for([8])
    assert table.release() == 2
    assert table.release() == 0
    other.release()
    assert pool.free_count == 3


def test_batch_tables():
    pool = make_pool(num_pages=10, page_size=4)
    a = PageTable.allocate(pool, seq_len=9)
    b = PageTable.allocate(pool, seq_len=2)
    bt = batch_tables([a, b])
    assert bt.page_table.dtype == torch.int32 and bt.seq_lens.dtype == torch.int32
    assert bt.page_table.tolist() == [list(a.pages), [b.pages[0], 0, 0]]
    assert bt.seq_lens.tolist() == [9, 2]
    with pytest.raises(ValueError, match="at least one"):
        batch_tables([])
