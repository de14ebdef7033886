"""Which output tile and k range a program of the block-FP8 GEMMs computes.

Both GEMMs (``gemm.py``'s w8a8 and ``gemm_w8a16.py``'s) hand tiles out in the same
order: ``GROUP_M`` row tiles share each sweep over the column tiles, so a wave of
programs reuses the same weight columns from L2, and a tile's k range is cut into
``SPLIT_K`` slices of whole ``BLOCK_K`` steps (float32 partials, reduced after).
"""

import triton
import triton.language as tl


@triton.jit
def tile_coords(tile, rows, cols, depth, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """Program ``tile`` -> (row tile, column tile, k slice, first k step, end k step)."""
    m_tiles = tl.cdiv(rows, BLOCK_M)
    n_tiles = tl.cdiv(cols, BLOCK_N)
    split = tile % SPLIT_K
    mn = tile // SPLIT_K
    width = GROUP_M * n_tiles
    first_m = (mn // width) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (mn % width) % group_rows
    pid_n = (mn % width) // group_rows
    k_steps = tl.cdiv(depth, BLOCK_K)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    k_lo = split * per_split
    k_hi = tl.minimum(k_lo + per_split, k_steps)
    return pid_m, pid_n, split, k_lo, k_hi
