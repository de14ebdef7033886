"""A NIXL agent over UCX, as both sides of lanekv use it (the ``lanekv[nixl]`` extra).

NIXL (``nixl-cu13``, imported as ``nixl_cu13``; ``nixl`` for other builds)
moves registered memory between agents: here the decode side READs pages
out of a prefill rank's registered pool. Which UCX transports and devices it
uses follows UCX's own environment (``UCX_TLS``, ``UCX_NET_DEVICES``; README,
"Cross-host KV: layer-wise gRPC and NIXL"); ``devices`` pins the backend to
some devices too. UCX's error handling mode is ``peer``, never ``none``: a
peer that dies fails the transfers to it instead of hanging them.

Nothing of NIXL's is pickled or sent by it here: an agent's metadata is the
opaque bytes ``get_agent_metadata`` gives, carried in lanekv's protobuf
messages (``NixlAttachReply``); remote places are computed from the pool's
registered address and the layout contract.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

# UCX's error handling: ``peer`` fails transfers to a peer that went away (``none`` would hang them).
ERROR_HANDLING_MODE = "peer"
# How often a transfer's state is asked while it runs.
POLL_S = 0.0005
# UCX settings an agent starts with where the operator's environment leaves them unset.
# UCX's TCP transport moves 8 KiB segments by default; on an H200 host a NIXL read of GPU
# memory over UCX TCP ran 0.41 GB/s, and 2.08 with 512 KiB segments, 2.32 with 8 MiB
# pipeline fragments too (bench/ucx_sweep.py, BENCHMARKS.md). RDMA transports ignore them.
UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "512k", "UCX_TCP_RX_SEG_SIZE": "512k",
                "UCX_RNDV_FRAG_SIZE": "host:8m,cuda:8m"}


def apply_ucx_defaults(environ: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """Set each of ``UCX_DEFAULTS`` the environment lacks (UCX reads it when a backend
    starts); an operator's own value always stays. Returns what was set."""
    added = {k: v for k, v in UCX_DEFAULTS.items() if k not in environ}
    environ.update(added)
    return added


class NixlUnavailable(RuntimeError):
    """NIXL is not installed here, or its UCX backend does not start."""


class NixlTransferError(RuntimeError):
    """A NIXL transfer failed (the peer died or refused), or did not end in time."""


class NixlReadFailed(NixlTransferError):
    """A NIXL read that NIXL itself ended in failure (state ``ERR``, or refused when
    posted): nothing of it is in flight any more, so the same pages may be written
    by another path. A read that did not end in time is a plain ``NixlTransferError``:
    UCX may still be writing into them."""


def load_api() -> Any:
    """NIXL's Python API module; ``NixlUnavailable`` naming what to install when absent."""
    for name in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise NixlUnavailable("NIXL is not installed: pip install 'lanekv[nixl]' (nixl-cu13)")


def available() -> bool:
    try:
        load_api()
    except NixlUnavailable:
        return False
    return True


def memory_kind(tensor: torch.Tensor) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


class Agent:
    """One NIXL agent with a UCX backend; thread-safe (one lock around NIXL's calls)."""

    def __init__(self, name: str, devices: Sequence[str] = ()) -> None:
        api = load_api()
        apply_ucx_defaults()
        try:
            self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=[]))
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": ERROR_HANDLING_MODE,
                                               "num_workers": "1", "ucx_devices": ",".join(devices)})
        except Exception as err:  # noqa: BLE001 - NIXL raises its own classes
            raise NixlUnavailable(f"NIXL agent {name!r} with UCX did not start: {err}") from err
        self.name = name
        self._lock = threading.Lock()
        self._registered: list[tuple[int, Any]] = []  # (data_ptr, NIXL's registration)
        self._remotes: set[str] = set()
        self._closed = False

    def register(self, tensor: torch.Tensor) -> tuple[int, int, int]:
        """Register ``tensor`` (contiguous) with the backend; its (address, bytes, device id)."""
        if not tensor.is_contiguous():
            raise ValueError("a NIXL-registered pool must be contiguous")
        with self._lock:
            self._check_open()
            self._registered.append((tensor.data_ptr(), self._agent.register_memory(tensor)))
        return tensor.data_ptr(), tensor.numel() * tensor.element_size(), tensor.device.index or 0

    def deregister(self, tensor: torch.Tensor) -> bool:
        """Release the registration of ``tensor`` (a pool freed); whether it was registered."""
        with self._lock:
            for i, (ptr, registered) in enumerate(self._registered):
                if ptr == tensor.data_ptr():
                    del self._registered[i]
                    if not self._closed:
                        self._agent.deregister_memory(registered)
                    return True
        return False

    @property
    def registrations(self) -> int:
        """How many memory regions are registered now."""
        with self._lock:
            return len(self._registered)

    def backend_params(self) -> dict[str, str]:
        """The UCX backend's parameters as NIXL runs it (``ucx_error_handling_mode`` among them)."""
        with self._lock:
            self._check_open()
            return dict(self._agent.get_backend_params("UCX"))

    def metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer agent's metadata; its name."""
        with self._lock:
            self._check_open()
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes.add(name)
            return name

    def remove_remote(self, name: str) -> None:
        with self._lock:
            if name in self._remotes and not self._closed:
                self._remotes.discard(name)
                self._agent.remove_remote_agent(name)

    def read(self, remote: str, memory: str, pairs: Sequence[tuple[int, int, int]], remote_device: int,
             local_memory: str, local_device: int, deadline: float) -> None:
        """READ ``pairs`` of (remote address, local address, bytes) from agent ``remote``;
        ``NixlTransferError`` when the transfer fails or runs past ``deadline`` (monotonic)."""
        if not pairs:
            return
        with self._lock:
            self._check_open()
            agent = self._agent
            try:
                remote_descs = agent.get_xfer_descs([(src, n, remote_device) for src, _, n in pairs], memory)
                local_descs = agent.get_xfer_descs([(dst, n, local_device) for _, dst, n in pairs], local_memory)
                handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote)
            except Exception as err:  # noqa: BLE001 - NIXL raises its own classes; nothing was posted
                raise NixlReadFailed(f"a NIXL read from {remote} was refused: {err}") from err
        try:
            with self._lock:
                try:
                    state = agent.transfer(handle)
                except Exception as err:  # noqa: BLE001 - not posted: nothing in flight
                    raise NixlReadFailed(f"a NIXL read from {remote} was refused: {err}") from err
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise NixlTransferError(f"a NIXL read from {remote} did not end in time")
                time.sleep(POLL_S)
                with self._lock:
                    state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise NixlReadFailed(f"a NIXL read from {remote} failed (the peer died or refused it)")
        except NixlTransferError:
            raise
        except Exception as err:  # noqa: BLE001 - NIXL raises its own classes
            raise NixlTransferError(f"a NIXL read from {remote} failed: {err}") from err
        finally:
            with self._lock:
                try:
                    agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001 - a handle of a dead peer may not release
                    pass

    def close(self) -> None:
        """Forget every peer and release every registration (a freed pool, a drained daemon)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for name in list(self._remotes):
                try:
                    self._agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001 - closing: nothing to report to
                    pass
            for _, registered in self._registered:
                try:
                    self._agent.deregister_memory(registered)
                except Exception:  # noqa: BLE001
                    pass
            self._remotes.clear()
            self._registered.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise NixlTransferError(f"NIXL agent {self.name} is closed")
