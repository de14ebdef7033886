"""Host memory of a process that moves KV chunks: keep freed chunk buffers.

Every chunk of a FetchKV stream is a fresh multi-MiB bytes object on both
sides (the message a rank builds, the one gRPC hands the receiver). glibc
serves such sizes with mmap and gives them back to the kernel when freed, so
each chunk faults in fresh pages (one fault per 4 KiB moved) and the kernel
zeroes them. ``keep_freed_buffers`` raises glibc's mmap and trim thresholds
so those buffers come from the heap and stay there for the next chunk.

Process-wide, so only the daemons call it (a rank process when it starts its
transfer server, the decode daemon when it starts); a no-op off glibc.
Memory held: the chunks in flight (``max_inflight_bytes`` on the decode side,
a few chunks per stream on a rank), which the process reuses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("lanekv.transfer")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above 32 MiB on 64-bit hosts; chunks are 8 MiB by default.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_buffers() -> bool:
    """Tune glibc malloc as the module docstring says; False where it cannot (another libc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not done:
        log.info("mallopt refused the chunk-buffer thresholds; chunks use fresh pages")
    return done
