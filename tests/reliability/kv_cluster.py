"""Shared pieces of the fault and corruption tests.

``start_servers`` runs one KVTransfer server per owner rank in this process
(random bfloat16 pages, owner-lane placement), so tests can patch the
server's ``frame`` hook and count the requests it gets. The rest helps the
tests that run real daemons: free ports, waiting, a Generate call, and the
check that nothing is held on either side.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable
from typing import NamedTuple

import grpc
import torch
from lanekv.proto import lanekv_pb2
from lanekv.runtime.security import SecurityConfig
from lanekv.transfer.protocol.agreement import POOL_LAYOUT, Agreement
from lanekv.transfer.protocol.contract import Topology
from lanekv.transfer.protocol.wire import WIRE_VERSION
from lanekv.transfer.rank.server import Served, serve
from lanekv.transfer.rank.sources import TensorPageSource

LAYERS, HEADS, DIM, PAGE = 4, 2, 8, 4
PAGE_LAYER_BYTES = 2 * PAGE * HEADS * DIM * 2  # K and V of one page of one layer, bfloat16


def make_agreement(**changes) -> Agreement:
    """The agreement of the test servers, with ``changes`` to some fields."""
    base = Agreement(
        architecture="LlamaForCausalLM",
        model_config={"hidden_size": 64, "vocab_size": 128},
        rope={"theta": 10000.0},
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        weights_digest="w" * 64,
        kv_dtype="bfloat16",
        page_size=PAGE,
        pool_layout=POOL_LAYOUT,
        wire_version=WIRE_VERSION,
        source_digest="s" * 64,
    )
    return dataclasses.replace(base, **changes)


def rows_of(pages) -> torch.Tensor:
    return (torch.as_tensor(list(pages), dtype=torch.long)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


class Servers(NamedTuple):
    served: list[Served]
    sources: list[TensorPageSource]
    endpoints: dict[int, str]
    full: torch.Tensor  # [LAYERS, 2, num_pages * PAGE, HEADS, DIM]: the request's KV by logical page
    fingerprint: str

    def pages_of(self, rank: int) -> list[int]:
        return [p for p, _ in self.sources[rank].pages_of("req")]

    def stop(self) -> None:
        for served in self.served:
            served.server.stop(None)


def start_servers(cp_size: int, num_pages: int, *, epoch: str | None = None,
                  security: SecurityConfig | None = None, capability: str | None = None) -> Servers:
    """One server per rank holding request "req" of ``num_pages`` pages (page P on rank P % cp_size),
    pinned with ``capability`` when given."""
    gen = torch.Generator().manual_seed(num_pages)
    shape = (LAYERS, 2, num_pages * PAGE, HEADS, DIM)
    # Random bit patterns, NaNs included: tests compare bytes.
    full = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16).view(torch.bfloat16)
    agreement = make_agreement()
    served, sources, endpoints = [], [], {}
    for rank in range(cp_size):
        owned = [p for p in range(num_pages) if p % cp_size == rank]
        pool = torch.zeros((LAYERS, 2, (len(owned) + 1) * PAGE, HEADS, DIM), dtype=torch.bfloat16)
        pool[:, :, rows_of([p // cp_size for p in owned])] = full[:, :, rows_of(owned)]
        source = TensorPageSource(agreement, rank, pool)
        source.add("req", [(p, p // cp_size) for p in owned], capability=capability)
        served.append(serve(source, security=security, epoch=epoch))
        sources.append(source)
        endpoints[rank] = f"127.0.0.1:{served[-1].port}"
    topology = Topology(cp_size, "in_seq", "page_mod_cp", tuple(endpoints[r] for r in range(cp_size)))
    for source in sources:
        source.set_topology(topology)
    return Servers(served, sources, endpoints, full, agreement.fingerprint)


def placer(dest: torch.Tensor, log: list) -> Callable:
    """A ``place`` writing chunks into ``dest`` by logical page and logging (rank, layer, page) cells."""
    def place(header, tensor):
        log.extend((header.rank, layer, page) for layer in range(header.layer_start, header.layer_end)
                   for page in header.pages)
        dest[header.layer_start:header.layer_end].index_copy_(2, rows_of(header.pages), tensor)

    return place


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports that are free now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def generate_request(ids, max_new_tokens: int, **kw) -> lanekv_pb2.GenerateRequest:
    return lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=max_new_tokens, **kw)


def tokens(stub, request, timeout: float = 30.0) -> list[int]:
    return [t for reply in stub.Generate(request, timeout=timeout) for t in reply.token_ids]


def status_of(call: Callable[[], object], details: bool = False):
    """The status code a call ends with (OK when it returns); with ``details``, (code, details)."""
    code, text = grpc.StatusCode.OK, ""
    try:
        call()
    except grpc.RpcError as err:
        code, text = err.code(), err.details() or ""
    return (code, text) if details else code


def settled(decode, prefill, prefill_free) -> bool:
    """Nothing held: every decode page free and unpromised, every prefill page back, no lease."""
    stats = decode.stats()
    return (stats.free_pages == stats.total_pages and stats.reserved_pages == 0 and stats.active_requests == 0
            and prefill.engine.allocator.free_counts() == prefill_free and prefill.leases.held() == {})
