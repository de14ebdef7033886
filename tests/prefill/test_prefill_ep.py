"""Prefill EP: a MoE model's routed experts sharded over the CP ranks (each rank reading
only its experts), each MoE layer exchanging rows; greedy tokens through prefill ->
transfer -> decode equal transformers', with the decode daemon at tp 1 and tp 2."""

from __future__ import annotations

import pytest
import torch
from lanekv.model.checkpoint import tensor_files
from lanekv.model.config import ModelConfig
from lanekv.model.parallel.tp import TPRank, load_shard
from lanekv.prefill.engine_config import EngineConfig
from safetensors import safe_open

from tests.checkpoints import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    write_deepseek_v3,
    write_deepseek_v32,
    write_llama,
    write_qwen3_moe,
)
from tests.daemons import generate_concurrently, running_pair
from tests.fp8_checkpoints import dequantized_copy, quantize_checkpoint

PAGE_SIZE, MAX_NEW_TOKENS = 4, 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    out = {"qwen3moe": write_qwen3_moe(root / "qwen3moe"), "deepseek_v3": write_deepseek_v3(root / "deepseek_v3"),
           "deepseek_v32": write_deepseek_v32(root / "deepseek_v32")}
    # Block-FP8 (16x32 blocks: the decode's tp 2 cuts fall on them), two files
    out["deepseek_v3_fp8"] = quantize_checkpoint(out["deepseek_v3"], root / "deepseek_v3_fp8", (16, 32), shards=2)
    out["deepseek_v3_fp8-dequantized"] = dequantized_copy(out["deepseek_v3_fp8"], root / "v3_fp8-dequantized")
    return out


def _prompts(lengths: tuple[int, ...] = (6, 21)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in lengths]


def _reference(path, lengths: tuple[int, ...] = (6, 21)) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in _prompts(lengths):
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=MAX_NEW_TOKENS, pad_token_id=EOS_TOKEN_ID)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize(("name", "size"), [("deepseek_v3", 2), ("deepseek_v3", 3), ("deepseek_v3_fp8", 2)])
def test_ep_rank_reads_only_its_experts(checkpoints, name: str, size: int) -> None:
    """The attention and shared experts whole, the routed experts split (8 experts over 3
    ranks: 2, 3 and 3): the ranks read the whole checkpoint's bytes plus one extra copy
    per extra rank of what is not a routed expert (block-FP8: an expert's e4m3 weights
    and their scales go together)."""
    path = checkpoints[name]
    nbytes = {}
    for file in tensor_files(path):
        with safe_open(str(file), framework="pt") as f:
            nbytes.update({n: torch.Size(f.get_slice(n).get_shape()).numel() * (
                1 if f.get_slice(n).get_dtype() == "F8_E4M3" else 4) for n in f.keys()})
    layers = ModelConfig.from_dir(path).num_layers
    owner = {2: [0, 0, 0, 0, 1, 1, 1, 1], 3: [0, 0, 1, 1, 1, 2, 2, 2]}[size]

    def routed_of(rank: int) -> int:  # of every MoE layer
        return sum(b for n, b in nbytes.items() if ".mlp.experts." in n and owner[int(n.split(".")[5])] == rank)

    rest = sum(b for n, b in nbytes.items() if ".mlp.experts." not in n and int(
        n.split(".")[2] if n.startswith("model.layers.") else 0) < layers)  # MTP layers are never read
    reads = [load_shard(path, TPRank(0, 1), ep=TPRank(r, size)) for r in range(size)]
    assert [r.bytes_read for r in reads] == [rest + routed_of(r) for r in range(size)]
    assert sum(routed_of(r) for r in range(size)) == sum(b for n, b in nbytes.items() if ".mlp.experts." in n and int(
        n.split(".")[2]) < layers)
    moe = reads[1].loaded.model.model.layers[1].mlp
    assert (moe.first, len(moe.experts), moe.shared_experts is not None) == (owner.index(1), owner.count(1), True)
    assert (moe.fp8 is not None) == name.endswith("_fp8")  # e4m3 experts stacked with their scales


def test_ep_needs_a_moe_model_and_an_expert_per_rank(checkpoints, tmp_path) -> None:
    with pytest.raises(ValueError, match="ep=True needs a MoE model"):
        EngineConfig(str(write_llama(tmp_path / "llama")), cp_size=2, ep=True, device="cpu")
    with pytest.raises(ValueError, match=r"cp_size=9 is more ranks than num_experts=8"):
        EngineConfig(str(checkpoints["qwen3moe"]), cp_size=9, ep=True, device="cpu")
    with pytest.raises(ValueError, match=r"ep_dispatch must be one of sized, capturable, got ep_dispatch='fixed'"):
        EngineConfig(str(checkpoints["qwen3moe"]), cp_size=2, ep=True, ep_dispatch="fixed", device="cpu")
    with pytest.raises(ValueError, match=r"ep_dispatch='capturable' needs ep=True"):
        EngineConfig(str(checkpoints["qwen3moe"]), cp_size=2, ep_dispatch="capturable", device="cpu")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "cp_size", "tp_size", "dispatch"), [
    ("qwen3moe", 2, 1, "sized"), ("qwen3moe", 3, 1, "sized"), ("deepseek_v3", 2, 2, "sized"),
    ("deepseek_v3", 3, 1, "sized"), ("deepseek_v3_fp8", 2, 2, "sized"), ("deepseek_v32", 2, 2, "sized"),
    ("deepseek_v3", 3, 1, "capturable")])
def test_ep_prefill_feeds_decode_equal_to_transformers(checkpoints, name: str, cp_size: int, tp_size: int,
                                                       dispatch: str) -> None:
    """Each MoE layer dispatches its (token, choice) rows to the experts' owners by
    all-to-all (cp 3: 8 experts split 2, 3, 3), with split sizes read on the host
    (``sized``) or with fixed padded shapes and no host read (``capturable``; a 17-token
    prompt, 5 pages, gives the ranks unequal rows, padded to the largest). Block-FP8: EP prefill ranks read their
    experts' e4m3 weights and scales, the decode ranks their slices of the attention
    (transformers runs the weights dequantized). DeepSeek-V3.2: the index keys in the
    model dtype, as transformers keeps them."""
    path = checkpoints[name]
    cache = {"index_cache_dtype": "model"} if name == "deepseek_v32" else {}
    engine = EngineConfig(str(path), cp_size=cp_size, ep=True, ep_dispatch=dispatch, page_size=PAGE_SIZE,
                          pages_per_lane=32, start_timeout_s=120, cpu_threads=1, **cache)
    lengths = (6, 21, 17) if dispatch == "capturable" else (6, 21)
    with running_pair(engine, pool_pages=64, tp_size=tp_size, transport="grpc") as (_, decode):
        got = generate_concurrently(decode.endpoint, _prompts(lengths), MAX_NEW_TOKENS)
    assert got == _reference(checkpoints.get(f"{name}-dequantized", path), lengths)
