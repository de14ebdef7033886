"""Prefill and decode in one process, on one pool: the colocated run.

``prefill_into_pool`` runs a whole prompt through the model with plain causal
attention and stores its K/V into fresh pages of a decode pool, as the
transfer client would after a remote prefill; ``generate_colocated`` then
hands every prompt to a ``DecodeEngine``. Tests hold the decode side against
``transformers`` with it, and the demo's single-process run uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from lanekv.decode.engine import DecodeEngine
from lanekv.decode.pool import PagePool, PageTable
from lanekv.model.attention import AnyCausalLM, kind_of
from lanekv.model.sampling import SamplingParams, sample_full


class PrefillResult(NamedTuple):
    page_table: PageTable  # the prompt's KV, seq_len = len(prompt)
    first_token: int  # sampled at generation step 0


def prefill_into_pool(model: AnyCausalLM, pool: PagePool, token_ids: Sequence[int] | torch.Tensor,
                      sampling: SamplingParams, logprob: list[float] | None = None,
                      bitmask: torch.Tensor | None = None) -> PrefillResult:
    """Prefill one prompt into freshly allocated pages of ``pool``; ``logprob``: a
    list the first token's raw logprob is appended to; ``bitmask``: the first
    token's grammar mask ``[1, ceil(vocab / 32)]`` int32 (``model.grammar``)."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).to(pool.device)
    if ids.numel() == 0:
        raise ValueError("token_ids must hold at least one token")
    vocab = model.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"token_ids hold ids outside [0, {vocab}): "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    table = PageTable.allocate(pool, ids.numel())
    try:
        locs = table.locs_for(range(ids.numel()))
        kind = kind_of(model.config)
        positions = torch.arange(ids.numel(), device=pool.device)
        with torch.inference_mode():
            hidden = kind.forward(model, ids, positions, kind.colocated(model, pool, locs))
            logits = model.compute_logits(hidden[-1:])
            out = sample_full(logits, [sampling], 0, prompts=[ids.tolist()],
                              eos_token_ids=model.config.eos_token_ids,
                              bitmask=None if bitmask is None else bitmask.to(pool.device))
        first = int(out.tokens[0])
        if logprob is not None:
            logprob.append(float(out.logprob[0]))
    except Exception:
        table.release()
        raise
    return PrefillResult(table, first)


def generate_colocated(model: AnyCausalLM, pool: PagePool, prompts: Sequence[Sequence[int]],
                       sampling: SamplingParams | Sequence[SamplingParams],
                       max_new_tokens: int, *, stop_token_ids: Sequence[int] = (),
                       ignore_eos: bool = False, max_batch_size: int = 256) -> list[list[int]]:
    """Output tokens of every prompt (prefill's first token included, a final
    stop token too, as ``transformers.generate`` returns them).

    Every prompt is prefilled first, so the pool must hold all prompts at once;
    decoding then runs as pages allow. Raises RuntimeError if the pool can never
    fit a waiting request (nothing running, nothing admitted).
    """
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    engine = DecodeEngine(model, pool, max_batch_size=max_batch_size)
    outputs: dict[str, list[int]] = {}
    try:
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            table, first = prefill_into_pool(model, pool, prompt, sp)
            request_id = f"prompt-{i}"
            outputs[request_id] = [first]
            try:
                engine.add(request_id, table, first, sp, max_new_tokens,
                           stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
            except Exception:
                table.release()
                raise
        # Every step either emits at least one event (moving a request one
        # step closer to its end) or the engine is stuck: the loop terminates.
        while engine.has_work:
            events = engine.step()
            if not events:
                raise RuntimeError(
                    f"decode made no progress: {engine.num_waiting} requests wait for pages "
                    f"that {pool.num_pages} pool pages ({pool.free_count} free) cannot give"
                )
            for event in events:
                if event.token_id is not None:
                    outputs[event.request_id].append(event.token_id)
    finally:
        for request_id in outputs:
            engine.cancel(request_id)  # frees whatever an error left behind
    return [outputs[f"prompt-{i}"] for i in range(len(prompts))]
