"""store_index_k / read_index_k: DSA indexer keys in one layer's uint8 index-K pool.

The pool is ``[rows, row_bytes]`` uint8 (``IndexCacheSpec.row_bytes``). With
``fp8_e4m3`` a row is ``head_dim`` e4m3 bytes, then one float32 scale per
``block`` values (little-endian), 132 bytes for 128 dims: per block
``scale = max(amax, AMAX_FLOOR) / 448`` and byte ``= e4m3(x / scale)``, both
divisions rounded to nearest (``div_rn``), the cast rounded to nearest even as
torch's ``float8_e4m3fn`` cast does (the reference). The kernels encode and
decode e4m3 with integer bit operations rather than a cast, so the interpreter
(whose fp8 cast rounds differently) and every GPU give torch's bytes bit for
bit; only finite keys are supported. With ``model`` a row is the key in the
model dtype, as bytes, and reads return it unchanged.

``store_index_k(k [T, D], pool, locs [T] int64, spec)`` writes row ``t`` at
``locs[t]``; ``loc < 0`` skips it. Locs in one call must be distinct. On CPU
every loc is checked ``< rows``; on CUDA the kernel drops rows beyond the pool.
``read_index_k(pool, rows [N] int64, spec)`` returns ``[N, D]``: float32
(dequantized) for fp8, the model dtype for ``model``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.store_kv import store_kv_triton

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # an all-zero block gets a tiny finite scale, never 0 / 0
INDEX_CACHE_DTYPES = ("fp8_e4m3", "model")
_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class IndexCacheSpec:
    """Row layout of one layer's index-K pool."""

    head_dim: int
    cache_dtype: str = "fp8_e4m3"
    model_dtype: torch.dtype = torch.bfloat16
    block: int = 128  # values per float32 scale (fp8 only)

    def __post_init__(self) -> None:
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or (
            self.head_dim <= 0
        ):
            raise ValueError(f"head_dim must be a positive int, got {self.head_dim!r}")
        if self.cache_dtype not in INDEX_CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {INDEX_CACHE_DTYPES}, "
                             f"got {self.cache_dtype!r}")
        if self.model_dtype not in _MODEL_DTYPES:
            raise ValueError(f"model_dtype must be one of {_MODEL_DTYPES}, got {self.model_dtype}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block <= 0 or (
            self.head_dim % self.block
        ):
            raise ValueError(f"block must be a positive int dividing head_dim {self.head_dim}, "
                             f"got {self.block!r}")

    @property
    def num_blocks(self) -> int:
        return self.head_dim // self.block

    @property
    def row_bytes(self) -> int:
        if self.cache_dtype == "fp8_e4m3":
            return self.head_dim + 4 * self.num_blocks
        return self.head_dim * self.model_dtype.itemsize

    def alloc_pool(self, rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros((rows, self.row_bytes), dtype=torch.uint8, device=device)


@triton.jit
def e4m3_bits(y):
    """float32 (|y| <= 448, finite) -> e4m3fn byte as int32, round to nearest even."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 31).to(tl.int32)
    a = (bits & 0x7FFFFFFF).to(tl.int32)
    # Normal targets (|y| >= 2**-6): drop 20 mantissa bits, ties to even, rebias 127 -> 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    normal = tl.minimum(normal, 0x7E)  # |y| <= 448 never rounds past 448
    # Subnormal targets: the value in units of 2**-9, ties to even.
    e = a >> 23
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - e, 21), 25)  # from 25 on the result is 0
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    q = tl.where(e == 0, 0, q)
    mag = tl.where(a >= 0x3C800000, normal, q)
    return mag | (sign << 7)


@triton.jit
def e4m3_value(byte):
    """e4m3fn byte (int32, never NaN) -> float32."""
    e = (byte >> 3) & 0xF
    m = byte & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((byte & 0x80) != 0, -mag, mag)


@triton.jit
def _store_index_k_fp8_kernel(
    k_ptr, pool_ptr, scale_ptr, locs_ptr, num_tokens, num_rows,
    stride_k, stride_pool, stride_scale,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    blk = tl.program_id(1)
    col = blk * BLOCK + tl.arange(0, BLOCK)
    in_tok = tok < num_tokens
    loc = tl.load(locs_ptr + tok, mask=in_tok, other=-1)
    ok = in_tok & (loc >= 0) & (loc < num_rows)
    x = tl.load(k_ptr + tok[:, None] * stride_k + col[None, :], mask=ok[:, None], other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-4)
    scale = tl.math.div_rn(amax, tl.full([BLOCK_T], 448.0, tl.float32))
    y = tl.math.div_rn(x, scale[:, None])
    byte = e4m3_bits(y).to(tl.uint8)
    tl.store(pool_ptr + loc[:, None] * stride_pool + col[None, :], byte, mask=ok[:, None])
    # The scales start at byte HEAD_DIM, i.e. float32 HEAD_DIM // 4 of the row.
    tl.store(scale_ptr + loc * stride_scale + HEAD_DIM // 4 + blk, scale, mask=ok)


@triton.jit
def _read_index_k_fp8_kernel(
    pool_ptr, scale_ptr, rows_ptr, out_ptr, num_rows, stride_pool, stride_scale, stride_out,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    blk = tl.program_id(1)
    col = blk * BLOCK + tl.arange(0, BLOCK)
    ok = i < num_rows
    row = tl.load(rows_ptr + i, mask=ok, other=0)
    byte = tl.load(pool_ptr + row[:, None] * stride_pool + col[None, :], mask=ok[:, None], other=0)
    scale = tl.load(scale_ptr + row * stride_scale + HEAD_DIM // 4 + blk, mask=ok, other=0.0)
    val = e4m3_value(byte.to(tl.int32)) * scale[:, None]
    tl.store(out_ptr + i[:, None] * stride_out + col[None, :], val, mask=ok[:, None])


def _check_pool(pool: torch.Tensor, spec: IndexCacheSpec) -> None:
    if not isinstance(spec, IndexCacheSpec):
        raise ValueError(f"spec must be an IndexCacheSpec, got {type(spec).__name__}")
    if not isinstance(pool, torch.Tensor) or pool.dim() != 2 or pool.dtype != torch.uint8:
        desc = (tuple(pool.shape), pool.dtype) if isinstance(pool, torch.Tensor) else pool
        raise ValueError(f"pool must be a 2-D uint8 tensor [rows, row_bytes], got {desc}")
    if pool.shape[1] != spec.row_bytes:
        raise ValueError(f"pool rows are {pool.shape[1]} bytes but the spec's row_bytes is "
                         f"{spec.row_bytes}")
    if pool.stride(1) != 1 or pool.stride(0) % 4 != 0 or pool.storage_offset() % 4 != 0:
        raise ValueError(f"pool must have dense rows at a 4-byte aligned stride, got strides "
                         f"{pool.stride()} and offset {pool.storage_offset()}")


def _check_locs(name: str, locs: torch.Tensor, count: int, rows: int, lowest: int) -> None:
    if not isinstance(locs, torch.Tensor) or locs.dim() != 1 or locs.dtype != torch.int64:
        desc = (tuple(locs.shape), locs.dtype) if isinstance(locs, torch.Tensor) else locs
        raise ValueError(f"{name} must be a 1-D int64 tensor, got {desc}")
    if count >= 0 and locs.shape[0] != count:
        raise ValueError(f"{name} has {locs.shape[0]} entries but k has {count} rows")
    if not locs.is_cuda and locs.numel() > 0:
        low, top = int(locs.min()), int(locs.max())
        if top >= rows or low < lowest:
            bad = top if top >= rows else low
            raise ValueError(f"{name} holds {bad}, outside the pool's {rows} rows")


def _check_store(k, pool, locs, spec) -> None:
    _check_pool(pool, spec)
    if not isinstance(k, torch.Tensor) or k.dim() != 2 or k.shape[1] != spec.head_dim:
        shape = tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__
        raise ValueError(f"k must be a 2-D tensor [tokens, {spec.head_dim}], got {shape}")
    if k.dtype != spec.model_dtype:
        raise ValueError(f"k.dtype is {k.dtype} but the spec's model_dtype is {spec.model_dtype}")
    if k.shape[0] and k.stride(1) != 1:
        raise ValueError(f"k must have dense rows, got strides {k.stride()}")
    check_same_device(k=k, pool=pool, locs=locs)
    _check_locs("locs", locs, k.shape[0], pool.shape[0], lowest=-(2**62))


def store_index_k_triton(k: torch.Tensor, pool: torch.Tensor, locs: torch.Tensor,
                         spec: IndexCacheSpec) -> None:
    """Quantize (fp8) or copy (model) ``k`` rows into ``pool`` at ``locs``, one fused kernel."""
    _check_store(k, pool, locs, spec)
    if k.shape[0] == 0:
        return
    if spec.cache_dtype == "model":
        # A model-dtype row is moved as bytes: store_kv's copy kernel with one "head".
        src = k.contiguous().view(torch.uint8).unsqueeze(1)  # [T, 1, row_bytes]
        store_kv_triton(src, src, pool.unsqueeze(1), pool.unsqueeze(1), locs)
        return
    block_t = 16
    scales = pool.view(torch.float32)
    grid = (triton.cdiv(k.shape[0], block_t), spec.num_blocks)
    _store_index_k_fp8_kernel[grid](
        k, pool, scales, locs, k.shape[0], pool.shape[0],
        k.stride(0), pool.stride(0), scales.stride(0),
        HEAD_DIM=spec.head_dim, BLOCK=spec.block, BLOCK_T=block_t,
    )


def quantize_index_k_ref(k: torch.Tensor, spec: IndexCacheSpec) -> torch.Tensor:
    """``[T, D]`` keys -> ``[T, row_bytes]`` uint8 rows as torch computes them."""
    x = k.float().view(k.shape[0], spec.num_blocks, spec.block)
    amax = x.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    # A tensor divisor: torch on CUDA multiplies by the reciprocal of a Python scalar
    # divisor (one bit off at times), and the convention is the division rounded to nearest.
    scale = amax / torch.full_like(amax, FP8_MAX)  # [T, num_blocks]
    q = (x / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([q.reshape(k.shape[0], -1), scale.contiguous().view(torch.uint8)], dim=1)


def store_index_k_ref(k: torch.Tensor, pool: torch.Tensor, locs: torch.Tensor,
                      spec: IndexCacheSpec) -> None:
    _check_store(k, pool, locs, spec)
    keep = (locs >= 0) & (locs < pool.shape[0])
    if spec.cache_dtype == "model":
        rows = k.contiguous().view(torch.uint8)
    else:
        rows = quantize_index_k_ref(k, spec)
    pool[locs[keep]] = rows[keep]


def store_index_k(k: torch.Tensor, pool: torch.Tensor, locs: torch.Tensor,
                  spec: IndexCacheSpec) -> None:
    """Write index key ``k[t]`` to pool row ``locs[t]`` for every ``locs[t] >= 0``."""
    if use_triton(pool):
        store_index_k_triton(k, pool, locs, spec)
    else:
        store_index_k_ref(k, pool, locs, spec)


def _check_read(pool, rows, spec) -> None:
    _check_pool(pool, spec)
    check_same_device(pool=pool, rows=rows)
    _check_locs("rows", rows, -1, pool.shape[0], lowest=0)


def read_index_k_triton(pool: torch.Tensor, rows: torch.Tensor,
                        spec: IndexCacheSpec) -> torch.Tensor:
    _check_read(pool, rows, spec)
    if spec.cache_dtype == "model":
        return pool[rows].view(spec.model_dtype)
    out = torch.empty((rows.shape[0], spec.head_dim), dtype=torch.float32, device=pool.device)
    if rows.shape[0] == 0:
        return out
    block_t = 16
    scales = pool.view(torch.float32)
    _read_index_k_fp8_kernel[(triton.cdiv(rows.shape[0], block_t), spec.num_blocks)](
        pool, scales, rows, out, rows.shape[0], pool.stride(0), scales.stride(0), out.stride(0),
        HEAD_DIM=spec.head_dim, BLOCK=spec.block, BLOCK_T=block_t,
    )
    return out


def read_index_k_ref(pool: torch.Tensor, rows: torch.Tensor,
                     spec: IndexCacheSpec) -> torch.Tensor:
    _check_read(pool, rows, spec)
    raw = pool[rows]
    if spec.cache_dtype == "model":
        return raw.view(spec.model_dtype)
    d = spec.head_dim
    vals = raw[:, :d].view(torch.float8_e4m3fn).float().view(-1, spec.num_blocks, spec.block)
    scale = raw[:, d:].contiguous().view(torch.float32)  # [N, num_blocks]
    return (vals * scale[..., None]).view(-1, d)


def read_index_k(pool: torch.Tensor, rows: torch.Tensor, spec: IndexCacheSpec) -> torch.Tensor:
    """The index keys of pool ``rows``: float32 for fp8 (dequantized), else the model dtype."""
    if use_triton(pool):
        return read_index_k_triton(pool, rows, spec)
    return read_index_k_ref(pool, rows, spec)
