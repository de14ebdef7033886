"""The source digest: which code defines the layout and the wire.

``source_digest`` is sha256 over the modules of ``CONTRACT_SOURCES`` (name
and raw bytes), an ``Agreement`` field: two builds with different code in any
of them refuse each other at Handshake instead of misreading each other's
bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

# The modules whose code defines the layout and what goes over the wire: a
# change to any of them changes source_digest, so two builds with different
# code refuse each other. The fast path's descriptors and the digest that
# seals them are wire too: two builds that digest differently would otherwise
# fail every fast-path check and fall back to gRPC without saying why. The
# contract is five modules (agreement, contract, encoding, fielddiff and this
# one), all digested as the one file they were.
CONTRACT_SOURCES = (
    "lanekv.prefill.plan",
    "lanekv.prefill.layout",
    "lanekv.transfer.protocol.wire",
    "lanekv.transfer.protocol.agreement",
    "lanekv.transfer.protocol.contract",
    "lanekv.transfer.protocol.encoding",
    "lanekv.transfer.protocol.fielddiff",
    "lanekv.transfer.protocol.source_digest",
    "lanekv.transfer.protocol.descriptors",
    "lanekv.kernels.page_digest",
)
# The folder holding the lanekv subpackages' folders: the repository's top in
# a checkout (kernels/, prefill/, ...), site-packages/lanekv in a wheel. A
# module lanekv.a.b is the file a/b.py under it.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


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
