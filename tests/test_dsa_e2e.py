"""DeepSeek-V3.2 (DSA) end to end: greedy tokens through prefill -> transfer ->
decode, with index_topk below the prompt lengths so that the selection decides.

With ``--index-cache-dtype model`` the tokens equal transformers' generate
(rank threads over several (cp_size, page_size) shapes, concurrent prompts, the
pages gathered in the wire order and scattered into a decode pool as a fetch
places them; and real daemons over gRPC). With fp8 index keys, real daemons
over the fast path generate what the rank threads of the same shape do. A
chunk whose index bytes are damaged on the wire is fetched again, never
decoded, and a decode daemon of another index cache dtype refuses to start,
naming the field.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lanekv.model.attention import pool_rows
from lanekv.prefill.engine_config import EngineConfig
from lanekv.transfer.grpcfetch import spans as spans_module
from lanekv.transfer.protocol.wire import ChunkHeader

from tests.checkpoints import EOS_TOKEN_ID, VOCAB_SIZE, write_deepseek_v32
from tests.daemons import generate_concurrently, running_pair
from tests.threaded_e2e import threaded_generate

REPO = Path(__file__).resolve().parents[1]
PROMPT_LENS = [1, 8, 27, 61]
MAX_NEW_TOKENS = 8
INDEX_TOPK = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_deepseek_v32(tmp_path_factory.mktemp("dsa-e2e"), index_topk=INDEX_TOPK)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _generate(path, **overrides) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                              dtype=torch.float32, **overrides).eval()
    with torch.inference_mode():
        return [hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                            dtype=torch.long), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                            pad_token_id=EOS_TOKEN_ID)[0, len(ids):].tolist()
                for ids in _prompts()]


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[list[int]]:
    sparse = _generate(checkpoint)
    # The selection decides: keeping every key generates other tokens.
    assert _generate(checkpoint, index_topk=1024) != sparse
    return sparse


def _threaded(checkpoint, cp_size: int, page_size: int, cache_dtype: str) -> list[list[int]]:
    return threaded_generate(checkpoint, cp_size, page_size, _prompts(), MAX_NEW_TOKENS,
                             index_cache_dtype=cache_dtype)


@pytest.mark.parametrize("cp_size,page_size", [(1, 1), (2, 4), (3, 16), (4, 2)])
def test_threaded_prefill_transfer_decode_equals_transformers(checkpoint, reference, cp_size,
                                                              page_size):
    assert _threaded(checkpoint, cp_size, page_size, "model") == reference


def _generate_concurrently(endpoint: str) -> list[list[int]]:
    return generate_concurrently(endpoint, _prompts(), MAX_NEW_TOKENS, id_prefix="dsa")


@pytest.fixture
def index_damage(monkeypatch):
    """Flip one index-K byte (row 0, the first index byte) of the first chunk the
    decode daemon receives of request ``dsa-3``; the genuine payloads' bytes are kept."""
    state = {"offset": None, "damaged": 0}
    split = spans_module.split_chunk

    def damaging_split(message):
        header_bytes, data = split(message)
        header = ChunkHeader.decode(header_bytes)
        if state["offset"] is not None and header.request_id == "dsa-3" and not state["damaged"]:
            state["damaged"] += 1
            damaged = bytearray(data)
            damaged[state["offset"]] ^= 0x40
            return header_bytes, memoryview(bytes(damaged))
        return header_bytes, data

    monkeypatch.setattr(spans_module, "split_chunk", damaging_split)
    return state


@pytest.mark.timeout(300)
def test_daemons_over_grpc_equal_transformers_and_refetch_a_damaged_index_page(
        checkpoint, reference, index_damage, caplog, tmp_path):
    engine = EngineConfig(str(checkpoint), cp_size=3, page_size=16, pages_per_lane=16,
                          start_timeout_s=120, index_cache_dtype="model")
    with running_pair(engine, pool_pages=64, transport="grpc") as (pre, dec):
        a = dec.agreement
        assert (a.attention, a.index_cache_dtype, a.index_topk) == ("mla", "model", INDEX_TOPK)
        index_damage["offset"] = dec.pool.rows.index_offset  # row 0's first index byte
        caplog.set_level(logging.INFO, logger="lanekv.decode")
        assert _generate_concurrently(dec.endpoint) == reference
        assert index_damage["damaged"] == 1
        done = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("transfer done request_id=dsa-3 ")]
        assert len(done) == 1 and " retries=1 " in done[0], done
        # Another index cache dtype on the decode side: refused at start-up by field.
        result = subprocess.run(
            [sys.executable, "-m", "lanekv.cli", "decode", "--model", str(checkpoint),
             "--prefill", pre.endpoint, "--page-size", "16", "--device", "cpu",
             "--index-cache-dtype", "fp8_e4m3", "--ready-file", str(tmp_path / "ready")],
            cwd=REPO, capture_output=True, text=True, timeout=150)
    assert result.returncode == 1, result.stderr
    assert "disagree on the layout contract" in result.stderr
    assert "index_cache_dtype" in result.stderr and "index_row_bytes" in result.stderr


@pytest.mark.timeout(300)
def test_fp8_daemons_over_the_fast_path_generate_what_rank_threads_do(checkpoint):
    want = _threaded(checkpoint, 2, 4, "fp8_e4m3")
    engine = EngineConfig(str(checkpoint), cp_size=2, page_size=4, pages_per_lane=64,
                          start_timeout_s=120)  # the default: fp8_e4m3
    with running_pair(engine, pool_pages=128) as (pre, dec):
        a = dec.agreement
        layout = pool_rows(dec.loaded.config, torch.float32, "fp8_e4m3")
        assert (a.index_cache_dtype, a.index_row_bytes, a.head_dim) == (
            "fp8_e4m3", layout.index.row_bytes, layout.head_dim)
        assert _generate_concurrently(dec.endpoint) == want
        assert {dec.fastpath.transport(e) for e in pre.topology.endpoints} == {"shm"}
