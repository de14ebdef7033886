"""The page manifest of a prefilled request (msgpack in PrefillReply.manifest).

It lists the request's logical pages in order, each with its owner rank and
how many of its rows are real tokens, so the decode side can allocate its own
pages, fetch each page from its owner and place it, and knows the sequence
length. It is untrusted input on the decode side: ``decode`` checks every field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import msgpack
from lanekv.transfer.protocol.wire import (
    MAX_REQUEST_ID_LEN,
    check_int,
    check_keys,
    check_str,
    unpack_map,
    untrusted,
)

MAX_PAGES = 1 << 22
MAX_PAGE_ID = 1 << 40
MAX_MANIFEST_BYTES = 64 << 20
_KEYS = ("request_id", "page_size", "num_tokens", "pages")


class ManifestPage(NamedTuple):
    page: int  # logical page id on the prefill side
    owner: int  # CP rank that holds it
    valid_rows: int  # rows of the page that hold real tokens


@dataclass(frozen=True)
class Manifest:
    request_id: str
    page_size: int
    num_tokens: int
    pages: tuple[ManifestPage, ...]

    def __post_init__(self) -> None:
        check_str("request_id", self.request_id, MAX_REQUEST_ID_LEN)
        check_int("page_size", self.page_size, 1, 1 << 20)
        check_int("num_tokens", self.num_tokens, 1, MAX_PAGES * self.page_size)
        object.__setattr__(self, "pages", tuple(ManifestPage(*p) for p in self.pages))
        expected = -(-self.num_tokens // self.page_size)
        if len(self.pages) != expected:
            raise ValueError(
                f"pages lists {len(self.pages)} pages, but num_tokens={self.num_tokens} at "
                f"page_size={self.page_size} needs {expected}"
            )
        seen = set()
        for k, (page, owner, valid) in enumerate(self.pages):
            check_int(f"pages[{k}].page", page, 0, MAX_PAGE_ID)
            check_int(f"pages[{k}].owner", owner, 0, 1 << 16)
            want = min(self.page_size, self.num_tokens - k * self.page_size)
            if valid != want:
                raise ValueError(f"pages[{k}].valid_rows must be {want}, got {valid!r}")
            if page in seen:
                raise ValueError(f"pages[{k}].page={page} is listed twice")
            seen.add(page)

    def pages_of_owner(self, owner: int) -> list[int]:
        return [p.page for p in self.pages if p.owner == owner]

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "num_tokens": self.num_tokens,
                "page_size": self.page_size,
                "pages": [list(p) for p in self.pages],
                "request_id": self.request_id,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        with untrusted("manifest"):
            value = unpack_map(data, "manifest", MAX_MANIFEST_BYTES)
            check_keys("manifest", value, _KEYS)
            pages = value["pages"]
            if not isinstance(pages, list | tuple) or len(pages) > MAX_PAGES:
                raise ValueError(f"manifest.pages must be a list of at most {MAX_PAGES} entries")
            for k, p in enumerate(pages):
                if not isinstance(p, list | tuple) or len(p) != 3:
                    raise ValueError(f"manifest.pages[{k}] must be [page, owner, valid_rows], got {p!r:.80}")
            return cls(value["request_id"], value["page_size"], value["num_tokens"], tuple(pages))
