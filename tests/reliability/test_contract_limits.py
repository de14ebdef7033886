"""Hostile contracts at Handshake: bounded status messages, bounded and linear decoding.

A refused Handshake once echoed the caller's values without bound (a 100 KB
field, or four 4000-character ones, made gRPC answer RESOURCE_EXHAUSTED for
the metadata instead of the diff), and decoding plus diffing cost time
quadratic in the number of keys (20 000 keys: seconds of server time). Every
refusal must now carry a message of at most ``MAX_DETAILS_CHARS``, and a
contract too large, with too many keys or nested too deep is refused before
any other work.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import grpc
import msgpack
import pytest
from lanekv.proto import lanekv_pb2 as pb
from lanekv.proto import lanekv_pb2_grpc
from lanekv.runtime.status import CONTRACT_METADATA_KEY, MAX_DETAILS_CHARS
from lanekv.transfer.protocol import agreement, contract, encoding, fielddiff
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.contract import LayoutContract
from lanekv.transfer.protocol.encoding import (
    MAX_CONTRACT_BYTES,
    MAX_CONTRACT_DEPTH,
    MAX_CONTRACT_KEYS,
)
from lanekv.transfer.protocol.fielddiff import diff

from tests.reliability.kv_cluster import make_agreement, start_servers

pytestmark = pytest.mark.timeout(60)
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def stub() -> Iterator[lanekv_pb2_grpc.KVTransferStub]:
    servers = start_servers(1, 4)
    channel = grpc.insecure_channel(servers.endpoints[0])
    try:
        yield lanekv_pb2_grpc.KVTransferStub(channel)
    finally:
        channel.close()
        servers.stop()


def _refusal(stub, contract: bytes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Handshake(pb.HandshakeRequest(contract=contract), timeout=20)
    return caught.value


def _plain(**model_config) -> dict:
    plain = make_agreement().to_dict()
    plain["model_config"] = {**plain["model_config"], **model_config}
    return plain


def test_a_100_kb_field_is_refused_with_a_short_message(stub):
    err = _refusal(stub, msgpack.packb(_plain(extra="x" * 100_000)))
    assert err.code() == Code.INVALID_ARGUMENT, (err.code(), err.details()[:200])
    assert len(err.details()) <= MAX_DETAILS_CHARS
    assert f"more than {MAX_CONTRACT_BYTES}" in err.details()


def test_four_4000_character_fields_are_refused_with_a_short_message(stub):
    plain = make_agreement().to_dict()
    for name in ("architecture", "weights_digest", "pool_layout", "source_digest"):
        plain[name] = name[0] * 4000
    err = _refusal(stub, msgpack.packb(plain))
    assert err.code() == Code.INVALID_ARGUMENT, (err.code(), err.details()[:200])
    assert len(err.details()) <= MAX_DETAILS_CHARS


def test_a_diff_of_many_long_fields_is_cut_short_and_names_every_field(stub):
    # 2 KB of differing values that the contract's bounds allow: still a
    # FAILED_PRECONDITION with the diff, but each value cut and the message bounded.
    fields = {f"f{i:02d}": "v" * 100 for i in range(20)}
    contract = msgpack.packb(_plain(**fields))
    assert len(contract) <= MAX_CONTRACT_BYTES
    err = _refusal(stub, contract)
    assert err.code() == Code.FAILED_PRECONDITION, (err.code(), err.details()[:200])
    details = err.details()
    assert len(details) <= MAX_DETAILS_CHARS, len(details)
    assert "20 field(s)" in details
    for name in fields:
        assert f"model_config.{name}" in details, name
    sent_back = dict(err.trailing_metadata())[CONTRACT_METADATA_KEY]
    assert LayoutContract.decode(sent_back).agreement == make_agreement()


def test_too_many_keys_are_refused_before_any_diff(stub, monkeypatch):
    calls = []
    monkeypatch.setattr(Agreement, "from_dict",
                        classmethod(lambda cls, value: calls.append(1)))
    # 20 000 keys (145 KiB) used to cost seconds: refused by size first.
    many = {f"k{i}": i for i in range(20_000)}
    err = _refusal(stub, msgpack.packb(_plain(**many)))
    assert err.code() == Code.INVALID_ARGUMENT and len(err.details()) <= MAX_DETAILS_CHARS
    # Within the byte limit, the entry count is the bound.
    few_bytes = {chr(0x21 + i % 90) + chr(0x21 + i // 90): 0 for i in range(MAX_CONTRACT_KEYS)}
    contract = msgpack.packb(_plain(**few_bytes))
    assert len(contract) <= MAX_CONTRACT_BYTES
    err = _refusal(stub, contract)
    assert err.code() == Code.INVALID_ARGUMENT, (err.code(), err.details()[:200])
    assert f"more than {MAX_CONTRACT_KEYS} map entries" in err.details()
    assert calls == []  # nothing was built from either


def test_nesting_past_the_bound_is_refused(stub):
    def nested(depth: int) -> object:
        value: object = 1
        for _ in range(depth):
            value = {"n": value}
        return value

    # The agreement map, model_config and the inner maps: depth 1 + 1 + n.
    ok = msgpack.packb(_plain(deep=nested(MAX_CONTRACT_DEPTH - 2)))
    assert _refusal(stub, ok).code() == Code.FAILED_PRECONDITION  # decoded, then diffed
    err = _refusal(stub, msgpack.packb(_plain(deep=nested(MAX_CONTRACT_DEPTH - 1))))
    assert err.code() == Code.INVALID_ARGUMENT, (err.code(), err.details()[:200])
    assert f"nested more than {MAX_CONTRACT_DEPTH} deep" in err.details()


def _lines_run(call) -> int:
    """Python lines executed in the contract modules by ``call()`` (deterministic, unlike time)."""
    count = 0
    files = {m.__file__ for m in (agreement, contract, encoding, fielddiff)}

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename in files:
            if event == "line":
                count += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def test_diffing_is_linear_in_the_number_of_keys():
    def pair(keys: int) -> tuple[Agreement, Agreement]:
        ours = make_agreement(model_config={f"k{i:05d}": i for i in range(keys)})
        theirs = make_agreement(model_config={f"k{i:05d}": -i for i in range(keys)})
        return ours, theirs

    small, large = pair(250), pair(1000)
    assert len(diff(*small)) == 249  # key 0 agrees
    ratio = _lines_run(lambda: diff(*large)) / _lines_run(lambda: diff(*small))
    # Linear: 4x the keys, about 4x the work (quadratic was about 16x).
    assert ratio < 6, ratio
