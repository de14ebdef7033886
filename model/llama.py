"""The Llama-family decoder shared by prefill and decode.

One flat batch of tokens goes in (``[T]`` ids and their absolute positions,
several requests concatenated); attention is a callback the caller supplies,
so context parallelism, KV caches and page tables all stay outside the model:

    attention(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> o [T, Hq, D]

RoPE is already applied to ``q`` and ``k`` when the callback runs. The ops and
their order follow ``transformers`` (RMSNorm in float32, cos/sin computed in
float32 and cast to the model dtype, SwiGLU as ``down(silu(gate) * up)``) so that
float32 logits agree with it to float32 rounding. Module and parameter names
mirror the Hugging Face checkpoint keys, so a checkpoint's tensors load by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from lanekv.kernels.fp8.gemm import fp8_linear
from lanekv.kernels.fp8.gemm_gemv import dense_linear
from lanekv.kernels.invariant.attention import blocked_attention
from lanekv.kernels.rmsnorm import add_rmsnorm
from lanekv.kernels.rope_store import apply_rotary, rotate_half  # noqa: F401 (the model's RoPE ops)
from lanekv.model.config import ModelConfig
from lanekv.model.quant.linear import Fp8Linear, fuse_fp8_linears
from torch import nn

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# With ``rope_in_attention=True`` the callback also gets cos/sin [T, D] and
# applies RoPE itself (so it can fuse it with the K/V store):
#     attention(layer, q, k, v, cos, sin) -> o [T, Hq, D]
RopeAttentionFn = Callable[..., torch.Tensor]
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics whatever the model dtype, cast back before the
        # weight multiply: the order transformers uses.
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None, *,
              out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)`` for ``[T, N]`` rows, the add fused
        into the norm (``kernels.rmsnorm``; the same ops as ``forward`` on the CPU);
        ``out`` takes the normed rows (it may be ``x``: in place)."""
        return add_rmsnorm(x, residual, self.weight, self.eps, out=out)


def unset_embedding(vocab_size: int, hidden_size: int, dtype: torch.dtype,
                    device: torch.device | str) -> nn.Embedding:
    """An ``nn.Embedding`` whose weight is left unset (the loader assigns the checkpoint's;
    ``load_dummy_model`` draws its own). ``nn.Embedding``'s ``normal_`` initialisation, on
    the meta device every loader builds on, imports ``torch._dynamo``: seconds of CPU in
    each daemon and rank process for values thrown away."""
    weight = torch.empty(vocab_size, hidden_size, dtype=dtype, device=device)
    return nn.Embedding(vocab_size, hidden_size, _weight=weight)


