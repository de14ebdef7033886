"""A decode daemon with tensor parallelism (``tp_size`` rank processes, gloo on the CPU)
behind a real prefill daemon: greedy tokens equal transformers' for prefill cp 1 and 2,
each decode rank fetching only its KV heads over gRPC or NIXL; a rank killed mid-generation
ends its requests UNAVAILABLE naming the rank and turns the daemon NOT_SERVING."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.decode.config import DecodeConfig
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.daemon import serve_until_signal

from tests.checkpoints import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    write_deepseek_v3,
    write_deepseek_v32,
    write_llama,
    write_llama_4kv,
)
from tests.daemons import running_pair
from tests.fp8_checkpoints import dequantized_copy, quantize_checkpoint
from tests.transfer.nixl.test_nixl_heads import NEEDS_NIXL

PAGE_SIZE = 4
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-e2e")
    # Llama: 4 query / 2 KV heads; DeepSeek-V3: MLA with 4 heads, 8 routed experts and a shared one.
    # DeepSeek-V3.2: DSA (4 index heads, top 5 keys); llama_fp8: block-FP8 weights (16x16 blocks).
    out = {"llama": write_llama(root / "llama"), "llama4": write_llama_4kv(root / "llama4"),
           "deepseek_v3": write_deepseek_v3(root / "deepseek_v3"),
           "deepseek_v32": write_deepseek_v32(root / "deepseek_v32")}
    out["llama_fp8"] = quantize_checkpoint(out["llama"], root / "llama_fp8", (16, 16), shards=2)
    out["llama_fp8-dequantized"] = dequantized_copy(out["llama_fp8"], root / "llama_fp8-dequantized")
    return out


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    return checkpoints["llama"]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in (3, 17, 30)]


def reference(checkpoint) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager", dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in _prompts():
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=MAX_NEW_TOKENS, pad_token_id=EOS_TOKEN_ID)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def references():
    """``reference`` per checkpoint, computed once for the module's cases that share it
    (llama: four, deepseek_v3: two)."""
    known: dict[str, list[list[int]]] = {}

    def of(checkpoint) -> list[list[int]]:
        if str(checkpoint) not in known:
            known[str(checkpoint)] = reference(checkpoint)
        return known[str(checkpoint)]

    return of


def _engine(checkpoint, cp_size: int, **fields) -> EngineConfig:
    """The prefill's config; ``fields`` (kv_cache_dtype, index_cache_dtype) the decode daemon takes too."""
    return EngineConfig(str(checkpoint), cp_size=cp_size, page_size=PAGE_SIZE, pages_per_lane=64,
                        start_timeout_s=120, cpu_threads=1, **fields)


def _generate(stub, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
    call = stub.Generate(lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids),
                                                    max_new_tokens=max_new_tokens), timeout=120)
    tokens = [t for reply in call for t in reply.token_ids]
    return tokens, dict(call.trailing_metadata())


def _single_fp8_kv(checkpoint) -> list[list[int]]:
    """The tokens of one process over FP8 KV (the reference of an FP8-KV run: e4m3 rows
    are not transformers')."""
    from lanekv.decode.colocated import generate_colocated
    from lanekv.decode.pool import PagePool
    from lanekv.model.checkpoint import load_model
    from lanekv.model.sampling import SamplingParams

    whole = load_model(checkpoint)
    pool = PagePool.for_model(whole.config, 64, PAGE_SIZE, torch.float32, kv_cache_dtype=FP8)
    return generate_colocated(whole.model, pool, _prompts(), SamplingParams(), MAX_NEW_TOKENS)


FP8 = "fp8_e4m3"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("name", "cp_size", "tp_size", "fields"),
                         [("llama", 1, 2, {}), ("llama", 2, 2, {}), ("llama4", 2, 4, {}), ("deepseek_v3", 2, 2, {}),
                          ("deepseek_v32", 2, 2, {"index_cache_dtype": "model"}), ("llama_fp8", 2, 2, {}),
                          ("llama", 2, 2, {"kv_cache_dtype": FP8}), ("deepseek_v32", 1, 2, {"kv_cache_dtype": FP8})])
