"""The layout contract: what both sides must agree on before any KV byte moves.

``Agreement`` holds every field that decides how KV bytes are laid out or
what they mean; it must be equal on both sides, and its fingerprint (sha256
of its canonical msgpack encoding) travels with every FetchKV and Release.
``Topology`` is the prefill side's own (CP size, split mode, owner rule, the
owner ranks' endpoints): the decode side is told it, checks it for
consistency and uses it to fetch, but never matches it against its own.

Canonical encoding: msgpack maps with keys sorted at every depth, floats as
float64, arrays for sequences. Equality of agreements is equality of their
encodings, so ``10000`` and ``10000.0`` (or ``1`` and ``True``) differ, as
their fingerprints do.

Size: a contract is decoded as hostile input. Its encoding is at most
``MAX_CONTRACT_BYTES`` (checked before unpacking), and its shape at most
``MAX_CONTRACT_KEYS`` map entries, ``MAX_CONTRACT_DEPTH`` deep, keys of
``MAX_KEY_LEN`` characters (checked in one pass before any other work), so
decoding and diffing are linear and bounded. Our own contract obeys the same
bounds; a refused Handshake sends it back in trailing metadata next to a
diff whose values are cut short (``FieldDiff.describe``), and both together
stay well under gRPC's 8 KiB metadata limit.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import torch
from lanekv.transfer.protocol.wire import (
    KV_DTYPES,
    MAX_HEAD_DIM,
    MAX_KV_HEADS,
    MAX_LAYERS,
    MAX_PAGE_SIZE,
    MAX_RANKS,
    WIRE_VERSION,
    check_int,
    check_keys,
    check_str,
    dtype_name,
    kv_dtype,
    unpack_map,
    untrusted,
)

# The pool tensor of docs/structure.md: [num_layers, kv, num_pages * page_size, kv_heads, head_dim],
# kv = 2 (K, V) for GQA, 1 for MLA (one latent row, kv_heads = 1).
POOL_LAYOUT = "layer,kv,page*row,head,dim"
ATTENTION_KINDS = ("gqa", "mla")
# The MLA dims of an agreement; all 0 for GQA (q_lora_rank 0: no q LoRA).
MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank")
# DeepSeek sparse attention (DSA): the indexer's dims and the index-K row the pool
# carries after each latent row (kernels/dsa/pool_layout.py); all 0 / "" without DSA.
DSA_INT_FIELDS = ("index_n_heads", "index_head_dim", "index_topk", "index_block",
                  "index_row_bytes")
INDEX_CACHE_DTYPES = ("fp8_e4m3", "model")
# The KV rows' dtype (model/attention/rows.py): "auto", values of kv_dtype, or
# "fp8_e4m3", a uint8 pool whose rows are named by kv_row_format (head_dim counts bytes).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def mla_fp8_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of an FP8 MLA latent row (``kernels/fp8/kv_rows.py``): 656 for 512 + 64."""
    return kv_lora_rank + 4 * (kv_lora_rank // math.gcd(kv_lora_rank, 128)) + 2 * rope_dim


def mla_fp8_row_stride(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes a pool gives that row: rounded up to 16 (``kernels/fp8/kv_rows.py``'s)."""
    return -(-mla_fp8_row_bytes(kv_lora_rank, rope_dim) // 16) * 16


def dsa_row_elements(latent_dim: int, itemsize: int, index_row_bytes: int) -> int:
    """Pool elements per DSA row: the latent, then the index-K bytes from the next
    4-byte boundary, rounded up to 16 bytes (``kernels/dsa/pool_layout.py``'s layout)."""
    def round_up(n: int, to: int) -> int:
        return -(-n // to) * to
    return round_up(round_up(latent_dim * itemsize, 4) + index_row_bytes, 16) // itemsize
SPLIT_MODES = ("in_seq",)
OWNER_RULES = ("page_mod_cp",)
# The modules whose code defines the layout and what goes over the wire: a
# change to any of them changes source_digest, so two builds with different
# code refuse each other. The fast path's descriptors and the digest that
# seals them are wire too: two builds that digest differently would otherwise
# fail every fast-path check and fall back to gRPC without saying why.
CONTRACT_SOURCES = (
    "lanekv.prefill.plan",
    "lanekv.prefill.layout",
    "lanekv.transfer.protocol.wire",
    "lanekv.transfer.protocol.contract",
    "lanekv.transfer.protocol.descriptors",
    "lanekv.kernels.page_digest",
)
# The folder holding the lanekv subpackages' folders: the repository's top in
# a checkout (kernels/, prefill/, ...), site-packages/lanekv in a wheel. A
# module lanekv.a.b is the file a/b.py under it.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# Keys of ModelConfig.contract_fields() that become Agreement fields of their own.
_OWN_MODEL_FIELDS = ("architecture", "num_layers", "num_kv_heads", "head_dim", "rope")
_MAX_TEXT = 256  # architecture, digests, pool layout: all far shorter
MAX_CONTRACT_BYTES = 3072  # Llama 3 70B with llama3 RoPE scaling on 8 ranks: 829 bytes
MAX_CONTRACT_KEYS = 256  # map entries at every depth together
MAX_CONTRACT_DEPTH = 8  # maps and arrays inside the contract's outer map
MAX_KEY_LEN = 128
# In a refused Handshake's message: each value's text is cut to this many
# characters, and at most this many differing fields are described.
DIFF_VALUE_CHARS = 72  # a sha256 in hex, quoted, fits
DIFF_FIELDS_DESCRIBED = 8


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
        return repr(_plain(self))


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


def _plain(value: Any) -> Any:
    """Frozen value -> plain dicts (keys sorted) and lists, ready for msgpack."""
    if isinstance(value, Mapping):
        return {key: _plain(value[key]) for key in sorted(value)}
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


def _pack(value: Any) -> bytes:
    return msgpack.packb(_plain(value), use_bin_type=True, use_single_float=False)


@dataclass(frozen=True, eq=False)
class Agreement:
    architecture: str
    model_config: FrozenDict  # the model fields that have no field of their own
    rope: FrozenDict
    num_layers: int
    num_kv_heads: int
    head_dim: int
    weights_digest: str
    kv_dtype: str
    page_size: int
    pool_layout: str
    wire_version: int
    source_digest: str
    attention: str = "gqa"  # one of ATTENTION_KINDS
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_cache_dtype: str = ""  # one of INDEX_CACHE_DTYPES for DSA
    index_block: int = 0  # values per float32 scale of an fp8 index key
    index_row_bytes: int = 0
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    kv_row_format: str = ""  # the FP8 row layout's name; "" for rows of plain kv_dtype values

    @property
    def kv_planes(self) -> int:
        """Planes per layer in the pool and on the wire: 2 (K, V), or 1 latent for MLA."""
        return 1 if self.attention == "mla" else 2

    def __post_init__(self) -> None:
        for name in ("model_config", "rope"):
            value = getattr(self, name)
            if not isinstance(value, Mapping):
                raise TypeError(f"{name} must be a mapping, got {type(value).__name__}")
            object.__setattr__(self, name, FrozenDict(value, name))
        for name in ("architecture", "weights_digest", "pool_layout", "source_digest"):
            check_str(name, getattr(self, name), _MAX_TEXT)
        check_int("num_layers", self.num_layers, 1, MAX_LAYERS)
        check_int("num_kv_heads", self.num_kv_heads, 1, MAX_KV_HEADS)
        check_int("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        check_int("page_size", self.page_size, 1, MAX_PAGE_SIZE)
        check_int("wire_version", self.wire_version, 1, 1 << 31)
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {self.kv_dtype!r}")
        check_str("kv_cache_dtype", self.kv_cache_dtype, _MAX_TEXT)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        check_str("kv_row_format", self.kv_row_format, _MAX_TEXT, allow_empty=True)
        fp8 = self.kv_cache_dtype == "fp8_e4m3"
        if fp8 and (self.kv_dtype != "uint8" or not self.kv_row_format):
            raise ValueError(f"kv_cache_dtype='fp8_e4m3' needs kv_dtype='uint8' and a "
                             f"kv_row_format, got kv_dtype={self.kv_dtype!r} "
                             f"kv_row_format={self.kv_row_format!r}")
        if not fp8 and self.kv_row_format:
            raise ValueError(f"kv_row_format must be empty with kv_cache_dtype="
                             f"{self.kv_cache_dtype!r}, got {self.kv_row_format!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        mla = self.attention == "mla"
        for name in MLA_FIELDS:
            low = (0 if name == "q_lora_rank" else 1) if mla else 0
            check_int(name, getattr(self, name), low, MAX_HEAD_DIM if mla else 0)
        dsa = self.index_head_dim != 0 or self.index_cache_dtype != ""
        for name in DSA_INT_FIELDS:
            check_int(name, getattr(self, name), 1 if dsa else 0, MAX_HEAD_DIM if dsa else 0)
        if dsa and (not mla or self.index_cache_dtype not in INDEX_CACHE_DTYPES):
            raise ValueError(f"index_cache_dtype must be one of {INDEX_CACHE_DTYPES} in an MLA "
                             f"agreement, got {self.index_cache_dtype!r} with attention="
                             f"{self.attention!r}")
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        if fp8 and mla:  # a DSA row pads after its index row instead
            latent = (mla_fp8_row_bytes if dsa else mla_fp8_row_stride)(self.kv_lora_rank,
                                                                         self.qk_rope_head_dim)
        row = latent if not dsa else dsa_row_elements(
            latent, kv_dtype(self.kv_dtype).itemsize, self.index_row_bytes)
        if mla and (self.num_kv_heads, self.head_dim) != (1, row):
            raise ValueError(
                f"an MLA agreement has num_kv_heads=1 and head_dim={row} (kv_lora_rank+"
                f"qk_rope_head_dim{', then the index-K row' if dsa else ''}), got num_kv_heads="
                f"{self.num_kv_heads} head_dim={self.head_dim}")

    @classmethod
    def from_model(
        cls,
        model_fields: Mapping[str, Any],
        weights_digest: str,
        kv_dtype: str | torch.dtype,
        page_size: int,
        *,
        pool_layout: str = POOL_LAYOUT,
        source_digest: str | None = None,
    ) -> Agreement:
        """Build from ``ModelConfig.contract_fields()``; the source digest is computed if not given."""
        missing = [key for key in _OWN_MODEL_FIELDS if key not in model_fields]
        if missing:
            raise ValueError(f"model_fields lacks {missing}; got keys {sorted(model_fields)}")
        mla = dict(model_fields.get("mla") or {})
        if mla.get("q_lora_rank") is None and mla:
            mla["q_lora_rank"] = 0
        dsa = dict(model_fields.get("dsa") or {})
        own = (*_OWN_MODEL_FIELDS, "attention", "mla", "dsa", "kv_cache_dtype", "kv_row_format")
        return cls(
            architecture=model_fields["architecture"],
            model_config={k: v for k, v in model_fields.items() if k not in own},
            rope=model_fields["rope"],
            num_layers=model_fields["num_layers"],
            num_kv_heads=model_fields["num_kv_heads"],
            head_dim=model_fields["head_dim"],
            weights_digest=weights_digest,
            kv_dtype=kv_dtype if isinstance(kv_dtype, str) else dtype_name(kv_dtype),
            page_size=page_size,
            pool_layout=pool_layout,
            wire_version=WIRE_VERSION,
            source_digest=source_digest if source_digest is not None else _hash_sources(None, None),
            attention=model_fields.get("attention", "gqa"),
            **{name: mla[name] for name in MLA_FIELDS if name in mla},
            **{name: dsa[name] for name in (*DSA_INT_FIELDS, "index_cache_dtype") if name in dsa},
            **{name: model_fields[name] for name in ("kv_cache_dtype", "kv_row_format")
               if name in model_fields},
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict, keys sorted at every depth."""
        return {name: _plain(getattr(self, name)) for name in sorted(f.name for f in fields(self))}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> Agreement:
        check_keys("agreement", dict(value), [f.name for f in fields(cls)])
        return cls(**value)

    def encode(self) -> bytes:
        return self._encoding

    @functools.cached_property
    def _encoding(self) -> bytes:  # frozen: encoded once (every FetchKV compares the fingerprint)
        return _pack(self.to_dict())

    @classmethod
    def decode(cls, data: bytes) -> Agreement:
        """Parse an untrusted agreement; any defect is a ValueError naming the field."""
        with untrusted("agreement"):
            return cls.from_dict(_unpack_contract(data, "agreement"))

    @functools.cached_property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Agreement):
            return NotImplemented
        return self.encode() == other.encode()

    def __hash__(self) -> int:
        return hash(self.encode())


@dataclass(frozen=True)
class Topology:
    cp_size: int
    split_mode: str  # one of SPLIT_MODES
    owner_rule: str  # one of OWNER_RULES
    endpoints: tuple[str, ...]  # "host:port" of each owner rank's KVTransfer service, by rank
    # The ranks serve FetchKV of a KV head range (``head_start``/``head_count``), which a
    # tensor-parallel decode group needs; absent in an older peer's topology: False.
    head_ranges: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.endpoints, list | tuple):
            raise TypeError(
                f"endpoints must be a sequence of 'host:port', got {self.endpoints!r:.80}"
            )
        object.__setattr__(self, "endpoints", tuple(self.endpoints))
        check_int("cp_size", self.cp_size, 1, MAX_RANKS)
        check_str("split_mode", self.split_mode, 64)
        check_str("owner_rule", self.owner_rule, 64)
        for rank, endpoint in enumerate(self.endpoints):
            host, _, port = check_str(f"endpoints[{rank}]", endpoint, 1024).rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"endpoints[{rank}] must be 'host:port', got {endpoint!r}")
        self.check()

    def check(self, page_owners: Iterable[tuple[int, int]] = ()) -> None:
        """Raise ValueError unless the topology is consistent.

        ``page_owners`` are (logical page, owner rank) pairs, e.g. from a prefill
        manifest: each owner must be a rank that exists and the one the owner
        rule names.
        """
        if self.split_mode not in SPLIT_MODES:
            raise ValueError(f"split_mode must be one of {SPLIT_MODES}, got {self.split_mode!r}")
        if self.owner_rule not in OWNER_RULES:
            raise ValueError(f"owner_rule must be one of {OWNER_RULES}, got {self.owner_rule!r}")
        if len(self.endpoints) != self.cp_size:
            raise ValueError(
                f"endpoints has {len(self.endpoints)} entries but cp_size is {self.cp_size}"
            )
        for page, owner in page_owners:
            check_int("owner", owner, 0, self.cp_size - 1)
            if owner != self.owner_of(page):
                raise ValueError(
                    f"page {page} is listed with owner {owner}, rule {self.owner_rule} gives {self.owner_of(page)}"
                )

    def owner_of(self, page: int) -> int:
        """The rank that owns logical page ``page`` (rule ``page_mod_cp``)."""
        return check_int("page", page, 0, 1 << 62) % self.cp_size

    def physical_of(self, page: int) -> int:
        """Where logical page ``page`` is in its owner's pool (rule ``page_mod_cp``: page ``page // cp_size``)."""
        return check_int("page", page, 0, 1 << 62) // self.cp_size

    def to_dict(self) -> dict[str, Any]:
        return {name: _plain(getattr(self, name)) for name in sorted(f.name for f in fields(self))}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> Topology:
        value = dict(value)
        value.setdefault("head_ranges", False)
        check_keys("topology", value, [f.name for f in fields(cls)])
        if not isinstance(value["head_ranges"], bool):
            raise ValueError(f"topology head_ranges must be a bool, got {value['head_ranges']!r:.40}")
        return cls(**value)

    def check_decode_layout(self, tp_size: int) -> None:
        """Refuse a decode group of ``tp_size`` ranks these ranks cannot feed, in one line
        naming both sides' values (a GQA decode rank fetches only its KV heads)."""
        if tp_size > 1 and not self.head_ranges:
            raise ValueError(f"decode tp_size={tp_size} needs KV head ranges, and this prefill "
                             f"(cp_size={self.cp_size}) serves head_ranges={self.head_ranges}")


@dataclass(frozen=True)
class LayoutContract:
    agreement: Agreement
    topology: Topology

    def __post_init__(self) -> None:
        if not isinstance(self.agreement, Agreement):
            raise TypeError(f"agreement must be an Agreement, got {type(self.agreement).__name__}")
        if not isinstance(self.topology, Topology):
            raise TypeError(f"topology must be a Topology, got {type(self.topology).__name__}")
        size = len(self.encode())
        if size > MAX_CONTRACT_BYTES:  # a peer would refuse it: say so at start-up
            raise ValueError(f"the layout contract encodes to {size} bytes, more than {MAX_CONTRACT_BYTES}")

    @property
    def fingerprint(self) -> str:
        return self.agreement.fingerprint

    def encode(self) -> bytes:
        return _pack({"agreement": self.agreement.to_dict(), "topology": self.topology.to_dict()})

    @classmethod
    def decode(cls, data: bytes) -> LayoutContract:
        """Parse an untrusted contract; any defect is a ValueError naming the field."""
        with untrusted("layout contract"):
            value = _unpack_contract(data, "layout contract")
            check_keys("layout contract", value, ["agreement", "topology"])
            for part in ("agreement", "topology"):
                if not isinstance(value[part], dict):
                    raise ValueError(f"{part} must be a map, got {type(value[part]).__name__}")
            return cls(
                Agreement.from_dict(value["agreement"]), Topology.from_dict(value["topology"])
            )


def agreement_of(data: bytes) -> Agreement:
    """Decode the agreement from either an encoded ``Agreement`` or an encoded ``LayoutContract``."""
    with untrusted("contract"):
        value = _unpack_contract(data, "contract")
        if "agreement" in value:
            return LayoutContract.decode(data).agreement
        return Agreement.from_dict(value)


def _unpack_contract(data: bytes, what: str) -> dict:
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
    if _pack(ours) == _pack(theirs):
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


def source_digest(files: Iterable[str] | None = None, root: Path | None = None) -> str:
    """sha256 over the contract's defining modules: module name and raw bytes, sorted by name.

    Defaults: ``CONTRACT_SOURCES`` under ``PACKAGE_ROOT``. Nothing else (paths on
    disk, mtimes, the interpreter) enters, so the digest is the same across
    processes, machines and checkouts of the same code.
    """
    return _hash_sources(files, root)


def _module_file(name: str, root: Path) -> Path:
    """``lanekv.a.b`` -> ``root/a/b.py``."""
    package, _, rest = name.partition(".")
    if package != "lanekv" or not rest:
        raise ValueError(f"source_digest: contract source {name!r} is not a module of lanekv")
    return root.joinpath(*rest.split(".")).with_suffix(".py")


def _hash_sources(files: Iterable[str] | None, root: Path | None) -> str:
    # Globals read at call time, so a test can point them elsewhere.
    files = CONTRACT_SOURCES if files is None else files
    root = PACKAGE_ROOT if root is None else Path(root)
    digest = hashlib.sha256()
    for name in sorted(files):
        path = _module_file(name, root)
        if not path.is_file():
            raise FileNotFoundError(f"source_digest: contract source {name} not found under {root}")
        content = path.read_bytes()
        digest.update(name.encode() + b"\0" + len(content).to_bytes(8, "big"))
        digest.update(content)
    return digest.hexdigest()
