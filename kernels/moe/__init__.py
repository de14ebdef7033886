"""Mixture-of-experts kernels: the routed experts as grouped GEMMs over the
(token, choice) pairs sorted by expert on the device, beside their torch
reference."""

from lanekv.kernels.moe.experts import MoETiles, moe_experts

__all__ = ["MoETiles", "moe_experts"]
