"""``echo`` on ``/v1/completions``: the prompt comes back before the output.

As OpenAI's legacy completions and vLLM answer it: the choice's text is the
prompt's text followed by the generated text, and with ``logprobs: k`` the
``logprobs`` lists hold one entry per prompt token first (the first prompt
token's logprob and top tokens are ``null``: nothing precedes it), then the
generated tokens'. ``max_tokens: 0`` returns the prompt alone: what
lm-evaluation-harness's loglikelihood requests read. With ``logprobs`` the
decode daemon is asked for ``max_new_tokens`` 0: the prompt is prefilled and
scored, no KV moves and nothing is decoded. Without ``logprobs`` (the text
alone) one token is made and dropped. Either way usage counts no completion
token.

The prompt's logprobs come from the prefill daemon, each CP rank scoring the
prompt tokens after the rows it owns (``PrefillRequest.prompt_logprobs``);
such a request is prefilled whole, never from a prefix cache, so
``prompt_tokens_details.cached_tokens`` is 0 for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lanekv.http.errors import APIError
from lanekv.http.generate import TokenLogprob


@dataclass(frozen=True)
class Echo:
    """What one request echoes."""

    text: str  # the prompt as the reply shows it
    prompt_ids: tuple[int, ...]
    only: bool  # max_tokens 0: nothing generated is returned

    @classmethod
    def of(cls, prompt: str | tuple[int, ...], ids: tuple[int, ...], max_tokens: int | None,
           decode: Callable[[list[int]], str] | None, token_text: Callable[[int], str]) -> Echo:
        """The echo of a prompt given as text (returned as given) or token ids (decoded)."""
        if isinstance(prompt, str):
            text = prompt
        elif decode is not None:
            text = decode(list(ids))
        else:
            text = "".join(token_text(t) for t in ids)
        return cls(text, ids, max_tokens == 0)

    def entries(self, scored: Sequence[TokenLogprob]) -> tuple[TokenLogprob, ...]:
        """The prompt's logprob entries: the first token's empty, then the daemon's (one per
        later prompt token, in order); a 502 if the daemon's do not match the prompt."""
        later = self.prompt_ids[1:]
        if tuple(e.token_id for e in scored) != later:
            raise APIError(502, f"the decode daemon sent logprobs of {len(scored)} prompt tokens for a "
                           f"prompt of {len(self.prompt_ids)} (or of other tokens)")
        return (TokenLogprob(self.prompt_ids[0], None, None), *scored)
