"""What a router remembers of the prompts it sent to each daemon, to send a prompt
where its prefix is likely cached: the decode daemon of its prefill daemons
(xPyD), ``lanekv serve`` of its decode daemons.

The memory is a hint: a daemon may have evicted a page since, and then
computes or moves it again. Correctness never depends on it, only the pick
does. Each reply says how much of the prompt the daemon's cache holds once it
is done (``PrefillReply.prefix_cache_pages``, ``GenerateReply.prefix_cache_tokens``):
``observe`` remembers that much and forgets what it remembered of the prompt
past it, so an evicted prefix stops steering picks after the first reply that
shows it gone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from lanekv.transfer.protocol.prefix_keys import chain_keys


class PrefixMemory:
    """The chain keys of whole prompt pages sent to one prefill daemon, the most
    recent ``capacity`` of them."""

    def __init__(self, seed: str, page_size: int, capacity: int = 1 << 16) -> None:
        self.seed, self.page_size, self.capacity = seed, page_size, capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, token_ids: Sequence[int]) -> None:
        keys = chain_keys(self.seed, token_ids, self.page_size, len(token_ids) // self.page_size)
        with self._lock:
            for key in keys:
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def observe(self, token_ids: Sequence[int], held_tokens: int, hit_tokens: int | None = None) -> bool:
        """The daemon's reply: its cache holds the first ``held_tokens`` of ``token_ids``
        now (its hit at the start was ``hit_tokens``). Remember those whole pages, forget
        the prompt's pages past them; whether we had remembered more than the daemon
        held at the start (``hit_tokens``; without it: holds now), a prefix evicted there since."""
        if isinstance(held_tokens, bool) or not isinstance(held_tokens, int) or held_tokens < 0:
            raise ValueError(f"held_tokens must be an int >= 0, got held_tokens={held_tokens!r}")
        keys = chain_keys(self.seed, token_ids, self.page_size, len(token_ids) // self.page_size)
        held = min(held_tokens // self.page_size, len(keys))
        with self._lock:
            known = 0
            while known < len(keys) and keys[known] in self._keys:
                known += 1
            for key in keys[:held]:
                self._keys[key] = None
                self._keys.move_to_end(key)
            for key in keys[held:]:
                self._keys.pop(key, None)
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)
        if hit_tokens is None:  # the daemon's reply says what it holds now only
            return known > held
        # A prefill hit never covers the prompt's last token (computed to sample the first output).
        usable = (len(token_ids) - 1) // self.page_size
        return min(known, usable) * self.page_size > hit_tokens

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of the longest run of ``token_ids``' leading whole pages remembered here."""
        count = 0
        keys = chain_keys(self.seed, token_ids, self.page_size, len(token_ids) // self.page_size)
        with self._lock:
            for key in keys:
                if key not in self._keys:
                    break
                count += 1
        return count * self.page_size


# A remembered prefix steers a pick only when it covers at least this share of the
# prompt (as SGLang's cache-aware router's threshold): a short shared head (a BOS
# page, a brief system prompt) would otherwise send all sequential traffic to one daemon.
ROUTE_MIN_SHARE = 0.5


def routed_hit(cached_tokens: int, prompt_tokens: int) -> int:
    """The cached tokens a pick counts: all of them past ``ROUTE_MIN_SHARE`` of the prompt, else none."""
    return cached_tokens if cached_tokens >= ROUTE_MIN_SHARE * prompt_tokens else 0


def pick_cost(queued_tokens: int, prompt_tokens: int, cached_tokens: int) -> int:
    """What a daemon has to compute before a prompt's prefill is done: what is queued
    on it, plus the prompt less its cached prefix. The least wins, so a daemon holding
    a longer prefix is preferred unless it is busier by more than that prefix."""
    return queued_tokens + prompt_tokens - cached_tokens
