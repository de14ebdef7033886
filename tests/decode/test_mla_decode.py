"""MLA decode: the paged latent-space attention reference against a per-request
torch computation, and greedy decoding of DeepSeek-V2/V3 and Qwen3 (continuous
batching over one pool) against transformers' generate."""

from __future__ import annotations

import pytest
import torch
from lanekv.decode.colocated import generate_colocated
from lanekv.decode.engine import DecodeEngine
from lanekv.decode.pool import PagePool
from lanekv.kernels.mla.paged_decode import paged_mla_decode_attention
from lanekv.kernels.mla.paged_decode_ref import paged_mla_decode_attention_ref
from lanekv.model.checkpoint import load_model
from lanekv.model.sampling import SamplingParams

from tests.checkpoints import (
    DEEPSEEK_WRITERS,
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    write_llama,
    write_qwen3,
    write_qwen3_moe,
)

GREEDY = SamplingParams()


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=gen).tolist()


def _hf_greedy(path, prompts, max_new_tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=EOS_TOKEN_ID)
            outs.append(out[0, len(ids):].tolist())
    return outs


def test_reference_equals_per_request_attention():
    gen = torch.Generator().manual_seed(0)
    page_size, rank = 4, 32
    cache = torch.randn(10 * page_size, 40, generator=gen)
    cache[5 * page_size + 1:6 * page_size] = float("nan")  # past request 1's one row
    q = torch.randn(3, 4, 40, generator=gen)
    page_table = torch.tensor([[7, 2, 0], [5, 0, 0], [1, 9, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 1, 12], dtype=torch.int32)
    out = paged_mla_decode_attention(q, cache, page_table, seq_lens, page_size, 0.25, rank)
    assert out.shape == (3, 4, rank)
    for b in range(3):
        n = int(seq_lens[b])
        rows = torch.tensor([int(page_table[b, p // page_size]) * page_size + p % page_size
                             for p in range(n)])
        keys = cache[rows]
        probs = torch.softmax(q[b] @ keys.T * 0.25, dim=-1)
        torch.testing.assert_close(out[b], probs @ keys[:, :rank], rtol=1e-5, atol=1e-5)
    given = torch.empty_like(out)
    assert paged_mla_decode_attention_ref(q, cache, page_table, seq_lens, page_size, 0.25, rank,
                                          out=given) is given
    torch.testing.assert_close(given, out)


@pytest.mark.parametrize("change,match", [
    ({"kv_lora_rank": 40}, "kv_lora_rank must be an int"),
    ({"seq_lens": torch.tensor([13, 1, 1], dtype=torch.int32)}, "seq_lens holds 13, outside"),
    ({"page_size": 3}, "not a multiple of page_size"),
    ({"q": torch.zeros(3, 4, 41)}, "latent_cache must be"),
])
def test_reference_names_bad_arguments(change, match):
    args = {"q": torch.zeros(3, 4, 40), "latent_cache": torch.zeros(16, 40),
            "page_table": torch.zeros(3, 3, dtype=torch.int32),
            "seq_lens": torch.ones(3, dtype=torch.int32), "page_size": 4, "softmax_scale": 0.2,
            "kv_lora_rank": 32}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        paged_mla_decode_attention(**args)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-decode")
    out = {name: write(root / name) for name, write in DEEPSEEK_WRITERS.items()}
    out["qwen3"] = write_qwen3(root / "qwen3")
    out["qwen3_moe"] = write_qwen3_moe(root / "qwen3_moe")
    return out


@pytest.mark.parametrize("name,page_size", [("deepseek_v2", 1), ("deepseek_v2_qlora", 4),
                                            ("deepseek_v3", 16), ("qwen3", 4),
                                            ("qwen3_moe", 1)])
def test_greedy_batch_matches_transformers(checkpoints, name, page_size):
    loaded = load_model(checkpoints[name])
    prompts = [_prompt(1, 1), _prompt(19, 2), _prompt(45, 3)]
    pool = PagePool.for_model(loaded.config, -(-120 // page_size) + 6, page_size, torch.float32)
    if loaded.config.mla is not None:
        assert pool.tensor.shape[1] == 1 and pool.latent_cache(0).shape[1] == 40
    ours = generate_colocated(loaded.model, pool, prompts, GREEDY, max_new_tokens=10)
    assert ours == _hf_greedy(checkpoints[name], prompts, 10)
    assert pool.free_count == pool.num_pages


def test_engine_refuses_a_pool_of_the_other_kind(checkpoints, tmp_path):
    mla = load_model(checkpoints["deepseek_v3"])
    gqa = load_model(write_llama(tmp_path / "llama"))
    with pytest.raises(ValueError, match="pool is"):
        DecodeEngine(mla.model, PagePool.for_model(gqa.config, 4, 4, torch.float32))
    with pytest.raises(ValueError, match="a latent view needs an MLA pool"):
        PagePool.for_model(gqa.config, 4, 4, torch.float32).latent_cache(0)
