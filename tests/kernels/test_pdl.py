"""kernels.pdl: the switch read strictly, off under the interpreter (and saying so), every
converted launcher unchanged with ``LANEKV_PDL=1`` and asking for PDL when it is on, every
converted kernel waiting first, and the sm_90 PTX of some holding the grid dependency
control (``bench/pdl_compile.py`` compiles them all)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lanekv.kernels import pdl

from bench.pdl_cases import CASES
from bench.pdl_compile import pdl_forced_on, recording

ROOT = Path(__file__).resolve().parents[2]
PDL_DIR = ROOT / "kernels" / "pdl"  # the switch itself names what it switches


def test_the_switch_reads_the_env_strictly(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert pdl.mode() == "auto" and pdl.requested() is False  # auto: off outside a decode graph
    for value, want in (("", "auto"), ("auto", "auto"), ("0", "off"), ("1", "on")):
        monkeypatch.setenv(pdl.ENV, value)
        assert pdl.mode() == want
        assert pdl.requested() is (want == "on")
    for bad in ("yes", "true", "2", " 1", "on", "AUTO"):
        monkeypatch.setenv(pdl.ENV, bad)
        with pytest.raises(ValueError, match=f"^LANEKV_PDL must be 0, 1 or auto, got {bad!r}$"):
            pdl.requested()
        with pytest.raises(ValueError, match="LANEKV_PDL"):  # a launch fails the same way
            pdl.pdl_args(torch.zeros(1))


def test_auto_asks_for_it_only_in_small_decode_graphs(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(pdl.ENV, raising=False)
    for batch in (1, pdl.AUTO_MAX_BATCH):
        with pdl.decode_graph(batch):
            assert pdl.requested() is True
            with pdl.decode_graph(pdl.AUTO_MAX_BATCH + 1):  # nested: the inner scope decides
                assert pdl.requested() is False
            assert pdl.requested() is True
        assert pdl.requested() is False
    with pdl.decode_graph(64):
        assert pdl.requested() is False
    monkeypatch.setenv(pdl.ENV, "0")
    with pdl.decode_graph(1):
        assert pdl.requested() is False  # 0 wins over the scope, and 1 is on everywhere
    monkeypatch.setenv(pdl.ENV, "1")
    with pdl.decode_graph(64):
        assert pdl.requested() is True
    with pytest.raises(RuntimeError):
        with pdl.decode_graph(1):
            raise RuntimeError("a capture that fails")
    monkeypatch.delenv(pdl.ENV)
    assert pdl.requested() is False  # the scope ended with the failure


def test_off_under_the_interpreter_and_says_so(monkeypatch: pytest.MonkeyPatch):
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py on a CPU machine
    monkeypatch.setenv(pdl.ENV, "1")
    status = pdl.pdl_status("cpu")
    assert status == (False, "off: the Triton interpreter is on (no grid dependency control)")
    assert pdl.pdl_args(torch.zeros(1)) == {"USE_PDL": False}
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl.pdl_status("cpu") == (False, "off: LANEKV_PDL=0")
    monkeypatch.delenv(pdl.ENV)
    assert pdl.pdl_status("cpu") == (False, "off: LANEKV_PDL=auto, on only in decode graphs "
                                            "of batch <= 4")


def test_only_cuda_devices_of_capability_9(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pdl.pdl_status("cpu") == (False, "off: cpu is not a CUDA device of capability >= 9.0")
    for capability, on in (((8, 9), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(pdl, "_capability", lambda index, c=capability: c)
        assert pdl.pdl_status("cuda:1").on is on
        assert pdl.pdl_enabled(torch.device("cuda", 1)) is on
    assert pdl.pdl_status("cuda:1") == (True, "on: LANEKV_PDL=1 on cuda:1")
    monkeypatch.delenv(pdl.ENV)
    with pdl.decode_graph(2):
        assert pdl.pdl_status("cuda:1") == (
            True, "on: LANEKV_PDL=auto in a decode graph of batch <= 4 on cuda:1")


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forced_on_by_the_env_var_the_launchers_give_identical_results(
        name: str, monkeypatch: pytest.MonkeyPatch):
    """Under the interpreter ``LANEKV_PDL=1`` changes nothing: no launch asks for PDL."""
    monkeypatch.delenv(pdl.ENV, raising=False)
    plain = CASES[name](torch.float32)
    monkeypatch.setenv(pdl.ENV, "1")
    with recording(run=True) as launches:
        forced = CASES[name](torch.float32)
    assert launches
    assert all(ln.args["USE_PDL"] is False and "launch_pdl" not in ln.options for ln in launches)
    assert len(plain) == len(forced)
    for a, b in zip(plain, forced, strict=True):
        _same(a, b)


def _converted_kernels() -> dict[str, list[ast.stmt]]:
    """Every Triton kernel under kernels/ with a ``USE_PDL`` parameter: its body."""
    found = {}
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        if path.is_relative_to(PDL_DIR):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    a.arg == "USE_PDL" for a in node.args.args) and node.decorator_list:
                found[node.name] = node.body
    return found


def test_converted_kernels_wait_before_anything_else():
    kernels = _converted_kernels()
    assert len(kernels) == 29
    for name, body in kernels.items():
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        first = [ast.unparse(s) for s in body[:2]]
        assert first == ["pdl_wait(USE_PDL)", "pdl_launch_dependents(USE_PDL)"], name


def test_every_converted_kernel_launches_with_pdl_when_on():
    """With the switch on, each launch of the cases carries ``USE_PDL`` and ``launch_pdl``,
    and together they launch every converted kernel."""
    launched = set()
    for name, case in CASES.items():
        with pdl_forced_on(), recording(run=False) as launches:
            case(torch.float32)
        for ln in launches:
            assert ln.args["USE_PDL"] is True and ln.options.get("launch_pdl") is True, (
                name, ln.name)
            launched.add(ln.name)
    assert launched == set(_converted_kernels())


def test_no_launch_asks_for_pdl_but_through_the_switch():
    """``launch_pdl`` is passed only by ``pdl_args``: an unconverted kernel never gets it."""
    for path in (ROOT / "kernels").rglob("*.py"):
        if not path.is_relative_to(PDL_DIR):
            assert "launch_pdl" not in path.read_text(), path


def test_offline_sm90_compile_holds_the_grid_dependency_control(tmp_path: Path):
    """Three cases compiled for sm_90 (the interpreter off, in a process of its own): the
    PTX waits and lets dependents launch; with ``USE_PDL=False`` it holds neither."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pdl_compile.py"), "--only", "add_rmsnorm",
         "--only", "quant", "--only", "moe_gate_route", "--control", "--json", str(out)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())
    assert [r["kernel"] for r in rows] == [
        "_add_rmsnorm_kernel", "_per_token_group_quant_kernel", "_silu_mul_quant_kernel",
        "_router_logits_kernel", "_route_kernel"]
    for r in rows:
        assert r["wait"] and r["launch_dependents"] and r["launch_pdl"] and r["use_pdl"], r
        assert r["wait_when_off"] is False and r["launch_dependents_when_off"] is False, r
