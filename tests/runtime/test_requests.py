"""Proto request fields -> the project's values: refusals name the field."""

import grpc
import pytest
from lanekv.proto import lanekv_pb2
from lanekv.runtime.requests import prompt_from_proto, sampling_from_proto
from lanekv.runtime.status import Refusal


def test_a_huge_text_is_refused_before_tokenizing():
    request = lanekv_pb2.PrefillRequest(text="x" * (100 * 64 + 1))
    with pytest.raises(Refusal) as caught:
        prompt_from_proto(request, tokenizer=None, vocab_size=300, max_tokens=100)
    assert caught.value.code == grpc.StatusCode.OUT_OF_RANGE and "prompt.text" in caught.value.message


def test_token_ids_outside_the_vocabulary_and_tiny_temperatures():
    request = lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=[5, 300]))
    with pytest.raises(Refusal, match="vocabulary") as caught:
        prompt_from_proto(request, tokenizer=None, vocab_size=300, max_tokens=100)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(Refusal, match="temperature") as caught:
        sampling_from_proto(lanekv_pb2.SamplingParams(temperature=1e-30))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
