"""Triton kernels, each beside a plain-torch reference with the same signature.

Import the dispatchers from here; ``name_triton`` and ``name_ref`` live in the
op's own module. ``kernels.backend`` says which one runs for a tensor.
"""

from lanekv.kernels.decode_attention import paged_decode_attention
from lanekv.kernels.kv_layout import KVCacheSpec
from lanekv.kernels.mla.paged_decode import paged_mla_decode_attention
from lanekv.kernels.page_copy import gather_pages, scatter_pages
from lanekv.kernels.prefill.attention import cp_prefill_attention
from lanekv.kernels.prefill.reference import AttnSegments
from lanekv.kernels.rerange import rerange
from lanekv.kernels.store_kv import store_kv

__all__ = [
    "AttnSegments",
    "KVCacheSpec",
    "cp_prefill_attention",
    "gather_pages",
    "paged_decode_attention",
    "paged_mla_decode_attention",
    "rerange",
    "scatter_pages",
    "store_kv",
]