def rope_inv_freq(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, llama3 scaling included,
    computed with the same float32 ops as transformers."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling_dict
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band in
    # between interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str):
        super().__init__()
        # Not persistent (not a checkpoint tensor) and kept float32: build the
        # model in its dtype rather than calling .to(dtype), which would round it.
        self.register_buffer("inv_freq", rope_inv_freq(config, device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, head_dim]`` in ``dtype`` for int64 ``positions [T]``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


class FusedLinear(nn.Module):
    """Several ``nn.Linear`` of one input as one GEMM: their weights (and biases)
    concatenated along the output dim; the originals' parameters are re-pointed
    at slices of the fused tensor, so loading, ``state_dict`` and memory are as
    before. Not a checkpoint tensor (nothing registered here). Block-FP8 parts
    fuse into an e4m3 weight with its scales (``weight_scale_inv``) when every
    part but the last spans whole blocks; otherwise they stay unfused."""

    def __init__(self) -> None:
        super().__init__()
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.weight_scale_inv: torch.Tensor | None = None  # block-FP8 parts only
        self.fp8: Fp8Linear | None = None  # the first part: its block and scale format

    @property
    def fused(self) -> bool:
        return self.weight is not None

    def fuse(self, *parts: nn.Linear) -> None:
        if self.fused:
            return
        if isinstance(parts[0], Fp8Linear):
            fused = fuse_fp8_linears(parts)
            if fused is not None:
                self.weight, self.weight_scale_inv, self.bias = fused
                self.__dict__["fp8"] = parts[0]  # not registered: its tensors are views of these
            return
        with torch.no_grad():
            weight = torch.cat([p.weight for p in parts])
            has_bias = [p.bias is not None for p in parts]
            if any(has_bias) and not all(has_bias):
                raise ValueError("fused projections must all have a bias or none")
            bias = torch.cat([p.bias for p in parts]) if all(has_bias) else None
        offset = 0
        for part in parts:
            rows = part.weight.shape[0]
            part.weight = nn.Parameter(weight[offset:offset + rows], requires_grad=False)
            if bias is not None:
                part.bias = nn.Parameter(bias[offset:offset + rows], requires_grad=False)
            offset += rows
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is not None:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.fp8.block, self.bias,
                              scale_ue8m0=self.fp8.quant.scale_ue8m0)
        return dense_linear(x, self.weight, self.bias)


def _plain(linear: nn.Module) -> bool:
    """A plain ``nn.Linear`` without hooks (tensor parallelism's all-reduce is one:
    ``model.parallel.tp``), which ``dense_linear`` may run in place of its forward."""
    return type(linear) is nn.Linear and not (linear._forward_hooks or linear._forward_pre_hooks)


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)``; a plain one through ``dense_linear`` (the GEMV where its shape is in
    the device's table at decode's row count)."""
    if _plain(linear):
        return dense_linear(x, linear.weight, linear.bias)
    return linear(x)


def silu_mul_down(down_proj: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """``down_proj(silu(gate) * up)`` for ``gate_up [T, 2I]``; a block-FP8 down
    projection computes the product itself (quantized in one pass for a w8a8 GEMM, in
    the GEMM's activation load for a w8a16 or gemv one: ``silu_mul_fp8_linear``), and so
    does a plain one where ``dense_linear`` runs the GEMV."""
    if isinstance(down_proj, Fp8Linear):
        return down_proj.silu_mul(gate_up)
    if _plain(down_proj):
        return dense_linear(gate_up, down_proj.weight, down_proj.bias, silu=True)
    gate, up = gate_up.chunk(2, dim=-1)
    return down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        bias = config.attention_bias
        kw = {"dtype": dtype, "device": device}
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias, **kw)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias, **kw)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias, **kw)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias, **kw)
        if config.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.qk_norm = config.qk_norm
        self.qkv = FusedLinear()
        self._sizes = [q_size, kv_size, kv_size]

    def fuse(self) -> None:
        self.qkv.fuse(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``, before RoPE."""
        num_tokens = x.shape[0]
        if self.qkv.fused:
            q, k, v = self.qkv(x).split(self._sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # per head: rows of head_dim
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, attention: AttentionFn | RopeAttentionFn,
               rope_in_attention: bool = False) -> torch.Tensor:
        """The callback's ``o [T, Hq, D]`` for ``project``'s q, k, v."""
        if rope_in_attention:
            o = attention(self.layer_index, q, k, v, cos, sin)
        else:
            o = attention(self.layer_index, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin),
                          v)  # [T, Hq, D]
        if o.shape != q.shape:
            raise ValueError(
                f"attention callback returned shape {tuple(o.shape)} for layer "
                f"{self.layer_index}, expected {tuple(q.shape)}"
            )
        return o

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """``o [T, Hq, D]`` -> ``[T, hidden]``."""
        return project(self.o_proj, o.reshape(o.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, **kw)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, **kw)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, **kw)
        self.gate_up = FusedLinear()

    def fuse(self) -> None:
        self.gate_up.fuse(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up.fused:
            return silu_mul_down(self.down_proj, self.gate_up(x))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.self_attn = Attention(config, layer_index, dtype, device)
        self.mlp = MLP(config, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attention: AttentionFn | RopeAttentionFn,
                rope_in_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual)``: the layer's output is their sum, which the
        next norm computes (fused with its RMSNorm); ``residual=None`` at layer 0."""
        q, k, v, residual = self.attention_inputs(hidden, residual)
        o = self.self_attn.attend(q, k, v, cos, sin, attention, rope_in_attention)
        return self.after_attention(o, residual)

    # The layer in two halves around its attention (``prefill.cp.graphs`` captures
    # what lies between two layers' attention as one CUDA graph).
    def attention_inputs(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v, residual)``: the input norm (the add fused) and the projections."""
        x, residual = self.input_layernorm.fused(hidden, residual)
        return (*self.self_attn.project(x), residual)

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual)`` from the attention's ``o [T, Hq, D]``."""
        x, residual = self.post_attention_layernorm.fused(self.self_attn.output(o), residual)
        return self.mlp(x), residual


