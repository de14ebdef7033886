"""What a decode daemon remembers of the prompts it sent to each prefill daemon,
to send a prompt where its prefix is likely cached (xPyD).

The memory is a hint: a prefill daemon may have evicted a page since, and
then computes it again. Correctness never depends on it, only the pick does.
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
