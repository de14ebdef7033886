"""Decode steps replayed from CUDA graphs captured with PDL on (``kernels.pdl``), and with
it on only in the small graphs (``auto``, the default), give the tokens of the same steps
captured with it off: Llama (bf16 and block-FP8 weights) and
DeepSeek-V3 (MLA, MoE). The converted kernels follow cuBLAS GEMMs and torch ops launched
without PDL as well as each other, so both kinds of edge are exercised."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lanekv.decode.cuda.graphs import default_ladder
from lanekv.kernels import pdl
from lanekv.model.checkpoint import load_model

from bench.pdl_compile import recording
from tests.checkpoints import write_deepseek_v3, write_llama
from tests.decode.test_decode_graphs import _scenario
from tests.fp8_checkpoints import quantize_checkpoint
from tests.markers import requires_gpu


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pdl-ckpt")
    llama = write_llama(root / "llama")
    return {"llama": llama, "llama_fp8": quantize_checkpoint(llama, root / "llama_fp8", (16, 16)),
            "deepseek_v3": write_deepseek_v3(root / "v3")}


@requires_gpu
@pytest.mark.parametrize("name", ["llama", "llama_fp8", "deepseek_v3"])
def test_graph_steps_with_pdl_give_the_tokens_without_it_gpu(
        name: str, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch):
    loaded = load_model(checkpoints[name], dtype=torch.bfloat16, device="cuda")
    device, sizes = torch.device("cuda"), default_ladder(16)
    monkeypatch.setenv(pdl.ENV, "0")
    plain, _ = _scenario(loaded, device, True, 16, sizes)
    monkeypatch.setenv(pdl.ENV, "1")
    status = pdl.pdl_status(device)
    if not status.on:
        pytest.skip(f"PDL cannot be on here: {status.reason}")
    with recording(run=True) as launches:
        with_pdl, planned = _scenario(loaded, device, True, 16, sizes)
    asked = [ln for ln in launches if "USE_PDL" in ln.args]
    assert asked and all(ln.args["USE_PDL"] and ln.options.get("launch_pdl") for ln in asked)
    assert with_pdl == plain and planned > 5
    assert len(plain) >= 12
    monkeypatch.delenv(pdl.ENV)  # auto, the default: on in the graphs of batch <= 4 only
    with recording(run=True) as launches:
        auto, _ = _scenario(loaded, device, True, 16, sizes)
    asked = {ln.args["USE_PDL"] for ln in launches if "USE_PDL" in ln.args}
    assert asked == {True, False} and auto == plain
