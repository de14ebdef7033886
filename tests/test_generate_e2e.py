"""The correctness oracle end to end: greedy tokens generated through prefill ->
transfer -> decode equal those of ``transformers.generate(do_sample=False)``.

Each (cp_size, page_size) pair runs a real prefill daemon (its CP ranks are
processes, the ranks' KVTransfer servers real loopback gRPC) and a decode
daemon in this process. The pairs (1, 4), (2, 1), (2, 16), (3, 4) and
(3, 16) cover cp_size 1, 2 and 3 and page sizes 1, 4 and 16 (a covering set,
not the full product: each prefill daemon costs seconds of start-up on a CPU). Every pair runs all
prompts (lengths 1 to 100, one of them sent as text) as concurrent requests,
then checks that both sides got every page back.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from lanekv.model.tokenizer import load_tokenizer
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc

from tests.checkpoints import EOS_TOKEN_ID, VOCAB_SIZE, write_llama
from tests.daemons import running_pair

# (cp_size, page_size, how the decode daemon reads the ranks: "auto" takes the
# same-host fast path, a /dev/shm pool on the CPU; "grpc" streams every byte;
# "grpc-receivers" too, received by two receiver processes, and by threads of
# the daemon for the ranks of concurrent requests beyond those two)
PAIRS = [(1, 4, "auto"), (2, 1, "grpc"), (2, 16, "auto"), (3, 4, "grpc-receivers"), (3, 16, "auto")]
PROMPT_LENS = [1, 9, 31, 100]
MAX_NEW_TOKENS = 12
TEXT_PROMPT = "w17 w42 w99 w5 w250 w18 w7"  # the word-level test tokenizer: <s> then one id per word


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("e2e-llama"), tokenizer=True)


def _prompts(checkpoint) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return [load_tokenizer(checkpoint).encode(TEXT_PROMPT)] + ids


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in _prompts(checkpoint):  # one at a time: no padding in the reference
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=MAX_NEW_TOKENS, pad_token_id=EOS_TOKEN_ID)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module", params=PAIRS, ids=[f"cp{cp}-ps{ps}-{how}" for cp, ps, how in PAIRS])
def daemons(request, checkpoint):
    cp_size, page_size, how = request.param
    engine = EngineConfig(str(checkpoint), cp_size=cp_size, page_size=page_size,
                          pages_per_lane=-(-400 // page_size), start_timeout_s=120)
    receivers = 2 if how == "grpc-receivers" else 0
    with running_pair(engine, pool_pages=-(-1200 // page_size), transport=how.split("-")[0],
                      fetch_processes=receivers) as pair:
        if receivers:
            assert pair[1].kv.receivers.wait_started(receivers, 90), "receiver processes did not start"
        yield pair


def _generate(stub, request) -> tuple[list[int], str, str, dict]:
    call = stub.Generate(request, timeout=120)
    tokens, text, reason = [], "", ""
    for reply in call:
        tokens += reply.token_ids
        text += reply.text
        reason = reply.finish_reason or reason
    return tokens, text, reason, dict(call.trailing_metadata())


@pytest.mark.timeout(240)
def test_concurrent_generations_equal_transformers(daemons, checkpoint, reference):
    prefill, decode = daemons
    prefill_free = prefill.engine.allocator.free_counts()
    prompts = _prompts(checkpoint)
    requests = [lanekv_pb2.GenerateRequest(text=TEXT_PROMPT, max_new_tokens=MAX_NEW_TOKENS)]
    requests += [lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=MAX_NEW_TOKENS)
                 for ids in prompts[1:]]
    results: list = [None] * len(requests)
    errors: list[BaseException] = []
    with grpc.insecure_channel(decode.endpoint) as channel:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)

        def run(i: int) -> None:
            try:
                results[i] = _generate(stub, requests[i])
            except grpc.RpcError as err:  # reported below, with the prompt it belongs to
                errors.append(err)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert not errors, errors
    if decode.config.fetch_processes:
        assert decode.kv.receivers.taken > 0
    # Each rank was read the way the pair was set up to read it.
    used = {decode.fastpath.transport(e) for e in prefill.topology.endpoints} if decode.fastpath else {"grpc"}
    assert used == ({"shm"} if decode.config.transport == "auto" else {"grpc"})
    tokenizer = load_tokenizer(checkpoint)
    agreement = decode.agreement
    page_bytes = 2 * agreement.num_layers * agreement.page_size * agreement.num_kv_heads * agreement.head_dim * 4
    for ids, want, (tokens, text, reason, stats) in zip(prompts, reference, results):
        assert tokens == want, f"prompt of {len(ids)} tokens"
        assert reason == ("stop" if want[-1] == EOS_TOKEN_ID else "length")
        assert text == tokenizer.decode(tokens)
        assert int(stats["lanekv-transfer-bytes"]) == -(-len(ids) // agreement.page_size) * page_bytes
        assert float(stats["lanekv-transfer-seconds"]) > 0 and float(stats["lanekv-prefill-seconds"]) > 0
        # The ranks' own time is within the prefill call's.
        assert 0 < float(stats["lanekv-prefill-compute-seconds"]) <= float(stats["lanekv-prefill-seconds"])
        how = "shm" if decode.config.transport == "auto" else "grpc"
        paths = dict(item.split(":") for item in stats["lanekv-transfer-paths"].split(","))
        assert paths and set(paths.values()) == {how}
        assert {int(r) for r in paths} <= set(range(prefill.topology.cp_size))
    # Both sides have every page back: decode at once, prefill once the ranks' releases arrive.
    stats = decode.stats()
    assert (stats.free_pages, stats.reserved_pages, stats.active_requests) == (stats.total_pages, 0, 0)
    assert stats.finished >= len(requests)
    deadline = time.monotonic() + 10
    while prefill.engine.allocator.free_counts() != prefill_free and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefill.engine.allocator.free_counts() == prefill_free
    assert prefill.leases.held() == {}
