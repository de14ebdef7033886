"""DeepSeek sparse attention (DSA) kernels: the index-K pool rows (fp8 e4m3 or
the model dtype), the lightning indexer's scores and top-k, and sparse MLA
attention over the selected latent rows. Each op sits beside its torch
reference, as the other kernels do."""

from lanekv.kernels.dsa.index_cache import IndexCacheSpec, read_index_k, store_index_k
from lanekv.kernels.dsa.indexer import index_scores, index_topk, paged_index_scores
from lanekv.kernels.dsa.sparse_mla import sparse_mla_decode, sparse_mla_prefill

__all__ = [
    "IndexCacheSpec",
    "index_scores",
    "index_topk",
    "paged_index_scores",
    "read_index_k",
    "sparse_mla_decode",
    "sparse_mla_prefill",
    "store_index_k",
]
