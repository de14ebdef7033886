"""lanekv: disaggregated prefill/decode KV-cache daemon (the command line lives in ``lanekv.cli``)."""

__version__ = "0.1.0"
