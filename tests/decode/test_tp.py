"""Tensor-parallel decode on the CPU (gloo): greedy tokens against transformers,
the shard each rank reads from the checkpoint, refusals, a rank's death."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from lanekv.decode.colocated import generate_colocated, prefill_into_pool
from lanekv.decode.config import DecodeConfig
from lanekv.decode.pool import PagePool, PageTable
from lanekv.decode.tp.engine import TPDecodeEngine
from lanekv.decode.tp.group import RankFailed, TPGroup
from lanekv.decode.tp.rank import TPSpec
from lanekv.model.checkpoint import load_model, tensor_files
from lanekv.model.config import ModelConfig
from lanekv.model.parallel.tp import TPRank, check_tp, load_shard, shard_index
from lanekv.model.sampling import SamplingParams
from safetensors import safe_open

from tests.checkpoints import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    write_deepseek_v3,
    write_deepseek_v32,
    write_llama,
    write_llama_4kv,
    write_qwen2,
    write_qwen3_moe,
)
from tests.decode.tp_tasks import Die, IndexerTopK, PlaceHeads
from tests.fp8_checkpoints import dequantized_copy, quantize_checkpoint
from tests.markers import requires_gpu

GREEDY = SamplingParams()
PAGE_SIZE, NUM_PAGES = 4, 48


# Block-FP8 copies (two files, so a weight and its scale may sit in different ones): the
# blocks tile each rank's part at tp 2 (DeepSeek-V3's o_proj: 32 of 64 input columns).
FP8_CHECKPOINTS = {"llama_fp8": ("llama", (16, 16)), "deepseek_v3_fp8": ("deepseek_v3", (16, 32))}
DSA_CACHE = {"index_cache_dtype": "model"}  # index keys in the model dtype, as transformers keeps them


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-ckpt")
    out = {"llama": write_llama(root / "llama"), "llama4": write_llama_4kv(root / "llama4"),
           "qwen2": write_qwen2(root / "qwen2"), "qwen3moe": write_qwen3_moe(root / "qwen3moe"),
           "deepseek_v3": write_deepseek_v3(root / "deepseek_v3"),
           "deepseek_v32": write_deepseek_v32(root / "deepseek_v32")}
    for name, (source, block) in FP8_CHECKPOINTS.items():
        out[name] = quantize_checkpoint(out[source], root / name, block, shards=2)
        out[f"{name}-dequantized"] = dequantized_copy(out[name], root / f"{name}-dequantized")
    return out


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=gen).tolist()


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=EOS_TOKEN_ID)
            outs.append(out[0, len(ids):].tolist())
    return outs


def test_each_rank_reads_only_its_shard(checkpoints) -> None:
    path = checkpoints["llama"]
    total = 0
    for file in tensor_files(path):
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    total = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    sharded = sum(torch.Size(s).numel() * 4 for n, s in shapes.items()
                  if shard_index(n, s, TPRank(0, 2)) is not None)
    reads = [load_shard(path, TPRank(rank, 2)).bytes_read for rank in range(2)]
    # Each rank: every replicated tensor whole, half of each sharded one.
    assert sharded > 0
    assert reads == [total - sharded // 2] * 2
    assert load_shard(path, TPRank(0, 1)).bytes_read == total
    # The two shards' q_proj rows are the whole q_proj, in rank order.
    whole = load_model(path).model.model.layers[0].self_attn.q_proj.weight
    parts = [load_shard(path, TPRank(r, 2)).loaded.model.model.layers[0].self_attn.q_proj.weight
             for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)


def test_each_rank_reads_only_its_experts(checkpoints) -> None:
    """Qwen3-MoE over 2 ranks: each reads its 4 of the 8 experts of every layer (and
    its half of the attention), never another rank's expert."""
    path = checkpoints["qwen3moe"]
    with safe_open(str(tensor_files(path)[0]), framework="pt") as f:
        sizes = {n: f.get_slice(n).get_shape() for n in f.keys()}
    nbytes = {n: torch.Size(s).numel() * 4 for n, s in sizes.items()}
    experts = {n: b for n, b in nbytes.items() if ".mlp.experts." in n}
    sharded = sum(b for n, b in nbytes.items() if shard_index(n, tuple(sizes[n]), TPRank(0, 2)) is not None)
    rest = sum(nbytes.values()) - sum(experts.values()) - sharded
    for rank in range(2):
        shard = load_shard(path, TPRank(rank, 2))
        mine = sum(b for n, b in experts.items() if int(n.split(".")[5]) // 4 == rank)
        assert shard.bytes_read == rest + sharded // 2 + mine
        moe = shard.loaded.model.model.layers[0].mlp
        assert (moe.first, len(moe.experts)) == (4 * rank, 4)


def test_tp_size_must_divide_kv_heads(checkpoints) -> None:
    config = ModelConfig.from_dir(checkpoints["llama"])  # 2 KV heads
    with pytest.raises(ValueError, match=r"^tp_size=4 does not divide num_kv_heads=2$"):
        check_tp(config, 4)
    with pytest.raises(ValueError, match="tp_size=4 does not divide num_kv_heads=2"):
        TPGroup(TPSpec(str(checkpoints["llama"]), 4, torch.float32, "cpu", NUM_PAGES, PAGE_SIZE))


def decode_tp(path: Path, tp_size: int, prompts: list[list[int]], max_new_tokens: int,
              tmp_path: Path, device: str = "cpu", **pool_dtypes: str) -> list[list[int]]:
    """Prefill each prompt on the whole model, place each rank's KV heads of it in
    that rank's pool, then decode all prompts at once on the TP group. ``pool_dtypes``:
    ``kv_cache_dtype``, ``index_cache_dtype`` of every pool."""
    whole = load_model(path)
    full_pool = PagePool.for_model(whole.config, NUM_PAGES, PAGE_SIZE, torch.float32, **pool_dtypes)
    firsts, tables = [], []
    for ids in prompts:
        table, first = prefill_into_pool(whole.model, full_pool, ids, GREEDY)
        firsts.append(first)
        tables.append(table)
    saved = tmp_path / f"pool-{tp_size}.pt"
    torch.save(full_pool.tensor, saved)
    group = TPGroup(TPSpec(str(path), tp_size, torch.float32, device, NUM_PAGES, PAGE_SIZE,
                           cpu_threads=1, share_gpu=device == "cuda", **pool_dtypes))
    try:
        pool = group.state.pool
        assert pool.tensor.dtype == full_pool.tensor.dtype and pool.tensor.shape[4] == full_pool.tensor.shape[4]
        mla = whole.config.mla is not None  # every rank holds the whole latent row
        assert pool.tensor.shape[3] == whole.config.num_kv_heads // (1 if mla else tp_size)
        engine = TPDecodeEngine(group.state.loaded.model, pool, group=group)
        outputs = {}
        for i, (ids, first, full_table) in enumerate(zip(prompts, firsts, tables)):
            table = PageTable.allocate(pool, len(ids))
            heads = group.run_task(PlaceHeads(str(saved), tuple(full_table.pages)), 30.0)
            assert heads == [pool.tensor.shape[3]] * tp_size
            # Same page ids on both sides: the tests' pools start empty and allocate alike.
            assert list(table.pages) == list(full_table.pages)
            engine.add(f"r{i}", table, first, GREEDY, max_new_tokens)
            outputs[f"r{i}"] = [first]
        while engine.has_work:
            for event in engine.step():
                if event.token_id is not None:
                    outputs[event.request_id].append(event.token_id)
        assert pool.free_count == pool.num_pages
    finally:
        group.close()
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "tp_size"), [("llama", 2), ("qwen2", 2), ("qwen3moe", 2), ("deepseek_v3", 2),
                                               ("llama4", 4), ("deepseek_v32", 2), ("llama_fp8", 2),
                                               ("deepseek_v3_fp8", 2)])
