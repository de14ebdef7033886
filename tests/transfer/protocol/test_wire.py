"""Wire codec: chunk headers against hostile input, payload round trips, the chunk plan."""

import dataclasses

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lanekv.proto import lanekv_pb2
from lanekv.transfer.protocol.wire import (
    MAX_HEADER_BYTES,
    ChunkHeader,
    buffer_address,
    check_ints,
    checksum,
    encode_chunk,
    frame_chunk,
    join_bytes,
    payload_to_tensor,
    plan_chunks,
    split_chunk,
)

pytestmark = [
    pytest.mark.timeout(60),
    # payload_to_tensor views immutable bytes on purpose (zero copy); torch warns once.
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
]


def gather(pool: torch.Tensor, pages: list[int], page_size: int, layer_start: int, layer_end: int):
    """Plain-torch stand-in for kernels.page_copy.gather_pages."""
    rows = torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])
    return pool[layer_start:layer_end, :, rows]


def random_pool(dtype: torch.dtype, layers=3, pages=7, page_size=4, heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, 2, pages * page_size, heads, dim)
    # Random bit patterns (NaNs included) so the comparison is of bytes, not values.
    bits = torch.randint(
        0, 256, (*shape[:-1], dim * dtype.itemsize), generator=gen, dtype=torch.uint8
    )
    return bits.view(dtype)


def good_header(**changes) -> ChunkHeader:
    fields = dict(
        request_id="req-1",
        rank=1,
        seq=0,
        layer_start=2,
        layer_end=4,
        pages=(3, 9),
        page_size=4,
        kv_heads=2,
        head_dim=8,
        dtype="bfloat16",
        nbytes=2 * 2 * 8 * 2 * 8 * 2,
        checksum=123,
    )
    fields.update(changes)
    return ChunkHeader(**fields)


