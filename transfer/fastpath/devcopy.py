"""Strided device copies on the copy engines, without torch's per-copy stream barriers.

A run of pages over a range of layers is ``planes * layers`` dense blocks of
the same width at a fixed pitch in both pools (``[layers, kv, rows, heads, dim]``:
a GQA pool has ``kv = 2``, its K and V blocks of consecutive layers
``stride(1)`` apart; an MLA pool is ``[layers, 1, rows, 1, R + P]``, one latent
block per layer). torch
moves such a view either block by block (one ``copy_`` per block; between two
GPUs each records and waits on two events, tens of microseconds of host time)
or, not contiguous, with an element-wise kernel. ``BlockCopy`` issues the whole view
as one ``cudaMemcpy2DAsync`` on the current stream of one of the two devices
(NVLink between two GPUs with peer access, a local copy on one), so a 4 GiB
fetch is a handful of calls instead of hundreds.

The CUDA runtime is the one torch loaded (found among the process's
mappings, else by soname). Where it is not found, ``BlockCopy.plan`` returns
None, as for CPU tensors and other layouts, and the caller copies with
torch; where a pitch exceeds the device's limit for 2-D copies, the blocks go
one ``cudaMemcpyAsync`` each.

Streams: the caller orders the copy; it runs on the current stream of the
device chosen at planning. The source is read as it is when the copy runs,
so the caller must know it is written (the fast path has the rank's
announcement, sent once the layers were written on the device).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import torch

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from unified addresses
_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch
_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


class _Runtime:
    """The few CUDA runtime calls used here, bound once per process for each way of
    calling (holding the GIL while a call queues its work, or not: ``CopyTuning.keep_gil``)."""

    _lock = threading.Lock()

    def __init__(self, lib: ctypes.CDLL) -> None:
        size_t, ptr = ctypes.c_size_t, ctypes.c_void_p
        self.memcpy_2d = lib.cudaMemcpy2DAsync
        self.memcpy_2d.argtypes = [ptr, size_t, ptr, size_t, size_t, size_t, ctypes.c_int, ptr]
        self.memcpy_2d.restype = ctypes.c_int
        self.memcpy = lib.cudaMemcpyAsync
        self.memcpy.argtypes = [ptr, ptr, size_t, ctypes.c_int, ptr]
        self.memcpy.restype = ctypes.c_int
        self._attribute = lib.cudaDeviceGetAttribute
        self._attribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self._attribute.restype = ctypes.c_int
        self._last_error = lib.cudaGetLastError
        self._last_error.restype = ctypes.c_int
        self._error_string = lib.cudaGetErrorString
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p
        self._max_pitch: dict[int, int] = {}
        self._peers: set[tuple[int, int]] = set()

    @classmethod
    def get(cls, keep_gil: bool = True) -> _Runtime | None:
        with cls._lock:
            return _load(keep_gil)

    def max_pitch(self, device: int) -> int:
        if device not in self._max_pitch:
            value = ctypes.c_int(0)
            self.check(self._attribute(ctypes.byref(value), _ATTR_MAX_PITCH, device), "cudaDeviceGetAttribute")
            self._max_pitch[device] = value.value
        return self._max_pitch[device]

    def enable_peers(self, a: torch.device, b: torch.device) -> None:
        """Peer access between two GPUs of this process (torch turns it on for its own
        cross-device copies; one tiny copy each way does that), so their copies use NVLink."""
        if a == b or (a.index, b.index) in self._peers:
            return
        one_a, one_b = torch.zeros(1, device=a), torch.zeros(1, device=b)
        one_a.copy_(one_b)
        one_b.copy_(one_a)
        self._peers.update({(a.index, b.index), (b.index, a.index)})

    def check(self, code: int, what: str) -> None:
        if code:
            # Clear it, or torch's next launch check would report it as its own.
            self._last_error()
            raise RuntimeError(f"{what} failed: CUDA error {code} ({self._error_string(code).decode()})")


@functools.cache
def _load(keep_gil: bool) -> _Runtime | None:
    """The CUDA runtime torch uses: by path from this process's mappings, else by soname
    (tried once per process and ``keep_gil``; None where it is not found)."""
    candidates: list[str] = []
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1] if line.split() else ""
            if "/libcudart.so" in path and path not in candidates:
                candidates.append(path)
    except OSError:
        pass
    for name in (*candidates, *_SONAMES):
        try:
            return _Runtime(ctypes.PyDLL(name) if keep_gil else ctypes.CDLL(name))
        except (OSError, AttributeError):
            continue
    return None


def _blocks(view: torch.Tensor) -> tuple[int, int, int] | None:
    """(count, width bytes, pitch bytes) when ``view`` [A, B, ...] is A*B dense blocks at one pitch."""
    if view.dim() < 3:
        return None
    inner = view[0, 0]
    if not inner.is_contiguous():
        return None
    size = view.element_size()
    if view.shape[0] > 1 and view.stride(0) != view.shape[1] * view.stride(1):
        return None
    return view.shape[0] * view.shape[1], inner.numel() * size, view.stride(1) * size


class BlockCopy:
    """The copy of one pair of block views, planned once, issued a run of blocks at a time.

    ``plan`` returns None when the views cannot be copied this way (the
    caller copies with torch). ``issue(first, count)`` copies blocks
    ``[first, first + count)`` on the stream chosen at planning (the current
    stream of the source's device with ``push``, else of the destination's).
    ``keep_gil``: the runtime's calls hold the GIL (``CopyTuning.keep_gil``).
    """

    def __init__(self, runtime: _Runtime, dst: torch.Tensor, src: torch.Tensor, device: torch.device,
                 count: int, width: int, dpitch: int, spitch: int) -> None:
        self._runtime, self._device = runtime, device
        self._dst, self._src = dst, src  # held: the addresses below stay valid
        self._dst_ptr, self._src_ptr = dst.data_ptr(), src.data_ptr()
        self.count, self._width, self._dpitch, self._spitch = count, width, dpitch, spitch
        self._stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
        limit = min(runtime.max_pitch(dst.device.index), runtime.max_pitch(src.device.index))
        self._two_d = max(dpitch, spitch) <= limit

    @classmethod
    def plan(cls, dst: torch.Tensor, src: torch.Tensor, *, push: bool = True,
             keep_gil: bool = True) -> BlockCopy | None:
        if not (dst.is_cuda and src.is_cuda) or dst.shape != src.shape or dst.dtype != src.dtype \
                or dst.numel() == 0:
            return None
        shape_d, shape_s = _blocks(dst), _blocks(src)
        if shape_d is None or shape_s is None:
            return None
        runtime = _Runtime.get(keep_gil)
        if runtime is None:
            return None
        runtime.enable_peers(src.device, dst.device)
        count, width, dpitch = shape_d
        return cls(runtime, dst, src, src.device if push else dst.device, count, width, dpitch, shape_s[2])

    def issue(self, first: int = 0, count: int | None = None) -> None:
        count = self.count - first if count is None else count
        if not (0 <= first and 1 <= count and first + count <= self.count):
            raise ValueError(f"blocks [{first}, {first + count}) are not within the {self.count} planned")
        rt, dst, src = self._runtime, self._dst_ptr + first * self._dpitch, self._src_ptr + first * self._spitch
        with torch.cuda.device(self._device):
            if self._two_d or count == 1:
                pitch_d, pitch_s = (self._dpitch, self._spitch) if count > 1 else (self._width, self._width)
                rt.check(rt.memcpy_2d(dst, pitch_d, src, pitch_s, self._width, count, _MEMCPY_DEFAULT,
                                      self._stream), "cudaMemcpy2DAsync")
                return
            for i in range(count):
                rt.check(rt.memcpy(dst + i * self._dpitch, src + i * self._spitch, self._width, _MEMCPY_DEFAULT,
                                   self._stream), "cudaMemcpyAsync")


class RowSliceCopy:
    """``BlockCopy`` for views whose blocks are rows of a part of each row: a tensor-parallel
    decode rank's KV heads ``[layers, planes, rows, heads, head_dim]`` out of a pool of
    more heads. Each block (a layer's K or V, or MLA latent, of a run of pages) is one
    ``cudaMemcpy2DAsync`` of ``rows`` rows of ``heads * head_dim`` elements at the two
    views' row pitches, so the copy stays on the copy engines (torch would make the
    strided source contiguous with a kernel on the source's GPU first).

    ``plan`` returns None where the views are not such blocks (the caller copies with
    torch); ``issue(first, count)`` as ``BlockCopy.issue``.
    """

    def __init__(self, runtime: _Runtime, dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> None:
        size = src.element_size()
        self._runtime, self._device, self._dst, self._src = runtime, device, dst, src  # held: addresses valid
        self.count = dst.shape[0] * dst.shape[1]
        self._rows, self._width = dst.shape[2], dst.shape[3] * dst.shape[4] * size
        self._dst_ptr, self._src_ptr = dst.data_ptr(), src.data_ptr()
        self._block_d, self._block_s = dst.stride(1) * size, src.stride(1) * size
        self._row_d, self._row_s = dst.stride(2) * size, src.stride(2) * size
        self._stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)

    @classmethod
    def plan(cls, dst: torch.Tensor, src: torch.Tensor, *, push: bool = True,
             keep_gil: bool = True) -> RowSliceCopy | None:
        if not (dst.is_cuda and src.is_cuda) or dst.dim() != 5 or dst.shape != src.shape \
                or dst.dtype != src.dtype or dst.numel() == 0:
            return None
        for view in (dst, src):
            rows, heads, dim = view.shape[2:]
            if view.stride(4) != 1 or (heads > 1 and view.stride(3) != dim) or view.stride(2) < heads * dim \
                    or (view.shape[0] > 1 and view.stride(0) != view.shape[1] * view.stride(1)):
                return None  # rows of one dense part each, blocks at one pitch
        runtime = _Runtime.get(keep_gil)
        if runtime is None:
            return None
        limit = min(runtime.max_pitch(dst.device.index), runtime.max_pitch(src.device.index))
        if max(dst.stride(2), src.stride(2)) * src.element_size() > limit:
            return None
        runtime.enable_peers(src.device, dst.device)
        return cls(runtime, dst, src, src.device if push else dst.device)

    def issue(self, first: int = 0, count: int | None = None) -> None:
        count = self.count - first if count is None else count
        if not (0 <= first and 1 <= count and first + count <= self.count):
            raise ValueError(f"blocks [{first}, {first + count}) are not within the {self.count} planned")
        rt = self._runtime
        with torch.cuda.device(self._device):
            for block in range(first, first + count):
                rt.check(rt.memcpy_2d(self._dst_ptr + block * self._block_d, self._row_d,
                                      self._src_ptr + block * self._block_s, self._row_s, self._width,
                                      self._rows, _MEMCPY_DEFAULT, self._stream), "cudaMemcpy2DAsync")