def test_tp_decode_matches_transformers(checkpoints, tmp_path, name: str, tp_size: int) -> None:
    """DeepSeek-V3.2: every rank holds the whole latent + index-K row and the whole
    indexer; FP8: each rank's e4m3 slices and block scales (transformers runs the same
    weights dequantized)."""
    prompts = [prompt(5, 1), prompt(19, 2)]
    ours = decode_tp(checkpoints[name], tp_size, prompts, 8, tmp_path, **(DSA_CACHE if name == "deepseek_v32" else {}))
    assert ours == hf_greedy(checkpoints.get(f"{name}-dequantized", checkpoints[name]), prompts, 8)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "tp_size"), [("llama", 2), ("deepseek_v3", 2), ("deepseek_v32", 2)])
def test_tp_decode_over_fp8_kv_equals_one_process(checkpoints, tmp_path, name: str, tp_size: int) -> None:
    """FP8 KV rows: a GQA rank holds its heads' e4m3 bytes and their scales, an MLA or
    DSA rank the whole FlashMLA row (and index-K row); the tokens are the
    single-process run's over the same FP8 KV."""
    prompts = [prompt(5, 1), prompt(19, 2)]
    ours = decode_tp(checkpoints[name], tp_size, prompts, 8, tmp_path, kv_cache_dtype="fp8_e4m3")
    whole = load_model(checkpoints[name])
    pool = PagePool.for_model(whole.config, NUM_PAGES, PAGE_SIZE, torch.float32, kv_cache_dtype="fp8_e4m3")
    assert ours == generate_colocated(whole.model, pool, prompts, GREEDY, 8)


