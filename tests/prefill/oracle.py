"""Prompts and transformers' last-token logits, the oracle of the CP prefill tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def random_prompts(lens: Sequence[int], seed: int = 0) -> list[list[int]]:
    """One prompt of each length, ids in [3, 290) (the test checkpoints' vocab), seeded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 290, (n,), generator=g).tolist() for n in lens]


def hf_last_logits(checkpoint: Path, prompts: Sequence[Sequence[int]],
                   attn_implementation: str | None = None) -> dict[int, torch.Tensor]:
    """transformers' float32 logits of each prompt's last token, by prompt length."""
    from transformers import AutoModelForCausalLM

    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **extra).eval()
    with torch.no_grad():
        return {len(ids): model(torch.tensor([list(ids)])).logits[0, -1].float() for ids in prompts}


def prefill_with_prefix(eng, prompt: Sequence[int], prefix_tokens: int, reuse_pages: int):
    """``prompt`` prefilled twice on ``eng``: reusing the first ``reuse_pages`` pages
    of an earlier prefill of its first ``prefix_tokens`` tokens (logits returned),
    and whole. Returns (reused, whole)."""
    from lanekv.prefill.cp.launcher import PrefillInput

    first = eng.prefill([PrefillInput(list(prompt[:prefix_tokens]))])[0]
    prefix = [p.page for p in first.pages][:reuse_pages]
    reused = eng.prefill([PrefillInput(list(prompt), prefix_pages=prefix)], return_logits=True)[0]
    whole = eng.prefill([PrefillInput(list(prompt))])[0]
    return reused, whole
