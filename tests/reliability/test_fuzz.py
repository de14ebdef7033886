"""Hostile input on every RPC of both daemons: a refusal status, never a crash.

One prefill daemon (CP 2: Prefill and KVTransfer.Handshake on its own port,
each rank's KVTransfer on another) and one decode daemon, in this process over
loopback gRPC. Each RPC first gets hand-written adversarial messages with the
status each must get, then hypothesis-drawn ones (derandomized, ``EXAMPLES``
per RPC; ``LANEKV_FUZZ_EXAMPLES=500`` explores longer). Every call must end OK
or with a status in ``REFUSALS`` and a message: UNKNOWN, INTERNAL or a hang
(the client's deadline) is a bug. After each batch a normal generation returns
the tokens it returned before any fuzzing, and neither side holds a page.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import NamedTuple

import grpc
import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2 as pb
from lanekv.proto import lanekv_pb2_grpc
from lanekv.runtime.requests import MalformedRequestInterceptor
from lanekv.runtime.status import grpc_options
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY, access_ticket
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.contract import LayoutContract, agreement_of
from lanekv.transfer.protocol.manifest import Manifest
from lanekv.transfer.protocol.wire import ChunkHeader, encode_chunk
from lanekv.transfer.rank.server import add_transfer_service
from lanekv.transfer.rank.service import KVTransferService

from tests.checkpoints import VOCAB_SIZE, write_llama
from tests.reliability import hostile_inputs as hostile

Code = grpc.StatusCode
OK, INVALID = Code.OK, Code.INVALID_ARGUMENT
REFUSALS = frozenset({INVALID, Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED, Code.OUT_OF_RANGE,
                      Code.FAILED_PRECONDITION, Code.ALREADY_EXISTS, Code.PERMISSION_DENIED})
PAGE_SIZE = 4
PAGES_PER_LANE = 64  # the prefill pools hold 2 * 64 pages = 512 tokens
POOL_PAGES = 160  # the decode pool holds 640 tokens
FREE = ((PAGES_PER_LANE, PAGES_PER_LANE), 0, POOL_PAGES, 0, 0)  # see _holdings
TIMEOUT_S = 60
NORMAL = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8, 9]), max_new_tokens=6)
EXAMPLES = int(os.environ.get("LANEKV_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)

# -- the daemons and calls -------------------------------------------------------


class Rig(NamedTuple):
    prefill: PrefillDaemon
    decode: DecodeDaemon
    channels: dict[str, grpc.Channel]  # parent, rank0, rank1, decode
    normal: tuple[int, ...]  # NORMAL's tokens before any fuzzing
    tickets: dict[str, str]  # request id -> its access ticket, for the requests this test pinned


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    checkpoint = str(write_llama(tmp_path_factory.mktemp("fuzz-llama"), tokenizer=True))
    prefill = PrefillDaemon(EngineConfig(checkpoint, cp_size=2, page_size=PAGE_SIZE, pages_per_lane=PAGES_PER_LANE,
                                         start_timeout_s=120), DaemonConfig(lease_s=600))
    decode, channels = None, {}
    try:
        decode = DecodeDaemon(DecodeConfig(checkpoint, prefill.endpoint, page_size=PAGE_SIZE, pool_pages=POOL_PAGES,
                                           device="cpu", page_wait_s=0.3))
        rank0, rank1 = prefill.topology.endpoints
        endpoints = {"parent": prefill.endpoint, "rank0": rank0, "rank1": rank1, "decode": decode.endpoint}
        channels = {name: grpc.insecure_channel(at, options=grpc_options()) for name, at in endpoints.items()}
        yield Rig(prefill, decode, channels, tuple(_generate(channels["decode"], NORMAL)), {})
    finally:
        for channel in channels.values():
            channel.close()
        if decode is not None:
            decode.stop(grace_s=1.0)
        prefill.stop()


def _generate(channel: grpc.Channel, request: pb.GenerateRequest) -> list[int]:
    replies = lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=TIMEOUT_S)
    return [t for reply in replies for t in reply.token_ids]


def _kv(rig: Rig, target: str) -> lanekv_pb2_grpc.KVTransferStub:
    return lanekv_pb2_grpc.KVTransferStub(rig.channels[target])


def _ticket(rig: Rig, request_id: str) -> tuple[tuple[str, str], ...] | None:
    """The metadata that presents a pinned request's capability (None for other ids)."""
    ticket = rig.tickets.get(request_id)
    return None if ticket is None else ((EPOCH_METADATA_KEY, ticket),)


