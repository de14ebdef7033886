"""Streamed text: the piece of text each generated token adds."""

from __future__ import annotations

from lanekv.model.tokenizer import Tokenizer


class Detokenizer:
    """Text pieces of a stream of ids: each piece is what the new ids add to the text.

    Only a short window is decoded per token (the ids since the last piece and
    the one before them, whose text is subtracted), so a long stream costs
    linear time; the window keeps a leading context because tokenizers render
    a token's leading space differently at the start of a text.
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids before this one are in the text already

    def piece(self, token_id: int | None) -> str:
        return "" if token_id is None else self.pieces([token_id])

    def pieces(self, token_ids: list[int]) -> str:
        """The text several new ids add, decoding the window once for all of them."""
        if self._tokenizer is None or not token_ids:
            return ""
        self._ids.extend(token_ids)
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        text = self._tokenizer.decode(self._ids[self._prefix:])
        # Hold a multi-byte character until it is complete.
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]
