"""The dtypes a model and its KV pool may be served in, by the name configs and flags use."""

from __future__ import annotations

from types import MappingProxyType

import torch

DTYPES = MappingProxyType({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16})
