"""A prefill rank's pages as the transfer service sees them.

The rank's own pool (on its GPU, or the CPU) behind the ``PageSource`` the
KVTransfer server reads. Reads copy pages in wire order with the
``gather_pages`` kernel, then to the host. A release by the decode side is
reported to the parent process (``on_release``), which owns the allocator and
the leases; an expired lease makes the rank ``forget`` the request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kernels.page_copy import gather_pages
from transfer.contract import Agreement
from transfer.server import TensorPageSource


class RankPageSource(TensorPageSource):
    def __init__(
        self,
        agreement: Agreement,
        rank: int,
        pool: torch.Tensor,
        on_release: Callable[[str, list[int]], None],
    ) -> None:
        super().__init__(agreement, rank, pool)
        self._page_size = agreement.page_size
        self._on_release = on_release

    def read(self, physical_pages: Sequence[int], layer_start: int, layer_end: int) -> torch.Tensor:
        pages = torch.as_tensor(list(physical_pages), dtype=torch.int64, device=self.pool.device)
        out = gather_pages(self.pool, pages, self._page_size, layer_start, layer_end)
        return out.cpu()

    def release(self, request_id: str) -> int:
        logical = [page for page, _ in self.pages_of(request_id)]
        freed = super().release(request_id)  # KeyError if a concurrent release won
        self._on_release(request_id, logical)
        return freed

    def forget(self, request_id: str) -> None:
        """The lease expired: the parent already freed the pages; stop serving them."""
        try:
            super().release(request_id)
        except KeyError:
            pass  # released by the decode side in the meantime
