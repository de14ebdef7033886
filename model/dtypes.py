"""The dtypes a model and its KV pool may be served in, by the name configs and flags use."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

import torch

DTYPES = MappingProxyType({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16})


def resolve_dtype(name: str, model_path: str | Path) -> str:
    """``name``, or for ``auto`` the checkpoint's own dtype (config.json's ``torch_dtype``,
    or ``dtype`` as newer exporters write it; float32 when it names none)."""
    if name != "auto":
        return name
    file = Path(model_path) / "config.json"
    if not file.is_file():
        raise ValueError(f"model_path={str(model_path)!r} has no config.json")
    try:
        hf = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"dtype=auto needs {file}: {err}") from err
    value = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if value not in DTYPES:
        raise ValueError(f"dtype=auto: the checkpoint's torch_dtype={value!r} is not one of {sorted(DTYPES)}; "
                         "give --dtype")
    return value
