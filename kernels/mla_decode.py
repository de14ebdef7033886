"""The six names ``kernels/dsa/sparse_mla.py`` still imports from here, until it imports
them from their homes in ``kernels/mla/``.

The MLA decode kernels moved into ``kernels/mla/`` (one concept a module); the sparse
(DSA) decode shares how a latent cache's rows are read and checked
(``kernels/mla/latent_rows.py``) and the split partials' merge (``kernels/mla/merge.py``).
``kernels/dsa/`` was another change's area when the split was made, so its import stays
pointed here for now: nothing else may import from this module, and it goes once that
one import line names ``lanekv.kernels.mla.latent_rows`` and ``lanekv.kernels.mla.merge``.
"""

from lanekv.kernels.mla.latent_rows import (
    check_latent_cache,
    dequantized_latent,
    latent_views,
    load_latent_rows,
    row_stride_args,
)
from lanekv.kernels.mla.merge import merge_mla_partials

__all__ = [
    "check_latent_cache",
    "dequantized_latent",
    "latent_views",
    "load_latent_rows",
    "merge_mla_partials",
    "row_stride_args",
]
