"""Layer-wise streaming over gRPC between real daemons: with a prefill slowed after its
first layer, the decode daemon places that layer's pages before the prefill ends, over
two streams per owner rank, and the greedy tokens equal transformers'."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from lanekv.prefill.cp.rank_worker import SLOW_LAYER_ENV
from lanekv.prefill.daemon import PrefillServicer
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.transfer.connector import grpc as grpc_transport
from lanekv.transfer.grpcfetch import client as grpcfetch_client

from tests.checkpoints import write_llama
from tests.daemons import running_pair
from tests.decode.test_decode_engine import hf_greedy

SLOW_S = 2.0  # the prefill sleeps this long once layer 0 is written
PROMPT = [(7 * i + 3) % 120 + 3 for i in range(37)]  # 10 pages of 4: 5 per rank of cp 2


@pytest.mark.timeout(240)
def test_the_first_layer_is_placed_before_the_prefill_ends(tmp_path, monkeypatch):
    checkpoint = write_llama(tmp_path / "llama", num_layers=3)
    expected = hf_greedy(checkpoint, [PROMPT], 6)[0]
    monkeypatch.setenv(SLOW_LAYER_ENV, f"0:{SLOW_S}")  # read by the rank processes at each prefill
    lock, placed, prefilled, streams = threading.Lock(), [], [], []
    place, done, split = grpc_transport.place_chunk, PrefillServicer._done, grpcfetch_client.split_span

    def timed_place(pool, physical, payload, page_size, layer_start, layer_end):
        place(pool, physical, payload, page_size, layer_start, layer_end)
        with lock:
            placed.append((time.monotonic(), layer_start, layer_end))

    def timed_done(self, res, start):
        prefilled.append(time.monotonic())  # the reply of a prefill whose every layer is written
        done(self, res, start)

    def counted_split(span, count):
        parts = split(span, count)
        streams.append(len(parts))
        return parts

    monkeypatch.setattr(grpc_transport, "place_chunk", timed_place)
    monkeypatch.setattr(PrefillServicer, "_done", timed_done)
    monkeypatch.setattr(grpcfetch_client, "split_span", counted_split)
    engine = EngineConfig(str(checkpoint), cp_size=2, page_size=4, pages_per_lane=32, start_timeout_s=120)
    with running_pair(engine, transport="grpc", fetch_streams=2, max_inflight_bytes=1 << 20,
                      fetch_chunk_bytes=2048) as (_, decode), grpc.insecure_channel(decode.endpoint) as channel:
        request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=PROMPT), max_new_tokens=6)
        start = time.monotonic()
        tokens = [t for reply in lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=120)
                  for t in reply.token_ids]
    assert tokens == expected
    assert streams == [2, 2]  # each owner rank's pages over two streams
    assert len(prefilled) == 1 and prefilled[0] - start >= SLOW_S
    first_layer = [t for t, layer_start, _ in placed if layer_start == 0]
    assert first_layer, placed
    # Layer 0 was in the decode pool while the prefill still slept in it, and so well
    # before the prefill's last layer was written.
    assert max(first_layer) < prefilled[0] - SLOW_S / 2, (max(first_layer) - start, prefilled[0] - start)
    assert max(t for t, _, _ in placed) > min(first_layer)  # later layers came after, in the same fetch
