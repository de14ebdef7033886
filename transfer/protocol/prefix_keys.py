"""The key of a cached prompt page, the same on both sides of a pairing.

A hash chain: page k's key hashes page k-1's key and page k's token ids, and
page 0 starts from the agreement's fingerprint. So a page matches only when
every page before it matches, and another model, layout or build never does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def chain_keys(seed: str, token_ids: Sequence[int], page_size: int, num_pages: int) -> list[bytes]:
    """The keys of the first ``num_pages`` whole pages of ``token_ids`` (``seed``: the
    agreement's fingerprint)."""
    keys, key = [], seed.encode()
    for k in range(num_pages):
        page = token_ids[k * page_size : (k + 1) * page_size]
        digest = hashlib.blake2b(key, digest_size=16)
        digest.update(b",".join(str(int(t)).encode() for t in page))
        key = digest.digest()
        keys.append(key)
    return keys
