"""The MLA decode kernels, in the absorbed form (attention in the latent space).

The paged decode's stage 1, its launcher and dispatch (``paged_decode.py``), its
argument checks and torch reference (``paged_decode_ref.py``), how its keys are cut
into splits (``splits.py``), how a latent cache's rows are read and checked, plain or
FP8 (``latent_rows.py``, shared with the sparse decode of ``kernels/dsa/``), the split
partials' merge (``merge.py``), and the projections of q_nope into the latent space and
of the output out of it (``absorb.py``). Around them, the decode step's fused kernels:
the q_pe RoPE, kv_a norm, key RoPE and latent store in one launch (``latent_store.py``),
and the expansion through kv_b_proj's V part that merges the split partials as it loads
them (``expand_merge.py``). Each op sits beside its torch reference, as the other
kernels do."""

from lanekv.kernels.mla.expand_merge import mla_expand_partials
from lanekv.kernels.mla.latent_store import mla_rope_norm_store

__all__ = ["mla_expand_partials", "mla_rope_norm_store"]
