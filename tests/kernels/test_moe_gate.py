"""router_logits: the router's float32 GEMV kernel (interpreted on CPU) against
``F.linear(x.float(), weight)``, odd sizes, several token and hidden blocks."""

import pytest
import torch
import torch.nn.functional as F
from lanekv.kernels.moe.gate import (
    MAX_GATE_TOKENS,
    router_logits,
    router_logits_ref,
    router_logits_triton,
)

from tests.markers import requires_gpu


@pytest.mark.parametrize("tokens,hidden,experts,dtype", [
    (1, 40, 7, torch.float16),  # one token, hidden past two 16-wide blocks plus a tail
    (5, 33, 5, torch.float32),  # token blocks of 2 with a tail, an odd hidden
    (3, 16, 1, torch.float16),  # one expert, hidden one exact block
])
def test_triton_matches_reference(tokens, hidden, experts, dtype):
    gen = torch.Generator().manual_seed(tokens * 100 + hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = torch.randn(experts, hidden, generator=gen)
    got = router_logits_triton(x, weight)
    assert got.dtype == torch.float32 and got.shape == (tokens, experts)
    torch.testing.assert_close(got, router_logits_ref(x, weight), rtol=1e-5, atol=1e-5)


def test_strided_rows_and_dispatch(monkeypatch: pytest.MonkeyPatch):
    """x as a column slice of a wider tensor (row stride above its width); the dispatcher
    takes the kernel only up to MAX_GATE_TOKENS tokens with the CPU kernels on."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 50, generator=gen)
    x, weight = wide[:, 3:37], torch.randn(6, 34, generator=gen)
    torch.testing.assert_close(router_logits_triton(x, weight), F.linear(x, weight),
                               rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    calls = []
    import lanekv.kernels.moe.gate as gate

    monkeypatch.setattr(gate, "router_logits_triton", lambda *a: calls.append(a[0].shape[0]) or
                        router_logits_ref(*a))
    router_logits(x, weight)
    router_logits(torch.zeros(MAX_GATE_TOKENS + 1, 34), weight)
    assert calls == [4]
    assert router_logits_triton(torch.zeros(0, 34), weight).shape == (0, 6)


@pytest.mark.parametrize("x,weight,match", [
    (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(3, 8), "x must be a 2-D tensor"),
    (torch.zeros(2, 8), torch.zeros(3, 8, dtype=torch.float16), "weight must be a float32"),
    (torch.zeros(2, 8), torch.zeros(3, 9), "weight must be a float32 tensor \\[E, 8\\]"),
    (torch.zeros(8, 2).t(), torch.zeros(3, 8), "x must be dense"),
])
def test_bad_arguments_are_refused(x, weight, match):
    for impl in (router_logits_triton, router_logits_ref):
        with pytest.raises(ValueError, match=match):
            impl(x, weight)


@requires_gpu
@pytest.mark.parametrize("tokens,hidden,experts", [(1, 2048, 64), (16, 2048, 64), (7, 7168, 256),
                                                   (64, 2047, 130)])
def test_gpu_matches_reference(tokens, hidden, experts):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    weight = torch.randn(experts, hidden, device="cuda", generator=gen) * 0.02
    torch.testing.assert_close(router_logits_triton(x, weight), router_logits_ref(x, weight),
                               rtol=1e-4, atol=1e-4)
