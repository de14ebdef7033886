"""Tensor-parallel decode: a group of rank processes, rank 0 in the daemon (``docs/parallelism.md``)."""
