"""A prefill rank's pool offered over NIXL (the rank side of ``KVTransfer.NixlAttach``).

The agent is made, and the pool registered with it, at the first NixlAttach
(nothing of NIXL's is loaded before). Its name holds the prefill daemon's
start (the epoch) and a random part, so a restarted daemon under the same
address is a new agent that the decode side cannot mistake for the old one.
``close`` releases the registration (the rank drains or stops).

A tensor-parallel decode rank asks for a head range: the rank packs those heads
of a sealed range into a lease of its staging region (``transfer.nixl.staging``,
registered beside the pool at the same attach), from where the decode rank
reads them in one block per layer and plane (``stage``).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Sequence

import torch
from lanekv.proto import lanekv_pb2
from lanekv.transfer.nixl.agent import Agent, memory_kind
from lanekv.transfer.nixl.staging import DEFAULT_STAGING_BYTES, Lease, StagingArena

log = logging.getLogger("lanekv.transfer")


class NixlExport:
    """``staging_bytes``: the staging region's size (default: ``DEFAULT_STAGING_BYTES``, at
    most the pool's bytes); 0 offers no head ranges over NIXL."""

    def __init__(self, pool: torch.Tensor, rank: int, epoch: str | None, devices: Sequence[str] = (),
                 staging_bytes: int | None = None) -> None:
        pool_bytes = pool.numel() * pool.element_size()
        if staging_bytes is None:
            staging_bytes = min(DEFAULT_STAGING_BYTES, pool_bytes)
        if staging_bytes < 0:
            raise ValueError(f"staging_bytes must be >= 0, got staging_bytes={staging_bytes}")
        self._pool, self._rank, self._epoch, self._devices = pool, rank, epoch or "", tuple(devices)
        self._staging_bytes = staging_bytes
        self._staging: StagingArena | None = None
        self._agent: Agent | None = None
        self._reply: lanekv_pb2.NixlAttachReply | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def attached(self) -> bool:
        """Whether a NixlAttach was answered (FetchKV for NIXL needs one first)."""
        with self._lock:
            return self._reply is not None

    def attach(self) -> lanekv_pb2.NixlAttachReply:
        """The agent's metadata and the pool's registered region; ``NixlUnavailable`` where
        NIXL is not installed or does not start."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"rank {self._rank}: NIXL is closed (the rank is stopping)")
            if self._reply is None:
                name = f"lanekv-rank{self._rank}-{self._epoch or 'noepoch'}-{secrets.token_hex(4)}"
                agent = Agent(name, self._devices)
                try:
                    addr, nbytes, device = agent.register(self._pool)
                    staging, staging_addr = self._new_staging(), 0
                    if staging is not None:
                        staging_addr, _, _ = agent.register(staging.buffer)
                    self._reply = lanekv_pb2.NixlAttachReply(
                        agent_metadata=agent.metadata(), agent_name=name, epoch=self._epoch, pool_addr=addr,
                        pool_bytes=nbytes, device_id=device, memory=memory_kind(self._pool),
                        staging_addr=staging_addr, staging_bytes=self._staging_bytes if staging else 0)
                except BaseException:
                    agent.close()
                    raise
                self._agent, self._staging = agent, staging
            return self._reply

    def _new_staging(self) -> StagingArena | None:
        """The staging region, on the pool's device; None (whole rows only) when it is not
        wanted or its memory is not there (the pool stays offered)."""
        if not self._staging_bytes:
            return None
        try:
            return StagingArena(self._staging_bytes, self._pool.device)
        except torch.OutOfMemoryError as err:
            log.warning("rank %d: no NIXL staging region of %d bytes (%s): head ranges go over gRPC",
                        self._rank, self._staging_bytes, str(err).splitlines()[0])
            return None

    def lease(self, nbytes: int) -> Lease:
        """``nbytes`` of the staging region for one FetchKV call (released when it ends);
        ``StagingFull`` when they do not fit now, RuntimeError when there is none."""
        with self._lock:
            staging = self._staging
        if staging is None:
            raise RuntimeError(f"rank {self._rank} stages no head ranges for NIXL (no NixlAttach, "
                               "staging_bytes=0, or closed)")
        return staging.lease(nbytes)

    def stage(self, lease: Lease, physical: Sequence[int], page_size: int, layer_start: int, layer_end: int,
              first_layer: int, heads: slice) -> int:
        """Pack KV heads ``heads`` of layers ``[layer_start, layer_end)`` of ``physical`` pages into
        ``lease``, whose layout begins at ``first_layer``; the range's offset in the region.

        One gather on the pool's device, waited for: the bytes are in place when it returns.
        The pool is viewed as bytes, so any KV dtype (FP8 rows with their scales) packs alike."""
        pool = self._pool
        layers, planes, _, _, _ = pool.shape
        as_bytes = pool.view(torch.uint8)  # [num_layers, planes, rows, kv_heads, head bytes]
        count, head_bytes = heads.stop - heads.start, as_bytes.shape[4]
        rows = len(physical) * page_size
        window = lease.nbytes // (planes * rows * count * head_bytes)
        if not 0 <= first_layer <= layer_start < layer_end <= min(layers, first_layer + window):
            raise ValueError(f"layers [{layer_start}, {layer_end}) do not lie in the lease's layers from "
                             f"{first_layer} ({window} of them)")
        out = lease.view((window, planes, rows, count, head_bytes))[layer_start - first_layer:layer_end - first_layer]
        index = (torch.as_tensor(physical, dtype=torch.int64).unsqueeze(1) * page_size
                 + torch.arange(page_size)).flatten().to(pool.device)
        torch.index_select(as_bytes[layer_start:layer_end, :, :, heads], 2, index, out=out)
        if pool.is_cuda:
            torch.cuda.current_stream(pool.device).synchronize()  # NIXL reads the region, not the stream
        return lease.offset + (layer_start - first_layer) * planes * rows * count * head_bytes

    def close(self) -> None:
        with self._lock:
            self._closed = True
            agent, self._agent, self._reply, self._staging = self._agent, None, None, None
        if agent is not None:
            agent.close()  # the pool's and the staging region's registrations
