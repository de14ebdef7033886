"""Piecewise CUDA graphs of a rank's prefill: what lies between two attentions, one graph per row count.

A 1k-token prefill of 8B shapes queues about 386 kernels, 12 per layer, and on
a slow core the host queues them slower than the GPU runs them (BENCHMARKS.md,
session 12): the prefill's time then follows the core it ran on, so identical
requests differ by up to 2x. The attention and the K/V store depend on the
batch's segments, its pages and (across ranks) the all-gather, so they stay
eager; everything else of a layer is a graph replayed per layer, and a layer
costs the host one replay plus the attention's launches.

The pieces, for a model of ``L`` layers (``model.llama.DecoderLayer``'s two halves):

- ``0``: the embedding, cos/sin, layer 0's input norm and its q/k/v projections;
- ``l`` for ``1 <= l < L``: layer ``l - 1``'s ``after_attention`` (o_proj,
  the post-attention norm, the MLP), then layer ``l``'s ``attention_inputs``;
- ``L``: layer ``L - 1``'s ``after_attention`` and the final norm.

They read and write static buffers sized for the largest captured row count
(ids, positions, cos, sin, q, k, v, residual, the attention's output, the final
hidden rows). A prefill of ``T`` rows replays the pieces of the smallest
captured count ``S >= T``; the eager attention between them sees only the
first ``T`` rows, and its output is copied into the static one. Rows ``T..S``
are padding with whatever an earlier prefill left there: every op of a piece
works row by row (the embedding, RMSNorm, the GEMMs, SiLU), so they never reach
a real row, and the attention never sees them, so they write no page.

Only the Llama family's dense models take graphs (``CausalLM`` whose every MLP
is ``model.llama.MLP``: Llama, Qwen2, Qwen3). A mixture of experts sizes its
expert groups on the host, and MLA/DSA attention is another callback: those,
and a prefill of more rows than the largest size, run the model eagerly. On
the CPU ``capture`` captures nothing and ``forward`` runs the same pieces
eagerly through the same buffers (the tests check that path against the
model's own forward).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
from lanekv.model.attention import kind_of
from lanekv.model.llama import MLP, CausalLM, RopeAttentionFn
from lanekv.runtime.gcpause import paused

log = logging.getLogger("lanekv.prefill")
# Row counts captured: every FINE_STEP rows up to FINE_ROWS, then every COARSE_STEP
# (both rounded up to whole pages); the GEMMs tile rows by 128 or more above that.
FINE_STEP = 64
FINE_ROWS = 512
COARSE_STEP = 128


class GraphCapture(NamedTuple):
    """What a rank captured (``CaptureGraphs``' answer)."""

    sizes: int  # row counts captured
    graphs: int  # graphs in all: sizes x (layers + 1)
    max_rows: int  # the largest row count captured (0: none)
    seconds: float
    memory_bytes: int  # the graphs' private pool and the static buffers


def graph_sizes(page_size: int, max_rows: int) -> tuple[int, ...]:
    """The row counts to capture up to ``max_rows``: whole pages, FINE_STEP apart up
    to FINE_ROWS and COARSE_STEP apart above (the last one covers ``max_rows``)."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
        raise ValueError(f"graph max rows must be an int >= 0, got max_rows={max_rows!r}")
    pages = lambda rows: -(-rows // page_size) * page_size  # noqa: E731
    fine, coarse = pages(FINE_STEP), pages(COARSE_STEP)
    sizes = list(range(fine, min(FINE_ROWS, max_rows) + fine, fine)) if max_rows else []
    while sizes and sizes[-1] < max_rows:
        sizes.append(sizes[-1] + coarse)
    return tuple(sizes)


def takes_graphs(model: torch.nn.Module) -> bool:
    """Whether ``model`` is one ``PrefillGraphs`` can capture (see the module doc)."""
    cfg = getattr(model, "config", None)
    return (cfg is not None and kind_of(cfg).prefill_graphs
            and all(type(layer.mlp) is MLP for layer in model.model.layers))


class PrefillGraphs:
    """One rank's captured pieces over static buffers; ``capture`` once, then ``forward``."""

    def __init__(self, model: CausalLM, sizes: Sequence[int]) -> None:
        if not takes_graphs(model):
            raise ValueError(f"prefill graphs take a dense Llama-family model, got "
                             f"architecture={model.config.architecture!r}")
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
            raise ValueError(f"graph row counts must be positive ints, got sizes={list(sizes)!r}")
        self.model = model
        self.layers = model.model.layers
        self.sizes = tuple(sorted(set(sizes)))
        cfg, weight = model.config, model.model.embed_tokens.weight
        self.device = weight.device
        n, like = self.sizes[-1], {"dtype": weight.dtype, "device": weight.device}
        self.ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.cos = torch.zeros(n, cfg.head_dim, **like)
        self.sin = torch.zeros(n, cfg.head_dim, **like)
        self.q = torch.zeros(n, cfg.num_heads, cfg.head_dim, **like)
        self.k = torch.zeros(n, cfg.num_kv_heads, cfg.head_dim, **like)
        self.v = torch.zeros(n, cfg.num_kv_heads, cfg.head_dim, **like)
        self.o = torch.zeros(n, cfg.num_heads, cfg.head_dim, **like)
        self.residual = torch.zeros(n, cfg.hidden_size, **like)
        self.hidden = torch.zeros(n, cfg.hidden_size, **like)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def size_for(self, rows: int) -> int | None:
        """The captured row count a prefill of ``rows`` rows runs at (None: eager)."""
        i = bisect.bisect_left(self.sizes, rows)
        return self.sizes[i] if rows > 0 and i < len(self.sizes) else None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: RopeAttentionFn) -> torch.Tensor:
        """What ``CausalLM.forward(input_ids, positions, attention, rope_in_attention=True)``
        gives, ``[T, hidden]``: a view of a static buffer, valid until the next call."""
        rows = input_ids.numel()
        size = self.size_for(rows)
        if size is None or positions.shape != input_ids.shape:
            raise ValueError(f"prefill graphs take 1-D ids and positions of 1..{self.sizes[-1]} rows, "
                             f"got ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)}")
        self.ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        graphs = self._graphs.get(size)
        for piece in range(len(self.layers) + 1):
            if piece:
                o = self.layers[piece - 1].self_attn.attend(
                    self.q[:rows], self.k[:rows], self.v[:rows], self.cos[:rows], self.sin[:rows],
                    attention, rope_in_attention=True)
                self.o[:rows].copy_(o)
            if graphs is None:  # the CPU, or a size not captured: the same piece, eager
                self._piece(piece, size)
            else:
                graphs[piece].replay()
        return self.hidden[:rows]

    def _piece(self, piece: int, size: int) -> None:
        """Run piece ``piece`` at ``size`` rows (see the module doc), buffers in and out."""
        if piece == 0:
            x = self.model.embed(self.ids[:size])
            cos, sin = self.model.rotary(self.positions[:size], x.dtype)
            self.cos[:size].copy_(cos)
            self.sin[:size].copy_(sin)
            self._keep(size, *self.layers[0].attention_inputs(x, None))
            return
        hidden, residual = self.layers[piece - 1].after_attention(self.o[:size], self.residual[:size])
        if piece < len(self.layers):
            self._keep(size, *self.layers[piece].attention_inputs(hidden, residual))
        else:
            self.hidden[:size].copy_(self.model.model.norm.fused(hidden, residual)[0])

    def _keep(self, size: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              residual: torch.Tensor) -> None:
        self.q[:size].copy_(q)
        self.k[:size].copy_(k)
        self.v[:size].copy_(v)
        self.residual[:size].copy_(residual)

    def capture(self) -> GraphCapture:
        """Capture every size's pieces, largest first, into one private memory pool
        (a piece's temporaries are dead once it ends, so later captures reuse them).
        Each size runs once eagerly first (compiles, cuBLAS's choice). On the CPU: nothing."""
        start = time.perf_counter()
        if self.device.type != "cuda":
            return GraphCapture(0, 0, 0, 0.0, 0)
        device = self.device
        buffers = sum(t.numel() * t.element_size() for t in (
            self.ids, self.positions, self.cos, self.sin, self.q, self.k, self.v, self.o,
            self.residual, self.hidden))
        with paused():  # no garbage collection while capturing
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(device)
            self._capture_all(device)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the eager runs' blocks go; the graphs' private pool stays
        done = GraphCapture(len(self.sizes), len(self.sizes) * (len(self.layers) + 1), self.sizes[-1],
                            time.perf_counter() - start,
                            torch.cuda.memory_reserved(device) - before + buffers)
        log.info("prefill: captured %d CUDA graphs (%d row counts up to %d rows) in %.2f s; they and "
                 "their buffers take %.1f MiB", done.graphs, done.sizes, done.max_rows, done.seconds,
                 done.memory_bytes / 2**20)
        return done

    def _capture_all(self, device: torch.device) -> None:
        # CUDAGraph.capture_begin/end, not torch.cuda.graph: that one syncs, collects
        # and empties the cache around each capture, seconds over a thousand pieces.
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        with torch.inference_mode(), torch.cuda.device(device):
            for size in reversed(self.sizes):
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for piece in range(len(self.layers) + 1):
                        self._piece(piece, size)
                    graphs = []
                    for piece in range(len(self.layers) + 1):
                        graph = torch.cuda.CUDAGraph()
                        graph.capture_begin(pool=mempool, capture_error_mode="thread_local")
                        try:
                            self._piece(piece, size)
                        finally:
                            graph.capture_end()
                        graphs.append(graph)
                torch.cuda.current_stream(device).wait_stream(stream)
                self._graphs[size] = graphs


def capture_graphs(model: torch.nn.Module, page_size: int, max_rows: int,
                   ) -> tuple[PrefillGraphs | None, GraphCapture]:
    """A rank's prefill pieces captured for up to ``max_rows`` rows on CUDA, and what
    that took; None on the CPU or for a model that takes none. Out of device memory,
    None too (logged): the rank runs eager, as it did before graphs."""
    sizes = graph_sizes(page_size, max_rows)
    device = next(model.parameters()).device
    if device.type != "cuda" or not sizes or not takes_graphs(model):
        return None, GraphCapture(0, 0, 0, 0.0, 0)
    graphs = PrefillGraphs(model, sizes)
    try:
        return graphs, graphs.capture()
    except torch.OutOfMemoryError:
        log.warning("prefill on %s: out of device memory capturing graphs up to %d rows; its "
                    "prefills run eager", device, max_rows)
        del graphs
        torch.cuda.empty_cache()
        return None, GraphCapture(0, 0, 0, 0.0, 0)
