"""The MLA decode step's fused kernels around the latent-space attention
(``kernels/mla_decode.py``): the q_pe RoPE, kv_a norm, key RoPE and latent store in
one launch (``latent_store.py``), and the expansion through kv_b_proj's V part that
merges the split partials as it loads them (``expand_merge.py``). Each op sits
beside its torch reference, as the other kernels do."""

from lanekv.kernels.mla.expand_merge import mla_expand_partials
from lanekv.kernels.mla.latent_store import mla_rope_norm_store

__all__ = ["mla_expand_partials", "mla_rope_norm_store"]
