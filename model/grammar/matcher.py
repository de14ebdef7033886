"""xgrammar over one tokenizer: compiled grammars and each request's matcher.

``Grammars`` compiles a ``GrammarSpec`` against the tokenizer a daemon loaded
(kept by spec, the most recently used), and
makes a ``RequestGrammar`` per request: its matcher, which fills the next
token's bitmask (``[ceil(vocab / 32)]`` int32, bit ``t % 32`` of word ``t // 32``
set: token ``t`` allowed, what ``model.sampling.process_logits`` applies) and
accepts each sampled token. The matcher terminates once it accepted one of
the model's end-of-sequence tokens after a complete output.

The prefill daemon fills the first token's mask (``first_mask``); the decode
daemon's matcher starts by accepting that first token and continues from
there, so both sides agree on the grammar's state. xgrammar is imported on
first use.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from lanekv.model.grammar.spec import GrammarSpec, error_text, grammar_of

CACHE_BYTES = 256 * 2**20  # compiled grammars kept by spec, the least recently used dropped first
COMPILER_CACHE_BYTES = 64 * 2**20  # what xgrammar's compiler keeps besides


def bitmask_words(vocab_size: int) -> int:
    """32-bit words of one row's token bitmask."""
    return -(-vocab_size // 32)


class RequestGrammar:
    """One request's matcher. Touched by one thread at a time (the decode loop's)."""

    def __init__(self, spec: GrammarSpec, matcher) -> None:
        self.spec = spec
        self._matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) when the grammar does not allow it."""
        return bool(self._matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        """The output is complete and its end-of-sequence token accepted."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next token's mask into ``bitmask[row]`` (CPU int32 ``[n, words]``)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


def fill_bitmasks(grammars: Sequence[RequestGrammar | None], bitmask: torch.Tensor) -> None:
    """Each row's next-token mask into ``bitmask[:len(grammars)]`` (CPU int32); rows
    without a grammar, and rows past them, allow every token (all ones)."""
    bitmask.fill_(-1)
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.fill(bitmask, row)


class Grammars:
    """Compiles grammars for one tokenizer (``tokenizers.Tokenizer``) and a model of
    ``vocab_size`` logits whose end-of-sequence ids are ``eos_token_ids``. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer.json")
        if not eos_token_ids:
            raise ValueError("structured output needs the model's eos_token_id (a grammar ends on it)")
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self._lock = threading.Lock()
        self._compiler = None
        self._compiled: dict[GrammarSpec, object] = {}  # spec -> compiled grammar, least recent first
        self._bytes = 0  # their memory_size_bytes

    @property
    def words(self) -> int:
        return bitmask_words(self.vocab_size)

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                  cache_limit_bytes=COMPILER_CACHE_BYTES)
            return self._compiler

    def compile(self, spec: GrammarSpec):
        """The compiled grammar (kept by spec, up to ``CACHE_BYTES`` of them); ValueError
        naming the kind and xgrammar's reason when it does not compile."""
        with self._lock:
            compiled = self._compiled.pop(spec, None)
            if compiled is not None:
                self._compiled[spec] = compiled  # the most recently used last
                return compiled
        grammar = grammar_of(spec)  # ValueError naming the kind and the reason
        try:
            compiled = self._get_compiler().compile_grammar(grammar)
        except RuntimeError as err:
            raise ValueError(f"grammar ({spec.kind}) does not compile: {error_text(err)}") from None
        with self._lock:
            self._compiled[spec] = compiled
            self._bytes = sum(c.memory_size_bytes for c in self._compiled.values())
            while self._bytes > CACHE_BYTES and len(self._compiled) > 1:
                self._bytes -= self._compiled.pop(next(iter(self._compiled))).memory_size_bytes
        return compiled

    def matcher(self, spec: GrammarSpec) -> RequestGrammar:
        """A fresh matcher of ``spec`` at its start."""
        import xgrammar as xgr

        return RequestGrammar(spec, xgr.GrammarMatcher(self.compile(spec)))

    def first_mask(self, spec: GrammarSpec) -> bytes:
        """The first token's bitmask of ``spec``, as bytes (``words`` little-endian int32)."""
        bitmask = torch.empty((1, self.words), dtype=torch.int32)
        self.matcher(spec).fill(bitmask, 0)
        return bitmask.numpy().tobytes()


def masks_from_bytes(masks: Sequence[bytes | None], words: int) -> torch.Tensor | None:
    """Rows of ``first_mask`` bytes (None: every token allowed) as a CPU ``[n, words]``
    int32 bitmask; None when no row has a mask."""
    if all(m is None for m in masks):
        return None
    out = torch.full((len(masks), words), -1, dtype=torch.int32)
    for row, mask in enumerate(masks):
        if mask is not None:
            if len(mask) != 4 * words:
                raise ValueError(f"grammar mask of row {row} has {len(mask)} bytes, want {4 * words}")
            out[row] = torch.frombuffer(bytearray(mask), dtype=torch.int32)
    return out
