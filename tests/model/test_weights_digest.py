"""The weights digest (model.parallel.weights_digest): today's definition, computed once
and cached per checkpoint folder; any stamp change recomputes; a corrupt or unwritable
cache is a warning, never a failed start; a rank handed a digest of other files refuses."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from lanekv.model.checkpoint import checkpoint_digest, load_model, tensor_files
from lanekv.model.parallel import weights_digest as wd
from lanekv.model.parallel.tp import TPRank, load_shard

from tests.checkpoints import reference_weights_digest, write_llama

HOUR_NS = 3600 * 10**9




@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    path = write_llama(tmp_path / "m", max_shard_size="40KB")
    for file in tensor_files(path):  # an hour old: a rewrite now surely moves mtime
        mtime = file.stat().st_mtime_ns - HOUR_NS
        os.utime(file, ns=(mtime, mtime))
    return path


@pytest.fixture()
def hashed(monkeypatch, tmp_path: Path) -> list[int]:
    """The tensor bytes hashed from here on (every hash goes through WeightsHasher.update)."""
    monkeypatch.setenv(wd.CACHE_ENV, str(tmp_path / "cache"))
    counts: list[int] = []
    update = wd.WeightsHasher.update

    def counted(self, data) -> None:
        counts.append(len(data))
        update(self, data)

    monkeypatch.setattr(wd.WeightsHasher, "update", counted)
    return counts


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in tensor_files(path))


def test_the_digest_is_todays_definition(checkpoint, hashed, monkeypatch) -> None:
    assert len(tensor_files(checkpoint)) > 1
    want = reference_weights_digest(checkpoint)
    assert checkpoint_digest(checkpoint).digest == want  # streamed in blocks
    monkeypatch.setenv(wd.CACHE_ENV, "")  # no cache: hashed from the bytes the load reads
    assert load_model(checkpoint).weights_digest == want
    assert sum(hashed) == 2 * _size(checkpoint)


def test_a_second_start_reads_no_tensor_bytes(checkpoint, hashed, tmp_path) -> None:
    files = sorted(checkpoint.iterdir())
    first = load_model(checkpoint)  # a miss: hashed from the bytes loaded, then cached
    assert sum(hashed) == _size(checkpoint)
    hashed.clear()
    assert load_model(checkpoint).weights_digest == checkpoint_digest(checkpoint).digest == first.weights_digest
    assert hashed == []
    cache = list((tmp_path / "cache").rglob("*"))
    assert [p.name for p in cache if p.is_file()] == [wd.cache_file(checkpoint, tmp_path / "cache").name]
    assert sorted(checkpoint.iterdir()) == files  # nothing written beside the model
    entry = json.loads(wd.cache_file(checkpoint, tmp_path / "cache").read_text())
    assert entry["digest"] == first.weights_digest == reference_weights_digest(checkpoint)
    assert [f[0] for f in entry["files"]] == [str(f.absolute()) for f in tensor_files(checkpoint)]


def test_touching_or_rewriting_a_file_recomputes(checkpoint, hashed) -> None:
    first = checkpoint_digest(checkpoint).digest
    file = tensor_files(checkpoint)[-1]
    os.utime(file)  # mtime now: same bytes, recomputed, same value
    hashed.clear()
    assert checkpoint_digest(checkpoint).digest == first
    assert sum(hashed) == _size(checkpoint)
    with open(file, "r+b") as f:  # one byte of the last tensor flipped in place: same size and inode
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    hashed.clear()
    changed = checkpoint_digest(checkpoint).digest
    assert changed != first and changed == reference_weights_digest(checkpoint)
    assert sum(hashed) == _size(checkpoint)
    hashed.clear()
    assert checkpoint_digest(checkpoint).digest == changed and hashed == []


CORRUPT = {
    "not json": lambda entry: "{not json",
    "not an object": lambda entry: "[1, 2]",
    "files not a list": lambda entry: json.dumps({**entry, "files": 7}),
    "a stamp cut short": lambda entry: json.dumps({**entry, "files": [f[:2] for f in entry["files"]]}),
    "digest not sha256 hex": lambda entry: json.dumps({**entry, "digest": "x" * 64}),
    "truncated": lambda entry: json.dumps(entry)[:40],
}


@pytest.mark.parametrize("corrupt", list(CORRUPT))
def test_a_corrupt_cache_is_ignored_with_a_warning(checkpoint, hashed, tmp_path, caplog, corrupt) -> None:
    want = checkpoint_digest(checkpoint)
    path = wd.cache_file(checkpoint, tmp_path / "cache")
    path.write_text(CORRUPT[corrupt](json.loads(path.read_text())))
    hashed.clear()
    with caplog.at_level(logging.WARNING, logger="lanekv.model"):
        assert checkpoint_digest(checkpoint) == want
    assert sum(hashed) == _size(checkpoint)
    assert any("weights digest cache" in r.getMessage() and "unreadable" in r.getMessage()
               for r in caplog.records), caplog.text
    hashed.clear()
    assert checkpoint_digest(checkpoint) == want and hashed == []  # written again, whole


def test_an_unwritable_cache_is_a_warning_and_an_empty_one_is_off(checkpoint, hashed, tmp_path, monkeypatch,
                                                                   caplog) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(wd.CACHE_ENV, str(blocker / "cache"))  # under a file: never a folder
    with caplog.at_level(logging.WARNING, logger="lanekv.model"):
        assert load_model(checkpoint).weights_digest == reference_weights_digest(checkpoint)
    assert any("could not be written" in r.getMessage() for r in caplog.records), caplog.text
    monkeypatch.setenv(wd.CACHE_ENV, "")
    assert wd.cache_dir() is None
    hashed.clear()
    checkpoint_digest(checkpoint)
    checkpoint_digest(checkpoint)
    assert sum(hashed) == 2 * _size(checkpoint)
    monkeypatch.delenv(wd.CACHE_ENV)
    assert wd.cache_dir() == Path.home() / ".cache" / "lanekv"

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", no_home)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lanekv.model"):
        assert wd.cache_dir() is None
    assert "no home folder" in caplog.text


def test_a_rank_handed_a_digest_of_other_files_refuses(checkpoint, hashed, tmp_path) -> None:
    given = checkpoint_digest(checkpoint)
    hashed.clear()
    loaded = load_model(checkpoint, weights=lambda: given)  # the rank reads, never hashes
    assert loaded.weights_digest == given.digest and hashed == []
    assert load_shard(checkpoint, TPRank(1, 2), weights=lambda: given).loaded.weights_digest == given.digest
    assert load_shard(checkpoint, TPRank(1, 2)).loaded.weights_digest == ""
    file = tensor_files(checkpoint)[0]
    os.utime(file)
    with pytest.raises(ValueError, match=f"checkpoint file {file.absolute()} changed .* restart the daemon"):
        load_model(checkpoint, weights=lambda: given)
    with pytest.raises(ValueError, match=f"checkpoint file {file.absolute()} changed"):
        load_shard(checkpoint, TPRank(0, 2), weights=lambda: given)
    assert hashed == []
