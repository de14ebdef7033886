"""Prompt logprobs: each CP rank scores the prompt tokens that follow the rows it owns.

The logprob of prompt token ``p`` (p >= 1) is the raw log-softmax, at that
token, of the logits of row ``p - 1`` (the model's distribution after the
first ``p`` tokens), with the ``k`` most likely tokens there, as vLLM's
``prompt_logprobs`` and OpenAI's ``echo`` report them. A rank holds the
hidden state of its own rows only, so it scores exactly the tokens right
after them (``rank_prompt_logprobs``) and sends back, per row, the chosen
token's logprob and its top-k, never the logits; the launcher puts the
ranks' parts in prompt order (``merge_prompt_logprobs``) and checks that
every token after the first was scored exactly once. The first token has no
logprob (nothing precedes it). Rows of a cached prefix have no hidden state
here: a request asking for prompt logprobs is prefilled whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

ROWS_PER_CHUNK = 256  # logits of at most this many rows at once ([rows, vocab] float32)


class PromptRows(NamedTuple):
    """One rank's scores of one request's prompt tokens (plain lists: they cross processes)."""

    index: int  # the request in the batch
    positions: list[int]  # prompt positions of the scored tokens (>= 1)
    logprobs: list[float]  # of the prompt token at each position
    top_ids: list[list[int]]  # the k most likely tokens there, most likely first
    top_logprobs: list[list[float]]


class PromptLogprob(NamedTuple):
    """One prompt token's logprob and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def rank_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                         input_index: torch.Tensor, token_ids: Sequence[Sequence[int]],
                         prefix_lens: Sequence[int], wanted: Sequence[int | None]) -> list[PromptRows]:
    """The prompt tokens following this rank's rows, scored for the requests that want them.

    ``hidden``: ``[rows, hidden]`` of this rank's compute rows; ``input_index``:
    ``[rows]`` each row's index into the concatenated extends (-1: padding);
    ``token_ids[b]``: request b's extend; ``wanted[b]``: its k (top tokens), or None.
    """
    if len(wanted) != len(token_ids) or len(prefix_lens) != len(token_ids):
        raise ValueError(f"wanted ({len(wanted)}), prefix_lens ({len(prefix_lens)}) and token_ids "
                         f"({len(token_ids)}) must have one entry per request")
    if all(k is None for k in wanted):
        return []
    lens = torch.tensor([len(t) for t in token_ids], dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    flat = input_index.detach().to("cpu", torch.int64)
    rows = torch.nonzero(flat >= 0).flatten()
    f = flat[rows]
    request = torch.searchsorted(starts, f, right=True) - 1  # [n] the request of each real row
    within = f - starts[request]  # its offset in the extend
    want = torch.tensor([k is not None for k in wanted])
    # A row scores the next token of its prompt: the last row of a prompt has none.
    keep = want[request] & (within + 1 < lens[request])
    rows, request, within = rows[keep], request[keep], within[keep]
    if not rows.numel():
        return []
    ids = torch.tensor([t for ext in token_ids for t in ext], dtype=torch.int64)
    following = ids[starts[request] + within + 1]  # [n] the token each row scores
    k_max = max(k for k in wanted if k is not None)
    chosen, top_v, top_i = [], [], []
    device = hidden.device
    for lo in range(0, rows.numel(), ROWS_PER_CHUNK):
        part = slice(lo, lo + ROWS_PER_CHUNK)
        logp = torch.log_softmax(compute_logits(hidden[rows[part].to(device)]).float(), dim=-1)
        chosen.append(logp.gather(1, following[part].to(device)[:, None])[:, 0].cpu())
        if k_max:
            values, indices = logp.topk(min(k_max, logp.shape[-1]), dim=-1)
            top_v.append(values.cpu())
            top_i.append(indices.cpu())
    chosen_t = torch.cat(chosen)
    out = []
    for b in torch.unique(request).tolist():
        sel = torch.nonzero(request == b).flatten()
        k = wanted[b]
        positions = (within[sel] + 1 + prefix_lens[b]).tolist()
        if k:
            tv, ti = torch.cat(top_v)[sel, :k].tolist(), torch.cat(top_i)[sel, :k].tolist()
        else:
            tv = ti = [[] for _ in positions]
        out.append(PromptRows(b, positions, chosen_t[sel].tolist(), ti, tv))
    return out


def merge_prompt_logprobs(prompt: Sequence[int], parts: Sequence[PromptRows]) -> list[PromptLogprob]:
    """One request's parts from every rank -> the logprobs of prompt tokens 1..len-1, in order.

    Raises ``RuntimeError`` if a position is missing, scored twice or outside the prompt.
    """
    found: dict[int, PromptLogprob] = {}
    for part in parts:
        for pos, lp, ids, values in zip(part.positions, part.logprobs, part.top_ids, part.top_logprobs):
            if not 1 <= pos < len(prompt) or pos in found:
                raise RuntimeError(f"prompt logprobs of request {part.index}: position {pos} is "
                                   f"{'scored twice' if pos in found else 'outside the prompt'} "
                                   f"({len(prompt)} tokens)")
            found[pos] = PromptLogprob(int(prompt[pos]), float(lp), tuple(zip(ids, values)))
    if len(found) != len(prompt) - 1:
        missing = sorted(set(range(1, len(prompt))) - set(found))
        raise RuntimeError(f"prompt logprobs: {len(missing)} positions were scored by no rank "
                           f"(first: {missing[0]})")
    return [found[p] for p in range(1, len(prompt))]
