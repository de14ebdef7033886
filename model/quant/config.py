"""A checkpoint's weight quantization, read from ``config.json``'s ``quantization_config``.

lanekv runs one method: Hugging Face's ``quant_method: fp8`` (DeepSeek-V3/V3.2,
the Qwen3 and Llama ``-FP8`` checkpoints): e4m3 weights with a float32
``weight_scale_inv`` per ``weight_block_size`` block, activations quantized
dynamically per token group. Any other method, format, scheme or block size
the kernels cannot tile is refused in one line naming the field and value.
Which linears are quantized is read from the tensors themselves (a weight with
a ``weight_scale_inv``), so ``modules_to_not_convert`` needs no reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("fp8",)
_KNOWN_KEYS = frozenset({"quant_method", "fmt", "activation_scheme", "weight_block_size",
                         "modules_to_not_convert", "scale_fmt"})
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default


@dataclass(frozen=True)
class WeightQuant:
    """How the quantized linears of a checkpoint are stored and run."""

    method: str = "fp8"
    fmt: str = "e4m3"
    block: tuple[int, int] = DEFAULT_BLOCK  # (block_n over output rows, block_k over inputs)
    activation_scheme: str = "dynamic"
    scale_ue8m0: bool = False  # activation scales rounded up to powers of two

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization_config.quant_method={self.method!r} is not supported "
                             f"(supported: {', '.join(METHODS)})")
        if self.fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt={self.fmt!r} is not supported (only 'e4m3')")
        if self.activation_scheme != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme={self.activation_scheme!r} "
                             "is not supported (only 'dynamic')")
        block = self.block
        if not isinstance(block, tuple) or len(block) != 2 or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1)
                for b in block):
            raise ValueError(f"quantization_config.weight_block_size={list(block)!r} is not "
                             "supported (two powers of two >= 16, e.g. [128, 128])")

    @classmethod
    def from_hf(cls, config: Any) -> WeightQuant:
        if not isinstance(config, dict):
            raise ValueError(f"quantization_config={config!r:.80} must be an object")
        method = config.get("quant_method")
        if method not in METHODS:
            raise ValueError(f"quantization_config.quant_method={method!r} is not supported "
                             f"(supported: {', '.join(METHODS)})")
        unknown = sorted(set(config) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(f"quantization_config has unsupported keys {unknown}")
        block = config.get("weight_block_size", list(DEFAULT_BLOCK))
        if not isinstance(block, list | tuple) or len(block) != 2:
            raise ValueError(f"quantization_config.weight_block_size={block!r} is not supported "
                             "(two powers of two >= 16, e.g. [128, 128]; per-tensor scales are not run)")
        scale_fmt = config.get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"quantization_config.scale_fmt={scale_fmt!r} is not supported "
                             "(absent or 'ue8m0')")
        return cls(method=method, fmt=config.get("fmt", "e4m3"), block=tuple(block),
                   activation_scheme=config.get("activation_scheme", "dynamic"),
                   scale_ue8m0=scale_fmt == "ue8m0")

    def contract_fields(self) -> dict[str, Any]:
        return {"method": self.method, "fmt": self.fmt, "block": list(self.block),
                "activation_scheme": self.activation_scheme,
                "scale_fmt": "ue8m0" if self.scale_ue8m0 else "float32"}
