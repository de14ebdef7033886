"""``lanekv serve``'s memory of what each decode daemon's prefix cache holds follows
the daemons' first replies (``GenerateReply.prefix_cache_tokens``): a prefix a daemon
no longer holds is forgotten, so the next pick goes by load, and that reply counts
as ``lanekv_prefix_routed_picks{followed="evicted"}``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
from lanekv.proto import lanekv_pb2

from lanekv.http.backends import Backend, Backends
from lanekv.http.generate import Generation


class _Call:
    def __init__(self, reply: lanekv_pb2.GenerateReply) -> None:
        self._replies = [reply]

    async def read(self):
        return self._replies.pop(0) if self._replies else grpc.aio.EOF

    def cancel(self) -> bool:
        return True


class _Stub:
    """A decode daemon whose cache holds ``held`` tokens of every prompt once it has it."""

    def __init__(self, held: int) -> None:
        self.held = held

    def Generate(self, request, timeout=None, metadata=None) -> _Call:  # noqa: N802 - gRPC's name
        return _Call(lanekv_pb2.GenerateReply(token_ids=[5], finished=True, finish_reason="length",
                                              prefix_cache_tokens=self.held))


def _plan(prompt: list[int]):
    return SimpleNamespace(prompt_ids=prompt, proto=lambda: lanekv_pb2.GenerateRequest(
        token_ids=lanekv_pb2.TokenIds(ids=prompt), max_new_tokens=1))


def _start(backends: Backends, prompt: list[int]) -> Backend:
    generation = Generation(backends, _plan(prompt), timeout_s=5.0)
    asyncio.run(generation.start())
    member = next(m for m in backends.members if m.endpoint == generation.endpoint)
    backends.done(member)
    return member


def test_the_front_follows_what_each_decode_daemon_says_it_holds():
    backends = Backends(config=SimpleNamespace(max_running_per_decode=100, security=SimpleNamespace(token="")),
                        members=[Backend(f"127.0.0.1:{9100 + i}", healthy=True) for i in range(2)])
    a, b = backends.members
    a.stub, b.stub = _Stub(0), _Stub(64)
    prompt = list(range(64))
    b.memory.remember(prompt)
    assert _start(backends, prompt) is b and backends.picks_on_hit == 1  # remembered: b
    assert b.memory.cached_tokens(prompt) == 64 and backends.picks_on_stale == 0
    b.stub.held = 0  # b's cache evicted the prompt (or keeps nothing)
    assert _start(backends, prompt) is b and backends.picks_on_hit == 2
    assert backends.picks_on_stale == 1 and b.memory.cached_tokens(prompt) == 0  # forgotten
    b.running = 1  # a little busier: with nothing remembered, load decides
    assert _start(backends, prompt) is a and backends.picks_on_hit == 2
