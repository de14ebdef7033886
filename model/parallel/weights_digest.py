"""The weights digest: computed at most once per daemon start, handed to its ranks, cached across starts.

The layout contract names the checkpoint by its weights digest: sha256 over the
tensor files in sorted name order (``tensor_files``), each as its length (8 bytes,
little-endian) then its bytes, so file boundaries count too. That definition is
fixed: daemons of older and newer builds given the same files agree.

Reading every byte of a 700 GB checkpoint takes minutes, so no rank reads it for
the digest once another process did:

- One process per daemon start computes it: the prefill launcher (while its rank
  processes load) hands it to every CP rank (``prefill.cp.messages.Weights``); decode
  rank 0, the one that handshakes, computes its own; a single-process daemon hashes
  the bytes it loads anyway. A value comes with the stamps of the files it describes
  (``WeightsDigest``); a rank handed one checks that the files it loaded carry those
  stamps, before and after its read (``stamped``, ``WeightsDigest.check``), so the
  digest still describes the weights loaded, as far as a file's stat tells.
- The value is cached in one small JSON file per checkpoint folder under
  ``cache_dir()`` (``$LANEKV_CACHE_DIR``, else ``~/.cache/lanekv``; set empty: no
  cache), never in the model folder (it may be read-only), keyed by every tensor
  file's absolute path, size, mtime_ns, inode and device: a change to any of them,
  or to the list of files, recomputes. A cache that cannot be read or written logs a
  warning and the digest is computed; it never fails a start. Writes are atomic (a
  temporary file beside it, then ``os.replace``). A file that changed while it was
  read fails the start in one line (its digest would describe neither version).

What the cache trusts, as make and rsync do: a file rewritten in place with the same
size, on the same inode, within one mtime tick of the cached read looks unchanged;
and whoever can write the cache folder can name any digest (the digest checks that
two daemons load the same weights; it authenticates nothing).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, TypeVar

CACHE_ENV = "LANEKV_CACHE_DIR"
_CACHE_VERSION = 1  # bumped if the file's fields or the digest's definition change
_BLOCK = 1 << 22  # bytes hashed at a time: the digest never holds a file

log = logging.getLogger("lanekv.model")
T = TypeVar("T")


class FileStamp(NamedTuple):
    """What a file's stat says about its identity: a change to any field recomputes."""

    path: str  # absolute, as listed (a symlink's target's stat below)
    size: int
    mtime_ns: int
    inode: int
    device: int


def stamp_files(files: Sequence[Path]) -> tuple[FileStamp, ...]:
    stamps = []
    for file in files:
        st = os.stat(file)
        stamps.append(FileStamp(os.path.abspath(file), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev))
    return tuple(stamps)


class WeightsDigest(NamedTuple):
    """A checkpoint's weights digest and the stamps of the files it was computed over."""

    digest: str  # sha256 hex
    stamps: tuple[FileStamp, ...]

    def check(self, stamps: tuple[FileStamp, ...]) -> None:
        """Raise ``ValueError`` naming the first file whose stamp is not this digest's."""
        if (change := _first_change(self.stamps, stamps)) is not None:
            raise ValueError(f"checkpoint {change} since the weights digest was computed: restart the daemon")


def _first_change(then: tuple[FileStamp, ...], now: tuple[FileStamp, ...]) -> str | None:
    """None when ``now`` equals ``then``, else what changed, in words."""
    if now == then:
        return None
    old = {s.path: s for s in then}
    for stamp in now:
        if old.get(stamp.path) != stamp:
            return f"file {stamp.path} changed (now {stamp}, then {old.get(stamp.path)})"
    return f"files changed ({len(now)} files now, {len(then)} then)"


class WeightsHasher:
    """The digest's one definition: ``begin_file(size)``, then the file's bytes by ``update``."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()

    def begin_file(self, size: int) -> None:
        self._sha.update(size.to_bytes(8, "little"))

    def update(self, data: bytes | memoryview) -> None:
        self._sha.update(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def hash_files(files: Sequence[Path]) -> str:
    """The digest of ``files`` read in blocks (never a whole file in memory)."""
    hasher = WeightsHasher()
    for file in files:
        with open(file, "rb") as f:
            hasher.begin_file(os.fstat(f.fileno()).st_size)
            while block := f.read(_BLOCK):
                hasher.update(block)
    return hasher.hexdigest()


def stamped(files: Sequence[Path], read: Callable[[], T]) -> tuple[T, tuple[FileStamp, ...]]:
    """``read()`` and the files' stamps, which must be the same before and after it."""
    before = stamp_files(files)
    out = read()
    after = stamp_files(files)
    if (change := _first_change(before, after)) is not None:
        raise ValueError(f"checkpoint {change} while it was read: restart the daemon")
    return out, after