def _prefilled(rig: Rig, request: pb.PrefillRequest) -> pb.PrefillReply:
    reply = lanekv_pb2_grpc.PrefillServiceStub(rig.channels["parent"]).Prefill(request, timeout=TIMEOUT_S)
    rig.tickets[reply.request_id] = access_ticket(None, reply.capability)
    return reply


def _outcome(call: Callable[[], object]) -> Code:
    """OK, or the refusal the call ended with; anything else fails the test."""
    try:
        call()
    except grpc.RpcError as err:
        assert err.code() in REFUSALS, f"{err.code().name}: {err.details()}"
        assert err.details(), f"{err.code().name} without a message"
        return err.code()
    return OK


def _expect(cases: list[tuple[str, Callable[[], object], Code]]) -> None:
    for label, call, code in cases:
        assert _outcome(call) == code, label


def _assert_explored(seen: list[Code], *codes: Code, distinct: int = 0) -> None:
    """The drawn examples reached each of ``codes`` and at least ``distinct`` outcomes
    in all (a fuzzer that only ever hits the first check tests little)."""
    tally = collections.Counter(code.name for code in seen)
    assert {code.name for code in codes} <= set(tally) and len(tally) >= distinct, tally


def _release(rig: Rig, request_id: str, fingerprint: str) -> None:
    """Release a prefilled request at both ranks; a refusal here is a failure, not an outcome."""
    for rank in ("rank0", "rank1"):
        try:
            _kv(rig, rank).Release(pb.ReleaseRequest(request_id=request_id, fingerprint=fingerprint),
                                   timeout=TIMEOUT_S, metadata=_ticket(rig, request_id))
        except grpc.RpcError as err:
            raise AssertionError(
                f"release of {request_id!r} at {rank}: {err.code().name} {err.details()}") from None


def _prefill(rig: Rig, request: pb.PrefillRequest) -> Callable[[], None]:
    def call() -> None:
        reply = _prefilled(rig, request)
        _release(rig, reply.request_id, reply.contract_fingerprint)

    return call


@contextmanager
def _pinned(rig: Rig, request_id: str, length: int) -> Iterator[pb.PrefillReply]:
    """A prefilled request whose pages stay pinned until the block ends."""
    request = pb.PrefillRequest(token_ids=pb.TokenIds(ids=list(range(3, 3 + length))), request_id=request_id)
    reply = _prefilled(rig, request)
    try:
        yield reply
    finally:
        _release(rig, request_id, reply.contract_fingerprint)


def _holdings(rig: Rig) -> tuple:
    stats = rig.decode.stats()
    return (tuple(rig.prefill.engine.allocator.free_counts()), len(rig.prefill.leases.held()),
            stats.free_pages, stats.reserved_pages, stats.active_requests)


def _assert_serves_on(rig: Rig) -> None:
    assert tuple(_generate(rig.channels["decode"], NORMAL)) == rig.normal
    deadline = time.monotonic() + 10  # prefill pages come back when the ranks' release events arrive
    while _holdings(rig) != FREE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _holdings(rig) == FREE


# -- the RPCs ----------------------------------------------------------------------


def _ids(n: int, token: int = 5) -> pb.TokenIds:
    return pb.TokenIds(ids=[token] * n)


def _sampling(**kw: float) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)


