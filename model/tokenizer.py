"""A thin wrapper over a checkpoint's ``tokenizer.json``.

Text is a convenience at the edge (the ``lanekv`` command line); the rest of
the system takes token ids directly, so a checkpoint without a tokenizer is
still served.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tokenizers

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class Tokenizer:
    backend: tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids as the checkpoint's own pipeline makes them (BOS included when
        its post-processor adds one)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def load_tokenizer(path: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer | None:
    """The tokenizer of checkpoint folder ``path``, or None without ``tokenizer.json``.
    ``eos_token_ids`` come from the model config, which is what generation stops on."""
    file = Path(path) / TOKENIZER_FILE
    if not file.exists():
        return None
    return Tokenizer(tokenizers.Tokenizer.from_file(str(file)), tuple(eos_token_ids))
