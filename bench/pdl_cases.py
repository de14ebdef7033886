"""Every launcher of the kernels ``kernels.pdl`` converted, on small CPU inputs.

Each case runs one public launcher (the ``_triton`` one, or a step of two where one
kernel only runs after another) and returns what it wrote, new tensors and the caches
it stored into. Together the cases launch each converted kernel at least once:
``tests/kernels/test_pdl.py`` runs them under the interpreter with ``LANEKV_PDL=1`` and
without, and records their launches; ``bench/pdl_compile.py`` compiles what they
launch for sm_90 with ``USE_PDL`` on. ``dtype`` is the activations' (float32 under the
interpreter, bf16 for the compile, the model's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from lanekv.kernels.decode_attention import DecodeConfig, paged_decode_attention_triton
from lanekv.kernels.fp8.gemm import fp8_linear_triton
from lanekv.kernels.fp8.gemm_configs import GemmConfig
from lanekv.kernels.fp8.gemm_gemv import gemv_linear
from lanekv.kernels.fp8.kv_rows import kv_fp8_head_bytes, mla_fp8_row_stride
from lanekv.kernels.fp8.moe_decode import Fp8SharedExpert, moe_experts_fp8_decode_triton
from lanekv.kernels.fp8.moe_gemv import MoEGemvTiles, moe_experts_fp8_gemv
from lanekv.kernels.fp8.quant import (
    per_token_group_quant_fp8_triton,
    silu_mul_quant_fp8_triton,
    silu_mul_triton,
)
from lanekv.kernels.fp8.rope_store import mla_rope_store_fp8_triton, rope_store_kv_fp8_triton
from lanekv.kernels.fp8.weights import quantize_weight_blocks
from lanekv.kernels.mla.absorb import mla_absorb_query_triton, mla_expand_output_triton
from lanekv.kernels.mla.expand_merge import mla_expand_partials_triton
from lanekv.kernels.mla.latent_store import mla_rope_norm_store_triton
from lanekv.kernels.mla.paged_decode import (
    paged_mla_decode_attention_triton,
    paged_mla_decode_stage1,
)
from lanekv.kernels.moe.decode import moe_experts_decode_triton
from lanekv.kernels.moe.gate import router_logits_triton
from lanekv.kernels.moe.route import moe_route_triton
from lanekv.kernels.rmsnorm import add_rmsnorm_triton
from lanekv.kernels.rope_store import mla_rope_triton, rope_store_kv_triton
from lanekv.kernels.store_kv import store_kv_triton

Outputs = tuple[torch.Tensor, ...]
BLOCK = (16, 16)  # FP8 weight blocks: small, so the interpreter stays quick
RANK, ROPE, HEADS = 32, 8, 4  # MLA's latent rank and RoPE width, query heads


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def add_rmsnorm(dtype: torch.dtype) -> Outputs:
    g = _gen()
    x, res = _randn(g, 3, 40, dtype=dtype), _randn(g, 3, 40, dtype=dtype)
    return add_rmsnorm_triton(x, res, _randn(g, 40, dtype=dtype), 1e-6)


def rope_store_kv(dtype: torch.dtype) -> Outputs:
    g = _gen()
    q, k, v = (_randn(g, 3, h, 16, dtype=dtype) for h in (4, 2, 2))
    angles = torch.rand(3, 8, generator=g) * 6
    cos, sin = (torch.cat((a, a), -1).to(dtype) for a in (angles.cos(), angles.sin()))
    k_cache, v_cache = torch.zeros(9, 2, 16, dtype=dtype), torch.zeros(9, 2, 16, dtype=dtype)
    q = rope_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, torch.tensor([4, -1, 7]))
    return q, k_cache, v_cache


def mla_rope(dtype: torch.dtype) -> Outputs:
    g = _gen()
    q_pe, k_pe = _randn(g, 2, HEADS, ROPE, dtype=dtype), _randn(g, 2, ROPE, dtype=dtype)
    angles = torch.rand(2, ROPE // 2, generator=g) * 6
    mla_rope_triton(q_pe, k_pe, angles.cos(), angles.sin(), True)
    return q_pe, k_pe


def store_kv(dtype: torch.dtype) -> Outputs:
    g = _gen()
    k, v = _randn(g, 3, 2, 8, dtype=dtype), _randn(g, 3, 2, 8, dtype=dtype)
    k_cache, v_cache = torch.zeros(10, 2, 8, dtype=dtype), torch.zeros(10, 2, 8, dtype=dtype)
    store_kv_triton(k, v, k_cache, v_cache, torch.tensor([9, 0, -1]))
    return k_cache, v_cache


def rope_store_kv_fp8(dtype: torch.dtype) -> Outputs:
    g = _gen()
    q, k, v = (_randn(g, 3, h, 16, dtype=dtype) for h in (4, 2, 2))
    angles = torch.rand(3, 8, generator=g) * 6
    cos, sin = (torch.cat((a, a), -1).to(dtype) for a in (angles.cos(), angles.sin()))
    k_cache, v_cache = (torch.zeros(9, 2, kv_fp8_head_bytes(16), dtype=torch.uint8)
                        for _ in range(2))
    q = rope_store_kv_fp8_triton(q, k, v, cos, sin, k_cache, v_cache, torch.tensor([4, -1, 7]))
    return q, k_cache, v_cache


def mla_rope_store_fp8(dtype: torch.dtype) -> Outputs:
    g = _gen()
    latent = _randn(g, 2, RANK + ROPE, dtype=dtype)
    angles = torch.rand(2, ROPE // 2, generator=g) * 6
    cache = torch.zeros(6, mla_fp8_row_stride(RANK, ROPE), dtype=torch.uint8)
    mla_rope_store_fp8_triton(latent, angles.cos(), angles.sin(), True, cache,
                              torch.tensor([5, 1]), RANK)
    return (cache,)


def _paged(gen: torch.Generator, lens: list[int], page_size: int, pages: int, rows: torch.Tensor):
    """A page table of ``pages`` distinct pages per request and its int32 lengths."""
    table = torch.randperm(rows.shape[0] // page_size, generator=gen)[: len(lens) * pages]
    return table.view(len(lens), pages).to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def paged_decode_attention(dtype: torch.dtype, fp8: bool = False) -> Outputs:
    g, page_size = _gen(), 4
    q = _randn(g, 2, 4, 16, dtype=dtype)
    if fp8:
        k_cache, v_cache = (torch.randint(0, 120, (64, 2, kv_fp8_head_bytes(16)), generator=g,
                                          dtype=torch.uint8) for _ in range(2))
        for cache in (k_cache, v_cache):  # float32 scales of 1/64 after each head's values
            cache[..., 16:] = torch.tensor([0.015625]).view(torch.uint8)
    else:
        k_cache, v_cache = _randn(g, 64, 2, 16, dtype=dtype), _randn(g, 64, 2, 16, dtype=dtype)
    table, lens = _paged(g, [5, 29], page_size, 8, k_cache)
    # two splits of 16 keys: stage 1 writes partials and the merge kernel runs
    return (paged_decode_attention_triton(q, k_cache, v_cache, table, lens, page_size, 0.25,
                                          num_splits=2, config=DecodeConfig(block_n=16)),)


def paged_decode_attention_fp8(dtype: torch.dtype) -> Outputs:
    return paged_decode_attention(dtype, fp8=True)


def _fp8_weight(gen: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_weight_blocks(torch.randn(*shape, generator=gen) * shape[-1] ** -0.5, BLOCK)


def quant(dtype: torch.dtype) -> Outputs:
    g = _gen()
    return (*per_token_group_quant_fp8_triton(_randn(g, 3, 48, dtype=dtype), 16),
            *silu_mul_quant_fp8_triton(_randn(g, 3, 64, dtype=dtype), 16))


def fp8_gemm_split_k(dtype: torch.dtype) -> Outputs:
    """The w8a8 GEMM over activations quantized first, two k splits and their reduction."""
    g = _gen()
    w, s = _fp8_weight(g, 32, 64)
    config = GemmConfig(16, 16, 16, split_k=2, num_stages=1)
    return (fp8_linear_triton(_randn(g, 3, 64, dtype=dtype), w, s, BLOCK, fuse_quant=False,
                              config=config),)


def fp8_gemm_w8a16(dtype: torch.dtype) -> Outputs:
    g = _gen()
    w, s = _fp8_weight(g, 32, 64)
    config = GemmConfig(16, 16, 16, num_stages=1, w8a16=True)
    return (fp8_linear_triton(_randn(g, 3, 64, dtype=dtype), w, s, BLOCK, config=config),)


def fp8_gemv_silu(dtype: torch.dtype) -> Outputs:
    """The gemv family over two k splits, the SiLU product fused in, reduced by the last
    split and by the reduce launch (where no arrival counters can be had); and the plain
    SiLU-and-multiply kernel."""
    g = _gen()
    w, s = _fp8_weight(g, 32, 64)
    gate_up = _randn(g, 3, 128, dtype=dtype)
    config = GemmConfig(16, 16, 16, split_k=2, num_stages=1, gemv=True)
    return (gemv_linear(gate_up, w, s, BLOCK, None, config, silu=True),
            gemv_linear(gate_up, w, s, BLOCK, None, config, silu=True, last_reduces=False),
            silu_mul_triton(gate_up))


def _routing(gen: torch.Generator, tokens: int, top_k: int, experts: int):
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=gen), ids


def moe_decode(dtype: torch.dtype) -> Outputs:
    g = _gen()
    x = _randn(g, 2, 32, dtype=dtype)
    w13, w2 = _randn(g, 4, 48, 32, dtype=dtype, scale=0.2), _randn(g, 4, 32, 24, dtype=dtype,
                                                                   scale=0.2)
    shared = {"shared_w13": _randn(g, 48, 32, dtype=dtype, scale=0.2),
              "shared_w2": _randn(g, 32, 24, dtype=dtype, scale=0.2)}
    return (moe_experts_decode_triton(x, w13, w2, *_routing(g, 2, 2, 4), **shared),)


def moe_decode_fp8(dtype: torch.dtype) -> Outputs:
    g = _gen()
    x = _randn(g, 2, 32, dtype=dtype)
    (w13, s13), (w2, s2) = _fp8_weight(g, 4, 64, 32), _fp8_weight(g, 4, 32, 32)
    shared = Fp8SharedExpert(*_fp8_weight(g, 128, 32), *_fp8_weight(g, 32, 64))  # two slices
    return (moe_experts_fp8_decode_triton(x, w13, s13, w2, s2, *_routing(g, 2, 2, 4), BLOCK,
                                          shared=shared),)


def moe_gemv_fp8(dtype: torch.dtype) -> Outputs:
    """One token's block-FP8 experts on the CUDA cores, two shared slices."""
    g = _gen()
    x = _randn(g, 1, 32, dtype=dtype)
    (w13, s13), (w2, s2) = _fp8_weight(g, 4, 64, 32), _fp8_weight(g, 4, 32, 32)
    shared = Fp8SharedExpert(*_fp8_weight(g, 128, 32), *_fp8_weight(g, 32, 64))
    return (moe_experts_fp8_gemv(x, w13, s13, w2, s2, *_routing(g, 1, 2, 4), BLOCK,
                                 shared=shared, tiles=MoEGemvTiles(16, 16, 4)),)


