"""Decode steps through the split-K GEMV on bf16 weights (``kernels.fp8.gemm_gemv
.dense_linear``), with every one-row linear of a tiny Llama listed in the device's table
(the real table lists the H200's 8B and V2-Lite shapes only): steps replayed from CUDA
graphs (PDL on at batch 1 by default) give the tokens of the same steps run eagerly, with
the GEMV in both, alone and in mixed batches. CPU: ``tests/kernels/test_fp8_gemv.py``
holds the kernel to ``F.linear`` and ``dense_linear``'s choice to the table."""

from __future__ import annotations

import torch
from lanekv.kernels.fp8 import gemm_configs
from lanekv.kernels.fp8 import gemm_gemv as gemv_module
from lanekv.kernels.fp8.gemm_configs import GemmConfig
from lanekv.model.checkpoint import load_model
from lanekv.model.llama import FusedLinear
from torch import nn

from tests.checkpoints import write_llama
from tests.decode.test_decode_graphs import _scenario
from tests.markers import requires_gpu


def _one_row_shapes(model: nn.Module) -> set[tuple[int, int, bool]]:
    """(N, K, SiLU fused) of each linear a decode step runs through ``dense_linear``: the
    fused q/k/v and gate/up, o_proj, down_proj (its SiLU product fused) and the lm_head."""
    shapes = {(*model.lm_head.weight.shape, False)}
    for layer in model.model.layers:
        for fused in (layer.self_attn.qkv, layer.mlp.gate_up):
            assert isinstance(fused, FusedLinear) and fused.fused
            shapes.add((*fused.weight.shape, False))
        shapes.add((*layer.self_attn.o_proj.weight.shape, False))
        shapes.add((*layer.mlp.down_proj.weight.shape, True))
    return shapes


@requires_gpu
def test_graph_steps_through_the_dense_gemv_give_the_eager_tokens_gpu(tmp_path, monkeypatch):
    loaded = load_model(write_llama(tmp_path / "llama"), dtype=torch.bfloat16, device="cuda")
    device = torch.device("cuda")
    config = GemmConfig(16, 16, 32, 1, 2, 2, 1, gemv=True)  # split-K: the last split adds
    shapes = _one_row_shapes(loaded.model)
    assert len(shapes) == 5
    monkeypatch.setitem(gemm_configs.DENSE_GEMV_TABLE, torch.cuda.get_device_name(device),
                        dict.fromkeys(shapes, config))
    calls = []
    real = gemv_module.gemv_linear
    monkeypatch.setattr(gemv_module, "gemv_linear",
                        lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    # (the scenario's tokens a request: 5 for one alone; 42 over six, one cancelled)
    for requests, tokens in ((1, 5), (6, 42)):
        eager, _ = _scenario(loaded, device, False, requests, (1, 2, 4, 8))
        graphed, _ = _scenario(loaded, device, True, requests, (1, 2, 4, 8))
        assert graphed == eager, requests
        assert sum(len(t) for t in eager.values()) == tokens
    # every listed shape went through the GEMV
    assert {tuple(s) for s in calls} == {(n, k) for n, k, _ in shapes}