def cache_dir() -> Path | None:
    """``$LANEKV_CACHE_DIR`` (empty: no cache), else ``~/.cache/lanekv``."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return Path(value) if value else None
    try:
        return Path.home() / ".cache" / "lanekv"
    except (RuntimeError, KeyError) as err:  # no HOME and no passwd entry
        log.warning("no home folder for the weights digest cache (%s); set %s", err, CACHE_ENV)
        return None


def cache_file(folder: Path, root: Path) -> Path:
    """The cache file of the checkpoint in ``folder``: named by its absolute path."""
    name = hashlib.sha256(os.path.abspath(folder).encode()).hexdigest()[:32]
    return root / "weights-digest" / f"{name}.json"


def cached(folder: Path, stamps: tuple[FileStamp, ...], root: Path | None) -> str | None:
    """The cached digest of these exact files, or None (no cache, a miss, or an unreadable file)."""
    if root is None:
        return None
    path = cache_file(folder, root)
    try:
        entry = json.loads(path.read_text())
        if entry.get("version") != _CACHE_VERSION:
            return None
        if tuple(FileStamp(*s) for s in entry["files"]) != stamps:
            return None
        digest = entry["digest"]
        if not isinstance(digest, str) or len(digest) != 64 or set(digest) - set("0123456789abcdef"):
            raise ValueError(f"digest={digest!r} is not sha256 hex")
        return digest
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        log.warning("weights digest cache %s is unreadable (%s: %s); computing the digest",
                    path, type(err).__name__, err)
        return None


def remember(folder: Path, value: WeightsDigest, root: Path | None) -> None:
    """Store ``value`` for ``folder`` atomically; a failure is a warning, never an error."""
    if root is None:
        return
    path = cache_file(folder, root)
    entry = {"version": _CACHE_VERSION, "folder": os.path.abspath(folder),
             "files": [list(s) for s in value.stamps], "digest": value.digest}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
    except OSError as err:
        log.warning("weights digest cache %s could not be written (%s); the next start computes it again",
                    path, err)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def weights_digest(folder: str | Path, files: Sequence[Path]) -> WeightsDigest:
    """The digest of ``files`` (the checkpoint in ``folder``): from the cache when every
    stamp matches, else read once, checked unchanged, and cached."""
    folder, root = Path(folder), cache_dir()
    stamps = stamp_files(files)
    if (hit := cached(folder, stamps, root)) is not None:
        log.info("weights digest of %s: %s, from the cache", folder, hit)
        return WeightsDigest(hit, stamps)
    start = time.monotonic()
    value, after = stamped(files, lambda: hash_files(files))
    computed = WeightsDigest(value, after)
    log.info("weights digest of %s: %s, %d bytes read in %.1f s", folder, value,
             sum(s.size for s in after), time.monotonic() - start)
    remember(folder, computed, root)
    return computed


WeightsSource = Callable[[], WeightsDigest]  # called once, after a rank's read: may wait for the value


def read_with_digest(folder: str | Path, files: Sequence[Path], read: Callable[[bool], tuple[T, str]],
                     given: WeightsSource | None = None) -> tuple[T, WeightsDigest]:
    """``read(hash)``'s result and the digest of ``files``: ``given()`` (handed down by
    the process that computed it, asked after the read), else the cached one, else the
    one ``read(True)`` hashed from the bytes it read anyway (then cached). ``read``
    returns its result and that digest ("" when not asked to hash). The files' stamps
    before and after the read must be the digest's."""
    folder, root = Path(folder), cache_dir()
    known = None
    if given is None:
        stamps = stamp_files(files)
        if (hit := cached(folder, stamps, root)) is not None:
            known = WeightsDigest(hit, stamps)
    (out, value), after = stamped(files, lambda: read(given is None and known is None))
    if given is not None:
        known = given()
    if known is not None:
        known.check(after)
        return out, known
    computed = WeightsDigest(value, after)
    remember(folder, computed, root)
    return out, computed
