"""A prefill rank's pool offered over NIXL (the rank side of ``KVTransfer.NixlAttach``).

The agent is made, and the pool registered with it, at the first NixlAttach
(nothing of NIXL's is loaded before). Its name holds the prefill daemon's
start (the epoch) and a random part, so a restarted daemon under the same
address is a new agent that the decode side cannot mistake for the old one.
``close`` releases the registration (the rank drains or stops).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence

import torch
from lanekv.proto import lanekv_pb2
from lanekv.transfer.nixl.agent import Agent, memory_kind


class NixlExport:
    def __init__(self, pool: torch.Tensor, rank: int, epoch: str | None, devices: Sequence[str] = ()) -> None:
        self._pool, self._rank, self._epoch, self._devices = pool, rank, epoch or "", tuple(devices)
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
                    self._reply = lanekv_pb2.NixlAttachReply(
                        agent_metadata=agent.metadata(), agent_name=name, epoch=self._epoch, pool_addr=addr,
                        pool_bytes=nbytes, device_id=device, memory=memory_kind(self._pool))
                except BaseException:
                    agent.close()
                    raise
                self._agent = agent
            return self._reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            agent, self._agent, self._reply = self._agent, None, None
        if agent is not None:
            agent.close()
