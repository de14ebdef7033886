"""The DeepSeek-V2/V3 decoder (MLA attention, MoE) shared by prefill and decode.

Like ``model.llama.CausalLM``, one flat batch of tokens goes in and attention
is a callback, but an MLA callback sees the compact latent row instead of
per-head K and V:

    attention(layer, q [T, H, qk_head_dim], latent [T, kv_lora_rank + qk_rope_head_dim])
        -> o [T, H, v_head_dim]

``latent`` is what the KV cache holds: ``kv_a_layernorm`` of the compressed KV,
then the RoPE'd shared key part; ``q`` is ``q_nope`` then the RoPE'd ``q_pe``.
The callback decompresses the latent through ``MLAAttention.decompress`` (per-head
K and V) or works in the latent space through ``absorb_query`` and
``expand_output``. With ``rope_in_attention=True`` (FP8 latent rows, whose store
rotates the key: ``kernels/fp8/rope_store.py``) the latent's RoPE part comes before
RoPE and the callback also gets ``cos, sin [T, qk_rope_head_dim / 2]``:
``attention(layer, q, latent, cos, sin)``. A ``RawLatentFn`` callback (the paged decode's)
gets the projection before any RoPE or kv_a_layernorm and does them itself, fused with
the latent's store. Ops and their order follow transformers (RMSNorm and the
router in float32, YaRN frequencies and cos/sin scaling as it computes them),
so float32 logits agree with it. The router's choice after its GEMM is one launch
(``kernels.moe.route``). Routed experts run as grouped GEMMs over the (token, choice)
pairs sorted by expert (``kernels.moe``: on CUDA without a host sync, so a decode step
can be captured in a CUDA graph); decode batches of up to 16 tokens take the sort-free
kernels of ``kernels/moe/decode.py`` instead, the shared expert fused in (three launches
for the whole MLP), block-FP8 experts and shared expert as well
(``kernels/fp8/moe_decode.py``). q and kv_a are one GEMM, the absorbed form's projections one launch
each at decode sizes; residual adds are fused into the RMSNorms (``kernels.rmsnorm``),
as in ``model.llama``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from lanekv.kernels.backend import use_triton
from lanekv.kernels.fp8.experts import moe_experts_fp8
from lanekv.kernels.fp8.gemm_gemv import dense_linear
from lanekv.kernels.fp8.moe_decode import Fp8SharedExpert, moe_experts_fp8_decode, shared_fits
from lanekv.kernels.mla.absorb import mla_absorb_query, mla_expand_output
from lanekv.kernels.mla.expand_merge import mla_expand_partials
from lanekv.kernels.mla.paged_decode import MLAPartials
from lanekv.kernels.moe.decode import MAX_DECODE_TOKENS, TOKEN_BUCKETS, moe_experts_decode
from lanekv.kernels.moe.experts import moe_experts, prefill_tile_min_pairs
from lanekv.kernels.moe.gate import router_logits
from lanekv.kernels.moe.route import moe_route
from lanekv.kernels.rope_store import mla_rope
from lanekv.model.config import ModelConfig
from lanekv.model.llama import (
    MODEL_DTYPES,
    FusedLinear,
    RMSNorm,
    causal_attention,
    project,
    silu_mul_down,
    unset_embedding,
)
from lanekv.model.mla_config import MoEConfig, yarn_inv_freq
from lanekv.model.quant.linear import Fp8Linear, StackedFp8Experts, dense_weight
from torch import nn

MLAAttentionFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# DeepSeek's q_a_layernorm and kv_a_layernorm keep the default epsilon whatever rms_norm_eps says.
_LORA_NORM_EPS = 1e-6
# Decode batches up to this many tokens run the routed and shared experts through the
# sort-free kernels of kernels/moe/decode.py (three launches); larger ones the grouped GEMMs.
# On the H200 the sort-free path led up to 16 tokens (V2-Lite: 53 against 79 us at 1, even at
# 16) and trailed at 64 (398 against 350 us; bench/results/session4_h200/deepseek_kernels.json).
MOE_DECODE_MAX_TOKENS = min(16, MAX_DECODE_TOKENS)


@dataclass(frozen=True)
class RawLatentFn:
    """An MLA callback that takes the projection as the GEMMs leave it: ``fn(layer, q,
    kv_a, cos, sin)`` with q's RoPE part unrotated and ``kv_a [T, R + P]`` before
    kv_a_layernorm and RoPE (``MLAAttention.project_unrotated``). The paged decode's
    callbacks: one launch rotates, norms and stores (``kernels/mla/latent_store.py``)."""

    fn: Callable[..., torch.Tensor]

    def __call__(self, layer: int, q: torch.Tensor, kv_a: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        return self.fn(layer, q, kv_a, cos, sin)


class MLAProjection(NamedTuple):
    q: torch.Tensor  # [T, H, qk_head_dim]: q_nope then the RoPE'd q_pe
    # [T, kv_lora_rank + qk_rope_head_dim], the cached row (rows may be strided: a view
    # of the q/kv_a GEMM's output)
    latent: torch.Tensor
    q_lora: torch.Tensor | None  # [T, q_lora_rank] after q_a_layernorm (DSA's index queries)


class MLARotary(nn.Module):
    """cos/sin ``[T, qk_rope_head_dim // 2]`` per rotated pair, YaRN scale included."""

    def __init__(self, config: ModelConfig, device: torch.device | str):
        super().__init__()
        mla = config.mla
        inv_freq, self.scale = yarn_inv_freq(mla.qk_rope_head_dim, config.rope_theta, None if (
            mla.yarn is None) else dict(mla.yarn), device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return freqs.cos() * self.scale, freqs.sin() * self.scale


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        mla = config.mla
        self.layer_index = layer_index
        self.mla = mla
        self.num_heads = config.num_heads
        kw = {"dtype": dtype, "device": device}
        hidden, heads = config.hidden_size, config.num_heads
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * mla.qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=config.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LORA_NORM_EPS, dtype, device)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=config.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LORA_NORM_EPS, dtype, device)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                   bias=False, **kw)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=config.attention_bias, **kw)
        # q_proj (or q_a_proj) and kv_a_proj_with_mqa read the same x: one GEMM once fused
        self.q_kv_a = FusedLinear()

    def _first_q(self) -> nn.Module:
        return self.q_proj if self.mla.q_lora_rank is None else self.q_a_proj

    def fuse(self) -> None:
        """q_proj (or q_a_proj) and kv_a_proj_with_mqa as one GEMM, where their biases
        agree (block-FP8 parts fuse where their blocks allow, as ``FusedLinear`` says)."""
        first, kv_a = self._first_q(), self.kv_a_proj_with_mqa
        if (first.bias is None) == (kv_a.bias is None):
            self.q_kv_a.fuse(first, kv_a)

    def project_unrotated(self, x: torch.Tensor) -> MLAProjection:
        """``x [T, hidden]`` -> the projection as the GEMMs leave it: q_pe before RoPE and
        the latent row before kv_a_layernorm and RoPE (``RawLatentFn``'s arguments)."""
        mla, num_tokens = self.mla, x.shape[0]
        if self.q_kv_a.fused:  # q (a strided view of the fused output) and kv_a in one GEMM
            q_part, kv_a = self.q_kv_a(x).split(
                [self._first_q().out_features, mla.latent_dim], dim=-1)
        else:
            q_part, kv_a = self._first_q()(x), self.kv_a_proj_with_mqa(x)
        if mla.q_lora_rank is None:
            q_lora, q = None, q_part
        else:
            q_lora = self.q_a_layernorm.fused(q_part)[0]
            q = self.q_b_proj(q_lora)
        return MLAProjection(q.view(num_tokens, self.num_heads, mla.qk_head_dim), kv_a, q_lora)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rope_latent: bool = True) -> MLAProjection:
        """``x [T, hidden]`` -> the queries, the latent rows and q_lora (None without it);
        ``rope_latent=False`` leaves the latent's RoPE part unrotated."""
        mla = self.mla
        q, kv_a, q_lora = self.project_unrotated(x)
        compressed, k_pe = kv_a.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        # q_pe and k_pe rotated in place (both are fresh GEMM outputs), one launch
        mla_rope(q[..., mla.qk_nope_head_dim:], k_pe if rope_latent else None, cos, sin,
                 mla.rope_interleave)
        # the compressed part normed in place: kv_a (a row-strided view of the GEMM output)
        # is then the latent row, with no concatenation
        self.kv_a_layernorm.fused(compressed, out=compressed)
        return MLAProjection(q, kv_a, q_lora)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: MLAAttentionFn, rope_in_attention: bool = False) -> torch.Tensor:
        if isinstance(attention, RawLatentFn):  # the callback rotates, norms and stores
            proj = self.project_unrotated(x)
            return self.output(attention(self.layer_index, proj.q, proj.latent, cos, sin))
        if rope_in_attention:  # the callback rotates the latent's key as it stores it
            proj = self.project(x, cos, sin, rope_latent=False)
            return self.output(attention(self.layer_index, proj.q, proj.latent, cos, sin))
        proj = self.project(x, cos, sin)
        return self.output(attention(self.layer_index, proj.q, proj.latent))

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The attention callback's ``o [T, H, v_head_dim]``, checked, through o_proj."""
        num_tokens, v_head_dim = o.shape[0], self.mla.v_head_dim
        expected = (num_tokens, self.num_heads, v_head_dim)
        if tuple(o.shape) != expected:
            raise ValueError(f"attention callback returned shape {tuple(o.shape)} for layer "
                             f"{self.layer_index}, expected {expected}")
        return project(self.o_proj, o.reshape(num_tokens, self.num_heads * v_head_dim))

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's K part ``[H, qk_nope, R]`` and V part ``[H, v_head_dim, R]``."""
        mla = self.mla
        # a block-FP8 kv_b_proj is dequantized once to the model dtype (dense_weight keeps it)
        w = dense_weight(self.kv_b_proj, self.kv_a_layernorm.weight.dtype).view(
            self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :]

    def decompress(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``latent [T, R+P]`` -> per-head K ``[T, H, qk_head_dim]`` and V ``[T, H, v_head_dim]``."""
        mla, num_tokens = self.mla, latent.shape[0]
        kv = self.kv_b_proj(latent[:, : mla.kv_lora_rank]).view(
            num_tokens, self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k_pe = latent[:, None, mla.kv_lora_rank :].expand(-1, self.num_heads, -1)
        return torch.cat((k_nope, k_pe), dim=-1), v

    def absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """``q [T, H, qk_head_dim]`` -> ``[T, H, R+P]``: q_nope through kv_b_proj's
        K part into the latent space, then q_pe, so ``q_abs . latent = q . k``."""
        return mla_absorb_query(q, self._kv_b()[0])

    def expand_output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Attention output in the latent space ``[T, H, R]`` -> ``[T, H, v_head_dim]``."""
        return mla_expand_output(o_latent, self._kv_b()[1])

    def expand_partials(self, parts: MLAPartials) -> torch.Tensor:
        """A split decode's stage-1 output (``paged_mla_decode_partials``), merged as it
        is expanded -> ``[T, H, v_head_dim]`` (``kernels/mla/expand_merge.py``)."""
        return mla_expand_partials(parts, self._kv_b()[1])


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.gate_proj = nn.Linear(hidden, intermediate, **kw)
        self.up_proj = nn.Linear(hidden, intermediate, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, **kw)
        self.gate_up = FusedLinear()

    def fuse(self) -> None:
        self.gate_up.fuse(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up.fused:
            return silu_mul_down(self.down_proj, self.gate_up(x))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Top-k expert choice in float32 (the gate weight and the correction bias stay float32)."""

    def __init__(self, moe: MoEConfig, hidden: int, device: torch.device | str):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden, dtype=torch.float32,
                                               device=device))
        if moe.scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(moe.num_experts, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> weights ``[T, k]`` float32 and expert ids ``[T, k]``
        (``kernels.moe.gate.router_logits``, then ``kernels.moe.moe_route``: two launches
        at decode sizes on CUDA)."""
        moe = self.moe
        logits = router_logits(x, self.weight.float())  # one launch at decode sizes on CUDA
        bias = self.e_score_correction_bias if moe.scoring == "sigmoid" else None
        return moe_route(logits, bias, moe.top_k, moe.n_group, moe.topk_group, moe.scoring,
                         bool(moe.norm_topk_prob), float(moe.routed_scaling_factor))


class MoE(nn.Module):
    """Routed experts (``kernels.moe.moe_experts``) plus the shared experts. ``fuse``
    stacks the experts' weights into ``w13 [E, 2I, H]`` (gate rows, then up rows)
    and ``w2 [E, H, I]``, the experts' parameters becoming views of them (no extra
    memory, checkpoint names unchanged); unfused, they are stacked per call."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        moe = config.moe
        self.gate = Router(moe, config.hidden_size, device)
        self.experts = nn.ModuleList(
            SwiGLU(config.hidden_size, moe.moe_intermediate_size, dtype, device)
            for _ in range(moe.num_experts))
        self.shared_experts = SwiGLU(
            config.hidden_size, moe.moe_intermediate_size * moe.num_shared_experts, dtype, device
        ) if moe.num_shared_experts else None
        self.w13: torch.Tensor | None = None  # not registered: not a checkpoint tensor
        self.w2: torch.Tensor | None = None
        self.fp8: StackedFp8Experts | None = None  # block-FP8 experts, stacked with their scales
        self.shared_dtype = dtype  # the model dtype, which dequantized experts take

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.shared_dtype
        w13 = torch.stack([torch.cat((dense_weight(e.gate_proj, dtype), dense_weight(e.up_proj, dtype)))
                           for e in self.experts])
        return w13, torch.stack([dense_weight(e.down_proj, dtype) for e in self.experts])

    def fuse(self) -> None:
        if self.shared_experts is not None:
            self.shared_experts.fuse()
        if self.w13 is not None or self.fp8 is not None:
            return
        if isinstance(self.experts[0].gate_proj, Fp8Linear):
            if StackedFp8Experts.stackable(self.experts):
                self.fp8 = StackedFp8Experts(self.experts, fuse=True)
            else:  # gate and up blocks would straddle: the bf16 path on dequantized weights
                self.w13, self.w2 = self._stacked()
            return
        with torch.no_grad():
            w13, w2 = self._stacked()
        inter = w2.shape[2]
        for i, expert in enumerate(self.experts):
            for name, view in (("gate_proj", w13[i, :inter]), ("up_proj", w13[i, inter:]),
                               ("down_proj", w2[i])):
                getattr(expert, name).weight = nn.Parameter(view, requires_grad=False)
        self.w13, self.w2 = w13, w2

    def _shared_weights(self, inter: int) -> dict[str, torch.Tensor] | None:
        """The fused shared expert as ``moe_experts_decode`` takes it, or None where it
        cannot (none, unfused, block-FP8, or a width that is no multiple of ``inter``)."""
        shared = self.shared_experts
        if shared is None or not shared.gate_up.fused or shared.gate_up.fp8 is not None or (
            shared.gate_up.bias is not None or type(shared.down_proj) is not nn.Linear
            or shared.down_proj.bias is not None or shared.down_proj.weight.shape[1] % inter
        ):
            return None
        return {"shared_w13": shared.gate_up.weight, "shared_w2": shared.down_proj.weight}

    def _fp8_shared(self) -> Fp8SharedExpert | None:
        """The block-FP8 shared expert as ``moe_experts_fp8_decode`` takes it (the stacked
        experts' block, no bias, whole slices of scale blocks), or None."""
        shared, fp8 = self.shared_experts, self.fp8
        if shared is None or fp8 is None or shared.gate_up.fp8 is None or (
            shared.gate_up.bias is not None or not isinstance(shared.down_proj, Fp8Linear)
            or shared.down_proj.bias is not None or shared.down_proj.block != fp8.block
            or shared.gate_up.fp8.block != fp8.block
            or not shared_fits(fp8.w2.shape[2], shared.down_proj.in_features, fp8.block)
        ):
            return None
        return Fp8SharedExpert(shared.gate_up.weight, shared.gate_up.weight_scale_inv,
                               shared.down_proj.weight, shared.down_proj.weight_scale_inv)

    def warm_up_decode(self) -> None:
        """Compile the experts' kernels an eager decode step may take that a CUDA-graph
        ladder did not: the sort-free decode kernels for each token bucket
        (``TOKEN_BUCKETS`` up to MOE_DECODE_MAX_TOKENS; a ladder compiles its own sizes'
        buckets only), and the grouped kernels past that at both of their tile sets (a
        batch above the ladder takes them). The kernels run on zeros, every token on the
        first experts; no collectives, so every rank may call it alone. Nothing on the CPU."""
        fp8 = self.fp8 or (StackedFp8Experts(self.experts, fuse=False)
                           if self.w13 is None and StackedFp8Experts.stackable(self.experts) else None)
        w13 = fp8.w13 if fp8 is not None else self.w13
        if w13 is None or not w13.is_cuda:
            return
        experts, inter, hidden = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
        top_k = min(self.gate.moe.top_k, experts)
        dtype = self.shared_dtype if fp8 is not None else w13.dtype
        shared = {} if fp8 is not None else self._shared_weights(inter) or {}
        # the routed-only FP8 kernels and, where experts_out fuses the shared expert in,
        # those with its slices (another compiled variant)
        fused_shared = self._fp8_shared() if fp8 is self.fp8 else None
        fp8_shared = [None] + ([fused_shared] if fused_shared is not None else [])
        like = {"device": w13.device}

        def run(tokens: int, decode: bool) -> None:
            ids = torch.arange(top_k, **like).repeat(tokens, 1)
            x, weights = torch.zeros((tokens, hidden), dtype=dtype, **like), torch.ones(ids.shape, **like)
            if fp8 is not None:
                if decode:
                    for extra in fp8_shared:
                        moe_experts_fp8_decode(x, fp8.w13, fp8.s13, fp8.w2, fp8.s2, weights, ids,
                                               fp8.block, shared=extra)
                else:
                    moe_experts_fp8(x, fp8.w13, fp8.s13, fp8.w2, fp8.s2, weights, ids, fp8.block,
                                    scale_ue8m0=fp8.scale_ue8m0)
            elif decode:
                moe_experts_decode(x, self.w13, self.w2, weights, ids, **shared)
            else:
                moe_experts(x, self.w13, self.w2, weights, ids)

        for bucket in (b for b in TOKEN_BUCKETS if b <= MOE_DECODE_MAX_TOKENS):
            run(bucket, decode=True)
        # the grouped kernels' two tile sets: below and from prefill_tile_min_pairs pairs
        first = MOE_DECODE_MAX_TOKENS + 1
        run(first, decode=False)
        run(max(first, -(-prefill_tile_min_pairs(experts) // top_k)), decode=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts_out(x, weights, ids, with_shared=self.shared_experts is not None)

    def experts_out(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    with_shared: bool) -> torch.Tensor:
        """The routed output of ``weights``, ``ids`` plus, ``with_shared``, the shared
        expert's. At decode batches the shared expert runs inside the experts' three
        launches where it can (bf16 fused experts; block-FP8 experts of its block), with
        the activations unquantized like the routed ones. A TP rank's share
        (``model.parallel.ep.ExpertShardMoE``) calls it too, rank 0 with the shared
        expert, so the ranks' sum is what one GPU computes, kernel for kernel."""
        if with_shared and self._decodes(x):
            if self.w13 is not None:  # fused bf16 experts (so a fused shared one)
                shared = self._shared_weights(self.w13.shape[1] // 2)
                if shared is not None:  # the shared expert in the same three launches
                    return moe_experts_decode(x, self.w13, self.w2, weights, ids, **shared)
            fp8_shared = self._fp8_shared()
            if fp8_shared is not None:  # block-FP8 experts, the shared one as more slices
                fp8 = self.fp8
                return moe_experts_fp8_decode(x, fp8.w13, fp8.s13, fp8.w2, fp8.s2, weights, ids,
                                              fp8.block, shared=fp8_shared)
        routed = self.routed_experts(x, weights, ids)
        return routed + self.shared_experts(x) if with_shared else routed

    def routed_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed output of the choices ``weights``, ``ids [T, k]`` over this block's
        experts: decode batches on CUDA through the sort-free kernels, larger ones through
        the grouped GEMMs; block-FP8 experts as stored. A TP rank's share of the experts
        (``model.parallel.ep.ExpertShardMoE``) runs it too, so a group computes what one GPU
        does: the FP8 decode kernels keep the activations unquantized, the grouped ones
        quantize them per token group."""
        if self.fp8 is not None or self.w13 is None and StackedFp8Experts.stackable(self.experts):
            fp8 = self.fp8 or StackedFp8Experts(self.experts, fuse=False)
            if self._decodes(x):  # each touched expert's e4m3 weights read once, no sort
                return moe_experts_fp8_decode(x, fp8.w13, fp8.s13, fp8.w2, fp8.s2, weights, ids,
                                              fp8.block)
            return moe_experts_fp8(x, fp8.w13, fp8.s13, fp8.w2, fp8.s2, weights, ids, fp8.block,
                                   scale_ue8m0=fp8.scale_ue8m0)
        w13, w2 = (self.w13, self.w2) if self.w13 is not None else self._stacked()
        if self._decodes(x):
            return moe_experts_decode(x, w13, w2, weights, ids)
        return moe_experts(x, w13, w2, weights, ids)

    @staticmethod
    def _decodes(x: torch.Tensor) -> bool:
        """A decode-sized batch on the kernels' device: the sort-free kernels."""
        return x.shape[0] <= MOE_DECODE_MAX_TOKENS and use_triton(x)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.self_attn = MLAAttention(config, layer_index, dtype, device)
        self.mlp = MoE(config, dtype, device) if config.moe.is_moe_layer(layer_index) else (
            SwiGLU(config.hidden_size, config.intermediate_size, dtype, device))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attention: MLAAttentionFn,
                rope_in_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual)``: the layer's output is their sum, which the next
        norm computes, fused with its RMSNorm; ``residual=None`` at layer 0."""
        x, residual = self.input_layernorm.fused(hidden, residual)
        hidden = self.self_attn(x, cos, sin, attention, rope_in_attention)
        x, residual = self.post_attention_layernorm.fused(hidden, residual)
        return self.mlp(x), residual


class DeepseekStack(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.embed_tokens = unset_embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, dtype, device) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class DeepseekCausalLM(nn.Module):
    """Decoder + LM head, the same interface as ``CausalLM`` but with an MLA callback."""

    # DeepSeek-V3 checkpoints carry multi-token-prediction layers past num_layers;
    # like transformers, the loader leaves them out.
    ignores_extra_layers = True

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype={dtype} is not supported (float32, float16, bfloat16)")
        if config.mla is None:
            raise ValueError(f"architecture={config.architecture!r} is not an MLA model")
        self.config = config
        self.model = DeepseekStack(config, dtype, device)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
        rope_device = "cpu" if torch.device(device).type == "meta" else device
        self.rotary = MLARotary(config, rope_device)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def mla_layer(self, layer: int) -> MLAAttention:
        return self.model.layers[layer].self_attn

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: MLAAttentionFn, rope_in_attention: bool = False) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` int64 -> hidden ``[T, hidden]`` after the final
        norm. ``rope_in_attention``: see the module doc."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids must be 1-D [T] and positions the same shape, got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(positions)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, cos, sin, attention, rope_in_attention)
        return self.model.norm.fused(hidden, residual)[0]

    def fuse_projections(self) -> None:
        """Gate/up of the dense and shared MLPs as one GEMM each, the routed experts'
        weights stacked for the grouped GEMM (``MoE.fuse``), the q and kv_a projections
        as one GEMM (``MLAAttention.fuse``); call once the weights are in place."""
        for layer in self.model.layers:
            layer.mlp.fuse()
            layer.self_attn.fuse()
            layer.self_attn._kv_b()  # a block-FP8 kv_b_proj dequantized now, not in a graph capture

    def warm_up_decode_kernels(self) -> None:
        """Compile the kernels whose launch variants follow the batch size beyond what the
        graph ladder compiled (``MoE.warm_up_decode``; the layers share their shapes)."""
        with torch.inference_mode():
            for layer in self.model.layers:
                if isinstance(layer.mlp, MoE):
                    layer.mlp.warm_up_decode()
                    return

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return dense_linear(hidden, weight).float()


def mla_causal_attention(model: DeepseekCausalLM) -> MLAAttentionFn:
    """A reference callback for one sequence: decompress the latent, causal attention."""
    scale = model.config.softmax_scale

    def attention(layer: int, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        k, v = model.mla_layer(layer).decompress(latent)
        return causal_attention(q, k, v, scale)

    return attention
