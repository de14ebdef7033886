"""The canonical encoding of a contract, and its bounded decoding.

Canonical encoding: msgpack maps with keys sorted at every depth, floats as
float64, arrays for sequences. Equality of agreements is equality of their
encodings, so ``10000`` and ``10000.0`` (or ``1`` and ``True``) differ, as
their fingerprints do. ``FrozenDict`` holds the nested maps of an agreement
(``model_config``, ``rope``) immutable and hashable; ``plain`` turns frozen
values back into the dicts and lists ``pack`` encodes.

Size: a contract is decoded as hostile input. Its encoding is at most
``MAX_CONTRACT_BYTES`` (checked before unpacking), and its shape at most
``MAX_CONTRACT_KEYS`` map entries, ``MAX_CONTRACT_DEPTH`` deep, keys of
``MAX_KEY_LEN`` characters (checked in one pass before any other work), so
decoding and diffing are linear and bounded. Our own contract obeys the same
bounds; a refused Handshake sends it back in trailing metadata next to a
diff whose values are cut short (``fielddiff.FieldDiff.describe``), and both
together stay well under gRPC's 8 KiB metadata limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import msgpack
from lanekv.transfer.protocol.wire import unpack_map

MAX_CONTRACT_BYTES = 3072  # Llama 3 70B with llama3 RoPE scaling on 8 ranks: 829 bytes
MAX_CONTRACT_KEYS = 256  # map entries at every depth together
MAX_CONTRACT_DEPTH = 8  # maps and arrays inside the contract's outer map
MAX_KEY_LEN = 128


class FrozenDict(Mapping[str, Any]):
    """An immutable, hashable mapping with sorted str keys; nested values frozen too."""

    __slots__ = ("_items", "_index")

    def __init__(self, items: Mapping[str, Any], name: str = "value") -> None:
        for key in items:
            if type(key) is not str:
                raise TypeError(f"{name} keys must be str, got {key!r:.80}")
        self._items = tuple((key, _freeze(items[key], f"{name}.{key:.80}")) for key in sorted(items))
        self._index = dict(self._items)  # lookups in O(1): diff() reads every key

    def __getitem__(self, key: str) -> Any:
        return self._index[key]

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __repr__(self) -> str:
        return repr(plain(self))


def _freeze(value: Any, name: str) -> Any:
    if isinstance(value, Mapping):
        return FrozenDict(value, name)
    if isinstance(value, list | tuple):
        return tuple(_freeze(item, f"{name}[{i}]") for i, item in enumerate(value))
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(
        f"{name} must be a str, number, bool, None, list or dict, got {type(value).__name__}"
    )


def plain(value: Any) -> Any:
    """Frozen value -> plain dicts (keys sorted) and lists, ready for msgpack."""
    if isinstance(value, Mapping):
        return {key: plain(value[key]) for key in sorted(value)}
    if isinstance(value, tuple):
        return [plain(item) for item in value]
    return value


def pack(value: Any) -> bytes:
    """The canonical msgpack bytes of a (frozen or plain) value: what fingerprints hash."""
    return msgpack.packb(plain(value), use_bin_type=True, use_single_float=False)


def unpack_contract(data: bytes, what: str) -> dict:
    """Unpack an untrusted contract, refusing one too large or too complex before any other work."""
    value = unpack_map(data, what, MAX_CONTRACT_BYTES)
    entries, stack = 0, [(value, 0)]
    while stack:  # one pass, no recursion
        item, depth = stack.pop()
        if isinstance(item, dict):
            entries += len(item)
            if entries > MAX_CONTRACT_KEYS:
                raise ValueError(f"{what} has more than {MAX_CONTRACT_KEYS} map entries")
            for key in item:
                if isinstance(key, str | bytes) and len(key) > MAX_KEY_LEN:
                    raise ValueError(f"{what} has a key of {len(key)} characters, more than {MAX_KEY_LEN}")
            children = item.values()
        elif isinstance(item, tuple):
            children = item
        else:
            continue
        if depth >= MAX_CONTRACT_DEPTH:
            raise ValueError(f"{what} is nested more than {MAX_CONTRACT_DEPTH} deep")
        stack.extend((child, depth + 1) for child in children)
    return value
