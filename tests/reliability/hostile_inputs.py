"""What hostile input to the lanekv RPCs looks like: hypothesis strategies and payloads.

Each request field has a strategy that is hostile in about one draw of four,
so that many drawn requests get past the first check and reach the later ones
(and some run to the end). Payload builders make msgpack that is truncated,
mistyped, nested past Python's recursion or larger than a daemon accepts.
"""

from __future__ import annotations

import msgpack
from hypothesis import strategies as st
from lanekv.proto import lanekv_pb2 as pb

from tests.checkpoints import VOCAB_SIZE

LIVE = "live"  # a request id the tests keep pinned on the prefill side while they fuzz
# msgpack packs at most ~1000 levels; Python's recursion ends near 250 nested maps.
DEPTHS = st.integers(1, 1000)

I32 = st.one_of(st.sampled_from([-1, 0, 3, VOCAB_SIZE - 1, VOCAB_SIZE, -(2**31), 2**31 - 1]),
                st.integers(-(2**31), 2**31 - 1))
U32 = st.one_of(st.sampled_from([0, 1, 2, 3, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
U64 = st.one_of(st.sampled_from([0, 1, 1023, 1024, 64 << 20, (64 << 20) + 1, 2**64 - 1]),
                st.integers(0, 2**64 - 1))
FLOATS = st.one_of(st.sampled_from([0.0, 1e-38, 1e-45, 0.5, 1.0, 1.5, -1.0]), st.floats(width=32))
VALID_IDS = st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=1, max_size=48)
# 480 tokens fit both pools; 513 and 600 the decode pool only; 1025 is past the model's positions.
LONG_IDS = st.builds(lambda n, t: [t] * n, st.sampled_from([0, 480, 513, 600, 1024, 1025, 4096]),
                     st.integers(3, VOCAB_SIZE - 1))
PROMPT_IDS = st.one_of(VALID_IDS, VALID_IDS, LONG_IDS, LONG_IDS, st.lists(I32, max_size=48))
TEXTS = st.one_of(st.text(max_size=200),
                  st.lists(st.integers(0, 400).map(lambda i: f"w{i}"), max_size=60).map(" ".join))
PRINTABLE_IDS = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40)
REQUEST_IDS = st.one_of(st.none(), st.none(), PRINTABLE_IDS, PRINTABLE_IDS,
                        st.text(max_size=300) | st.sampled_from(["", "x" * 257, "a\x00b", LIVE]))
SEEDS = st.integers(0, 2**64 - 1)
VALID_SAMPLING = st.builds(pb.SamplingParams, temperature=st.sampled_from([0.0, 0.5, 1.0]),
                           top_k=st.integers(0, 50), top_p=st.sampled_from([0.0, 0.9, 1.0]), seed=SEEDS,
                           has_seed=st.booleans())
SAMPLING = st.one_of(
    st.just(pb.SamplingParams()), VALID_SAMPLING, VALID_SAMPLING,
    st.builds(pb.SamplingParams, temperature=FLOATS, top_k=I32, top_p=FLOATS, seed=SEEDS, has_seed=st.booleans()),
)
# Small enough to generate, or too large for the pool or the model's positions.
MAX_NEW = st.one_of(st.integers(0, 6), st.integers(700, 2**32 - 1))
MSGPACK_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
              st.text(max_size=16), st.binary(max_size=16)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def prompted(draw, message_class, **fields):
    """A Prefill or Generate request: any prompt (or none), sampling and request id."""
    kw = {name: draw(strategy) for name, strategy in fields.items()}
    kind = draw(st.sampled_from(("token_ids", "token_ids", "text", None)))
    if kind == "token_ids":
        kw["token_ids"] = pb.TokenIds(ids=draw(PROMPT_IDS))
    elif kind == "text":
        kw["text"] = draw(TEXTS)
    request_id = draw(REQUEST_IDS)
    if request_id is not None:
        kw["request_id"] = request_id
    return message_class(sampling=draw(SAMPLING), **kw)


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def packed(plain: dict, drop: str = "", **changes: object) -> bytes:
    return msgpack.packb({**{k: v for k, v in plain.items() if k != drop}, **changes})


def mutations(plain: dict) -> st.SearchStrategy[bytes]:
    """msgpack of ``plain`` with one key set to a drawn value, dropped, or joined by a new key."""

    def mutate(key: str, value: object, how: str) -> bytes:
        if how == "drop":
            return packed(plain, drop=key)
        return packed(plain, **{key if how == "set" else f"_{key}": value})

    return st.builds(mutate, st.sampled_from(sorted(plain)), MSGPACK_VALUES,
                     st.sampled_from(["set", "drop", "add"]))


def oversized(size: int) -> bytes:
    """A request message whose field 1 (a string or bytes field of every lanekv
    request) holds ``size`` bytes: one payload for every method."""
    varint, rest = bytearray(), size
    while rest >= 0x80:
        varint.append((rest & 0x7F) | 0x80)
        rest >>= 7
    varint.append(rest)
    return b"\x0a" + bytes(varint) + b"a" * size


# Not protobuf at all: a bad tag, a length past the end, a varint cut short,
# wire types 7, 3 and 4, and (last) bad UTF-8 in a string field, which a bytes field takes.
NOT_PROTOBUF = [b"\xff", b"\x0a\x05ab", b"\x08", b"\x0f", b"\x0b", b"\x0a\x02\xff\xfe"]