@pytest.mark.timeout(180)
def test_prefill_refuses_hostile_requests(rig):
    def req(ids: list[int] | None = None, **kw) -> pb.PrefillRequest:
        return pb.PrefillRequest(**{"token_ids": pb.TokenIds(ids=[5, 6, 7, 8] if ids is None else ids), **kw})

    cases = [
        (pb.PrefillRequest(), INVALID),
        (req([]), INVALID),
        (req([5, -1]), INVALID),
        (req([5, VOCAB_SIZE]), INVALID),
        (req([2**31 - 1]), INVALID),
        (req([5] * 1025), Code.OUT_OF_RANGE),  # past the model's positions
        (req([5] * 600), Code.RESOURCE_EXHAUSTED),  # more than the pools
        (req(request_id=hostile.LIVE), Code.ALREADY_EXISTS),
        (req(request_id=""), INVALID),
        (req(request_id="x" * 257), INVALID),
        (req(request_id="a\nb"), INVALID),
        (req(sampling=_sampling(temperature=float("nan"))), INVALID),
        (req(sampling=_sampling(temperature=-1.0)), INVALID),
        (req(sampling=_sampling(temperature=float("inf"))), INVALID),
        # logits / 1e-38 overflow to inf: refused, not a CP batch that fails on a rank
        (req(sampling=_sampling(temperature=1e-38)), INVALID),
        (req(sampling=_sampling(temperature=1.0, top_p=1.5)), INVALID),
        (req(sampling=_sampling(temperature=1.0, top_p=-0.5)), INVALID),
        (req(sampling=_sampling(temperature=1.0, top_k=-1)), INVALID),
        (req(sampling=_sampling(temperature=1.0, top_p=0.0)), OK),  # top_p 0: no nucleus cut
        (pb.PrefillRequest(text="w5 w6 w299 unknown-word"), OK),
    ]
    with _pinned(rig, hostile.LIVE, 9):
        _expect([(str(request)[:200], _prefill(rig, request), code) for request, code in cases])

        seen: list[Code] = []

        @FUZZ
        @given(request=hostile.prompted(pb.PrefillRequest))
        def fuzz(request: pb.PrefillRequest) -> None:
            seen.append(_outcome(_prefill(rig, request)))

        fuzz()
        _assert_explored(seen, OK, INVALID, distinct=3)
    _assert_serves_on(rig)


@pytest.mark.timeout(180)
def test_generate_refuses_hostile_requests(rig):
    def gen(ids: list[int] | None, max_new: int = 4, **kw) -> pb.GenerateRequest:
        prompt = {} if ids is None else {"token_ids": pb.TokenIds(ids=ids)}
        return pb.GenerateRequest(max_new_tokens=max_new, **prompt, **kw)

    cases = [
        (gen(None), INVALID),
        (gen([]), INVALID),
        (gen([5, VOCAB_SIZE]), INVALID),
        (gen([5, -(2**31)]), INVALID),
        (gen([5], 0), INVALID),
        (gen([5], 2**32 - 1), Code.OUT_OF_RANGE),
        (gen([5] * 1025, 1), Code.OUT_OF_RANGE),
        (gen([5] * 10, 1000), Code.RESOURCE_EXHAUSTED),  # 253 pages: more than the decode pool
        (gen([5] * 700, 1), Code.RESOURCE_EXHAUSTED),  # 175 pages: likewise
        (gen([5] * 600, 1), Code.RESOURCE_EXHAUSTED),  # fits the decode pool, not the prefill pools
        (gen([5], stop_token_ids=[VOCAB_SIZE]), INVALID),
        (gen([5], stop_token_ids=[3] * 1025), INVALID),
        (gen([5], request_id=""), INVALID),
        (gen([5], request_id="\x00"), INVALID),
        (gen([5], request_id=hostile.LIVE), Code.ALREADY_EXISTS),  # pinned by the prefill daemon
        (gen([5], sampling=_sampling(temperature=float("nan"))), INVALID),
        (gen([5], sampling=_sampling(temperature=1e-38)), INVALID),
        (gen([5], sampling=_sampling(temperature=0.5, top_p=2.0)), INVALID),
        (gen([5], sampling=_sampling(temperature=0.5, top_p=0.0, seed=2**64 - 1, has_seed=True)), OK),
        (pb.GenerateRequest(text="", max_new_tokens=2), OK),  # the tokenizer's BOS alone
    ]
    channel = rig.channels["decode"]
    with _pinned(rig, hostile.LIVE, 9):
        _expect([(str(request)[:200], lambda r=request: _generate(channel, r), code) for request, code in cases])

        requests = hostile.prompted(pb.GenerateRequest, max_new_tokens=hostile.MAX_NEW,
                                    stop_token_ids=st.lists(hostile.I32, max_size=6))

        seen: list[Code] = []

        @FUZZ
        @given(request=requests)
        def fuzz(request: pb.GenerateRequest) -> None:
            seen.append(_outcome(lambda: _generate(channel, request)))

        fuzz()
        _assert_explored(seen, OK, INVALID, distinct=3)
    _assert_serves_on(rig)


