"""Host cost of structured output: compiling a grammar and filling each step's masks.

A step of a batch with grammar requests is launched only after the step before
it was read and its tokens accepted, and each row's mask is filled on the host
then (``model/grammar``), so this cost lies on the decode loop's path. Here a
byte-level BPE tokenizer of ``--vocab`` tokens is trained on this repository's
text (no hub downloads here; a real model's tokenizer is of the same kind), the
mask width is that of ``--model-vocab`` logits, and for each spec: the first
compile, a compile from the cache, and per decode step the fill of every row's
mask plus the accept of its token (each matcher walks a valid output, its
tokens drawn at random among those its mask allows), for ``--batches`` rows.

    python bench/grammar.py --vocab 32000 --model-vocab 128256 --batches 1 16 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lanekv.model.grammar import Grammars, GrammarSpec, bitmask_words, fill_bitmasks  # noqa: E402
from lanekv.model.sampling import unpack_bitmask  # noqa: E402

from bench.stats import percentiles  # noqa: E402

SPECIALS = ("<unk>", "<s>", "</s>")
EOS = 2
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
SPECS = {"json_schema": GrammarSpec("json_schema", json.dumps(PERSON)),
         "json_object": GrammarSpec("json_object"),
         "regex": GrammarSpec("regex", r"[A-Z][a-z]{2,12} [0-9]{1,4}(, [A-Z][a-z]{2,12} [0-9]{1,4}){0,5}")}


def train_tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [p.read_text(errors="ignore") for p in sorted(ROOT.rglob("*")) if p.suffix in (".py", ".md")
             and ".venv" not in p.parts and ".extra" not in p.parts]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def walk(grammars: Grammars, spec: GrammarSpec, rows: int, steps: int, rng: random.Random) -> list[float]:
    """Seconds per step of filling ``rows`` masks and accepting a token per row."""
    matchers = [grammars.matcher(spec) for _ in range(rows)]
    bitmask = torch.empty((rows, grammars.words), dtype=torch.int32)
    vocab = grammars.vocab_size
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fill_bitmasks(matchers, bitmask)
        elapsed = time.perf_counter() - start
        allowed = unpack_bitmask(bitmask, vocab)
        tokens = []
        for row in range(rows):
            ids = allowed[row].nonzero().flatten().tolist()
            # Prefer ending once it may end, so that a walk stays a plausible output's length.
            tokens.append(EOS if EOS in ids and rng.random() < 0.3 else rng.choice(ids))
        start = time.perf_counter()
        for matcher, token in zip(matchers, tokens):
            if not matcher.accept(token):
                raise RuntimeError(f"a token its mask allowed was refused: {token}")
        elapsed += time.perf_counter() - start
        times.append(elapsed)
        for row, matcher in enumerate(matchers):
            if matcher.terminated:
                matchers[row] = grammars.matcher(spec)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000, help="tokens of the trained tokenizer")
    ap.add_argument("--model-vocab", type=int, default=128256, help="logits per row (the mask's width)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    tok = train_tokenizer(args.vocab)
    train_s = time.perf_counter() - t0
    rows = []
    for name, spec in SPECS.items():
        grammars = Grammars(tok, args.model_vocab, (EOS,))
        if name == "json_schema":  # the compiler's tokenizer info, built once per daemon
            t0 = time.perf_counter()
            grammars.compile(GrammarSpec("regex", "x"))
            info_s = time.perf_counter() - t0
        else:
            grammars.compile(GrammarSpec("regex", "x"))
        t0 = time.perf_counter()
        grammars.compile(spec)
        first_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        grammars.compile(spec)
        cached_ms = (time.perf_counter() - t0) * 1e3
        for batch in args.batches:
            times = walk(grammars, spec, batch, args.steps, random.Random(0))
            row = dict(spec=name, batch=batch, compile_ms=first_ms, cached_compile_ms=cached_ms,
                       **percentiles("step_host_ms", [t * 1e3 for t in times]))
            row["per_row_us_p50"] = row["step_host_ms_p50"] * 1e3 / batch
            rows.append(row)
    print(f"\nstructured output, host side: tokenizer {tok.get_vocab_size()} tokens (trained in {train_s:.1f} s), "
          f"masks of {args.model_vocab} logits ({bitmask_words(args.model_vocab)} words); tokenizer info "
          f"built in {info_s:.2f} s")
    print(f"{'spec':>12} {'batch':>5} {'compile ms':>10} {'cached ms':>9} {'step p50 ms':>11} {'p99 ms':>7} "
          f"{'us/row':>7}")
    for r in rows:
        print(f"{r['spec']:>12} {r['batch']:>5} {r['compile_ms']:>10.1f} {r['cached_compile_ms']:>9.3f} "
              f"{r['step_host_ms_p50']:>11.3f} {r['step_host_ms_p99']:>7.3f} {r['per_row_us_p50']:>7.1f}")
    print(f"step: fill every row's mask and accept its token, {args.steps} steps, perf_counter")
    if args.json:
        args.json.write_text(json.dumps(dict(vocab=tok.get_vocab_size(), model_vocab=args.model_vocab,
                                             tokenizer_info_s=info_s, rows=rows), indent=2))


if __name__ == "__main__":
    main()