def test_header_round_trip():
    header = good_header()
    assert ChunkHeader.decode(header.encode()) == header
    assert header.shape == (2, 2, 8, 2, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_payload_round_trip(dtype):
    pool = random_pool(dtype)
    pages = [5, 0, 3]
    payload = gather(pool, pages, 4, 1, 3)
    header, data = encode_chunk("r", 0, 7, 1, pages, payload)
    assert (header.layer_start, header.layer_end, header.pages, header.seq) == (1, 3, (5, 0, 3), 7)
    assert header.nbytes == len(data) == payload.numel() * dtype.itemsize
    assert header.checksum == checksum(data)
    back = payload_to_tensor(ChunkHeader.decode(header.encode()), data)
    assert back.dtype == dtype and back.shape == payload.shape
    assert torch.equal(back.view(torch.uint8), payload.contiguous().view(torch.uint8))


def test_framing_is_a_kvchunk_message():
    payload = gather(random_pool(torch.bfloat16), [6, 2], 4, 0, 3)
    header, data = encode_chunk("r", 2, 0, 0, [6, 2], payload)
    message = frame_chunk(header.encode(), data)
    parsed = lanekv_pb2.KVChunk.FromString(message)  # what any protobuf client sees
    assert parsed.header == header.encode() and parsed.data == bytes(data)
    header_view, data_view = split_chunk(message)
    assert bytes(header_view) == header.encode() and bytes(data_view) == bytes(data)
    # The payload starts 8-byte aligned, so views of it suit every KV dtype.
    assert message.index(bytes(data)) % 8 == 0
    tensor = payload_to_tensor(header, data_view)
    assert tensor.data_ptr() % 8 == 0 and torch.equal(
        tensor.view(torch.int16), payload.view(torch.int16)
    )
    generated = lanekv_pb2.KVChunk(header=b"h", data=b"payload").SerializeToString()
    assert [bytes(v) for v in split_chunk(generated)] == [b"h", b"payload"]


def test_join_bytes_equals_a_plain_join():
    """Large parts are copied by memmove from their own buffers (read-only bytes, a slice at an
    offset, a tensor's memory), small ones through bytes: the result is b"".join's, byte for byte."""
    big = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    message = bytes(big.numpy())
    parts = [b"\x1a\x03", b"", memoryview(message)[5:(1 << 20) + 5], b"\x00" * 3,
             memoryview(big.numpy())[17:], bytearray(b"tail"), memoryview(message)[:100]]
    joined = join_bytes(parts)
    assert type(joined) is bytes and joined == b"".join(parts)
    assert join_bytes([b"a", b"bc"]) == b"abc"  # all small: bytes.join itself


def test_buffer_address_is_where_the_bytes_are():
    import ctypes

    data = bytes(range(256)) * 4
    view = memoryview(data)[100:300]
    assert ctypes.string_at(buffer_address(view), view.nbytes) == data[100:300]
    assert ctypes.string_at(buffer_address(memoryview(bytearray(data))), 16) == data[:16]
    with pytest.raises(ValueError, match="contiguous"):
        buffer_address(memoryview(bytearray(data))[::2])


def test_a_framed_chunk_with_a_flipped_payload_bit_is_refused():
    """frame_chunk's copy is the bytes the checksum covered: one flipped bit in the framed
    payload fails verification on the receiver (``spans.StreamCheck``)."""
    from lanekv.transfer.errors import ChecksumError
    from lanekv.transfer.grpcfetch.spans import Span, StreamCheck

    pool = random_pool(torch.bfloat16)
    payload = gather(pool, [6, 2], 4, 0, 3)
    header, data = encode_chunk("r", 0, 0, 0, [6, 2], payload)
    message = frame_chunk(header.encode(), data)
    got_header, got = StreamCheck("r", 0, Span(0, 3, (6, 2))).chunk(message)
    assert got_header == header and bytes(got) == bytes(data)
    bad = bytearray(message)
    bad[message.index(bytes(data)) + len(bytes(data)) // 2] ^= 0x04
    with pytest.raises(ChecksumError):
        StreamCheck("r", 0, Span(0, 3, (6, 2))).chunk(bytes(bad))


def test_misaligned_payload_is_copied():
    payload = gather(random_pool(torch.float32), [1], 4, 0, 1)
    header, data = encode_chunk("r", 0, 0, 0, [1], payload)
    shifted = memoryview(b"\0" + bytes(data))[1:]
    assert torch.equal(payload_to_tensor(header, shifted), payload)


@pytest.mark.parametrize(
    "message",
    [
        b"\x22\x00",
        b"\x0a\x05abc",
        b"\x0a\x00\x0a\x00",
        b"\x0a" + b"\xff" * 11,
        b"\x12",
        b"\x08\x01",
    ],
)
def test_split_chunk_rejects_malformed(message):
    with pytest.raises(ValueError):
        split_chunk(message)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_split_chunk_only_raises_value_error(message):
    try:
        header, data = split_chunk(message)
    except ValueError:
        return
    assert header.nbytes + data.nbytes <= len(message)


def test_checksum_sees_one_flipped_bit():
    data = bytearray(random_pool(torch.uint8).numpy().tobytes())
    before = checksum(bytes(data))
    data[len(data) // 2] ^= 0x10
    assert checksum(bytes(data)) != before


@pytest.mark.parametrize("values,match", [
    ([3, True, 5], "ids must be an int, got bool True"),
    ([3, 1.0], "ids must be an int, got float"),
    ([3, 10, 11], r"ids must be in \[0, 10\], got 11"),
    ([-1], r"ids must be in \[0, 10\], got -1"),
])
def test_check_ints_names_the_first_bad_value(values, match):
    with pytest.raises((TypeError, ValueError), match=match):
        check_ints("ids", values, 0, 10)


def test_check_ints_passes_ints_in_range_as_a_tuple():
    assert check_ints("ids", [0, 10, 5], 0, 10) == (0, 10, 5)
    assert check_ints("ids", (), 0, 10) == ()


def test_payload_size_must_match():
    header = good_header()
    with pytest.raises(ValueError, match="nbytes|bytes"):
        payload_to_tensor(header, bytes(header.nbytes - 2))


def encoded(**changes) -> bytes:
    fields = dataclasses.asdict(good_header())
    fields["pages"] = list(fields["pages"])
    fields.update(changes)
    return msgpack.packb({k: v for k, v in fields.items() if v is not DROP})


DROP = object()


@pytest.mark.parametrize(
    "data, field",
    [
        (encoded(rank="1"), "rank"),
        (encoded(seq=True), "seq"),
        (encoded(page_size=4.0), "page_size"),
        (encoded(request_id=b"req-1"), "request_id"),
        (encoded(request_id=""), "request_id"),
        (encoded(request_id="x" * 10_000), "request_id"),
        (encoded(checksum=DROP), "checksum"),
        (encoded(extra=1), "extra"),
        (encoded(rank=-1), "rank"),
        (encoded(layer_start=3, layer_end=3), "layer_end"),
        (encoded(head_dim=2**63), "head_dim"),
        (encoded(pages=[-4]), "page"),
        (encoded(pages=[]), "pages"),
        (encoded(pages=["a"]), "page"),
        (encoded(pages=5), "pages"),
        (encoded(dtype="int4"), "dtype"),
        (encoded(nbytes=513), "nbytes"),
        (encoded(checksum=-1), "checksum"),
        (msgpack.packb([1, 2, 3]), "map"),
        (msgpack.packb({1: 2}), "msgpack"),
        (b"\xc1\x00", "msgpack"),
        (b"\x8c", "msgpack"),  # a map that never arrives
        (encoded() + b"\x00", "msgpack"),  # trailing bytes
        (b"\x91" * 5000 + b"\x00", "msgpack"),  # nested past the unpacker's depth limit
        (msgpack.packb({"rank": msgpack.ExtType(1, b"x")}), "msgpack"),
        (b"\x80" * (MAX_HEADER_BYTES + 1), "bytes"),
        ("not bytes", "bytes"),
    ],
)
def test_header_rejects_hostile_input(data, field):
    with pytest.raises(ValueError, match=field):
        ChunkHeader.decode(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_header_decode_only_raises_value_error(data):
    try:
        ChunkHeader.decode(data)
    except ValueError:
        pass


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(sorted(dataclasses.asdict(good_header()))),
        st.one_of(
            st.integers(-(2**63), 2**64 - 1),
            st.text(max_size=8),
            st.none(),
            st.lists(st.integers(0, 9)),
        ),
    )
)
def test_header_decode_fuzzed_maps(fields):
    base = dataclasses.asdict(good_header())
    base["pages"] = list(base["pages"])
    try:
        header = ChunkHeader.decode(msgpack.packb({**base, **fields}))
    except ValueError:
        return
    assert header.nbytes == header.expected_nbytes


def coverage(chunks):
    return sorted(
        (layer, page)
        for c in chunks
        for layer in range(c.layer_start, c.layer_end)
        for page in c.pages
    )


def test_plan_groups_layers_when_they_fit():
    chunks = plan_chunks(8, [4, 1, 7], 100, 700)  # two layers of 300 bytes per chunk
    assert [(c.layer_start, c.layer_end) for c in chunks] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(c.pages == (4, 1, 7) for c in chunks)


def test_plan_splits_pages_evenly_within_a_layer():
    chunks = plan_chunks(2, list(range(10)), 100, 400, layer_start=5)
    # 10 pages at most 4 per chunk: 3 chunks of 4, 3, 3 pages, per layer.
    assert [(c.layer_start, len(c.pages)) for c in chunks] == [
        (5, 4),
        (5, 3),
        (5, 3),
        (6, 4),
        (6, 3),
        (6, 3),
    ]
    assert coverage(chunks) == sorted((layer, p) for layer in (5, 6) for p in range(10))


def test_plan_edge_cases():
    assert plan_chunks(4, [], 100, 1000) == []
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        plan_chunks(4, [1], 100, 99)
    with pytest.raises(ValueError, match="layer_start"):
        plan_chunks(4, [1], 100, 1000, layer_start=-1)


@settings(max_examples=200, deadline=None)
@given(
    num_layers=st.integers(1, 12),
    layer_start=st.integers(0, 4),
    pages=st.lists(st.integers(0, 10_000), unique=True, max_size=40),
    page_bytes=st.integers(1, 64),
    budget_pages=st.integers(1, 100),
)
def test_plan_properties(num_layers, layer_start, pages, page_bytes, budget_pages):
    max_bytes = page_bytes * budget_pages
    chunks = plan_chunks(num_layers, pages, page_bytes, max_bytes, layer_start=layer_start)
    # Every (layer, page) exactly once, each chunk within the bound, layer-major order.
    expected = sorted(
        (layer, p) for layer in range(layer_start, layer_start + num_layers) for p in pages
    )
    assert coverage(chunks) == expected
    assert all(
        (c.layer_end - c.layer_start) * len(c.pages) * page_bytes <= max_bytes for c in chunks
    )
    assert all(
        a.layer_end <= b.layer_start or a.layer_start == b.layer_start
        for a, b in zip(chunks, chunks[1:])
    )
    # Pages keep their given order within and across the chunks of a layer.
    first_layer = [p for c in chunks if c.layer_start == layer_start for p in c.pages]
    assert first_layer == pages