@pytest.mark.timeout(120)
def test_handshake_refuses_hostile_contracts(rig):
    ours = rig.decode.agreement
    encoded, plain = ours.encode(), ours.to_dict()
    cases = [
        (b"", INVALID),
        (b"\xc1", INVALID),  # a byte msgpack never uses
        (msgpack.packb([1, 2]), INVALID),
        (encoded[: len(encoded) // 2], INVALID),
        (hostile.packed(plain, page_size="4"), INVALID),
        (hostile.packed(plain, page_size=-4), INVALID),
        (hostile.packed(plain, num_layers=2**63), INVALID),
        (hostile.packed(plain, drop="rope"), INVALID),
        (hostile.packed(plain, surplus=1), INVALID),
        (hostile.packed(plain, weights_digest="x" * 5000), INVALID),
        (hostile.packed(plain, weights_digest="x" * (2 << 20)), INVALID),  # beyond the 3 KiB a contract may take
        (hostile.packed(plain, model_config=hostile.nested(900)), INVALID),  # nested deeper than Python's recursion
        (hostile.packed(plain, model_config={"x": float("nan")}), INVALID),
        (msgpack.packb({"agreement": plain, "topology": {"cp_size": "two"}}), INVALID),
        (hostile.packed(plain, page_size=16), Code.FAILED_PRECONDITION),
        (hostile.packed(plain, model_config={**plain["model_config"], "vocab_size": 301}),
         Code.FAILED_PRECONDITION),
        (encoded, OK),
        (rig.prefill.contract.encode(), OK),  # a whole LayoutContract carries the same agreement
    ]
    targets = ("parent", "rank0", "rank1", "decode")

    def handshake(target: str, contract: bytes) -> Callable[[], object]:
        return lambda: _kv(rig, target).Handshake(pb.HandshakeRequest(contract=contract), timeout=TIMEOUT_S)

    _expect([(f"{target} {contract[:80]!r}", handshake(target, contract), code)
             for target in targets for contract, code in cases])

    contracts = st.one_of(
        st.sampled_from([encoded, rig.prefill.contract.encode()]),
        st.binary(max_size=256),
        hostile.MSGPACK_VALUES.map(msgpack.packb),
        hostile.mutations(plain),
        st.integers(0, len(encoded) - 1).map(lambda n: encoded[:n]),
        hostile.DEPTHS.map(lambda depth: hostile.packed(plain, model_config=hostile.nested(depth))),
    )

    seen: list[Code] = []

    @FUZZ
    @given(target=st.sampled_from(targets), contract=contracts)
    def fuzz(target: str, contract: bytes) -> None:
        seen.append(_outcome(handshake(target, contract)))

    fuzz()
    _assert_explored(seen, OK, INVALID, Code.FAILED_PRECONDITION)
    _assert_serves_on(rig)


@pytest.mark.timeout(120)
def test_fetch_and_release_refuse_hostile_requests(rig):
    with _pinned(rig, "gone", 6) as gone:
        pass  # released: a fetch of it must hear NOT_FOUND, 'released'
    fingerprint = gone.contract_fingerprint

    def fetch(target: str, request_id: str = hostile.LIVE, fp: str = fingerprint, layer_end: int | None = None,
              *, ticket: bool = True, **kw) -> Callable[[], list]:
        request = pb.FetchRequest(request_id=request_id, fingerprint=fp, **kw)
        if layer_end is not None:
            request.layer_end = layer_end
        metadata = _ticket(rig, request_id) if ticket else None
        return lambda: list(_kv(rig, target).FetchKV(request, timeout=TIMEOUT_S, metadata=metadata))

    def release(target: str, request_id: str, fp: str = fingerprint, *, ticket: bool = True) -> Callable[[], object]:
        request = pb.ReleaseRequest(request_id=request_id, fingerprint=fp)
        metadata = _ticket(rig, request_id) if ticket else None
        return lambda: _kv(rig, target).Release(request, timeout=TIMEOUT_S, metadata=metadata)

    with _pinned(rig, hostile.LIVE, 40) as live:  # 10 pages, 5 on each rank
        manifest = Manifest.decode(live.manifest)
        owned = {f"rank{r}": manifest.pages_of_owner(r) for r in (0, 1)}
        before = {rank: fetch(rank)() for rank in owned}
        assert all(before.values())
        cases = [
            ("unknown id", fetch("rank0", "nobody"), Code.NOT_FOUND),
            ("released id", fetch("rank0", "gone"), Code.NOT_FOUND),
            ("empty id", fetch("rank0", ""), INVALID),
            ("long id", fetch("rank0", "x" * 300), INVALID),
            ("other fingerprint", fetch("rank0", fp="0" * 64), Code.FAILED_PRECONDITION),
            ("no fingerprint", fetch("rank0", fp=""), Code.FAILED_PRECONDITION),
            ("layer_start past the end", fetch("rank0", layer_start=2), INVALID),
            ("huge layer_start", fetch("rank0", layer_start=2**32 - 1), INVALID),
            ("empty layer range", fetch("rank0", layer_start=1, layer_end=1), INVALID),
            ("reversed layer range", fetch("rank1", layer_start=1, layer_end=0), INVALID),
            ("layer_end past the end", fetch("rank1", layer_end=3), INVALID),
            ("another rank's pages", fetch("rank0", pages=owned["rank1"][:2]), INVALID),
            ("a negative page", fetch("rank0", pages=[-1]), INVALID),
            ("a huge page", fetch("rank1", pages=[2**63 - 1]), INVALID),
            ("a page twice", fetch("rank0", pages=owned["rank0"][:1] * 2), INVALID),
            ("100k pages", fetch("rank0", pages=list(range(100_000))), INVALID),
            ("chunk smaller than a page", fetch("rank0", max_chunk_bytes=1), INVALID),
            ("huge chunk", fetch("rank0", max_chunk_bytes=2**64 - 1), INVALID),
            ("parent holds no pages", fetch("parent"), Code.NOT_FOUND),
            ("decode holds no pages", fetch("decode"), Code.NOT_FOUND),
            ("a subset, one layer, page-sized chunks",
             fetch("rank1", pages=owned["rank1"][1:3], layer_start=1, max_chunk_bytes=1024), OK),
            ("release unknown", release("rank0", "nobody"), Code.NOT_FOUND),
            ("release released", release("rank1", "gone"), Code.NOT_FOUND),
            ("release empty id", release("rank0", ""), INVALID),
            ("release other fingerprint", release("rank0", hostile.LIVE, "f" * 64), Code.FAILED_PRECONDITION),
            ("release at the parent", release("parent", hostile.LIVE), Code.NOT_FOUND),
            ("release at decode", release("decode", hostile.LIVE), Code.NOT_FOUND),
            ("fetch without the capability", fetch("rank0", ticket=False), Code.NOT_FOUND),
            ("descriptors without the capability", fetch("rank1", ticket=False, descriptors=True),
             Code.NOT_FOUND),
            ("release without the capability", release("rank1", hostile.LIVE, ticket=False), Code.NOT_FOUND),
        ]
        _expect(cases)
        ids = st.one_of(st.sampled_from([hostile.LIVE, hostile.LIVE, "gone", "", "x" * 257]), st.text(max_size=40))
        fingerprints = st.one_of(st.just(fingerprint), st.just(fingerprint), st.text(max_size=80))
        known = [-1, *owned["rank0"], *owned["rank1"], 2**63 - 1]
        pages = st.lists(st.one_of(st.sampled_from(known), st.integers(-(2**63), 2**63 - 1)), max_size=12)
        targets = st.sampled_from(["rank0", "rank1", "rank0", "rank1", "parent", "decode"])

        seen: list[Code] = []

        @FUZZ
        @given(target=targets, request_id=ids, fp=fingerprints, layer_start=hostile.U32,
               layer_end=st.none() | hostile.U32, page_list=pages, max_chunk_bytes=hostile.U64)
        def fuzz_fetch(target, request_id, fp, layer_start, layer_end, page_list, max_chunk_bytes) -> None:
            seen.append(_outcome(fetch(target, request_id, fp, layer_end, layer_start=layer_start,
                                       pages=page_list, max_chunk_bytes=max_chunk_bytes)))

        @FUZZ
        @given(target=targets, request_id=ids.filter(lambda rid: rid != hostile.LIVE), fp=fingerprints)
        def fuzz_release(target, request_id, fp) -> None:
            seen.append(_outcome(release(target, request_id, fp)))

        fuzz_fetch()
        fuzz_release()
        _assert_explored(seen, OK, INVALID, Code.NOT_FOUND, Code.FAILED_PRECONDITION)
        # A client that leaves after one chunk of page-sized chunks.
        stream = _kv(rig, "rank0").FetchKV(pb.FetchRequest(request_id=hostile.LIVE, fingerprint=fingerprint,
                                                          max_chunk_bytes=1024), timeout=TIMEOUT_S,
                                           metadata=_ticket(rig, hostile.LIVE))
        next(stream)
        stream.cancel()
        # The pinned request is whole: every byte as before the fuzzing.
        assert {rank: fetch(rank)() for rank in owned} == before

    # A release racing a fetch of the same pages: the stream ends whole or NOT_FOUND,
    # and the pages come back once (a second free would raise in the parent).
    _prefilled(rig, pb.PrefillRequest(token_ids=pb.TokenIds(ids=list(range(3, 43))), request_id="racy"))
    stream = _kv(rig, "rank0").FetchKV(pb.FetchRequest(request_id="racy", fingerprint=fingerprint,
                                                      max_chunk_bytes=1024), timeout=TIMEOUT_S,
                                       metadata=_ticket(rig, "racy"))
    next(stream)
    assert _outcome(release("rank0", "racy")) == OK
    assert _outcome(lambda: list(stream)) in (OK, Code.NOT_FOUND)
    assert _outcome(release("rank0", "racy")) == Code.NOT_FOUND
    assert _outcome(release("rank1", "racy")) == OK
    _assert_serves_on(rig)


_MANIFEST = Manifest("r", PAGE_SIZE, 10, ((6, 0, 4), (3, 1, 4), (8, 0, 2))).encode()
_HEADER = encode_chunk("r", 1, 0, 0, [3], torch.zeros(2, 2, PAGE_SIZE, 2, 16))[0].encode()


@pytest.mark.timeout(60)
@FUZZ
@given(data=st.one_of(st.binary(max_size=128), hostile.MSGPACK_VALUES.map(msgpack.packb),
                      hostile.mutations(msgpack.unpackb(_MANIFEST)), hostile.mutations(msgpack.unpackb(_HEADER)),
                      hostile.DEPTHS.map(lambda depth: msgpack.packb({"pages": hostile.nested(depth)}))))
def test_decoders_refuse_hostile_msgpack_with_value_error(data):
    # The manifest reaches decode from the prefill daemon, the header from a rank:
    # no client can send them, so they are fuzzed here rather than through an RPC.
    for decode in (Manifest.decode, ChunkHeader.decode, Agreement.decode, LayoutContract.decode, agreement_of):
        try:
            decode(data)
        except ValueError:
            pass


RAW_METHODS = [  # (method, streaming, targets)
    ("/lanekv.v1.PrefillService/Prefill", False, ("parent",)),
    ("/lanekv.v1.PrefillService/PrefillStream", True, ("parent",)),
    ("/lanekv.v1.DecodeService/Generate", True, ("decode",)),
    ("/lanekv.v1.KVTransfer/Handshake", False, ("parent", "rank0", "decode")),
    ("/lanekv.v1.KVTransfer/FetchKV", True, ("parent", "rank1", "decode")),
    ("/lanekv.v1.KVTransfer/Release", False, ("parent", "rank0", "decode")),
    ("/lanekv.v1.KVTransfer/AttachPool", False, ("parent", "rank1", "decode")),
]


def _raw(channel: grpc.Channel, method: str, streaming: bool, data: bytes) -> Callable[[], object]:
    if streaming:
        return lambda: list(channel.unary_stream(method)(data, timeout=TIMEOUT_S))
    return lambda: channel.unary_unary(method)(data, timeout=TIMEOUT_S)


@pytest.mark.timeout(60)
def test_raw_bytes_that_are_not_protobuf_are_refused(rig):
    try:
        for method, streaming, targets in RAW_METHODS:
            for target in targets:
                for data in hostile.NOT_PROTOBUF:
                    if method.endswith("Handshake") and data == hostile.NOT_PROTOBUF[-1]:
                        continue  # a bytes field takes any bytes: this one parses
                    call = _raw(rig.channels[target], method, streaming, data)
                    assert _outcome(call) == INVALID, (method, target, data)
    finally:
        _assert_serves_on(rig)


class _ContractOnly:
    """A page source that holds no pages: enough for a KVTransfer server."""

    rank = 0

    def __init__(self, contract) -> None:
        self._contract = contract

    def contract(self):
        return self._contract

    def pages_of(self, request_id: str):
        raise KeyError("no pages here")

    def ready(self, request_id, layer_end, timeout_s, alive, *, exact=False):
        raise KeyError("no pages here")

    def read(self, physical_pages, layer_start: int, layer_end: int, after=None):
        raise KeyError("no pages here")

    def digest(self, physical_pages, layer_start: int, layer_end: int, after=None, *, request_id=None, heads=None):
        raise KeyError("no pages here")

    def share(self, transports):
        raise ValueError("no pool here")

    def admits(self, request_id: str, capability):
        return True  # holds nothing: pages_of answers NOT_FOUND

    def release(self, request_id: str) -> int:
        raise KeyError("no pages here")


@pytest.mark.timeout(60)
def test_malformed_request_interceptor_refuses_what_does_not_parse(rig):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=grpc_options(),
                         interceptors=[MalformedRequestInterceptor()])
    add_transfer_service(server, KVTransferService(_ContractOnly(rig.prefill.contract)))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method, streaming, _ in [m for m in RAW_METHODS if "KVTransfer" in m[0]]:
                for data in hostile.NOT_PROTOBUF:
                    if method.endswith("Handshake") and data == hostile.NOT_PROTOBUF[-1]:
                        continue  # a bytes field takes any bytes: this one parses
                    assert _outcome(_raw(channel, method, streaming, data)) == INVALID, (method, data)
            # What parses is served as before.
            kv = lanekv_pb2_grpc.KVTransferStub(channel)
            contract = rig.prefill.contract
            assert kv.Handshake(pb.HandshakeRequest(contract=contract.agreement.encode()), timeout=10).ok
            fetch = pb.FetchRequest(request_id="x", fingerprint=contract.fingerprint)
            assert _outcome(lambda: list(kv.FetchKV(fetch, timeout=10))) == Code.NOT_FOUND
    finally:
        server.stop(0)


@pytest.mark.timeout(60)
def test_messages_over_the_receive_limit_are_refused(rig):
    data = hostile.oversized((128 << 20) + 1)  # field 1 alone is a byte over the receive limit
    options = [("grpc.max_send_message_length", -1)]
    rank0, rank1 = rig.prefill.topology.endpoints
    endpoints = {"parent": rig.prefill.endpoint, "decode": rig.decode.endpoint, "rank0": rank0, "rank1": rank1}
    for method, streaming, targets in RAW_METHODS[:4]:
        with grpc.insecure_channel(endpoints[targets[-1]], options=options) as channel:
            assert _outcome(_raw(channel, method, streaming, data)) == Code.RESOURCE_EXHAUSTED, method
    _assert_serves_on(rig)
