"""Block-FP8 linears: the checkpoint's e4m3 weights and float32 scales, run as stored.

``use_fp8_linears(model, state, quant)`` checks a loaded state dict against
the model built on the meta device and swaps every ``nn.Linear`` whose weight
the checkpoint stores quantized (an e4m3 ``X.weight`` with a float32
``X.weight_scale_inv`` of one value per block) for an ``Fp8Linear``; every
other tensor (embeddings, norms, the router, the lm_head, whatever the file
holds unquantized) stays as it was. A malformed checkpoint is refused in one
line naming the tensor: an e4m3 weight without its scale, a scale of the wrong
shape or dtype, a scale without an e4m3 weight, a scale of a layer that is not a
linear, quantized tensors in a checkpoint without ``quantization_config``.

Fused projections (q/k/v, gate/up) and stacked experts concatenate the e4m3
weights and their scales alike, which keeps every block whole when each part but
the last spans whole blocks (``fuse_fp8_linears``; otherwise the parts run one
by one). ``dense_weight`` gives a layer's weight for ops that read it as a
matrix (MLA's absorbed ``kv_b_proj``), dequantized once and kept.
"""

from __future__ import annotations

import torch
from lanekv.kernels.fp8.gemm import fp8_linear, silu_mul_fp8_linear
from lanekv.kernels.fp8.weights import (
    FP8_DTYPE,
    dequantize_weight_blocks,
    quantize_weight_blocks,
    scale_shape,
)
from lanekv.model.quant.config import WeightQuant
from torch import nn

SCALE_SUFFIX = ".weight_scale_inv"


class Fp8Linear(nn.Module):
    """``nn.Linear`` with an e4m3 ``weight [out, in]`` and a float32
    ``weight_scale_inv [cdiv(out, bn), cdiv(in, bk)]`` (checkpoint names)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: WeightQuant,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant = quant
        self.weight = nn.Parameter(torch.empty((out_features, in_features), dtype=FP8_DTYPE,
                                               device=device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(
            scale_shape((out_features, in_features), quant.block), dtype=torch.float32,
            device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        self._dense: torch.Tensor | None = None

    @property
    def block(self) -> tuple[int, int]:
        return self.quant.block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias,
                          scale_ue8m0=self.quant.scale_ue8m0)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(silu(gate) * up)`` for ``gate_up [T, 2 * in]``. On CUDA the selected
        config decides: w8a8 quantizes the product in one pass, w8a16 and gemv (decode's
        few rows) compute it inside the GEMM's activation load (one launch fewer)."""
        return silu_mul_fp8_linear(gate_up, self.weight, self.weight_scale_inv, self.block,
                                   self.bias, scale_ue8m0=self.quant.scale_ue8m0)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight in ``dtype``, computed on first use and kept."""
        if self._dense is None or self._dense.dtype != dtype:
            self._dense = dequantize_weight_blocks(self.weight, self.weight_scale_inv,
                                                   self.block, dtype)
        return self._dense

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, block={self.block}")


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight as a ``dtype`` matrix, quantized or not."""
    return linear.dense_weight(dtype) if isinstance(linear, Fp8Linear) else linear.weight


def use_fp8_linears(model: nn.Module, state: dict[str, torch.Tensor],
                    quant: WeightQuant | None, dtype: torch.dtype) -> None:
    """Swap the linears the checkpoint stores quantized for ``Fp8Linear`` (on the
    meta device, before ``load_state_dict(assign=True)``); refuse a malformed file."""
    scales = sorted(name for name in state if name.endswith(SCALE_SUFFIX))
    quantized = sorted(name for name, t in state.items() if t.dtype == FP8_DTYPE)
    if quant is None:
        if scales or quantized:
            name = (quantized or scales)[0]
            raise ValueError(f"tensor {name!r} is quantized but config.json has no "
                             "quantization_config")
        return
    for name in quantized:
        if not name.endswith(".weight") or name[: -len(".weight")] + SCALE_SUFFIX not in state:
            raise ValueError(f"tensor {name!r} is {FP8_DTYPE} but "
                             f"{name.removesuffix('.weight') + SCALE_SUFFIX!r} is missing")
    for scale_name in scales:
        prefix = scale_name[: -len(SCALE_SUFFIX)]
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            module = None
        if not isinstance(module, nn.Linear) or prefix == "lm_head":
            raise ValueError(f"tensor {scale_name!r} scales {prefix!r}, which lanekv does not "
                             "run quantized (only the decoder's linear layers)")
        weight = state.get(prefix + ".weight")
        if weight is None or weight.dtype != FP8_DTYPE:
            raise ValueError(f"tensor {scale_name!r} has no {FP8_DTYPE} weight beside it (weight "
                             f"dtype {None if weight is None else weight.dtype})")
        scale = state[scale_name]
        expected = scale_shape((module.out_features, module.in_features), quant.block)
        if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
            raise ValueError(f"tensor {scale_name!r} is {scale.dtype} {tuple(scale.shape)}, "
                             f"expected float32 {expected} for weight "
                             f"{(module.out_features, module.in_features)} and block "
                             f"{list(quant.block)}")
        parent_name, _, child = prefix.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear(module.in_features, module.out_features,
                                         module.bias is not None, quant, dtype, "meta"))


