"""One in-process KVTransfer rank whose pool lives in /dev/shm, for the fast-path tests.

``shm_rank()`` serves rank 0 of a cp=1 layout (float16 pages, ``LAYERS``
layers of ``kv_cluster``) and yields ``(source, pool, endpoint, agreement,
kv)``; ``fill`` writes seeded random bytes into some pages of one layer;
``fetch_rank`` runs ``FastPath.fetch`` for one rank's pages.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import torch
from lanekv.transfer.fastpath.client import FastPath
from lanekv.transfer.fastpath.rankfetch import FastRequest, FastStats, RankPages
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.contract import Topology
from lanekv.transfer.protocol.descriptors import SHM_DIR, remove_shared_pool, shared_cpu_pool
from lanekv.transfer.rank.server import serve
from lanekv.transfer.rank.sources import TensorPageSource

from tests.reliability.kv_cluster import LAYERS, PAGE, make_agreement, rows_of

POOL_PAGES = 8


@contextlib.contextmanager
def shm_rank() -> Iterator[tuple[TensorPageSource, torch.Tensor, str, Agreement, KVClient]]:
    path = SHM_DIR / f"lanekv-test-{uuid.uuid4().hex}"
    agreement = make_agreement(kv_dtype="float16")
    pool = shared_cpu_pool(path, (LAYERS, 2, POOL_PAGES * PAGE, 2, 8), torch.float16, 0.0)
    source = TensorPageSource(agreement, 0, pool, shared_path=path)
    served = serve(source)
    endpoint = f"127.0.0.1:{served.port}"
    source.set_topology(Topology(1, "in_seq", "page_mod_cp", (endpoint,)))
    kv = KVClient()
    try:
        yield source, pool, endpoint, agreement, kv
    finally:
        kv.close()
        served.server.stop(None)
        remove_shared_pool(path)


def fill(pool: torch.Tensor, physical: list[int], layer: int, seed: int | None = None) -> None:
    g = torch.Generator().manual_seed(layer if seed is None else seed)
    pool[layer, :, rows_of(physical)] = torch.randn(2, len(physical) * PAGE, 2, 8, generator=g).half()


def fetch_rank(fast: FastPath, endpoint: str, rank: int, src: torch.Tensor, request_id: str, fingerprint: str,
               pages, dst: torch.Tensor, pages_for, on_copied, *, epoch: str | None, timeout: float,
               expect=None, **kw) -> FastStats:
    """``FastPath.fetch`` of one rank's ``pages`` of ``request_id``, within ``timeout`` seconds."""
    request = FastRequest(request_id, fingerprint, dst, pages_for, on_copied, epoch, time.monotonic() + timeout)
    part = RankPages(rank, endpoint, src, tuple(pages), None if expect is None else tuple(expect))
    return fast.fetch(request, part, **kw)
