"""A CP prefill of 3 rank processes hashes its checkpoint once per start (in the
launcher, not in each rank), and leaves the digest cached: the next start's launcher
hashes nothing (the ranks never do; tests/model/test_weights_digest.py covers the cache).

Every hash of tensor bytes goes through ``WeightsHasher.update``; the rank processes
(spawned: fresh interpreters) count theirs through a ``sitecustomize`` put on their
PYTHONPATH, which also says it was loaded, so a rank that hashed would be seen."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from lanekv.model.checkpoint import tensor_files
from lanekv.model.parallel import weights_digest as wd
from lanekv.prefill.cp.launcher import CPPrefillEngine, PrefillInput
from lanekv.prefill.engine_config import EngineConfig
from lanekv.runtime.workers.start import START_ENV

from tests.checkpoints import reference_weights_digest, write_llama

LOG_ENV = "LANEKV_TEST_DIGEST_LOG"
HOOK = textwrap.dedent(f'''
    import os
    if os.environ.get("{LOG_ENV}"):
        from lanekv.model.parallel import weights_digest

        def _log(line):
            with open(os.environ["{LOG_ENV}"], "a") as f:
                f.write(line + "\\n")

        _update = weights_digest.WeightsHasher.update

        def _counted(self, data):
            _log(f"hashed {{os.getpid()}} {{len(data)}}")
            _update(self, data)

        weights_digest.WeightsHasher.update = _counted
        _log(f"hooked {{os.getpid()}}")
''')




def _read_log(log: Path) -> tuple[set[int], dict[int, int]]:
    """The pids whose hook was loaded and the bytes each pid hashed; the log is emptied."""
    hooked, hashed = set(), {}
    for line in log.read_text().splitlines() if log.exists() else ():
        kind, pid, *n = line.split()
        if kind == "hooked":
            hooked.add(int(pid))
        else:
            hashed[int(pid)] = hashed.get(int(pid), 0) + int(n[0])
    log.unlink(missing_ok=True)
    return hooked, hashed


@pytest.mark.timeout(240)
def test_cp3_hashes_the_checkpoint_once_then_never(tmp_path, monkeypatch):
    path = write_llama(tmp_path / "m", max_shard_size="40KB")
    size = sum(f.stat().st_size for f in tensor_files(path))
    want = reference_weights_digest(path)
    hook, log = tmp_path / "hook", tmp_path / "digest.log"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(LOG_ENV, str(log))
    # The hook is a sitecustomize: it runs where an interpreter starts, so the ranks are
    # spawned (a fork server's workers start from its already-running interpreter).
    monkeypatch.setenv(START_ENV, "spawn")
    monkeypatch.setenv(wd.CACHE_ENV, str(tmp_path / "cache"))
    update = wd.WeightsHasher.update

    def counted(self, data) -> None:  # this process: the launcher
        with open(log, "a") as f:
            f.write(f"hashed {os.getpid()} {len(data)}\n")
        update(self, data)

    monkeypatch.setattr(wd.WeightsHasher, "update", counted)
    cfg = EngineConfig(str(path), cp_size=3, page_size=4, pages_per_lane=16, start_timeout_s=120)
    with CPPrefillEngine(cfg) as eng:
        ranks = {p.pid for p in eng.processes}
        assert eng.info.weights_digest == want
        assert eng.prefill([PrefillInput([5, 6, 7, 8, 9])])[0].first_token >= 0
    hooked, hashed = _read_log(log)
    assert ranks <= hooked, f"the hook did not load in every rank: {hooked} vs {ranks}"
    assert hashed == {os.getpid(): size}, f"bytes hashed by pid: {hashed}; the ranks are {ranks}"
    assert wd.weights_digest(path, tensor_files(path)).digest == want  # what the next start's launcher does
    assert _read_log(log) == (set(), {})