def quantize_linears(module: nn.Module, quant: WeightQuant) -> None:
    """Every ``nn.Linear`` under ``module`` swapped for an ``Fp8Linear`` of its
    weight quantized blockwise (random-weight models of FP8 checkpoints' shapes)."""
    for name, child in list(module.named_modules()):
        if not isinstance(child, nn.Linear):
            continue
        layer = Fp8Linear(child.in_features, child.out_features, child.bias is not None, quant,
                          child.weight.dtype, child.weight.device)
        with torch.no_grad():
            layer.weight.data, layer.weight_scale_inv.data = quantize_weight_blocks(
                child.weight, quant.block)
            if child.bias is not None:
                layer.bias.data = child.bias.data
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, layer)


def fuse_fp8_linears(parts: tuple[nn.Module, ...],
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(weight, weight_scale_inv, bias)`` of the parts concatenated along the
    output rows, the parts' parameters re-pointed at views of them; None (nothing
    changed) when the parts are not all ``Fp8Linear`` of one block or a part but
    the last ends inside a block."""
    if not all(isinstance(p, Fp8Linear) for p in parts):
        return None
    block = parts[0].block
    if any(p.block != block for p in parts) or any(
            p.out_features % block[0] for p in parts[:-1]):
        return None
    with torch.no_grad():
        weight = torch.cat([p.weight for p in parts])
        scale = torch.cat([p.weight_scale_inv for p in parts])
        has_bias = [p.bias is not None for p in parts]
        if any(has_bias) and not all(has_bias):
            raise ValueError("fused projections must all have a bias or none")
        bias = torch.cat([p.bias for p in parts]) if all(has_bias) else None
    rows = scale_rows = 0
    for part in parts:
        n, sn = part.out_features, part.weight_scale_inv.shape[0]
        part.weight = nn.Parameter(weight[rows:rows + n], requires_grad=False)
        part.weight_scale_inv = nn.Parameter(scale[scale_rows:scale_rows + sn], requires_grad=False)
        if bias is not None:
            part.bias = nn.Parameter(bias[rows:rows + n], requires_grad=False)
        rows, scale_rows = rows + n, scale_rows + sn
    return weight, scale, bias


class StackedFp8Experts:
    """Experts' e4m3 weights and scales stacked: ``w13 [E, 2I, H]`` (gate rows,
    then up rows), ``w2 [E, H, I]`` and their ``[E, ...]`` block scales."""

    @staticmethod
    def stackable(experts: nn.ModuleList) -> bool:
        """Quantized experts whose intermediate size spans whole blocks (gate's last
        block ends where up's first begins)."""
        first = experts[0].gate_proj
        return isinstance(first, Fp8Linear) and first.out_features % first.block[0] == 0

    def __init__(self, experts: nn.ModuleList, fuse: bool):
        first = experts[0].gate_proj
        self.block = first.block
        self.scale_ue8m0 = first.quant.scale_ue8m0
        inter = first.out_features
        if not self.stackable(experts):
            raise ValueError(f"moe_intermediate_size={inter} is not a multiple of "
                             f"weight_block_size[0]={self.block[0]}: the gate and up blocks of "
                             "a quantized expert would not stack")
        with torch.no_grad():
            self.w13 = torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight))
                                    for e in experts])
            self.s13 = torch.stack([torch.cat((e.gate_proj.weight_scale_inv,
                                               e.up_proj.weight_scale_inv)) for e in experts])
            self.w2 = torch.stack([e.down_proj.weight for e in experts])
            self.s2 = torch.stack([e.down_proj.weight_scale_inv for e in experts])
        if not fuse:
            return
        s_inter = first.weight_scale_inv.shape[0]
        for i, expert in enumerate(experts):
            for name, w, s in (("gate_proj", self.w13[i, :inter], self.s13[i, :s_inter]),
                               ("up_proj", self.w13[i, inter:], self.s13[i, s_inter:]),
                               ("down_proj", self.w2[i], self.s2[i])):
                layer = getattr(expert, name)
                layer.weight = nn.Parameter(w, requires_grad=False)
                layer.weight_scale_inv = nn.Parameter(s, requires_grad=False)
