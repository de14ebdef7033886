"""The ``lanekv`` command line against live daemons: ``handshake`` says
compatible or prints the diff, ``generate`` prints ids or text equal to a
colocated run, and bad arguments exit non-zero with a message that names the
problem, and ``make demo``'s program passes its own check. A few commands run
as real subprocesses (the entry point as users run it); the rest call
``lanekv.cli.main`` in-process to keep the suite fast.
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lanekv.decode.colocated import generate_colocated
from lanekv.decode.pool import PagePool
from lanekv.model.checkpoint import load_model
from lanekv.model.sampling import SamplingParams
from lanekv.prefill.engine_config import EngineConfig
from lanekv.transfer.protocol.contract import LayoutContract
from lanekv.transfer.rank.server import serve
from lanekv.transfer.rank.sources import TensorPageSource

from lanekv.cli import main as lanekv
from tests.checkpoints import write_llama
from tests.daemons import running_pair

REPO = Path(__file__).resolve().parents[2]
PAGE_SIZE = 4
PROMPT = [7, 8, 9, 10, 11, 12, 13]
TEXT = "w7 w8 w9 w10"


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lanekv.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("cli-llama"), tokenizer=True)


@pytest.fixture(scope="module")
def daemons(checkpoint):
    engine = EngineConfig(str(checkpoint), cp_size=1, page_size=PAGE_SIZE, pages_per_lane=64, start_timeout_s=120)
    with running_pair(engine, pool_pages=64) as pair:
        yield pair


@pytest.fixture(scope="module")
def colocated(checkpoint):
    loaded = load_model(checkpoint)

    def run(ids: list[int], max_new_tokens: int) -> list[int]:
        pool = PagePool.for_model(loaded.config, 64, PAGE_SIZE, torch.float32)
        return generate_colocated(loaded.model, pool, [ids], SamplingParams(), max_new_tokens)[0]

    run.tokenizer = loaded.tokenizer
    return run


@pytest.fixture
def other_page_size(daemons):
    """A transfer server whose contract differs from the daemons' in page_size only."""
    prefill, _ = daemons
    agreement = dataclasses.replace(prefill.contract.agreement, page_size=16)
    pool = torch.zeros(agreement.num_layers, 2, 16, agreement.num_kv_heads, agreement.head_dim)
    source = TensorPageSource(agreement, 0, pool, prefill.topology)
    served = serve(source)
    yield f"127.0.0.1:{served.port}", LayoutContract(agreement, prefill.topology)
    served.server.stop(0)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_handshake_says_compatible(daemons):
    prefill, decode = daemons
    result = _run("handshake", "--prefill", prefill.endpoint, "--decode", decode.endpoint)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("compatible")
    assert prefill.contract.fingerprint[:16] in result.stdout


@pytest.mark.timeout(60)
def test_handshake_prints_the_diff(daemons, other_page_size, capsys):
    _, decode = daemons
    endpoint, _ = other_page_size
    assert lanekv(["handshake", "--prefill", endpoint, "--decode", decode.endpoint]) == 1
    out = capsys.readouterr().out
    assert "incompatible: 1 field(s) differ" in out
    assert "page_size: prefill=16 decode=4" in out
    assert lanekv(["handshake", "--prefill", f"127.0.0.1:{_closed_port()}", "--decode", decode.endpoint,
                   "--timeout", "2"]) == 2
    assert "UNAVAILABLE" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_generate_prints_ids_equal_to_a_colocated_run(daemons, colocated):
    _, decode = daemons
    ids = ",".join(map(str, PROMPT))
    result = _run("generate", "--decode", decode.endpoint, "--ids", ids, "--max-new-tokens", "10", "--print-ids")
    assert result.returncode == 0, result.stderr
    assert [int(t) for t in result.stdout.split()] == colocated(PROMPT, 10)
    assert "KV transfer" in result.stderr and "bytes" in result.stderr


@pytest.mark.timeout(60)
def test_generate_streams_text(daemons, colocated, capsys):
    _, decode = daemons
    assert lanekv(["generate", "--decode", decode.endpoint, TEXT, "--max-new-tokens", "6"]) == 0
    want = colocated(colocated.tokenizer.encode(TEXT), 6)
    assert capsys.readouterr().out.strip() == colocated.tokenizer.decode(want)


@pytest.mark.timeout(60)
def test_generate_reports_a_refused_call(daemons, capsys):
    _, decode = daemons
    assert lanekv(["generate", "--decode", decode.endpoint, "--ids", "5,6", "--max-new-tokens", "0"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert lanekv(["generate", "--decode", decode.endpoint, "--ids", "5,299999"]) == 1
    assert "outside the vocabulary" in capsys.readouterr().err
    assert lanekv(["generate", "--decode", f"127.0.0.1:{_closed_port()}", "--ids", "5", "--timeout", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_bad_arguments_exit_non_zero_naming_the_problem(checkpoint, capsys, tmp_path):
    assert lanekv(["generate", "--decode", "127.0.0.1:1"]) == 2
    assert "give either a prompt text or --ids" in capsys.readouterr().err
    assert lanekv(["generate", "--decode", "127.0.0.1:1", "--ids", "5,x"]) == 2
    assert "--ids must be comma-separated integers" in capsys.readouterr().err
    assert lanekv(["decode", "--model", str(tmp_path), "--prefill", "127.0.0.1:1"]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert lanekv(["decode", "--model", str(checkpoint), "--prefill", "nowhere"]) == 2
    assert "prefill_endpoint must be 'host:port'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        lanekv(["decode", "--prefill", "127.0.0.1:1"])
    assert exit_info.value.code == 2 and "--model" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_prefill_with_a_missing_model_exits_non_zero():
    result = _run("prefill", "--model", "/nonexistent", "--cp-size", "1")
    assert result.returncode != 0
    assert "/nonexistent" in result.stderr and "config.json" in result.stderr


@pytest.mark.timeout(180)
def test_demo_matches_the_colocated_run():
    result = subprocess.run([sys.executable, "-m", "lanekv.demo", "--page-size", "4", "--prompt-len", "21",
                             "--max-new-tokens", "8"], cwd=REPO, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "KV transfer:" in result.stdout
    assert "check: the 8 tokens equal the colocated run: OK" in result.stdout
