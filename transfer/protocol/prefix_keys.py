"""The key of a cached prompt page, the same on both sides of a pairing.

A hash chain: page k's key hashes page k-1's key and page k's token ids, and
page 0 starts from the agreement's fingerprint. So a page matches only when
every page before it matches, and another model, layout or build never does.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_keys(seed: str, token_ids: Sequence[int], page_size: int, num_pages: int) -> list[bytes]:
    """The keys of the first ``num_pages`` whole pages of ``token_ids`` (fewer when it has
    fewer; ``seed``: the agreement's fingerprint). Each side keys and matches only its own cache, so the
    encoding (int64 words) need only agree within one build; packed once, not per
    token, since the decode loop keys a finished request's pages (about 1 ms for 4k tokens)."""
    num_pages = min(num_pages, len(token_ids) // page_size)  # only whole pages have keys
    keys, key = [], seed.encode()
    words = memoryview(array("q", token_ids[: num_pages * page_size]).tobytes())
    step = 8 * page_size
    for k in range(num_pages):
        digest = hashlib.blake2b(key, digest_size=16)
        digest.update(words[k * step : (k + 1) * step])
        key = digest.digest()
        keys.append(key)
    return keys
