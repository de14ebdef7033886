"""CUDA-graph decode steps: the whole step captured once per batch size of a ladder.

A captured step runs embedding, every layer (``decode.cuda.step``: for the Llama
family fused QKV GEMM, RoPE fused with the K/V store, paged decode attention,
fused gate/up GEMM; for DeepSeek MLA the latent store, the absorbed query, paged
MLA decode attention and the MoE's grouped expert GEMMs, routed on the device;
for DeepSeek-V3.2 the index-K store, the paged index scores over the table's
whole width, the top-k and sparse MLA decode; residual adds fused into RMSNorm), the final norm, the logits and their
argmax, from static buffers:

- ``ids``, ``positions``, ``locs`` ``[max_size]`` int64 and ``seq_lens``
  ``[max_size]`` int32, and a page table ``[max_size, max_pages]`` int32 wide
  enough for the longest context the pool can hold;
- a step of ``n`` requests replays the smallest captured size ``>= n``; the
  rows past ``n`` are padding: loc -1 (the store writes nothing for them, so
  no page of any request is touched) and seq_len 0 (attention reads nothing);
- the paged decode kernel's grid is fixed per captured size; it reads the real
  lengths from ``seq_lens`` and cuts each request's keys into its splits.

The host fills pinned staging buffers (two sides, so the next step can be
staged while the copy from the other side may still wait behind the step in
flight) and sends each dtype with one copy: a replay costs two copies and one
launch; the caller reads back the sampled ids, the step's only sync. Batches above the ladder (or wider page
tables) run eager.

Each size is captured twice: the greedy step (argmax only), replayed when
every request is plain greedy, and the full step, which also runs
``model.sampling.sample_step`` over the sampler's per-slot device state: the
logits processors, the draw from a staged uniform number per row, the raw
logprobs and the update of the output token counts, all on the device. Its
per-row inputs (each row's slot, padding rows the scratch slot, and uniform
number) are staged with the rest. The full step also applies a token bitmask
(structured output) from a static ``[max_size, ceil(vocab / 32)]`` int32 buffer:
when a step has rows with a grammar, ``replay`` has their matchers fill a
pinned host copy (every other row all ones) and copies it in before the
replay; otherwise the buffer holds all ones (set once after a masked step). The engine builds these on CUDA only; on a CPU pool (tests)
``replay`` runs the same static-buffer step eagerly instead of a graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from lanekv.decode.cuda.step import step_hidden
from lanekv.decode.pool import PagePool, PageTable
from lanekv.kernels import pdl
from lanekv.model.attention import AnyCausalLM
from lanekv.model.grammar import RequestGrammar, bitmask_words, fill_bitmasks
from lanekv.model.sampling import SamplerState, StepResult, sample_step
from lanekv.runtime.gcpause import paused

log = logging.getLogger("lanekv.decode")


def default_ladder(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8 to 64, then steps of 16, up to ``max_batch_size``."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, max(max_batch_size, 64) + 1, 16)]
    return tuple(s for s in sizes if s <= max_batch_size) or (max_batch_size,)


def check_ladder(sizes: Sequence[int], max_batch_size: int) -> tuple[int, ...]:
    """The sizes sorted, or ValueError naming the bad one."""
    out = []
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= max_batch_size:
            raise ValueError(f"graph batch size {size!r} must be an int in [1, {max_batch_size}]")
        out.append(size)
    if len(set(out)) != len(out):
        raise ValueError(f"graph batch sizes repeat a size: {list(sizes)}")
    return tuple(sorted(out))


class StepOutput(NamedTuple):
    logits: torch.Tensor  # [n, vocab] float32, valid until the next replay
    greedy: torch.Tensor  # [n] int64: the argmax of the logits, or the full step's tokens
    sampled: StepResult | None = None  # the full step's tokens and logprobs


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    greedy: torch.Tensor
    sampled: StepResult | None = None


class DecodeGraphs:
    """Captured decode steps over one pool; ``capture`` once, then ``replay`` per step."""

    def __init__(self, model: AnyCausalLM, pool: PagePool,
                 sizes: Sequence[int], sampler: SamplerState | None = None) -> None:
        if not sizes:
            raise ValueError("graph batch sizes must name at least one size")
        self.model, self.pool, self.sampler = model, pool, sampler
        self.sizes = tuple(sorted(sizes))
        self.cuda = pool.device.type == "cuda"
        self.max_size = self.sizes[-1]
        max_positions = model.config.max_position_embeddings
        self.max_pages = max(1, min(pool.num_pages, -(-max_positions // pool.page_size)))
        device, n = pool.device, self.max_size
        # Two staging sides: the host fills one for the next step while the copy
        # from the other may still be queued behind the step in flight.
        # int64 rows: ids, positions, locs, sampler slots; float32: uniform numbers
        self._host64 = [torch.empty((4, n), dtype=torch.int64) for _ in range(2)]
        self._host32 = [torch.empty(n * (1 + self.max_pages), dtype=torch.int32) for _ in range(2)]
        self._hostf = [torch.zeros(n, dtype=torch.float32) for _ in range(2)]
        if self.cuda:
            self._host64 = [t.pin_memory() for t in self._host64]
            self._host32 = [t.pin_memory() for t in self._host32]
            self._hostf = [t.pin_memory() for t in self._hostf]
        # numpy views of the pinned buffers: filling them from lists costs no torch op
        self._host64_np = [t.numpy() for t in self._host64]
        self._host32_np = [t.numpy() for t in self._host32]
        self._hostf_np = [t.numpy() for t in self._hostf]
        # Where a step's greedy ids come back to the host (one per step in flight).
        self._host_ids = [torch.empty(n, dtype=torch.int64) for _ in range(2)]
        self._ids_read = [None, None]  # per side: the event after the copy to the host
        if self.cuda:
            self._host_ids = [t.pin_memory() for t in self._host_ids]
            self._ids_read = [torch.cuda.Event() for _ in range(2)]
        self._dev64 = torch.zeros((4, n), dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(n * (1 + self.max_pages), dtype=torch.int32, device=device)
        self._devf = torch.zeros(n, dtype=torch.float32, device=device)
        self.ids, self.positions, self.locs, self.slots = self._dev64
        self.uniform = self._devf
        self.seq_lens = self._dev32[:n]
        # The full step's token bitmask (all ones: every token allowed), and its host side.
        words = bitmask_words(model.config.vocab_size)
        self.bitmask = torch.full((n, words), -1, dtype=torch.int32, device=device)
        self._hostmask = [torch.full((n, words), -1, dtype=torch.int32) for _ in range(2)]
        if self.cuda:
            self._hostmask = [t.pin_memory() for t in self._hostmask]
        self._masked = False  # the device bitmask holds a step's masks (not all ones)
        self.page_table = self._dev32[n:].view(n, self.max_pages)
        self._graphs: dict[int, _Captured | None] = {}
        self._full: dict[int, _Captured | None] = {}  # the full steps (with a sampler)
        self.memory_bytes = 0

    def size_for(self, batch: int, width: int) -> int | None:
        """The captured size a batch of ``batch`` requests with ``width`` pages runs at."""
        if width > self.max_pages or not self._graphs:
            return None
        for size in self.sizes:
            if size >= batch:
                return size
        return None

    def _forward(self, n: int, full: bool = False) -> _Captured:
        hidden = step_hidden(self.model, self.pool, self.ids[:n], self.positions[:n],
                             self.locs[:n], self.page_table[:n], self.seq_lens[:n])
        logits = self.model.compute_logits(hidden)
        if not full:
            return _Captured(None, logits, logits.argmax(dim=-1))
        sampled = sample_step(logits, self.sampler, self.slots[:n], self.uniform[:n], self.bitmask[:n])
        return _Captured(None, logits, sampled.tokens, sampled)

    def _pad_all(self) -> None:
        """Every row padding: ids/positions 0, loc -1, seq_len 0 (writes and reads
        nothing), the sampler's scratch slot."""
        self._dev64.zero_()
        self.locs.fill_(-1)
        if self.sampler is not None:
            self.slots.fill_(self.sampler.scratch)
        self._dev32.zero_()
        self._devf.zero_()

    def capture(self) -> None:
        """Capture every size, largest first (smaller ones reuse its memory pool).
        Each size runs once eagerly first (kernel compilation, lazy init); where the
        graph launches with PDL (``kernels.pdl.decode_graph``) and an eager step would
        not, once in each mode, so an eager step of a small batch compiles nothing."""
        if not self.cuda:
            self._graphs = dict.fromkeys(self.sizes)
            if self.sampler is not None:
                self._full = dict.fromkeys(self.sizes)
            return
        device = self.pool.device
        with paused():  # no garbage collection while capturing
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # so that the figure below counts only what the graphs keep
            before = torch.cuda.memory_reserved(device)
            self._capture_all(device, torch.cuda.graph_pool_handle(), torch.cuda.Stream(device))
            warm = getattr(self.model, "warm_up_decode_kernels", None)
            if warm is not None:  # variants an eager step above the ladder may take (DeepSeek's MoE)
                warm()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the eager runs' blocks go; the graphs' private pool stays
        self.memory_bytes = torch.cuda.memory_reserved(device) - before
        log.info("decode: captured CUDA graphs for batch sizes %s (pages per request up to %d); "
                 "graphs and their buffers take %.1f MiB", list(self.sizes), self.max_pages,
                 self.memory_bytes / 2**20)

    def _capture_all(self, device: torch.device, mempool, stream: torch.cuda.Stream) -> None:
        with torch.inference_mode(), torch.cuda.device(device):
            self._pad_all()
            for full in (False, True) if self.sampler is not None else (False,):
                for n in reversed(self.sizes):
                    with pdl.decode_graph(n):
                        graph_pdl = pdl.requested()
                    stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(stream):
                        self._forward(n, full)  # eager first: what an eager step launches
                        if graph_pdl != pdl.requested():  # the graph's PDL variants too
                            with pdl.decode_graph(n):
                                self._forward(n, full)
                    torch.cuda.current_stream(device).wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with pdl.decode_graph(n), torch.cuda.graph(graph, pool=mempool, stream=stream):
                        out = self._forward(n, full)  # captured in the launch mode it replays
                    (self._full if full else self._graphs)[n] = out._replace(graph=graph)
            if self.sampler is not None:
                # The eager runs and the captures counted tokens in the scratch slot only.
                self._pad_all()

    def stage(self, side: int, tables: Sequence[PageTable], positions: Sequence[int],
              locs: Sequence[int], seq_lens: Sequence[int], slots: Sequence[int] | None = None,
              uniform: Sequence[float] | None = None) -> None:
        """Fill staging ``side`` (0 or 1) for a step of ``len(tables)`` requests:
        everything but the input ids, which ``replay`` writes last. ``slots`` and
        ``uniform``: each request's sampler slot and uniform number (a full step)."""
        n = len(tables)
        h64, h32, hf = self._host64_np[side], self._host32_np[side], self._hostf_np[side]
        h64[1, :n] = positions
        h64[2, :n] = locs
        h64[:2, n:] = 0
        h64[2, n:] = -1  # padding rows: stored nowhere
        scratch = 0 if self.sampler is None else self.sampler.scratch
        h64[3, :n] = scratch if slots is None else slots
        h64[3, n:] = scratch  # padding rows: counted in the scratch slot
        hf[:n] = 0.0 if uniform is None else uniform
        lens, table = h32[:self.max_size], h32[self.max_size:].reshape(self.max_size, -1)
        lens[:n] = seq_lens
        lens[n:] = 0  # padding rows: attention reads nothing
        for row, t in enumerate(tables):
            pages = t.pages
            table[row, :len(pages)] = pages  # past a request's pages: never read

    def replay(self, side: int, ids: Sequence[int], size: int,
               feed: torch.Tensor | None = None, full: bool = False,
               grammars: Sequence[RequestGrammar | None] | None = None) -> StepOutput:
        """Replay captured ``size`` (from ``size_for``) over staging ``side`` with
        these input ids, one per request of the staged step; ``feed``: the ids
        on the device instead (the tokens of the step queued before, row for
        row), so the step can be queued before those are read. ``full``: the
        step with the sampler (needs one). ``grammars``: each row's matcher (None: no
        grammar), which fill the rows' token bitmasks now (a full step)."""
        if full and self.sampler is None:
            raise ValueError("a full step needs DecodeGraphs built with a sampler")
        if grammars is not None and not full:
            raise ValueError("a step with a grammar must be a full step")
        n = len(ids)
        captured = (self._full if full else self._graphs)[size]
        self._host64_np[side][0, :n] = ids
        self._dev64.copy_(self._host64[side], non_blocking=True)
        self._dev32.copy_(self._host32[side], non_blocking=True)
        if full:
            self._devf.copy_(self._hostf[side], non_blocking=True)
            self._stage_masks(side, size, grammars)
        if feed is not None:
            self.ids[:n].copy_(feed)
        if captured is None:  # CPU: the same step, eager
            with torch.inference_mode():
                captured = self._forward(size, full)
        else:
            captured.graph.replay()
        sampled = captured.sampled
        if sampled is not None:
            sampled = StepResult(*(t[:n] for t in sampled))
        return StepOutput(captured.logits[:n], captured.greedy[:n], sampled)

    def _stage_masks(self, side: int, size: int, grammars: Sequence[RequestGrammar | None] | None) -> None:
        """The rows' bitmasks into the device buffer: filled by the matchers on the host
        (rows without one, and padding rows, all ones) and copied; all ones without any."""
        if grammars is None:
            if self._masked:
                self.bitmask.fill_(-1)
                self._masked = False
            return
        host = self._hostmask[side][:size]
        fill_bitmasks(grammars, host)  # every row of ``host``: the padding rows too
        self.bitmask[:size].copy_(host, non_blocking=True)
        self._masked = True

    def read_ids(self, greedy: torch.Tensor, side: int) -> Callable[[], list[int]]:
        """Queue the copy of a step's ``greedy`` ids to the host now, before a step
        queued later replays over them; the returned call waits for that copy
        alone (not for later steps) and gives the ids. ``side``: the step's
        staging side (two steps in flight use two buffers)."""
        host = self._host_ids[side][:greedy.shape[0]]
        host.copy_(greedy, non_blocking=self.cuda)
        if not self.cuda:
            values = host.tolist()
            return lambda: values
        done = self._ids_read[side]
        done.record()

        def ids() -> list[int]:
            done.synchronize()
            return host.tolist()

        return ids
