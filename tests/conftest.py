"""Suite-wide setup.

The Triton interpreter must be switched on before any kernel module is
imported (``triton.jit`` picks interpreter or compiler at decoration time), so
this happens here, first. On a CUDA machine the compiled kernels run instead.

The weights digest cache (``model.parallel.weights_digest``) lives in a folder of
this test process's own, removed at its exit, never in the user's ``~/.cache``;
the daemons and ranks the tests start inherit it.
"""

import atexit
import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ["LANEKV_CACHE_DIR"] = tempfile.mkdtemp(prefix="lanekv-test-cache-")
atexit.register(shutil.rmtree, os.environ["LANEKV_CACHE_DIR"], True)

# Before any test module imports transformers: the checkout's root is on sys.path here,
# and its kernels/ folder must not shadow the kernels distribution transformers imports
# (lanekv/__init__.py).
import lanekv  # noqa: E402, F401

# Tests that start daemons end to end: ``slow`` (``make test-fast`` leaves them out).
SLOW_PATHS = ("tests/reliability/", "tests/lanekv/http/test_front.py", "tests/lanekv/http/test_xpyd.py",
              "tests/decode/test_decode_daemon.py", "tests/decode/test_fastpath_daemons.py",
              "tests/decode/test_tp_daemons.py", "tests/decode/test_tp.py", "tests/decode/test_tp_pairing_matrix.py", "tests/prefill/test_prefill_ep.py",
              "tests/test_generate_e2e.py", "tests/test_dsa_e2e.py", "tests/test_mla_e2e.py")


def pytest_collection_modifyitems(config, items):
    import pytest

    root = str(config.rootpath)
    for item in items:
        path = str(item.path).removeprefix(root).lstrip("/")
        if path.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)