@pytest.mark.timeout(60)
def test_dsa_ranks_select_the_same_keys(checkpoints) -> None:
    """The indexer is whole on every rank and its inputs are the same on every rank,
    so each rank's top-k of the same scores is the same (and the whole model's)."""
    path = checkpoints["deepseek_v32"]
    group = TPGroup(TPSpec(str(path), 2, torch.float32, "cpu", 8, PAGE_SIZE, cpu_threads=1,
                           **DSA_CACHE))
    try:
        picks = group.run_task(IndexerTopK(layer=1, tokens=12, seed=5), 30.0)
    finally:
        group.close()
    whole = IndexerTopK(layer=1, tokens=12, seed=5).select(load_model(path).model)
    assert picks[0].shape == whole.shape and (picks[0] >= 0).any()
    assert all(torch.equal(p, whole) for p in picks)


def test_each_rank_reads_only_its_fp8_slices_and_scales(checkpoints) -> None:
    """Each rank reads its rows or columns of every cut e4m3 weight and the matching
    blocks of its ``weight_scale_inv``, nothing else of them; the ranks' parts are the
    whole tensors, in rank order."""
    path = checkpoints["llama_fp8"]
    shapes, sizes = {}, {}
    for file in tensor_files(path):
        with safe_open(str(file), framework="pt") as f:
            for n in f.keys():
                t = f.get_slice(n)
                shapes[n] = tuple(t.get_shape())
                sizes[n] = torch.Size(shapes[n]).numel() * (1 if t.get_dtype() == "F8_E4M3" else 4)
    cut = {n for n in shapes if shard_index(n.replace(".weight_scale_inv", ".weight"), shapes[n], TPRank(0, 2))}
    assert any(n.endswith(".weight_scale_inv") for n in cut) and any(n.endswith(".weight") for n in cut)
    shards = [load_shard(path, TPRank(rank, 2)) for rank in range(2)]
    assert [s.bytes_read for s in shards] == [sum(sizes.values()) - sum(sizes[n] for n in cut) // 2] * 2
    whole = load_model(path).model.model.layers[0]
    for attr, dim in (("self_attn.k_proj", 0), ("self_attn.o_proj", 1), ("mlp.down_proj", 1)):
        parts = [s.loaded.model.model.layers[0].get_submodule(attr) for s in shards]
        layer = whole.get_submodule(attr)
        for tensor in ("weight", "weight_scale_inv"):  # e4m3 compared as bytes
            got = torch.cat([getattr(p, tensor).view(torch.uint8) for p in parts], dim=dim)
            assert torch.equal(got, getattr(layer, tensor).view(torch.uint8))


def test_fp8_cut_off_its_blocks_is_refused_naming_the_layer(checkpoints, tmp_path) -> None:
    # 32-row blocks: k_proj's 32 rows (2 KV heads of 16) cut in two are 16 rows a rank.
    path = quantize_checkpoint(checkpoints["llama"], tmp_path / "llama-fp8-32", (32, 32))
    with pytest.raises(ValueError, match=r"^layer 'model\.layers\.0\.self_attn\.k_proj': tp_size=2 cuts its "
                                         r"32 output rows into parts of 16, not whole blocks of "
                                         r"weight_block_size=\[32, 32\]$"):
        load_shard(path, TPRank(1, 2))
    # The daemon's config refuses it before any rank starts (the files' headers only).
    with pytest.raises(ValueError, match=r"^layer 'model\.layers\.0\.self_attn\.k_proj': tp_size=2 cuts"):
        DecodeConfig(str(path), "127.0.0.1:1", tp_size=2, device="cpu")
    DecodeConfig(str(path), "127.0.0.1:1", tp_size=1, device="cpu")  # whole rows: no cut


@requires_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "tp_size"), [("llama", 2), ("qwen3moe", 2), ("deepseek_v3", 2), ("llama4", 4)])
def test_tp_decode_on_one_gpu_matches_transformers(checkpoints, tmp_path, name: str, tp_size: int) -> None:
    """The ranks share cuda:0 over gloo (NCCL refuses two ranks on one GPU): the Triton
    kernels on each rank's shard and pool, the collectives on CUDA tensors."""
    prompts = [prompt(5, 1), prompt(19, 2)]
    ours = decode_tp(checkpoints[name], tp_size, prompts, 8, tmp_path, device="cuda")
    assert ours == hf_greedy(checkpoints[name], prompts, 8)


