"""The field diff of two agreements: what a refused Handshake says differs.

``diff`` names every differing agreement field with both values (nested keys
as ``a.b``), ``format_diff`` turns it into the status message: values cut to
``DIFF_VALUE_CHARS`` characters and at most ``DIFF_FIELDS_DESCRIBED`` fields
described, so the message stays small whatever a peer sends. Values are
compared by their canonical encoding, so the diff agrees with the fingerprint.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.encoding import pack

# In a refused Handshake's message: each value's text is cut to this many
# characters, and at most this many differing fields are described.
DIFF_VALUE_CHARS = 72  # a sha256 in hex, quoted, fits
DIFF_FIELDS_DESCRIBED = 8


def _short(value: Any) -> str:
    """ASCII text of a value, cut to ``DIFF_VALUE_CHARS`` (status messages stay small)."""
    text = ascii(value)
    if len(text) <= DIFF_VALUE_CHARS:
        return text
    return f"{text[:DIFF_VALUE_CHARS]}... ({len(text)} characters)"


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()


class FieldDiff(NamedTuple):
    name: str  # an agreement field, or "field.key" inside model_config / rope
    ours: Any
    theirs: Any

    def describe(self, ours: str = "ours", theirs: str = "theirs") -> str:
        """``name: ours=... theirs=...``, each value cut to ``DIFF_VALUE_CHARS`` characters."""
        return f"{self.name}: {ours}={_short(self.ours)} {theirs}={_short(self.theirs)}"

    def __str__(self) -> str:
        return self.describe()


def _diff_values(name: str, ours: Any, theirs: Any) -> list[FieldDiff]:
    if ours is ABSENT or theirs is ABSENT:
        return [FieldDiff(name, ours, theirs)]
    if pack(ours) == pack(theirs):
        return []
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for key in sorted(set(ours) | set(theirs)):
            out += _diff_values(f"{name}.{key}", ours.get(key, ABSENT), theirs.get(key, ABSENT))
        return out
    return [FieldDiff(name, ours, theirs)]


def diff(ours: Agreement, theirs: Agreement) -> list[FieldDiff]:
    """Every differing agreement field with both values, by field name (nested keys as ``a.b``).
    Sides whose ``kv_cache_dtype`` differs get that one field: the row fields that follow
    from it (``kv_dtype``, ``head_dim``, ``kv_row_format``) would only repeat it."""
    mine, other = ours.to_dict(), theirs.to_dict()
    if mine["kv_cache_dtype"] != other["kv_cache_dtype"]:
        return [FieldDiff("kv_cache_dtype", mine["kv_cache_dtype"], other["kv_cache_dtype"])]
    out = []
    for name in mine:
        out += _diff_values(name, mine[name], other[name])
    return out


def format_diff(diffs: Iterable[FieldDiff], ours: str = "ours", theirs: str = "theirs") -> str:
    """One line per differing field, e.g. ``page_size: server=64 caller=16``; past
    ``DIFF_FIELDS_DESCRIBED`` fields, the rest only by name on one line."""
    diffs = list(diffs)
    lines = [d.describe(ours, theirs) for d in diffs[:DIFF_FIELDS_DESCRIBED]]
    rest = diffs[DIFF_FIELDS_DESCRIBED:]
    if rest:
        names = ", ".join(d.name for d in rest)
        cut = names if len(names) <= 7 * DIFF_VALUE_CHARS else names[: 7 * DIFF_VALUE_CHARS] + "..."
        lines.append(f"and {len(rest)} more: {cut}")
    return "\n".join(lines)
