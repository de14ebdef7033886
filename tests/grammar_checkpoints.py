"""A tiny checkpoint whose tokenizer spells any text (for structured-output tests).

The word-level tokenizer of ``tests.checkpoints`` cannot spell JSON; this one is
the byte-level BPE of ``lanekv tiny-model`` (every byte a token, plus merges), over
``tests.checkpoints``' tiny Llama (vocab 300, 2 layers, hidden 64), with its chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from lanekv.tiny_model import CHAT_TEMPLATE, _tokenizer
from tests.checkpoints import VOCAB_SIZE, write_llama


def write_grammar_checkpoint(path: Path, seed: int = 0) -> Path:
    write_llama(path, seed=seed)
    _tokenizer(VOCAB_SIZE).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
    }))
    return path
