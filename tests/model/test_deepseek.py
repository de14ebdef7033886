"""DeepSeek-V2/V3 (MLA, MoE, YaRN) against transformers on tiny random
checkpoints: logits, the latent-space (absorbed) form of MLA attention, the
router, the config checks and the loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lanekv.model.attention import KINDS, kind_of, pool_contract_fields
from lanekv.model.checkpoint import load_model
from lanekv.model.config import ModelConfig
from lanekv.model.deepseek import DeepseekCausalLM, mla_causal_attention
from safetensors.torch import load_file, save_file

from tests.checkpoints import DEEPSEEK_WRITERS, VOCAB_SIZE, write_deepseek_v3

NAMES = sorted(DEEPSEEK_WRITERS)


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    dirs = {name: write(root / name) for name, write in DEEPSEEK_WRITERS.items()}
    dirs["deepseek_v3-sharded"] = write_deepseek_v3(root / "v3-sharded", max_shard_size="60KB")
    return dirs


@pytest.fixture(scope="module")
def hf_models(checkpoint_dirs: dict[str, Path]) -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(
        checkpoint_dirs[name], attn_implementation="eager", dtype=torch.float32).eval()
        for name in NAMES}


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed))


def _our_logits(model: DeepseekCausalLM, ids: torch.Tensor, first: int = 0) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(ids, torch.arange(first, first + ids.numel()), mla_causal_attention(model))
        return model.compute_logits(hidden)


def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor, first: int = 0) -> torch.Tensor:
    with torch.inference_mode():
        positions = torch.arange(first, first + ids.numel())[None]
        return hf(ids[None], position_ids=positions).logits[0].float()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length,first", [(1, 0), (7, 0), (40, 0), (9, 600)])
def test_logits_match_transformers(checkpoint_dirs, hf_models, name, length, first) -> None:
    # Positions past original_max_position_embeddings exercise YaRN where it matters.
    loaded = load_model(checkpoint_dirs[name])
    assert isinstance(loaded.model, DeepseekCausalLM)
    ids = _ids(length, seed=length + first)
    ours, ref = _our_logits(loaded.model, ids, first), _hf_logits(hf_models[name], ids, first)
    assert ours.shape == (length, VOCAB_SIZE)
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_configs_read_the_mla_moe_and_yarn_fields(checkpoint_dirs) -> None:
    v2 = ModelConfig.from_dir(checkpoint_dirs["deepseek_v2"])
    v2q = ModelConfig.from_dir(checkpoint_dirs["deepseek_v2_qlora"])
    v3 = ModelConfig.from_dir(checkpoint_dirs["deepseek_v3"])
    assert kind_of(v2) is kind_of(v3) is KINDS[1] and KINDS[1].name == "mla"
    assert (v3.num_kv_heads, v3.head_dim) == (1, 40)  # one latent row: 32 + 8
    assert v2.mla.q_lora_rank is None and v3.mla.q_lora_rank == 48
    assert (v2.moe.scoring, v2.moe.n_group, v2.moe.topk_group) == ("softmax", 1, 1)
    assert (v2q.moe.n_group, v2q.moe.topk_group) == (4, 2)
    assert (v3.moe.scoring, v3.moe.n_group, v3.moe.topk_group, v3.moe.top_k) == ("sigmoid", 4, 2, 3)
    assert v3.moe.norm_topk_prob and v3.moe.routed_scaling_factor == 2.5
    # YaRN: V2-style mscale == mscale_all_dim leaves cos/sin unscaled, the
    # softmax scale gets mscale squared; V3's differ.
    yarn2, yarn3 = dict(v2.mla.yarn), dict(v3.mla.yarn)
    assert yarn2["attention_factor"] == pytest.approx(1.0)
    m = 0.1 * 0.707 * torch.log(torch.tensor(8.0)).item() + 1
    assert v2.softmax_scale == pytest.approx(24**-0.5 * m * m)
    assert yarn3["attention_factor"] == pytest.approx(
        (0.1 * torch.log(torch.tensor(4.0)).item() + 1)
        / (0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1))
    assert v2q.mla.yarn is None and v2q.softmax_scale == pytest.approx(24**-0.5)
    fields = pool_contract_fields(v3, torch.float32)
    assert fields["attention"] == "mla" and fields["mla"]["kv_lora_rank"] == 32


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_absorbed_latent_attention_equals_decompressed(checkpoint_dirs, kernels,
                                                       monkeypatch) -> None:
    """q absorbed through kv_b_proj's K part scores the latent rows as q scores
    the decompressed K; latent-space values mapped through the V part are V (with the
    torch einsums, and with the one-launch projection kernels interpreted)."""
    model = load_model(checkpoint_dirs["deepseek_v3"]).model
    if kernels == "triton":
        monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    attn = model.mla_layer(1)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 24, generator=gen)
    latent = torch.randn(9, 40, generator=gen)
    k, v = attn.decompress(latent)
    q_abs = attn.absorb_query(q)
    assert q_abs.shape == (5, 4, 40)
    torch.testing.assert_close(torch.einsum("thd,shd->ths", q, k),
                               torch.einsum("thr,sr->ths", q_abs, latent), rtol=1e-4, atol=1e-4)
    probs = torch.softmax(torch.randn(5, 4, 9, generator=gen), dim=-1)
    latent_out = torch.einsum("ths,sr->thr", probs, latent[:, :32])
    torch.testing.assert_close(attn.expand_output(latent_out),
                               torch.einsum("ths,shv->thv", probs, v), rtol=1e-4, atol=1e-4)


def test_router_groups_bias_and_scaling(checkpoint_dirs) -> None:
    model = load_model(checkpoint_dirs["deepseek_v3"]).model
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32
    assert gate.e_score_correction_bias.abs().sum() > 0  # the writer made it matter
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(2))
    weights, ids = gate(x)
    # 3 distinct experts from at most topk_group=2 of the 4 groups of 2 experts.
    assert ids.shape == (50, 3)
    assert all(len(set(row)) == 3 and len({e // 2 for e in row}) <= 2 for row in ids.tolist())
    # norm_topk_prob then routed_scaling_factor: each row sums to 2.5.
    torch.testing.assert_close(weights.sum(-1), torch.full((50,), 2.5))


def test_first_k_dense_layers_and_shared_experts(checkpoint_dirs) -> None:
    model = load_model(checkpoint_dirs["deepseek_v2"]).model
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "experts")
    assert len(layers[1].mlp.experts) == 8
    assert layers[1].mlp.shared_experts.gate_proj.weight.shape == (64, 64)  # 2 x 32


def test_sharded_checkpoint_and_mtp_layers(checkpoint_dirs, tmp_path) -> None:
    single = load_model(checkpoint_dirs["deepseek_v3"]).model.state_dict()
    sharded = load_model(checkpoint_dirs["deepseek_v3-sharded"]).model.state_dict()
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[n], sharded[n]) for n in single)
    # A multi-token-prediction layer after the last decoder layer is not loaded.
    path = write_deepseek_v3(tmp_path / "mtp")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert load_model(path).model.state_dict().keys() == single.keys()


def test_half_precision_keeps_the_router_in_float32(checkpoint_dirs) -> None:
    loaded = load_model(checkpoint_dirs["deepseek_v3"], dtype=torch.bfloat16)
    mlp = loaded.model.model.layers[1].mlp
    assert mlp.gate.weight.dtype == torch.float32
    assert mlp.experts[0].up_proj.weight.dtype == torch.bfloat16
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint_dirs["deepseek_v3"], dtype=torch.bfloat16,
                                              attn_implementation="eager").eval()
    ids = _ids(12, seed=3)
    diff = (_our_logits(loaded.model, ids) - _hf_logits(hf, ids)).abs().max().item()
    # Logits span about +-7; RoPE runs in float32 here, in bfloat16 there.
    assert diff < 0.5


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures=\\['GPT2LMHeadModel'\\]"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"n_group": 3}, "n_routed_experts=8 is not a multiple of n_group=3"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type='longrope'"),
])
def test_config_refusals_name_the_field(checkpoint_dirs, change, match) -> None:
    hf = {**_config(checkpoint_dirs["deepseek_v3"]), **change}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf)


def test_v2_norm_topk_prob_is_refused(checkpoint_dirs) -> None:
    hf = {**_config(checkpoint_dirs["deepseek_v2"]), "norm_topk_prob": True}
    with pytest.raises(ValueError, match="norm_topk_prob=True"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_moe_decode_path_matches_the_grouped_path(checkpoint_dirs, name, monkeypatch) -> None:
    """A decode-sized batch through the sort-free kernels (interpreted: the shared expert
    fused in) gives what the reference path gives; a batch past the threshold still
    takes the grouped path (the same result too)."""
    from lanekv.model import deepseek

    mlp = load_model(checkpoint_dirs[name]).model.model.layers[1].mlp
    assert mlp._shared_weights(mlp.w13.shape[1] // 2) is not None
    calls = []
    real = deepseek.moe_experts_decode
    monkeypatch.setattr(deepseek, "moe_experts_decode",
                        lambda *a, **k: calls.append(sorted(k)) or real(*a, **k))
    monkeypatch.setattr(deepseek, "MOE_DECODE_MAX_TOKENS", 5)
    for tokens in (1, 5, 6):
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
        with torch.inference_mode():
            want = mlp(x)
            monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
            got = mlp(x)
            monkeypatch.delenv("LANEKV_CPU_KERNELS")
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert calls == [["shared_w13", "shared_w2"]] * 2