class DecoderStack(nn.Module):
    """The checkpoint's ``model.*`` tensors: embedding, layers, final norm."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.embed_tokens = unset_embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class CausalLM(nn.Module):
    """Decoder + LM head. Build it in its final dtype (``device="meta"`` builds
    the parameters without memory; the loader assigns real tensors)."""

    ignores_extra_layers = False  # a checkpoint's layers past num_layers are refused

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype={dtype} is not supported (float32, float16, bfloat16)")
        self.config = config
        self.model = DecoderStack(config, dtype, device)
        # Tied models have no lm_head tensor: compute_logits reads the embedding.
        self.lm_head = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype,
                           device=device)
        )
        # The frequencies are computed, never loaded, so a meta build still
        # gets real ones (on the CPU; .to(device) moves them with the weights).
        rope_device = "cpu" if torch.device(device).type == "meta" else device
        self.rotary = RotaryEmbedding(config, rope_device)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]``."""
        return self.model.embed_tokens(input_ids)

    def fuse_projections(self) -> None:
        """Concatenate each layer's q/k/v and gate/up weights into one GEMM each
        (the separate parameters become views of the fused tensors: no extra
        memory, checkpoint names unchanged). Call once the weights are in place."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: AttentionFn | RopeAttentionFn, *,
                rope_in_attention: bool = False) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` int64 -> hidden ``[T, hidden]``
        after the final norm. ``rope_in_attention``: the callback gets q and k
        before RoPE and cos/sin with them (see ``RopeAttentionFn``)."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D [T], got shape {tuple(input_ids.shape)}")
        if positions.shape != input_ids.shape:
            raise ValueError(
                f"positions shape {tuple(positions.shape)} != input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(positions, hidden.dtype)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, cos, sin, attention, rope_in_attention)
        return self.model.norm.fused(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 ``[n, vocab]``."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return dense_linear(hidden, weight).float()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     softmax_scale: float) -> torch.Tensor:
    """Reference attention for one sequence, in plain torch.

    ``q [Tq, Hq, D]``, ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]`` (MLA: ``Dv != D``)
    with ``Tk >= Tq``: the queries
    are the last ``Tq`` positions, query ``i`` sees keys ``[0, Tk - Tq + i]``.
    Query head ``h`` reads KV head ``h // (Hq // Hkv)``. In float32 on the CPU it
    is ``blocked_attention`` (each query's bits independent of the batch, as the CP
    reference computes them: ``kernels/invariant``); otherwise transformers' eager
    op order (softmax in float32, cast back), which the half-precision oracle tests
    track.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"expected q [Tq, Hq, D], k [Tk, Hkv, D] and v [Tk, Hkv, Dv]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    (q_len, num_heads, head_dim), (kv_len, num_kv_heads, _) = q.shape, k.shape
    if k.shape[2] != head_dim or num_heads % num_kv_heads != 0 or kv_len < q_len:
        raise ValueError(
            f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)} "
            "(need equal head_dim, Hq a multiple of Hkv, Tk >= Tq)"
        )
    if not q.is_cuda and q.dtype == torch.float32:
        positions = torch.arange(q_len, device=q.device) + (kv_len - q_len)
        return blocked_attention(q, k, v, positions, softmax_scale)[0]
    group = num_heads // num_kv_heads
    qh = q.transpose(0, 1)  # [Hq, Tq, D]
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * softmax_scale  # [Hq, Tq, Tk]
    q_pos = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
    hidden_keys = torch.arange(kv_len, device=q.device)[None, :] > q_pos
    scores = scores.masked_fill(hidden_keys, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1).contiguous()
