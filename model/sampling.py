"""Token sampling shared by prefill (the first token) and decode (the rest).

A request's token at generation step ``s`` depends only on its logits, its
``SamplingParams`` and ``s``: the random number is drawn from a CPU
``torch.Generator`` seeded from ``(seed, s)``, never from a device generator or
from how requests happen to be batched. So prefill on one machine (step 0) and
decode on another (steps 1, 2, ...) replay a seeded request identically.

Sampling is inverse-CDF over the tokens sorted by probability: one uniform
number per row picks the first token whose cumulative probability exceeds it.

Logits processors follow vLLM's sampler, in its order: stop tokens are
banned while fewer than ``min_tokens`` tokens were generated, ``logit_bias``
is added, then the penalties (``repetition_penalty`` divides a positive logit
and multiplies a negative one of every token seen in the prompt or the
output; ``frequency_penalty`` subtracts per output occurrence,
``presence_penalty`` once per token present in the output), a grammar's
token bitmask bans what it does not allow; greedy rows take the argmax of
the result; sampled rows divide by the temperature, drop tokens below
``min_p`` times the top probability, then cut by ``top_k`` and ``top_p``.
Logprobs are those of the raw model logits (vLLM's default).

``SamplerState`` holds the per-request state on the device, one slot per
request: the parameters, the prompt's tokens, the output's token counts. A
step's processing and draw (``sample_step``) are tensor operations only, with
every per-row value in a tensor, so a CUDA graph captures them; the counts are
updated on the device (``record``). The CPU runs the same code eagerly.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from lanekv.model.grammar.spec import GrammarSpec

_MAX_SEED = 2**64
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_STOP_IDS = 1024 + 16  # stop_token_ids and end-of-sequence ids banned under min_tokens
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI allows
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
    min_p: float = 0.0  # 0: no cut
    repetition_penalty: float = 1.0  # 1: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct
    min_tokens: int = 0  # stop tokens are banned until this many were generated
    stop_token_ids: tuple[int, ...] = ()  # banned under min_tokens, with EOS unless ignore_eos
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the token's logprob and the k most likely
    grammar: GrammarSpec | None = None  # structured output: the tokens its bitmask allows

    def __post_init__(self) -> None:
        self._check_processors()
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise TypeError(f"grammar must be a GrammarSpec or None, got {type(self.grammar).__name__}")
        if self.grammar is not None and self.min_tokens:
            # min_tokens bans the end-of-sequence token a finished grammar allows alone.
            raise ValueError(f"min_tokens={self.min_tokens} cannot be combined with structured output "
                             f"({self.grammar.kind}): the grammar decides where the output ends")
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

    def _check_processors(self) -> None:
        for name, low, high in (("min_p", 0.0, 1.0), ("repetition_penalty", 1e-6, 1e6),
                                ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name}={value!r} must be a number")
            if not math.isfinite(value) or not low <= value <= high:
                raise ValueError(f"{name}={value!r} must be in [{low:g}, {high:g}]")
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must be a tuple of at most {MAX_LOGIT_BIAS} (id, bias) pairs")
        ids = [pair[0] for pair in self.logit_bias]
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias token id {token!r} must be an int >= 0")
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{token}]={bias!r} must be a number in [-100, 100]")
        if len(set(ids)) != len(ids):
            raise ValueError("logit_bias names a token id twice")
        for name in ("min_tokens",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        if len(self.stop_token_ids) > MAX_STOP_IDS - 16 or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be at most {MAX_STOP_IDS - 16} ids >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos={self.ignore_eos!r} must be a bool")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r} must be None or an int in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether any logits processor changes this request's logits."""
        return bool(self.repetition_penalty != 1 or self.presence_penalty or self.frequency_penalty
                    or self.logit_bias or self.min_tokens or self.grammar is not None)

    @property
    def plain(self) -> bool:
        """Greedy with no processor and no logprobs: the argmax is the whole step."""
        return self.greedy and not self.penalised and self.logprobs is None

    def check_vocab(self, vocab: int) -> None:
        """ValueError naming a token id outside ``[0, vocab)``."""
        for token, _ in self.logit_bias:
            if token >= vocab:
                raise ValueError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab})")


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


