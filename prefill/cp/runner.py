"""One CP rank's prefill of a batch: plan, embed, attend across ranks, write owned pages.

Each rank runs the whole model on its own rows (valid + compute padding). In
every layer the attention callback (1) applies RoPE to q and k and, in the same
launch, writes this rank's valid rows into its own pool through physical rows
(every loc is checked to be owned by this rank once per batch) and its new K/V
rows into a block, which also takes the K/V rows of the cached-prefix pages it
owns, (2) all-gathers the blocks, (3) reranges the rank-major result into
request order and (4) runs the CP attention kernel for its query segments. The
rank holding a request's real last token samples the first output token.

What the callback does is the model's attention kind's (``model.attention``:
``cp_prefill``; GQA rotates and stores in one launch, an MLA block is the
latent rows, a DSA block the latent and index-K rows); the runner hands it the
batch's rows, segments and the all-gather (``CPBatch``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from lanekv.kernels.prefill.reference import AttnSegments
from lanekv.kernels.rerange import rerange
from lanekv.model.attention import AnyCausalLM, CPBatch, QuerySegment, RowLayout, kind_of
from lanekv.model.grammar import bitmask_words, masks_from_bytes
from lanekv.model.sampling import SamplingParams, sample, sample_full
from lanekv.prefill.cp.graphs import GraphCapture, PrefillGraphs, capture_graphs
from lanekv.prefill.cp.prompt_logprobs import PromptRows, rank_prompt_logprobs
from lanekv.prefill.cp.thread_group import ThreadGroup
from lanekv.prefill.index import RankIndex, build_rank_index
from lanekv.prefill.layout import OwnerLaneLayout
from lanekv.prefill.plan import BatchPlan, plan_batch
from lanekv.runtime.gcpause import GcClock

if TYPE_CHECKING:
    from lanekv.model.parallel.ep import ExpertExchange
    from lanekv.prefill.cp.page_source import RankPageSource
    from lanekv.transfer.rank.server import Served


@dataclass(frozen=True)
class PrefillBatch:
    """What every rank needs to prefill a batch (plain data, sent to each rank)."""

    request_ids: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]  # the extend of each request (prefix excluded)
    prefix_lens: tuple[int, ...]
    prefix_pages: tuple[tuple[int, ...], ...]  # logical pages holding each cached prefix
    extend_pages: tuple[tuple[int, ...], ...]  # logical pages for each extend, from the owners' lanes
    sampling: tuple[SamplingParams, ...]
    return_logits: bool = False
    # Each request's KV capability (FetchKV and Release must present it); None: none.
    capabilities: tuple[str | None, ...] | None = None
    # Each request's whole prompt where its repetition penalty reads it (else empty); None: none.
    prompts: tuple[tuple[int, ...], ...] | None = None
    # Each request's prompt logprobs (k top tokens, or None: none); None: no request asks.
    prompt_logprobs: tuple[int | None, ...] | None = None
    # Each request's first-token grammar bitmask (``model.grammar``; None: no grammar); None: none.
    first_masks: tuple[bytes | None, ...] | None = None

    def plan(self, cp_size: int, page_size: int) -> BatchPlan:
        return plan_batch(
            [len(t) for t in self.token_ids], list(self.prefix_lens), cp_size=cp_size, page_size=page_size
        )


class RequestOutput(NamedTuple):
    index: int  # request index in the batch
    first_token: int
    logits: torch.Tensor | None  # [vocab] float32 of the last token, when asked
    # The first token's raw logprob and its most likely tokens, when the request asks.
    logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None


@dataclass
class RankResult:
    rank: int
    outputs: list[RequestOutput]  # requests whose last token this rank holds
    seconds: float
    gather_seconds: float = 0.0
    rows: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    queued_seconds: float = 0.0  # until the host had queued the whole forward (its launches)
    gc_seconds: float = 0.0  # this process's garbage collections during the run
    # The prompt tokens after this rank's rows, scored for the requests asking (``prompt_logprobs``).
    prompt_logprobs: list[PromptRows] = field(default_factory=list)


@dataclass(frozen=True)
class RankProcess:
    """What a rank's process holds beside its model and pool, built once before its runner
    (``prefill.cp.rank_worker``); rank threads (``prefill.cp.threaded``) hold the first two."""

    weights_digest: str = ""  # of the checkpoint (the contract names it)
    tokenizer: Any = None
    shared_path: Path | None = None  # the /dev/shm file of a CPU pool a same-host decode daemon may map
    gc_clock: GcClock | None = None  # the process's garbage collections, timed per prefill
    page_source: RankPageSource | None = None  # what KVTransfer serves from the pool, when it serves
    transfer_server: Served | None = None  # the rank's KVTransfer server, when it serves


class RankRunner:
    """Holds one rank's model and owner-lane pool; ``run`` prefills a batch."""

    def __init__(
        self,
        model: AnyCausalLM,
        pool: torch.Tensor,  # [num_layers, kv (2, or 1 for MLA), pages * page_size, kv_heads, head_dim]
        *,
        cp_rank: int,
        cp_size: int,
        page_size: int,
        group: dist.ProcessGroup | ThreadGroup | None = None,
        rows: RowLayout | None = None,  # the pool's rows; None: the kind's in the pool's dtype
        process: RankProcess | None = None,  # what the rank's process holds beside (None: nothing)
        exchange: ExpertExchange | None = None,  # prefill EP: told each forward's rows per rank
    ) -> None:
        kind = kind_of(model.config)
        rows = kind.rows(model.config, pool.dtype) if rows is None else rows
        if not kind.fits(model.config, rows) or tuple(pool.shape[1:2] + pool.shape[3:]) != (
                rows.kv, rows.kv_heads, rows.head_dim):
            raise ValueError(f"pool rows {rows} (pool shape {tuple(pool.shape)}) do not fit the "
                             f"{kind.name} model architecture={model.config.architecture!r}")
        self.model = model
        self.kind = kind
        self.pool = pool
        self.rows = rows
        self.layout = OwnerLaneLayout(cp_size, page_size)
        self.cp_rank = cp_rank
        self.cp_size = cp_size
        self.page_size = page_size
        self.group = group
        cfg = model.config
        self.softmax_scale = cfg.softmax_scale
        self.device = pool.device
        self.process = RankProcess() if process is None else process
        self.exchange = exchange
        self.graphs: PrefillGraphs | None = None  # captured at warm-up (``capture_graphs``)

    def capture_graphs(self, max_rows: int) -> GraphCapture:
        """Capture this rank's prefill graphs up to ``max_rows`` rows (``prefill.cp.graphs``);
        ``run`` replays them from then on."""
        self.graphs, done = capture_graphs(self.model, self.page_size, max_rows)
        return done

    @torch.inference_mode()
    def run(self, batch: PrefillBatch, on_layer: Callable[[int], None] | None = None) -> RankResult:
        """Prefill ``batch``; ``on_layer(l)`` right after layer ``l``'s K/V store is queued."""
        start = time.perf_counter()
        clock = self.process.gc_clock
        gc_start = 0.0 if clock is None else clock.seconds
        plan = batch.plan(self.cp_size, self.page_size)
        ix = build_rank_index(
            plan,
            self.cp_rank,
            extend_pages=[list(p) for p in batch.extend_pages],
            prefix_pages=[list(p) for p in batch.prefix_pages],
            device=self.device,
        )
        flat_ids = torch.tensor([t for ids in batch.token_ids for t in ids], dtype=torch.int64)
        flat_ids = flat_ids.to(self.device)
        input_ids = torch.where(ix.input_index >= 0, flat_ids[ix.input_index.clamp(min=0)], 0)
        gather = _Gather(self, ix)
        attention = self.kind.cp_prefill(self.model, gather.batch(batch, on_layer))
        # EP: the capturable exchange's fixed shapes come from the largest rank's rows
        rows_per_rank = nullcontext() if self.exchange is None else self.exchange.rows_per_rank(plan.max_rank_len)
        with rows_per_rank:
            if self.graphs is not None and self.graphs.size_for(input_ids.numel()) is not None:
                hidden = self.graphs.forward(input_ids, ix.positions, attention)
            else:
                hidden = self.kind.forward(self.model, input_ids, ix.positions, attention)
        queued = time.perf_counter() - start

        outputs = []
        mine = [b for b, row in enumerate(ix.last_rows) if row >= 0]
        if mine:
            rows = torch.tensor([ix.last_rows[b] for b in mine], device=self.device)
            logits = self.model.compute_logits(hidden[rows])
            params = [batch.sampling[b] for b in mine]
            logprobs = [None] * len(mine)
            if all(p.plain for p in params):
                tokens = sample(logits, params, 0).tolist()
            else:  # the logits processors, with the prompts and EOS, and the logprobs
                prompts = [batch.prompts[b] if batch.prompts else () for b in mine]
                masks = None if batch.first_masks is None else masks_from_bytes(
                    [batch.first_masks[b] for b in mine], bitmask_words(logits.shape[1]))
                out = sample_full(logits, params, 0, prompts=prompts,
                                  eos_token_ids=self.model.config.eos_token_ids,
                                  bitmask=None if masks is None else masks.to(self.device))
                tokens = out.tokens.tolist()
                chosen, values, ids = (out.logprob.tolist(), out.top_logprobs.tolist(),
                                       out.top_ids.tolist())
                logprobs = [None if p.logprobs is None else
                            (chosen[i], tuple(zip(ids[i][:p.logprobs], values[i][:p.logprobs])))
                            for i, p in enumerate(params)]
            for i, b in enumerate(mine):
                keep = logits[i].cpu() if batch.return_logits else None
                outputs.append(RequestOutput(b, int(tokens[i]), keep, logprobs[i]))
        scored = [] if batch.prompt_logprobs is None else rank_prompt_logprobs(
            self.model.compute_logits, hidden, ix.input_index, batch.token_ids, batch.prefix_lens,
            batch.prompt_logprobs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return RankResult(
            self.cp_rank,
            outputs,
            time.perf_counter() - start,
            gather_seconds=gather.finish(),
            rows=int(input_ids.numel()),
            queued_seconds=queued,
            gc_seconds=0.0 if clock is None else clock.seconds - gc_start,
            prompt_logprobs=scored,
        )


class _Gather:
    """The all-gather of one batch on one rank, handed to the kind's callback (state
    built once per batch): the rank's block, with its owned prefix rows, from every
    rank, in request order."""

    def __init__(self, runner: RankRunner, ix: RankIndex) -> None:
        self.r = runner
        self.ix = ix
        self.gather_seconds = 0.0
        # On CUDA the all-gather is timed with events (a host timer would sync every layer).
        self.events: list | None = [] if runner.device.type == "cuda" else None

    def batch(self, batch: PrefillBatch, on_layer: Callable[[int], None] | None) -> CPBatch:
        """What the kind's callback needs of ``batch`` on this rank, this gather included."""
        r, ix, dev = self.r, self.ix, self.r.device
        # Every valid loc must belong to this rank: checked once, not per layer.
        phys = r.layout.physical_rows(r.cp_rank, ix.write_locs)
        store_rows = torch.full((ix.input_index.numel(),), -1, dtype=torch.int64, device=dev)
        store_rows[ix.valid_rows] = phys
        kv_start = [ix.kv_offsets[b] for b in ix.seg_request]
        i32 = dict(dtype=torch.int32, device=dev)
        segments = AttnSegments(
            torch.tensor(ix.seg_q_start, **i32),
            torch.tensor(ix.seg_q_len, **i32),
            torch.tensor(ix.seg_q_pos, **i32),
            torch.tensor(kv_start, **i32),
        )
        request_lens = [p + len(t) for p, t in zip(batch.prefix_lens, batch.token_ids)]
        queries = tuple(QuerySegment(start, length, pos, ix.kv_offsets[b], request_lens[b])
                        for start, length, pos, b in zip(ix.seg_q_start, ix.seg_q_len,
                                                         ix.seg_q_pos, ix.seg_request))
        return CPBatch(r.pool, r.rows, store_rows, ix.block_rows, segments, queries, self,
                       on_layer)

    def finish(self) -> float:
        """Seconds spent in the all-gathers of this batch (call after a device sync)."""
        if self.events:
            self.gather_seconds = sum(s.elapsed_time(e) for s, e in self.events) / 1e3
        return self.gather_seconds

    def __call__(self, layer: int, block: torch.Tensor) -> torch.Tensor:
        """Fill ``block``'s owned prefix rows, all-gather it, rerange into request order."""
        r, ix = self.r, self.ix
        if ix.prefix_send_rows.numel():
            sent = r.pool[layer][:, ix.prefix_send_rows].transpose(0, 1)
            block[ix.compute_block_rows : ix.compute_block_rows + sent.shape[0]] = sent
        if r.cp_size == 1:  # nothing to gather, nothing to time
            return self._in_request_order(block)
        if self.events is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            gathered = _all_gather_rows(block, r.cp_rank, r.cp_size, r.group)
            end.record()
            self.events.append((start, end))
        else:
            t0 = time.perf_counter()
            gathered = _all_gather_rows(block, r.cp_rank, r.cp_size, r.group)
            self.gather_seconds += time.perf_counter() - t0
        return self._in_request_order(gathered)

    def _in_request_order(self, gathered: torch.Tensor) -> torch.Tensor:
        """The gathered rows in request order: a slice when the rerange keeps their
        order (one rank, no cached prefix), so no launch (the host's launches bound a
        short prefill, BENCHMARKS.md)."""
        if self.ix.rerange_in_order:
            return gathered[: self.ix.rerange_index.numel()]
        return rerange(gathered, self.ix.rerange_index)


def _all_gather_rows(
    block: torch.Tensor, rank: int, world: int, group: dist.ProcessGroup | ThreadGroup | None
) -> torch.Tensor:
    """Rank-major concatenation of every rank's equally sized block."""
    if world == 1:
        return block
    if isinstance(group, ThreadGroup):
        return group.all_gather(rank, block)
    if block.is_cuda:
        out = block.new_empty((world * block.shape[0], *block.shape[1:]))
        dist.all_gather_into_tensor(out, block, group=group)
        return out
    parts = [torch.empty_like(block) for _ in range(world)]
    dist.all_gather(parts, block, group=group)  # gloo has no all_gather_into_tensor
    return torch.cat(parts)
