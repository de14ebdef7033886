"""The byte ranges one NIXL read moves: whole runs of pages per layer and plane.

Both pools are ``[num_layers, planes, rows, kv_heads, head_dim]`` and contiguous,
so a page's rows of one layer and plane are one block of ``page_size * row_bytes``
bytes, and consecutive pages that land on consecutive pages are one block too: a
read of a range takes ``layers * planes * runs`` descriptors, where ``runs`` is
the number of runs of pages consecutive on both sides (one for a fresh pool).

A head range staged by the rank (``transfer.nixl.staging``) is one block
``[layers, planes, pages * page_size, head_count, head bytes]`` with the pages
in the order asked; the decode rank's pool holds only those heads, so a read
takes ``layers * planes * runs`` descriptors too, the runs now of consecutive
destination pages alone (``staged_pairs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class PoolRegion(NamedTuple):
    """A registered pool: where it starts, and its shape in rows."""

    addr: int
    planes: int
    rows: int  # num_pages * page_size
    row_bytes: int  # kv_heads * head_dim * itemsize


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source page, first destination page, count) of runs consecutive on both sides."""
    if len(src) != len(dst):
        raise ValueError(f"src and dst name {len(src)} and {len(dst)} pages")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def read_pairs(remote: PoolRegion, local: PoolRegion, src: Sequence[int], dst: Sequence[int], page_size: int,
               layer_start: int, layer_end: int, remote_first_layer: int = 0) -> list[tuple[int, int, int]]:
    """(remote address, local address, bytes) of every block of layers ``[layer_start,
    layer_end)`` of pages ``src`` (remote) going to pages ``dst`` (local); the remote
    region's first layer is layer ``remote_first_layer`` (a staged range's first)."""
    if (remote.planes, remote.row_bytes) != (local.planes, local.row_bytes):
        raise ValueError(f"pools differ in planes or row bytes: {remote} and {local}")
    block = page_size * remote.row_bytes
    pairs = []
    for s, d, count in page_runs(src, dst):
        if (s + count) * page_size > remote.rows or (d + count) * page_size > local.rows:
            raise ValueError(f"pages [{s}, {s + count}) or [{d}, {d + count}) lie outside their pool")
        for layer in range(layer_start, layer_end):
            for plane in range(remote.planes):
                held = layer - remote_first_layer
                r = remote.addr + ((held * remote.planes + plane) * remote.rows + s * page_size) * remote.row_bytes
                lo = local.addr + ((layer * local.planes + plane) * local.rows + d * page_size) * local.row_bytes
                pairs.append((r, lo, count * block))
    return pairs


def staged_pairs(staged_addr: int, local: PoolRegion, dst: Sequence[int], page_size: int, layer_start: int,
                 layer_end: int) -> list[tuple[int, int, int]]:
    """(remote address, local address, bytes) of every block of a staged range: layers
    ``[layer_start, layer_end)`` of ``len(dst)`` pages packed at ``staged_addr`` in the order
    of ``dst`` (rows of ``local.row_bytes``, the heads the local pool holds) into pages ``dst``."""
    staged = PoolRegion(staged_addr, local.planes, len(dst) * page_size, local.row_bytes)
    return read_pairs(staged, local, range(len(dst)), dst, page_size, layer_start, layer_end,
                      remote_first_layer=layer_start)


def staged_bytes(local: PoolRegion, pages: int, page_size: int, layers: int) -> int:
    """Bytes of a staged range of ``layers`` layers of ``pages`` pages (the heads ``local`` holds)."""
    return layers * local.planes * pages * page_size * local.row_bytes
