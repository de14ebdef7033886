"""What an attention kind says, and what its callers hand it.

A model's attention is a callback the caller supplies (``model/llama.py``,
``model/deepseek.py``, ``model/deepseek_v32.py``); what that callback does
differs by kind (GQA, MLA, DSA) in every place that builds one: CP prefill,
paged decode, the colocated run. An ``AttentionKind`` holds all of it, so no
caller tests which kind a model is: it asks ``kind_of(config)``
(``model/attention/__init__.py``) and calls the kind. A kind says

- its pool rows (``rows``: a ``RowLayout``; ``fits``) and its contract fields;
- whether RoPE runs in its callbacks (``rope_in_attention``, or per callback
  ``takes_rope``: MLA's FP8 callbacks rotate the latent's key as they store it;
  ``forward`` runs the model with a callback of the kind, on the CPU with
  batch-invariant linears) and whether the CP prefill may run captured pieces
  around it (``prefill_graphs``);
- its callbacks: ``cp_prefill`` (the rank's all-gather comes in as
  ``CPBatch.gather``, so model code never imports prefill code),
  ``paged_decode`` and ``colocated``;
- its warm-up: ``prefill_qk_dim`` (the prefill kernel's tiles) and
  ``warm_up_decode`` (the eager decode kernels no captured graph compiles).

The callers' state comes in as the small typed objects below; a pool is
anything with ``tensor``, ``rows``, ``page_size`` and ``num_pages``
(``decode.pool.PagePool`` is one).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
from lanekv.kernels.invariant.linear import RowInvariantLinear
from lanekv.kernels.prefill.attention import cp_prefill_attention
from lanekv.kernels.prefill.reference import AttnSegments
from lanekv.kernels.prefill.sdpa import prefill_attention_backend, sdpa_prefill_attention
from lanekv.model.attention.rows import (
    DEFAULT_INDEX_CACHE_DTYPE,
    DEFAULT_KV_CACHE_DTYPE,
    RowLayout,
)
from lanekv.model.config import ModelConfig
from lanekv.model.deepseek import DeepseekCausalLM
from lanekv.model.llama import CausalLM

# Every model class: Llama-family (Qwen3-MoE among them) and DeepSeek (V3.2 among them).
AnyCausalLM = CausalLM | DeepseekCausalLM
AttentionFn = Callable[..., torch.Tensor]


class Pool(Protocol):
    """A paged pool as attention reads it (``decode.pool.PagePool`` is one)."""

    tensor: torch.Tensor  # [num_layers, kv, num_pages * page_size, kv_heads, head_dim]
    rows: RowLayout

    @property
    def page_size(self) -> int: ...

    @property
    def num_pages(self) -> int: ...


class QuerySegment(NamedTuple):
    """One request's query rows on a rank and where its keys sit in the gathered rows."""

    q_start: int  # first row of the rank's q
    q_len: int
    q_pos: int  # absolute position of the first row
    kv_first: int  # the request's position 0 among the gathered rows
    kv_len: int  # the request's tokens (prefix and extend)


@dataclass(frozen=True)
class CPBatch:
    """What a rank's CP prefill callback needs of one batch (built by the prefill runner)."""

    pool: torch.Tensor  # the rank's owner-lane pool [L, kv, rows, kv_heads, head_dim]
    rows: RowLayout
    store_rows: torch.Tensor  # [local rows] int64: the pool row of each local row, -1: none
    block_rows: int  # rows each rank gives the all-gather: new rows, then owned prefix rows
    segments: AttnSegments  # the rank's query segments over the gathered rows (device tensors)
    query_segments: tuple[QuerySegment, ...]  # the same on the host, with request lengths
    # (layer, block [block_rows, kv, kv_heads, head_dim] with its new rows filled) ->
    # every rank's rows in request order; the caller fills the owned prefix rows first.
    gather: Callable[[int, torch.Tensor], torch.Tensor]
    on_layer: Callable[[int], None] | None = None  # called once the layer's rows are stored


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: AttnSegments,
                      softmax_scale: float, host: Sequence[QuerySegment] | None = None) -> torch.Tensor:
    """A rank's prefill attention over its gathered K/V rows: ``cp_prefill_attention`` (the
    Triton kernel), or with ``LANEKV_PREFILL_ATTENTION=cudnn`` cuDNN's kernel segment by
    segment (``kernels/prefill/sdpa.py``; on the CPU its float32 torch twin) over ``host``,
    the same segments on the host (read back from ``segments`` when not given)."""
    if prefill_attention_backend() == "cudnn":
        if host is None:
            bounds = list(zip(*(t.tolist() for t in segments), strict=True))
        else:
            bounds = [(s.q_start, s.q_len, s.q_pos, s.kv_first) for s in host]
        return sdpa_prefill_attention(q, k, v, bounds, softmax_scale)
    return cp_prefill_attention(q, k, v, segments, softmax_scale)


