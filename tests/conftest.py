"""Suite-wide setup.

The Triton interpreter must be switched on before any kernel module is
imported (``triton.jit`` picks interpreter or compiler at decoration time), so
this happens here, first. On a CUDA machine the compiled kernels run instead.

The weights digest cache (``model.parallel.weights_digest``) lives in a folder of
this test process's own, removed at its exit, never in the user's ``~/.cache``;
the daemons and ranks the tests start inherit it.
"""

import atexit
import faulthandler
import os
import shutil
import signal
import sys
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


_REAL_STDERR = []  # stderr as the process began, not the capture that holds it during a test


def _dump_and_die(signum, frame):
    """A SIGTERM that reaches a test process names where every thread stood, then ends it
    as the default action would. Without it such a death is silent ("node down")."""
    out = _REAL_STDERR[0] if _REAL_STDERR else sys.stderr
    print(f"\n{signal.Signals(signum).name} reached test process {os.getpid()}; its threads:",
          file=out, flush=True)
    faulthandler.dump_traceback(file=out, all_threads=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _loud_exit(exit_now, test_pid):
    """``os._exit`` for the test process itself says where it was called from first (a
    child forked from it exits quietly as before)."""
    def exit_(code):
        if os.getpid() == test_pid and _REAL_STDERR:
            print(f"\nos._exit({code}) in test process {test_pid}; its threads:", file=_REAL_STDERR[0],
                  flush=True)
            faulthandler.dump_traceback(file=_REAL_STDERR[0], all_threads=True)
        exit_now(code)
    return exit_


def pytest_configure(config):
    _REAL_STDERR.append(os.fdopen(os.dup(sys.stderr.fileno()), "w"))  # capture is off here
    # Tests that install their own handler (runtime.daemon's) save and restore this one.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _dump_and_die)
    os._exit = _loud_exit(os._exit, os.getpid())


def pytest_collection_modifyitems(config, items):
    import pytest

    root = str(config.rootpath)
    for item in items:
        path = str(item.path).removeprefix(root).lstrip("/")
        if path.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)