class StepResult(NamedTuple):
    """One sampled token per row, with the raw logprobs every row may ask for."""

    tokens: torch.Tensor  # [n] int64
    logprob: torch.Tensor  # [n] float32: log_softmax of the raw logits at the token
    top_logprobs: torch.Tensor  # [n, K] float32, K = min(MAX_LOGPROBS, vocab), most likely first
    top_ids: torch.Tensor  # [n, K] int64


# Columns of SamplerState.params.
_GREEDY, _TEMP, _TOP_K, _TOP_P, _MIN_P, _REP, _PRES, _FREQ, _MIN_TOKENS = range(9)


class SamplerState:
    """Per-request sampling state on one device, one slot per request (``acquire``,
    ``load``, ``release``); slot ``scratch`` (the last) takes padding rows.

    ``params [slots+1, 9]`` float32 (greedy flag, temperature, top_k, top_p,
    min_p, repetition, presence and frequency penalties, min_tokens);
    ``counts [slots+1, vocab]`` int32 output token counts; ``prompt`` the same
    shape, bool, the prompt's tokens (filled only for a repetition penalty);
    ``generated [slots+1]`` int64 tokens generated; ``bias_ids``/``bias``
    ``[slots+1, MAX_LOGIT_BIAS]``; ``ban_ids``/``ban_valid``
    ``[slots+1, MAX_STOP_IDS]`` the tokens banned under ``min_tokens``.
    """

    def __init__(self, slots: int, vocab: int, device: torch.device | str,
                 eos_token_ids: Sequence[int] = ()) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"vocab must be an int >= 1, got {vocab!r}")
        self.vocab, self.device, self.scratch = vocab, torch.device(device), slots
        self.eos_token_ids = tuple(sorted({int(t) for t in eos_token_ids}))
        n, dev = slots + 1, self.device
        self.params = torch.zeros((n, 9), dtype=torch.float32, device=dev)
        self.counts = torch.zeros((n, vocab), dtype=torch.int32, device=dev)
        self.prompt = torch.zeros((n, vocab), dtype=torch.bool, device=dev)
        self.generated = torch.zeros(n, dtype=torch.int64, device=dev)
        self.bias_ids = torch.zeros((n, MAX_LOGIT_BIAS), dtype=torch.int64, device=dev)
        self.bias = torch.zeros((n, MAX_LOGIT_BIAS), dtype=torch.float32, device=dev)
        self.ban_ids = torch.zeros((n, MAX_STOP_IDS), dtype=torch.int64, device=dev)
        self.ban_valid = torch.zeros((n, MAX_STOP_IDS), dtype=torch.bool, device=dev)
        self.params[:] = self._row(SamplingParams())
        self._free = list(range(slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        """A free slot, or None when every slot is taken."""
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.scratch or slot in self._free:
            raise ValueError(f"slot {slot} is not a taken slot")
        self._free.append(slot)

    def _row(self, p: SamplingParams) -> torch.Tensor:
        return torch.tensor([float(p.greedy), p.temperature if not p.greedy else 1.0,
                             p.top_k or self.vocab, p.top_p if p.top_p < 1 else math.inf, p.min_p,
                             p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                             p.min_tokens], dtype=torch.float32)

    def banned(self, p: SamplingParams) -> list[int]:
        """The tokens ``min_tokens`` bans: the stop ids and, unless ignore_eos, EOS."""
        ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        return sorted(t for t in ids if 0 <= t < self.vocab)

    def load(self, slot: int, p: SamplingParams, prompt_ids: Sequence[int] = (),
             outputs: Sequence[int] = ()) -> None:
        """Set ``slot`` for a request: its parameters, its prompt (read for a
        repetition penalty) and the tokens it generated so far."""
        if not 0 <= slot <= self.scratch:
            raise ValueError(f"slot {slot} is outside [0, {self.scratch}]")
        p.check_vocab(self.vocab)
        dev = self.device
        self.params[slot] = self._row(p).to(dev)
        self.counts[slot].zero_()
        if outputs:
            out = torch.tensor(list(outputs), dtype=torch.int64, device=dev)
            self.counts[slot].index_put_((out,), torch.ones_like(out, dtype=torch.int32), accumulate=True)
        self.generated[slot] = len(outputs)
        self.prompt[slot].zero_()
        if p.repetition_penalty != 1 and prompt_ids:
            self.prompt[slot, torch.tensor(list(prompt_ids), dtype=torch.int64, device=dev)] = True
        ids = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.int64)
        bias = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.float32)
        for k, (token, value) in enumerate(p.logit_bias):
            ids[k], bias[k] = token, value
        self.bias_ids[slot], self.bias[slot] = ids.to(dev), bias.to(dev)
        ban = self.banned(p)
        # Padding repeats the first banned id, so every write to it agrees.
        ban_ids = torch.full((MAX_STOP_IDS,), ban[0] if ban else 0, dtype=torch.int64)
        ban_ids[:len(ban)] = torch.tensor(ban, dtype=torch.int64)
        self.ban_ids[slot] = ban_ids.to(dev)
        self.ban_valid[slot] = bool(ban)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A token bitmask ``[n, ceil(vocab / 32)]`` int32 (bit ``t % 32`` of word
    ``t // 32`` set: token ``t`` allowed, xgrammar's layout) -> ``[n, vocab]`` bool."""
    index = torch.arange(vocab, device=bitmask.device)
    words = bitmask[:, index >> 5]
    return ((words >> (index & 31).to(words.dtype)) & 1).bool()


def process_logits(logits: torch.Tensor, state: SamplerState, slots: torch.Tensor,
                   bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """The logits processors of every row (see the module's docstring), as a new tensor."""
    p = state.params[slots]
    x = logits.float().clone()
    active = state.generated[slots] < p[:, _MIN_TOKENS].long()
    ban = state.ban_ids[slots]
    x.scatter_(1, ban, torch.where(active[:, None] & state.ban_valid[slots], -math.inf, x.gather(1, ban)))
    x.scatter_add_(1, state.bias_ids[slots], state.bias[slots])
    counts = state.counts[slots]
    present = counts > 0
    rep = p[:, _REP, None]
    x = torch.where(present | state.prompt[slots], torch.where(x > 0, x / rep, x * rep), x)
    x = x - p[:, _FREQ, None] * counts - p[:, _PRES, None] * present
    if bitmask is not None:
        x = x.masked_fill(~unpack_bitmask(bitmask, x.shape[1]), -math.inf)
    return x


def draw(x: torch.Tensor, p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Tokens ``[n]`` from processed logits ``x [n, V]``, the rows' parameter rows
    ``p [n, 9]`` and uniform numbers ``[n]``: greedy rows take the argmax."""
    vocab = x.shape[1]
    argmax = x.argmax(dim=-1)
    scaled = x / p[:, _TEMP, None]
    probs = torch.softmax(scaled, dim=-1)
    floor = p[:, _MIN_P, None] * probs.max(dim=-1, keepdim=True).values
    scaled = scaled.masked_fill(probs < floor, -math.inf)
    # Stable sort: among equal logits the lower token id ranks first.
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=x.device)[None, :]
    keep = rank < p[:, _TOP_K, None].long()
    probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= mass_before < p[:, _TOP_P, None]  # the top token always stays
    keep &= sorted_logits > -math.inf
    keep[:, 0] = True
    probs = probs * keep
    cdf = probs.cumsum(dim=-1)  # [rows, V], not renormalised: scale the draw instead
    target = (uniform.to(cdf.dtype) * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    # Rounding could land the pick one past the last kept token; step back.
    picked = torch.minimum(picked, keep.sum(dim=-1, keepdim=True) - 1)
    sampled = order.gather(1, picked).squeeze(1)
    return torch.where(p[:, _GREEDY] > 0, argmax, sampled)


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The token's log_softmax ``[n]`` and the top ``[n, K]`` values and ids."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(min(MAX_LOGPROBS, lp.shape[1]), dim=-1)
    return lp.gather(1, tokens[:, None]).squeeze(1), top.values, top.indices


def record(state: SamplerState, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """Count the rows' new tokens in their slots, on the device."""
    # scatter_add on the flat view: no host sync, so a CUDA graph captures it.
    flat = slots * state.vocab + tokens
    state.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    state.generated.index_add_(0, slots, torch.ones_like(slots))


def sample_step(logits: torch.Tensor, state: SamplerState, slots: torch.Tensor,
                uniform: torch.Tensor, bitmask: torch.Tensor | None = None) -> StepResult:
    """One step of every row: process, draw, logprobs, count. Tensor operations
    only (a CUDA graph captures it); ``slots [n]`` int64, ``uniform [n]`` float32."""
    x = process_logits(logits, state, slots, bitmask)
    tokens = draw(x, state.params[slots], uniform)
    logprob, top_values, top_ids = raw_logprobs(logits, tokens)
    record(state, slots, tokens)
    return StepResult(tokens, logprob, top_values, top_ids)


def uniforms(params: Sequence[SamplingParams], steps: Sequence[int]) -> list[float]:
    """Each row's uniform number (0 for greedy rows, which draw none)."""
    return [0.0 if p.greedy else _uniform(p, s) for p, s in zip(params, steps)]


def sample_full(logits: torch.Tensor, params: Sequence[SamplingParams], step: int | Sequence[int],
                prompts: Sequence[Sequence[int]] | None = None,
                outputs: Sequence[Sequence[int]] | None = None,
                eos_token_ids: Sequence[int] = (), bitmask: torch.Tensor | None = None) -> StepResult:
    """``sample`` with every processor and the logprobs, for rows with no state
    kept between steps (prefill's first token): ``prompts`` and ``outputs``
    are each row's prompt and generated tokens so far."""
    batch, vocab = _check(logits, params)
    steps = [step] * batch if isinstance(step, int) else list(step)
    if len(steps) != batch:
        raise ValueError(f"len(step)={len(steps)} != batch size {batch}")
    state = SamplerState(batch, vocab, logits.device, eos_token_ids)
    for i, p in enumerate(params):
        state.load(i, p, prompts[i] if prompts else (), outputs[i] if outputs else ())
    slots = torch.arange(batch, device=logits.device)
    uniform = torch.tensor(uniforms(params, steps), dtype=torch.float32, device=logits.device)
    return sample_step(logits, state, slots, uniform, bitmask)


def _check(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[int, int]:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        raise TypeError(f"logits dtype {logits.dtype} must be torch.float32")
    if len(params) != logits.shape[0]:
        raise ValueError(f"len(params)={len(params)} != batch size {logits.shape[0]}")
    return logits.shape[0], logits.shape[1]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           step: int | Sequence[int], greedy_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [B, V]`` float32 -> token ids ``[B]`` int64 on the logits' device.

    Greedy rows take the argmax (the lowest index on ties). Other rows divide
    by the temperature, keep the ``top_k`` most likely tokens, then the
    smallest most-likely prefix whose probability reaches ``top_p``, and draw.
    ``step`` is the generation step of every row, or one per row.
    ``greedy_tokens``: the argmax of ``logits`` already computed (a captured
    decode step gives it), used instead of computing it again.

    Rows with logits processors run them (``sample_full``, with no prompt:
    a repetition penalty then sees no prompt tokens). Everything runs on the
    logits' device; no result is read back here: the caller reads the ids once.
    """
    batch, _ = _check(logits, params)
    steps = [step] * batch if isinstance(step, int) else list(step)
    if len(steps) != batch:
        raise ValueError(f"len(step)={len(steps)} != batch size {batch}")
    if greedy_tokens is not None and (greedy_tokens.shape != (batch,)
                                      or greedy_tokens.dtype != torch.int64):
        raise ValueError(f"greedy_tokens must be [{batch}] int64, got "
                         f"{tuple(greedy_tokens.shape)} {greedy_tokens.dtype}")

    if all(p.greedy and not p.penalised for p in params):
        return logits.argmax(dim=-1) if greedy_tokens is None else greedy_tokens.clone()
    return sample_full(logits, params, steps).tokens
