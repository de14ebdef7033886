"""The agreement: every field that decides how KV bytes are laid out or what they mean.

``Agreement`` must be equal on both sides, and its fingerprint (sha256 of its
canonical msgpack encoding, ``encoding.py``) travels with every FetchKV and
Release. Its ``source_digest`` field names the code that defines the layout
(``source_digest.py``). The row-size helpers mirror the kernels' row layouts
(``kernels/fp8/kv_rows.py``, ``kernels/dsa/pool_layout.py``) so the protocol
floor can check a peer's ``head_dim`` without importing the kernels; tests
pin the two against each other.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from lanekv.transfer.protocol.encoding import FrozenDict, pack, plain, unpack_contract
from lanekv.transfer.protocol.source_digest import source_digest as code_digest
from lanekv.transfer.protocol.wire import (
    KV_DTYPES,
    MAX_HEAD_DIM,
    MAX_KV_HEADS,
    MAX_LAYERS,
    MAX_PAGE_SIZE,
    WIRE_VERSION,
    check_int,
    check_keys,
    check_str,
    dtype_name,
    kv_dtype,
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
# Keys of ModelConfig.contract_fields() that become Agreement fields of their own.
_OWN_MODEL_FIELDS = ("architecture", "num_layers", "num_kv_heads", "head_dim", "rope")
_MAX_TEXT = 256  # architecture, digests, pool layout: all far shorter


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
            source_digest=source_digest if source_digest is not None else code_digest(),
            attention=model_fields.get("attention", "gqa"),
            **{name: mla[name] for name in MLA_FIELDS if name in mla},
            **{name: dsa[name] for name in (*DSA_INT_FIELDS, "index_cache_dtype") if name in dsa},
            **{name: model_fields[name] for name in ("kv_cache_dtype", "kv_row_format")
               if name in model_fields},
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict, keys sorted at every depth."""
        return {name: plain(getattr(self, name)) for name in sorted(f.name for f in fields(self))}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> Agreement:
        check_keys("agreement", dict(value), [f.name for f in fields(cls)])
        return cls(**value)

    def encode(self) -> bytes:
        return self._encoding

    @functools.cached_property
    def _encoding(self) -> bytes:  # frozen: encoded once (every FetchKV compares the fingerprint)
        return pack(self.to_dict())

    @classmethod
    def decode(cls, data: bytes) -> Agreement:
        """Parse an untrusted agreement; any defect is a ValueError naming the field."""
        with untrusted("agreement"):
            return cls.from_dict(unpack_contract(data, "agreement"))

    @functools.cached_property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Agreement):
            return NotImplemented
        return self.encode() == other.encode()

    def __hash__(self) -> int:
        return hash(self.encode())