@requires_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "tp_size", "kv"), [("deepseek_v32", 2, "auto"), ("llama_fp8", 2, "auto"),
                                                     ("deepseek_v3_fp8", 2, "auto"), ("llama", 2, "fp8_e4m3"),
                                                     ("deepseek_v3", 2, "fp8_e4m3"), ("deepseek_v32", 2, "fp8_e4m3")])
def test_tp_on_one_gpu_equals_one_rank(checkpoints, tmp_path, name: str, tp_size: int, kv: str) -> None:
    """The Triton kernels (sparse MLA and the indexer's selection, the block-FP8 GEMMs with
    their activation quantization, FP8 KV rows) on each rank's shard, the ranks sharing
    cuda:0 over gloo: the tokens of a group of one on the same GPU (the FP8 GEMMs quantize
    activations on CUDA, so transformers' float32 run is not the reference there)."""
    prompts = [prompt(5, 1), prompt(19, 2)]
    dtypes = {"kv_cache_dtype": kv, **(DSA_CACHE if name == "deepseek_v32" else {})}
    ours = decode_tp(checkpoints[name], tp_size, prompts, 8, tmp_path, device="cuda", **dtypes)
    assert ours == decode_tp(checkpoints[name], 1, prompts, 8, tmp_path, device="cuda", **dtypes)


@pytest.mark.timeout(60)
def test_rank_death_is_reported_naming_the_rank(checkpoints) -> None:
    deaths: list[tuple[int, str]] = []
    died = threading.Event()

    def on_death(rank: int, reason: str) -> None:
        deaths.append((rank, reason))
        died.set()

    group = TPGroup(TPSpec(str(checkpoints["llama"]), 2, torch.float32, "cpu", 8, PAGE_SIZE,
                           cpu_threads=1), on_death=on_death)
    try:
        with pytest.raises(RankFailed, match=r"decode rank 1 \(pid \d+\) exited with code 9"):
            group.run_task(Die(), 30.0)
        assert died.wait(10.0)
        assert deaths[0][0] == 1 and "decode rank 1" in deaths[0][1]
        assert group.failure == deaths[0][1]
        with pytest.raises(RankFailed, match="decode rank 1"):
            group.run_task(Die(), 1.0)
    finally:
        group.close()


def test_prefill_without_head_ranges_is_refused_naming_both_layouts() -> None:
    from lanekv.transfer.protocol.contract import Topology

    old = Topology.from_dict({"cp_size": 2, "split_mode": "in_seq", "owner_rule": "page_mod_cp",
                              "endpoints": ["127.0.0.1:1", "127.0.0.1:2"]})  # an older peer's: no key
    assert old.head_ranges is False
    old.check_decode_layout(1)  # one decode process takes whole rows from anyone
    with pytest.raises(ValueError, match=r"^decode tp_size=2 needs KV head ranges, and this prefill "
                                         r"\(cp_size=2\) serves head_ranges=False$"):
        old.check_decode_layout(2)
    new = Topology.from_dict({**old.to_dict(), "head_ranges": True})
    new.check_decode_layout(4)


def test_a_tp_fetch_names_every_path_its_ranks_took() -> None:
    from lanekv.decode.tp.fetch import _paths

    # Decode rank 1 fell back to gRPC for prefill rank 0 (its digest did not match): both show.
    assert _paths([{0: "shm", 1: "shm"}, {0: "grpc", 1: "shm"}]) == {0: "grpc+shm", 1: "shm"}
    assert _paths([{0: "grpc"}, {0: "grpc"}, {0: "grpc"}]) == {0: "grpc"}
