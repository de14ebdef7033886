"""lanekv: disaggregated prefill/decode KV-cache daemon (the command line lives in ``lanekv.cli``)."""

__version__ = "0.1.0"


def _import_the_kernels_distribution_first() -> None:
    """transformers (5.25 on) imports the Hugging Face ``kernels`` distribution by its
    top-level name. In a checkout, the folder ``lanekv.kernels`` maps onto is also named
    ``kernels``; where the checkout's root is on ``sys.path`` (pytest, ``python -m`` run
    from it, processes given it in PYTHONPATH) that folder would shadow the distribution
    and every import of transformers would fail. So the distribution, when installed, is
    imported first from ``sys.path`` without the root, and the name is its own for the
    whole process. lanekv imports its own kernels only as ``lanekv.kernels``; an
    installed wheel has no such folder and nothing happens."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if "kernels" in sys.modules or not (root / "kernels" / "__init__.py").is_file():
        return

    def is_root(entry: str) -> bool:
        try:
            return Path(entry or ".").resolve() == root
        except (OSError, TypeError):
            return False

    if not any(is_root(entry) for entry in sys.path):
        return
    import importlib
    import importlib.util

    saved = sys.path[:]
    sys.path[:] = [entry for entry in saved if not is_root(entry)]
    try:
        if importlib.util.find_spec("kernels") is not None:
            importlib.import_module("kernels")
    except ImportError:
        pass  # a broken install of the distribution: transformers reports it as it would anyway
    finally:
        sys.path[:] = saved


_import_the_kernels_distribution_first()
