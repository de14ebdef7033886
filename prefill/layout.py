"""Owner-lane KV layout: which CP rank holds which logical page, and where.

Logical page P is owned by rank ``P mod N`` and lives at physical page
``P div N`` of that rank's compact pool. With ``loc = P * ps + o`` this is
``loc = Q*(N*ps) + r*ps + o`` -> rank r, physical row ``Q*ps + o``. Each rank's
pool therefore holds 1/N of the KV bytes and no rank keeps a replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class RankRows(NamedTuple):
    rank: torch.Tensor  # owner rank per loc
    row: torch.Tensor  # physical row in that rank's pool


class NotOwnedError(ValueError):
    """A rank was asked to write or serve a loc that another rank owns."""


@dataclass(frozen=True)
class OwnerLaneLayout:
    cp_size: int
    page_size: int

    def __post_init__(self) -> None:
        for name in ("cp_size", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")

    def owner(self, pages: torch.Tensor) -> torch.Tensor:
        return torch.remainder(pages, self.cp_size)

    def physical_pages(self, pages: torch.Tensor) -> torch.Tensor:
        return torch.div(pages, self.cp_size, rounding_mode="floor")

    def logical_pages(self, rank: int, physical_pages: torch.Tensor) -> torch.Tensor:
        self._check_rank(rank)
        return physical_pages * self.cp_size + rank

    def loc_to_rank_row(self, locs: torch.Tensor) -> RankRows:
        pages = torch.div(locs, self.page_size, rounding_mode="floor")
        offset = locs - pages * self.page_size
        return RankRows(self.owner(pages), self.physical_pages(pages) * self.page_size + offset)

    def rank_row_to_loc(self, rank: int, rows: torch.Tensor) -> torch.Tensor:
        self._check_rank(rank)
        phys = torch.div(rows, self.page_size, rounding_mode="floor")
        offset = rows - phys * self.page_size
        return (phys * self.cp_size + rank) * self.page_size + offset

    def owned_by(self, rank: int, locs: torch.Tensor) -> torch.Tensor:
        self._check_rank(rank)
        return self.owner(torch.div(locs, self.page_size, rounding_mode="floor")) == rank

    def physical_rows(self, rank: int, locs: torch.Tensor) -> torch.Tensor:
        """Physical rows of ``locs`` in ``rank``'s pool; any loc it does not own is a bug."""
        if locs.numel():
            bad = ~self.owned_by(rank, locs) | (locs < 0)
            if bool(bad.any()):
                first = int(locs[bad][0])
                raise NotOwnedError(
                    f"rank {rank} asked to write loc {first} (page {first // self.page_size}), "
                    f"which rank {(first // self.page_size) % self.cp_size} owns "
                    f"(cp_size={self.cp_size}, page_size={self.page_size})"
                )
        return self.loc_to_rank_row(locs).row

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.cp_size:
            raise ValueError(f"cp_rank must be in [0, {self.cp_size}), got cp_rank={rank!r}")
