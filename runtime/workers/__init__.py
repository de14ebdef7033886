"""How a daemon starts its worker processes: ``start`` (the fork server on CPU, spawn on
CUDA) and ``server`` (imported by the fork server alone)."""
