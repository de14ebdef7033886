"""Decode side: the physical page pool, per-request page tables and the continuous-batching decode loop."""
