"""Token sampling shared by prefill (the first token) and decode (the rest).

A request's token at generation step ``s`` depends only on its logits, its
``SamplingParams`` and ``s``: the random number is drawn from a CPU
``torch.Generator`` seeded from ``(seed, s)``, never from a device generator or
from how requests happen to be batched. So prefill on one machine (step 0) and
decode on another (steps 1, 2, ...) replay a seeded request identically.

Sampling is inverse-CDF over the tokens sorted by probability: one uniform
number per row picks the first token whose cumulative probability exceeds it.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MAX_SEED = 2**64
# The smallest temperature that samples: below it logits / temperature can
# overflow float32 to inf and the probabilities turn NaN. Such a temperature
# is greedy in all but name; 0 says greedy.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy (top_k and top_p are then unused);
    ``top_k == 0`` keeps every token; ``seed=None`` draws fresh randomness."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise TypeError(f"temperature={self.temperature!r} must be a number")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be finite and >= 0")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature={self.temperature!r} must be 0 (greedy) or at least {MIN_TEMPERATURE}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise TypeError(f"top_k={self.top_k!r} must be an integer")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise TypeError(f"top_p={self.top_p!r} must be a number")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise TypeError(f"seed={self.seed!r} must be an integer or None")
            if not 0 <= self.seed < _MAX_SEED:
                raise ValueError(f"seed={self.seed} must be in [0, 2**64)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def step_seed(seed: int, step: int) -> int:
    """The generator seed of one (request seed, generation step): a hash, so
    neighbouring seeds and steps give unrelated streams."""
    if not 0 <= step < _MAX_SEED:
        raise ValueError(f"step={step} must be in [0, 2**64)")
    digest = hashlib.sha256(struct.pack("<QQ", seed, step)).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # manual_seed takes < 2**63


def _uniform(params: SamplingParams, step: int) -> float:
    seed = secrets.randbits(64) if params.seed is None else params.seed
    generator = torch.Generator(device="cpu").manual_seed(step_seed(seed, step))
    return torch.rand((), generator=generator, dtype=torch.float64).item()


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           step: int | Sequence[int], greedy_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [B, V]`` float32 -> token ids ``[B]`` int64 on the logits' device.

    Greedy rows take the argmax (the lowest index on ties). Other rows divide
    by the temperature, keep the ``top_k`` most likely tokens, then the
    smallest most-likely prefix whose probability reaches ``top_p``, and draw.
    ``step`` is the generation step of every row, or one per row.
    ``greedy_tokens``: the argmax of ``logits`` already computed (a captured
    decode step gives it), used instead of computing it again.

    Everything runs on the logits' device; the host only computes each sampled
    row's uniform number and sends the rows' parameters in one copy. No result
    is read back here: the caller reads the ids once.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        raise TypeError(f"logits dtype {logits.dtype} must be torch.float32")
    batch, vocab = logits.shape
    if len(params) != batch:
        raise ValueError(f"len(params)={len(params)} != batch size {batch}")
    steps = [step] * batch if isinstance(step, int) else list(step)
    if len(steps) != batch:
        raise ValueError(f"len(step)={len(steps)} != batch size {batch}")
    if greedy_tokens is not None and (greedy_tokens.shape != (batch,)
                                      or greedy_tokens.dtype != torch.int64):
        raise ValueError(f"greedy_tokens must be [{batch}] int64, got "
                         f"{tuple(greedy_tokens.shape)} {greedy_tokens.dtype}")

    tokens = logits.argmax(dim=-1) if greedy_tokens is None else greedy_tokens.clone()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    device = logits.device
    # One host tensor, one copy: row index, temperature, top_k, top_p, uniform.
    # float32 holds each exactly as the separate tensors did (ids and top_k < 2**24).
    # top_p == 1 must keep every token, even where rounding puts the
    # cumulative sum at 1 before the tail.
    table = torch.tensor(
        [[i, params[i].temperature, params[i].top_k or vocab,
          params[i].top_p if params[i].top_p < 1 else math.inf, _uniform(params[i], steps[i])]
         for i in rows], dtype=torch.float32).T.contiguous()
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    index, temperature, top_k, top_p, uniform = table
    index, top_k = index.long(), top_k.long()

    scaled = logits[index] / temperature[:, None]
    # Stable sort: among equal logits the lower token id ranks first.
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=device)[None, :]
    keep = rank < top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= mass_before < top_p[:, None]  # the top token always stays
    probs = probs * keep
    cdf = probs.cumsum(dim=-1)  # [rows, V], not renormalised: scale the draw instead
    target = (uniform * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    # Rounding could land the pick one past the last kept token; step back.
    picked = torch.minimum(picked, keep.sum(dim=-1, keepdim=True) - 1)
    tokens[index] = order.gather(1, picked).squeeze(1)
    return tokens