def moe_gate_route(dtype: torch.dtype) -> Outputs:
    g = _gen()
    logits = router_logits_triton(_randn(g, 2, 32, dtype=dtype), torch.randn(8, 32, generator=g))
    return (logits, *moe_route_triton(logits, torch.randn(8, generator=g) * 0.5, 2, 4, 2,
                                      "sigmoid", True, 2.5))


def mla_rope_norm_store(dtype: torch.dtype, fp8: bool = False) -> Outputs:
    g = _gen()
    q_pe, kv_a = _randn(g, 2, HEADS, ROPE, dtype=dtype), _randn(g, 2, RANK + ROPE, dtype=dtype)
    angles = torch.rand(2, ROPE // 2, generator=g) * 6
    cache = (torch.zeros(6, mla_fp8_row_stride(RANK, ROPE), dtype=torch.uint8) if fp8
             else torch.zeros(6, RANK + ROPE, dtype=dtype))
    mla_rope_norm_store_triton(q_pe, kv_a, 1 + _randn(g, RANK, dtype=dtype, scale=0.2), 1e-6,
                               angles.cos(), angles.sin(), True, cache, torch.tensor([3, -1]),
                               RANK)
    return q_pe, cache


def mla_rope_norm_store_fp8(dtype: torch.dtype) -> Outputs:
    return mla_rope_norm_store(dtype, fp8=True)


def _mla_problem(gen: torch.Generator, dtype: torch.dtype):
    latent = _randn(gen, 48, RANK + ROPE, dtype=dtype)
    table, lens = _paged(gen, [6, 19], 4, 5, latent)
    return _randn(gen, 2, HEADS, RANK + ROPE, dtype=dtype), latent, table, lens


def mla_decode(dtype: torch.dtype) -> Outputs:
    """Stage 1 with two splits, then the merge kernel."""
    q, latent, table, lens = _mla_problem(_gen(), dtype)
    return (paged_mla_decode_attention_triton(q, latent, table, lens, 4, 0.3, RANK,
                                              num_splits=2),)


def mla_decode_expand(dtype: torch.dtype) -> Outputs:
    """Stage 1's partials merged in the expansion's prologue, then the plain expansion."""
    g = _gen()
    q, latent, table, lens = _mla_problem(g, dtype)
    w_v = _randn(g, HEADS, 8, RANK, dtype=dtype, scale=RANK ** -0.5)
    parts = paged_mla_decode_stage1(q, latent, table, lens, 4, 0.3, RANK, num_splits=2)
    o_latent = _randn(g, 2, HEADS, RANK, dtype=dtype)
    return mla_expand_partials_triton(parts, w_v), mla_expand_output_triton(o_latent, w_v)


def mla_absorb(dtype: torch.dtype) -> Outputs:
    g = _gen()
    q = _randn(g, 2, HEADS, 16 + ROPE, dtype=dtype)
    return (mla_absorb_query_triton(q, _randn(g, HEADS, 16, RANK, dtype=dtype, scale=0.25)),)


CASES: dict[str, Callable[[torch.dtype], Outputs]] = {
    fn.__name__: fn for fn in (
        add_rmsnorm, rope_store_kv, mla_rope, store_kv, rope_store_kv_fp8, mla_rope_store_fp8,
        paged_decode_attention, paged_decode_attention_fp8, quant, fp8_gemm_split_k,
        fp8_gemm_w8a16, fp8_gemv_silu, moe_decode, moe_decode_fp8, moe_gemv_fp8, moe_gate_route,
        mla_rope_norm_store,
        mla_rope_norm_store_fp8, mla_decode, mla_decode_expand, mla_absorb)
}
