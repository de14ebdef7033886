"""The OpenAI reply bodies: whole replies, stream chunks and SSE framing.

Completions answer ``text_completion`` objects, chat completions
``chat.completion`` (``chat.completion.chunk`` when streamed: the first
chunk's delta names the role). A stream ends with ``data: [DONE]``; with
``stream_options.include_usage`` the chunk before it has no choices and the
usage, and every other chunk says ``"usage": null``.

Logprobs, when asked, take each choice's OpenAI shape: chat's ``content``
list of ``{token, logprob, bytes, top_logprobs}``; completions' ``tokens``,
``token_logprobs``, ``top_logprobs`` (token -> logprob, the sampled token
included, as vLLM does) and ``text_offset``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lanekv.http.generate import Delta, TokenLogprob

DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: the prompt tokens whose
    compute a prefix cache skipped (GenerateReply.cached_tokens), never more than the prompt."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": max(0, min(cached_tokens, prompt_tokens))}}


@dataclass(frozen=True)
class ReplyShape:
    """How one endpoint's replies look."""

    chat: bool
    request_id: str
    model: str
    created: int
    include_usage: bool = False
    logprobs: bool = False  # whether the request asked for them
    token_text: Callable[[int], str] = str  # a token's text, for the logprobs
    _offset: list[int] = field(default_factory=lambda: [0])  # completions' text_offset so far

    def logprobs_of(self, entries: Sequence[TokenLogprob]) -> dict | None:
        """The ``logprobs`` of a choice holding these tokens (None unless asked)."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [{**self._entry(e.token_id, e.logprob),
                                 "top_logprobs": [self._entry(t, v) for t, v in e.top]} for e in entries]}
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self._offset[0])
            self._offset[0] += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None else  # the first prompt token's (echo)
                                 {**{self.token_text(t): v for t, v in e.top},
                                  self.token_text(e.token_id): e.logprob} for e in entries],
                "text_offset": offsets}

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
              cached_tokens: int = 0, logprobs: Sequence[TokenLogprob] = ()) -> dict:
        lp = self.logprobs_of(logprobs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": lp, "finish_reason": finish_reason}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def first_chunk(self) -> str | None:
        """Chat streams open with the role; completions have no such chunk."""
        if not self.chat:
            return None
        return self._chunk({"role": "assistant", "content": ""}, None)

    def chunk(self, delta: Delta) -> str:
        lp = self.logprobs_of(delta.logprobs)
        if self.chat:
            body = {} if not delta.text and delta.finish_reason else {"content": delta.text}
            return self._chunk(body, delta.finish_reason, lp)
        return self._chunk(delta.text, delta.finish_reason, lp)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> str:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)})

    def _chunk(self, content: Any, finish_reason: str | None, logprobs: dict | None = None) -> str:
        if self.chat:
            choice = {"index": 0, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}
            head = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": content, "logprobs": logprobs, "finish_reason": finish_reason}
            head = self._head("text_completion")
        body = {**head, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return sse(body)
