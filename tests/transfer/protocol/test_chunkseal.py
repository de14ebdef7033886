"""The chunk seal (``transfer.protocol.chunkseal``): numpy's two passes on the CPU and the torch
form a rank takes on its device give the definition's value, and a changed or moved word changes it."""

from __future__ import annotations

import pytest
import torch
from lanekv.kernels.page_digest import DIGEST_WEIGHT
from lanekv.transfer.protocol.chunkseal import (
    ROW_BYTES,
    ROW_WORDS,
    U64,
    SealSum,
    seal,
    seal_bytes,
    seal_tensor,
)
from lanekv.transfer.protocol.wire import WATCH_BLOCK_BYTES, frame_chunk, split_chunk


def _definition(data: bytes) -> int:
    data += bytes(-len(data) % 8)
    return sum(int.from_bytes(data[j * 8:(j + 1) * 8], "little") * (((j * DIGEST_WEIGHT) & U64) | 1)
               for j in range(len(data) // 8)) & U64


@pytest.mark.parametrize("nbytes", [1, 4, 7, 8, 12, 8 * ROW_WORDS - 4, 8 * ROW_WORDS, 8 * ROW_WORDS + 4,
                                    3 * 8 * ROW_WORDS + 20, 5 * 8 * ROW_WORDS])
def test_numpy_and_torch_give_the_definitions_value(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    expected = _definition(data.numpy().tobytes())
    assert seal_bytes(data.numpy().tobytes()) == expected
    assert seal(data) == expected
    assert int(seal_tensor(data).item()) & U64 == expected  # the form a GPU rank takes, here on the CPU


def test_all_ones_words_wrap_as_the_definition_says():
    data = b"\xff" * (8 * ROW_WORDS * 2 + 16)  # every product and sum wraps
    assert seal_bytes(data) == _definition(data) == int(seal_tensor(torch.frombuffer(bytearray(data),
                                                                                     dtype=torch.uint8)).item()) & U64


def test_a_flipped_bit_and_swapped_words_and_rows_change_it():
    data = bytearray(torch.randint(0, 256, (8 * ROW_WORDS * 3,), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(7)).numpy().tobytes())
    base = seal_bytes(bytes(data))
    flipped = bytearray(data)
    flipped[-1] ^= 0x40
    words = bytearray(data)
    words[0:8], words[8:16] = data[8:16], data[0:8]
    rows = bytearray(data)
    row = 8 * ROW_WORDS
    rows[0:row], rows[row:2 * row] = data[row:2 * row], data[0:row]
    assert len({base, seal_bytes(bytes(flipped)), seal_bytes(bytes(words)), seal_bytes(bytes(rows))}) == 4


def test_a_strided_tensor_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        seal(torch.zeros(4, 4)[:, ::2])


@pytest.mark.parametrize("nbytes", [12, ROW_BYTES + 4, WATCH_BLOCK_BYTES, 2 * WATCH_BLOCK_BYTES + ROW_BYTES + 20])
def test_the_seal_summed_block_by_block_as_a_message_is_framed_is_the_payloads(nbytes):
    # How a relay takes it: frame_chunk hands each block of the payload, as copied, to SealSum.
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    total, blocks = SealSum(nbytes), []
    message = frame_chunk(b"header", memoryview(data.numpy()), each_block=lambda b: (blocks.append(b.size),
                                                                                      total.add(b)))
    header, payload = split_chunk(message)
    assert bytes(header) == b"header" and bytes(payload) == data.numpy().tobytes()
    assert total.value() == seal_bytes(data.numpy().tobytes()) == _definition(data.numpy().tobytes())
    assert sum(blocks) == nbytes and all(size == WATCH_BLOCK_BYTES for size in blocks[:-1])


def test_seal_sum_refuses_blocks_that_do_not_follow_whole_rows():
    total = SealSum(3 * ROW_BYTES)
    total.add(b"\0" * (ROW_BYTES + 8))
    with pytest.raises(ValueError, match="whole rows"):
        total.add(b"\0" * ROW_BYTES)
    with pytest.raises(ValueError, match="were added"):
        total.value()
