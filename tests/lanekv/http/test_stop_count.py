"""Usage at a stop string counts the tokens up to the one that completed it, also when one
reply from the decode daemon carried several tokens (it batches replies for a slow reader)."""

from __future__ import annotations

from lanekv.http.generate import Generation, StopMatcher

PIECES = ["He", "llo", " wo", "rld", " and", " more"]  # token i decodes to PIECES[i]


def _decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def test_the_matcher_says_where_the_stop_string_ends():
    stops = StopMatcher((" world",))
    assert stops.feed("Hello wor") == "Hello"
    assert not stops.hit
    assert stops.feed("ld and more") == ""
    assert stops.hit and stops.stop_end == len("Hello world")


def test_a_batched_reply_counts_only_the_tokens_up_to_the_stop():
    generation = Generation(backends=None, plan=None, timeout_s=1.0, decode=_decode)
    generation.completion_tokens = 6
    generation._token_ids = [0, 1, 2, 3, 4, 5]  # one reply of 4 tokens after a reply of 2
    generation._count_to(len("Hello world"), in_reply=4)
    assert generation.completion_tokens == 4
    # Without a tokenizer the count stays what the daemon generated.
    blind = Generation(backends=None, plan=None, timeout_s=1.0)
    blind.completion_tokens, blind._token_ids = 6, [0, 1, 2, 3, 4, 5]
    blind._count_to(len("Hello world"), in_reply=4)
    assert blind.completion_tokens == 6
