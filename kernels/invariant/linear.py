"""``F.linear``, sigmoid and SiLU whose every output row is independent of the rows
beside it (CPU).

``row_invariant_linear(x, weight, bias)``: ``y[i, j] = sum_k x[i, k] * w[j, k]``
as an elementwise product reduced over its last dim (float32), so each output
sums the same K products in the same order whatever ``x``'s row count; rows
run in chunks that bound the ``[rows, N, K]`` product. ``RowInvariantLinear``
is a ``TorchFunctionMode``: inside it, ``F.linear`` (``nn.Linear``, the experts'
and router's GEMMs) on float32 CPU tensors is ``row_invariant_linear``; CUDA
tensors keep cuBLAS, half-precision CPU ones torch's GEMM. Sigmoid and SiLU are there too: torch's CPU kernels compute a
contiguous tensor's full vectors with one routine and its tail with another,
which round differently, so an element's bits depend on where the tensor ends
(the router's ``[tokens, experts]`` sigmoid: measured); inside the mode they are
``1 / (1 + exp(-x))`` and ``x / (1 + exp(-x))``, whose exp rounds the same in
both routines (measured for every row count up to 40). The mode is a context
object, per thread (each CP rank thread enters its own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_PRODUCT_ELEMENTS = 1 << 22  # float32 elements of one chunk's [rows, N, K] product (16 MiB)


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with each output row a function of its input row alone."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"x [..., {x.shape[-1]}] and weight {tuple(weight.shape)} do not "
                         f"make a linear (weight must be [N, {x.shape[-1]}])")
    lead, (out_features, in_features) = x.shape[:-1], weight.shape
    rows = x.reshape(-1, in_features)
    w = weight.float()
    out = torch.empty((rows.shape[0], out_features), dtype=torch.float32, device=x.device)
    step = max(1, _PRODUCT_ELEMENTS // max(1, out_features * in_features))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step].float()
        out[start : start + step] = (chunk[:, None, :] * w[None]).sum(-1)  # [rows, N]
    if bias is not None:
        out += bias.float()
    return out.to(torch.promote_types(x.dtype, weight.dtype)).reshape(*lead, out_features)


_SIGMOIDS = (torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid)


class RowInvariantLinear(TorchFunctionMode):
    """Inside: ``F.linear`` on float32 CPU tensors is ``row_invariant_linear``; sigmoid and
    SiLU are computed through ``exp`` (see the module doc). Half precision keeps torch's
    ops: its CPU runs track transformers' op order (the half-precision oracle tests)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not args or not isinstance(args[0], torch.Tensor) or args[0].is_cuda or (
                args[0].dtype != torch.float32):
            return func(*args, **kwargs)
        if func is F.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return row_invariant_linear(args[0], args[1], bias)
        if func in _SIGMOIDS and len(args) == 1 and not kwargs:
            return 1.0 / (1.0 + torch.exp(-args[0]))
        if func is F.silu and len(args) == 1 and not kwargs.get("inplace", False):
            return args[0] / (1.0 + torch.exp(-args[0]))
        return func(*args, **kwargs)