class DecodeStep(NamedTuple):
    """One decode step's paged reads and writes (device tensors; a CUDA graph may hold them)."""

    locs: torch.Tensor  # [B] int64 pool row of each new token (negative: padding, stored nowhere)
    page_table: torch.Tensor  # [B, pages] int32
    seq_lens: torch.Tensor  # [B] int32, the new token included


class AttentionKind(ABC):
    """One attention kind; one instance per kind lives in the registry."""

    name: ClassVar[str]  # "gqa", "mla", "dsa"
    rope_in_attention: ClassVar[bool] = False  # callbacks get q, k before RoPE and cos, sin
    prefill_graphs: ClassVar[bool] = False  # the CP prefill may replay graphs around it
    # Every query head reads the same row (MLA's latent): tensor parallelism splits the
    # query heads only and each rank holds whole rows.
    heads_share_rows: ClassVar[bool] = False

    @abstractmethod
    def matches(self, config: ModelConfig) -> bool:
        """Whether ``config`` is a model of this kind (the registry asks the kinds in order)."""

    @abstractmethod
    def model_class(self, config: ModelConfig) -> type[AnyCausalLM]:
        """The model class that runs ``config``."""

    # ---- pool rows and the contract ----

    @abstractmethod
    def rows(self, config: ModelConfig, dtype: torch.dtype, *,
             index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE,
             kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE) -> RowLayout:
        """The pool's row layout for ``config`` in ``dtype`` (``kv_cache_dtype``: ``auto``,
        the rows in ``dtype``, or ``fp8_e4m3``)."""

    @abstractmethod
    def fits(self, config: ModelConfig, rows: RowLayout) -> bool:
        """Whether ``config`` is of this kind and a pool of ``rows`` can hold its KV."""

    def contract_fields(self, config: ModelConfig, rows: RowLayout) -> dict[str, Any]:
        """``config.contract_fields()`` with the kind's own fields (``Agreement.from_model``)."""
        return config.contract_fields(kv_fields(rows))

    # ---- running the model with a callback of this kind ----

    def forward(self, model: AnyCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: AttentionFn) -> torch.Tensor:
        """``model``'s final hidden rows with ``attention``, built by this kind. On the CPU the
        linears are batch-invariant (``RowInvariantLinear``): a row's bits do not depend on
        the rows beside it, so a CP rank's rows equal the single-process run's."""
        with _linears_for(input_ids):
            if self.takes_rope(attention):
                return model(input_ids, positions, attention, rope_in_attention=True)
            return model(input_ids, positions, attention)

    def takes_rope(self, attention: AttentionFn) -> bool:
        """Whether ``attention`` gets q and k (or the latent) before RoPE, and cos/sin."""
        return self.rope_in_attention

    @abstractmethod
    def cp_prefill(self, model: AnyCausalLM, batch: CPBatch) -> AttentionFn:
        """A rank's callback: store its own rows, gather every rank's, attend its queries."""

    @abstractmethod
    def paged_decode(self, model: AnyCausalLM, pool: Pool, step: DecodeStep) -> AttentionFn:
        """A decode step's callback: store the new row at ``step.locs``, attend through pages.
        Only device ops whose shapes depend on the batch: a CUDA graph captures it."""

    @abstractmethod
    def colocated(self, model: AnyCausalLM, pool: Pool, locs: torch.Tensor) -> AttentionFn:
        """One whole prompt's callback: plain causal attention, rows stored at ``locs``."""

    # ---- warm-up ----

    def prefill_qk_dim(self, config: ModelConfig) -> int:
        """The q/k head dim the CP prefill attention kernel sees (its tiles depend on it)."""
        return config.head_dim

    @abstractmethod
    def warm_up_decode(self, config: ModelConfig, pool: Pool) -> None:
        """Run (so compile, on CUDA) the eager decode attention at every launch shape a
        step can pick, reading nothing and writing only its own output."""

    def __repr__(self) -> str:
        return f"<attention kind {self.name}>"


def kv_fields(rows: RowLayout) -> dict[str, Any]:
    """The contract fields of the rows' KV dtype and format (``Agreement.kv_cache_dtype``
    and ``kv_row_format``)."""
    return {"kv_cache_dtype": rows.kv_cache_dtype, "kv_row_format": rows.row_format,
            "head_dim": rows.head_dim}  # pool elements per head: bytes for FP8 rows


def table_width(pool: Pool, max_positions: int) -> int:
    """Pages of the widest page table a request of ``max_positions`` tokens needs."""
    return max(1, min(pool.num_pages, -(-max_positions // pool.page_size)))


def _linears_for(input_ids: torch.Tensor) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if input_ids.is_cuda else RowInvariantLinear()
