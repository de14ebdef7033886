"""The layout contract: what both sides must agree on before any KV byte moves.

A ``LayoutContract`` is an ``Agreement`` (``agreement.py``: the fields that
must be equal on both sides) and a ``Topology``. ``Topology`` is the prefill
side's own (CP size, split mode, owner rule, the owner ranks' endpoints): the
decode side is told it, checks it for consistency and uses it to fetch, but
never matches it against its own. A Handshake carries the encoded contract;
``agreement_of`` reads the agreement from either encoding. Decoding is
bounded as ``encoding.py`` says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.encoding import MAX_CONTRACT_BYTES, pack, plain, unpack_contract
from lanekv.transfer.protocol.wire import MAX_RANKS, check_int, check_keys, check_str, untrusted

SPLIT_MODES = ("in_seq",)
OWNER_RULES = ("page_mod_cp",)


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
        return {name: plain(getattr(self, name)) for name in sorted(f.name for f in fields(self))}

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
        return pack({"agreement": self.agreement.to_dict(), "topology": self.topology.to_dict()})

    @classmethod
    def decode(cls, data: bytes) -> LayoutContract:
        """Parse an untrusted contract; any defect is a ValueError naming the field."""
        with untrusted("layout contract"):
            value = unpack_contract(data, "layout contract")
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
        value = unpack_contract(data, "contract")
        if "agreement" in value:
            return LayoutContract.decode(data).agreement
        return Agreement.from_dict(value)