def test_tp_decode_after_cp_prefill_equals_transformers(checkpoints, references, name: str, cp_size: int, tp_size: int,
                                                        fields: dict) -> None:
    """Transformers' tokens (on the dequantized weights for block-FP8), or with FP8 KV
    the single-process FP8-KV run's: every pairing fetches each rank's heads (GQA;
    FP8 rows with their scales) or whole rows (MLA, DSA's latent + index-K row)."""
    checkpoint = checkpoints[name]
    mla = name.startswith("deepseek")
    with running_pair(_engine(checkpoint, cp_size, **fields), pool_pages=64, tp_size=tp_size, transport="grpc") as (
            prefill, decode):
        # Llama: 1 of the 2 KV heads, llama4: 1 of 4; MLA: the latent row
        assert decode.pool.tensor.shape[3] == 1
        assert decode.config.transports == ("grpc",)
        results: list = [None] * 3
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _generate(stub, _prompts()[i],
                                                                                          MAX_NEW_TOKENS)))
                       for i in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
        agreement = decode.agreement
        page_bytes = agreement.kv_planes * agreement.num_layers * PAGE_SIZE * agreement.num_kv_heads \
            * agreement.head_dim * decode.pool.tensor.element_size()
        want = _single_fp8_kv(checkpoint) if "kv_cache_dtype" in fields else references(
            checkpoints.get(f"{name}-dequantized", checkpoint))
        for ids, expected, (tokens, stats) in zip(_prompts(), want, results):
            assert tokens == expected, f"prompt of {len(ids)} tokens"
            # GQA: both ranks' halves of every page, the whole page's bytes once; MLA: each
            # rank the whole latent rows.
            copies = tp_size if mla else 1
            assert int(stats["lanekv-transfer-bytes"]) == copies * -(-len(ids) // PAGE_SIZE) * page_bytes
        stats = decode.stats()
        assert (stats.free_pages, stats.active_requests) == (stats.total_pages, 0)


@NEEDS_NIXL
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("name", "cp_size"), [("llama", 1), ("llama", 2), ("deepseek_v3", 1)])
def test_tp_decode_over_nixl_equals_transformers(checkpoints, references, name: str, cp_size: int,
                                                 monkeypatch) -> None:
    """``--transport nixl`` with ``tp_size=2`` (UCX over TCP): every prefill rank read through
    NIXL by both decode ranks, GQA ranks each only their KV head's bytes (staged by the
    prefill rank), MLA ranks the whole latent rows; transformers' tokens."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # the rank processes inherit it: UCX over TCP only
    checkpoint = checkpoints[name]
    mla = name.startswith("deepseek")
    with running_pair(_engine(checkpoint, cp_size), pool_pages=64, tp_size=2, transport="nixl",
                      prefix_cache=False) as (prefill, decode):
        assert decode.config.transports == ("nixl", "grpc")
        fetch, paths = decode.fetcher.fetch, []

        def recorded(job):
            fetched = fetch(job)
            paths.append(dict(fetched.paths))
            return fetched

        decode.fetcher.fetch = recorded
        agreement = decode.agreement
        page_bytes = agreement.kv_planes * agreement.num_layers * PAGE_SIZE * agreement.num_kv_heads \
            * agreement.head_dim * decode.pool.tensor.element_size()
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            ids = _prompts()[2]  # 30 tokens: 8 pages, 4 on each prefill rank with cp 2
            tokens, stats = _generate(stub, ids, MAX_NEW_TOKENS)
        assert tokens == references(checkpoint)[2]
        assert paths == [dict.fromkeys(range(cp_size), "nixl")]  # on both decode ranks
        # GQA: each rank its half of every page (the page's bytes once in all); MLA: whole rows each.
        assert int(stats["lanekv-transfer-bytes"]) == (2 if mla else 1) * -(-len(ids) // PAGE_SIZE) * page_bytes
        assert decode.metrics.failures.labels(cause="nixl_digest").value == 0


def test_tp_size_not_dividing_kv_heads_is_refused(checkpoint) -> None:
    with pytest.raises(ValueError, match=r"^tp_size=4 does not divide num_kv_heads=2$"):
        DecodeConfig(str(checkpoint), "127.0.0.1:1", tp_size=4, device="cpu")
    # NIXL reads each rank's heads (staged by the prefill rank) or whole MLA rows: accepted.
    assert DecodeConfig(str(checkpoint), "127.0.0.1:1", tp_size=2, device="cpu", transport="nixl").transports \
        == ("nixl", "grpc")


@pytest.mark.timeout(180)
def test_killed_rank_ends_requests_unavailable(checkpoint) -> None:
    with running_pair(_engine(checkpoint, 1), pool_pages=128, tp_size=2, transport="grpc") as (prefill, decode):
        free_before = prefill.engine.allocator.free_counts()
        follower = decode.tp._procs[1]
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            call = stub.Generate(lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=_prompts()[1]),
                                                            max_new_tokens=400,
                                                            sampling=lanekv_pb2.SamplingParams(ignore_eos=True)),
                                   timeout=120)
            got = 0
            with pytest.raises(grpc.RpcError) as caught:
                for reply in call:
                    got += len(reply.token_ids)
                    if got >= 3 and follower.is_alive():
                        os.kill(follower.pid, signal.SIGKILL)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "decode rank 1" in caught.value.details() and "SIGKILL" in caught.value.details()
            assert 3 <= got < 400
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert "decode rank 1" in decode.failure()
        # ``lanekv decode`` serves through serve_until_signal: it sees the failure and exits 1.
        assert serve_until_signal(decode, "banner", None, 1.0, logging.getLogger("test"), "draining",
                                  prog="lanekv decode") == 1
        # Nothing leaks on the prefill side: the request's pages came back (released after the fetch).
        deadline = time.monotonic() + 10
        while prefill.engine.allocator.free_counts() != free_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert prefill.engine.allocator.free_counts() == free_before
