"""The decoder against transformers on tiny random checkpoints, the loader,
the weights digest and the config checks."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest
import torch
from lanekv.model.checkpoint import LoadedModel, load_model, tensor_files
from lanekv.model.config import ModelConfig
from lanekv.model.llama import CausalLM, causal_attention
from safetensors.torch import load_file, save_file

from tests.checkpoints import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    WRITERS,
    reference_weights_digest,
    write_llama,
)

ARCHS = sorted(WRITERS)


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    dirs = {name: write(root / name, tokenizer=name == "llama") for name, write in WRITERS.items()}
    dirs["llama-sharded"] = write_llama(root / "llama-sharded", max_shard_size="40KB")
    dirs["llama-bias"] = write_llama(root / "llama-bias", attention_bias=True, num_layers=3, seed=5)
    return dirs


@pytest.fixture(scope="module")
def hf_models(checkpoint_dirs: dict[str, Path]) -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    return {
        name: AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32
        ).eval()
        for name, path in checkpoint_dirs.items()
    }


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed))


def _our_logits(model: CausalLM, ids: torch.Tensor, first_position: int = 0) -> torch.Tensor:
    scale = model.config.softmax_scale
    positions = torch.arange(first_position, first_position + ids.numel())
    with torch.inference_mode():
        hidden = model(ids, positions, lambda layer, q, k, v: causal_attention(q, k, v, scale))
        return model.compute_logits(hidden)


def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor, first_position: int = 0) -> torch.Tensor:
    positions = torch.arange(first_position, first_position + ids.numel())[None]
    with torch.inference_mode():
        return hf(ids[None], position_ids=positions).logits[0].float()


@pytest.mark.parametrize("name", [*ARCHS, "llama-bias"])
@pytest.mark.parametrize("length", [1, 6, 45])
def test_logits_match_transformers(checkpoint_dirs, hf_models, name: str, length: int) -> None:
    loaded = load_model(checkpoint_dirs[name])
    ids = _ids(length, seed=length)
    ours = _our_logits(loaded.model, ids)
    ref = _hf_logits(hf_models[name], ids)
    assert ours.shape == (length, VOCAB_SIZE) and ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_positions_beyond_llama3_original_context(checkpoint_dirs, hf_models) -> None:
    # Positions past original_max_position_embeddings (256) exercise the
    # scaled RoPE frequencies where they matter.
    loaded = load_model(checkpoint_dirs["llama"])
    ids = _ids(8, seed=3)
    ours = _our_logits(loaded.model, ids, first_position=700)
    ref = _hf_logits(hf_models["llama"], ids, first_position=700)
    assert (ours - ref).abs().max().item() < 1e-4


def test_flat_batch_equals_separate_requests(checkpoint_dirs) -> None:
    """Two requests concatenated into one forward, with an attention callback
    that keeps them apart, give each request's own logits."""
    model = load_model(checkpoint_dirs["qwen2"]).model
    a, b = _ids(5, seed=1), _ids(9, seed=2)
    scale = model.config.softmax_scale

    def two_requests(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = a.numel()
        return torch.cat([causal_attention(q[:n], k[:n], v[:n], scale),
                          causal_attention(q[n:], k[n:], v[n:], scale)])

    ids = torch.cat([a, b])
    positions = torch.cat([torch.arange(5), torch.arange(9)])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, two_requests))
    torch.testing.assert_close(logits[:5], _our_logits(model, a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[5:], _our_logits(model, b), rtol=1e-5, atol=1e-5)


def test_attention_callback_sees_roped_qk_per_layer(checkpoint_dirs) -> None:
    model = load_model(checkpoint_dirs["mistral"]).model
    config = model.config
    calls = []

    def record(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls.append((layer, q.shape, k.shape, v.shape))
        return causal_attention(q, k, v, config.softmax_scale)

    with torch.inference_mode():
        model(_ids(7), torch.arange(7), record)
    q_shape = (7, config.num_heads, config.head_dim)
    kv_shape = (7, config.num_kv_heads, config.head_dim)
    assert calls == [(i, q_shape, kv_shape, kv_shape) for i in range(config.num_layers)]
    with pytest.raises(ValueError, match="attention callback returned shape"):
        model(_ids(7), torch.arange(7), lambda layer, q, k, v: q[:, :1])


def test_greedy_generation_matches_transformers_generate(checkpoint_dirs, hf_models) -> None:
    loaded = load_model(checkpoint_dirs["llama"])
    prompt = _ids(6, seed=11).tolist()
    max_new_tokens = 12
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        # No KV cache: recompute the whole sequence every step.
        next_token = int(_our_logits(loaded.model, torch.tensor(tokens))[-1].argmax())
        tokens.append(next_token)
        if next_token in loaded.config.eos_token_ids:
            break
    with torch.inference_mode():
        ref = hf_models["llama"].generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=EOS_TOKEN_ID,
        )[0].tolist()
    assert tokens == ref
    assert len(set(tokens[len(prompt):])) > 1  # the random model is not stuck on one token


def test_sharded_checkpoint_loads_the_same_weights(checkpoint_dirs) -> None:
    sharded, single = load_model(checkpoint_dirs["llama-sharded"]), load_model(checkpoint_dirs["llama"])
    assert len(tensor_files(checkpoint_dirs["llama-sharded"])) > 1
    assert sharded.config == single.config
    ours, theirs = sharded.model.state_dict(), single.model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_tied_embeddings_have_no_head(checkpoint_dirs) -> None:
    model = load_model(checkpoint_dirs["qwen2"]).model
    assert model.lm_head is None
    assert "lm_head.weight" not in model.state_dict()




def test_weights_digest_stable_and_sensitive(tmp_path: Path) -> None:
    path = write_llama(tmp_path / "m", max_shard_size="40KB")
    first, second = load_model(path), load_model(path)
    assert first.weights_digest == second.weights_digest == reference_weights_digest(path)
    file = tensor_files(path)[-1]
    tensors = load_file(file)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, file, metadata={"format": "pt"})
    changed = load_model(path)
    assert changed.weights_digest != first.weights_digest
    assert changed.weights_digest == reference_weights_digest(path)


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    path = write_llama(tmp_path / "m")
    file = path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj.weight.*\n?.*extra.weight"):
        load_model(path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_transformers(checkpoint_dirs, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    path = checkpoint_dirs["llama"]
    loaded = load_model(path, dtype=dtype)
    assert loaded.model.dtype == dtype
    assert loaded.model.rotary.inv_freq.dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=dtype).eval()
    ids = _ids(20, seed=4)
    ours, ref = _our_logits(loaded.model, ids), _hf_logits(hf, ids)
    # Same ops in the same order; only the matmul blocking may round differently.
    assert (ours - ref).abs().max().item() < 0.05


def test_tokenizer_wrapper(checkpoint_dirs) -> None:
    loaded: LoadedModel = load_model(checkpoint_dirs["llama"])
    assert loaded.tokenizer is not None
    ids = loaded.tokenizer.encode("w5 w17 w299")
    assert ids == [1, 5, 17, 299]
    assert loaded.tokenizer.decode(ids) == "w5 w17 w299"
    assert loaded.tokenizer.eos_token_ids == (EOS_TOKEN_ID,)
    assert load_model(checkpoint_dirs["qwen2"]).tokenizer is None


def test_causal_attention_matches_sdpa() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 6, 8, generator=gen)
    k, v = torch.randn(9, 2, 8, generator=gen), torch.randn(9, 2, 8, generator=gen)
    out = causal_attention(q, k, v, 0.3)
    # Queries are the last 5 of 9 positions: query i sees keys [0, 4 + i].
    mask = torch.arange(9)[None, :] <= torch.arange(5)[:, None] + 4
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
        v.repeat_interleave(3, 1).transpose(0, 1), attn_mask=mask, scale=0.3,
    ).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="Tk >= Tq"):
        causal_attention(q, k[:3], v[:3], 0.3)


# ---- config ----

def _hf_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_contract_fields_are_plain(checkpoint_dirs) -> None:
    config = ModelConfig.from_dir(checkpoint_dirs["llama"])
    fields = config.contract_fields()
    assert msgpack.unpackb(msgpack.packb(fields)) == fields
    assert fields["rope"]["scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    assert fields["num_kv_heads"] == 2 and fields["head_dim"] == 16
    assert hash(config) == hash(ModelConfig.from_dir(checkpoint_dirs["llama"]))
    assert ModelConfig.from_dir(checkpoint_dirs["qwen2"]).contract_fields()["attention_bias"]


def test_qwen3_moe_reads_its_experts_and_routes_like_transformers(checkpoint_dirs) -> None:
    """Every layer's MLP is a MoE block (no shared experts, softmax top-2 of 8,
    renormalised); the contract names the MoE; config.json's expert count may come
    as num_experts (Qwen's files) or num_local_experts (transformers 5 writes it)."""
    from lanekv.model.qwen3_moe import Qwen3MoeCausalLM

    hf = _hf_config(checkpoint_dirs["qwen3_moe"])
    config = ModelConfig.from_hf(hf)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.scoring) == (8, 2, 0, "softmax")
    assert moe.norm_topk_prob and config.qk_norm and config.mla is None
    assert config.contract_fields()["moe"]["num_experts"] == 8
    renamed = {k: v for k, v in hf.items() if k != "num_local_experts"}
    assert ModelConfig.from_hf({**renamed, "num_experts": 8}) == config
    loaded = load_model(checkpoint_dirs["qwen3_moe"])
    assert isinstance(loaded.model, Qwen3MoeCausalLM)
    mlp = loaded.model.model.layers[1].mlp
    assert mlp.shared_experts is None and mlp.w13.shape == (8, 64, 64)
    assert mlp.experts[3].up_proj.weight.data_ptr() == mlp.w13[3, 32:].data_ptr()


def test_legacy_rope_fields_read_the_same(checkpoint_dirs) -> None:
    hf = _hf_config(checkpoint_dirs["llama"])
    params = dict(hf.pop("rope_parameters"))
    hf["rope_theta"] = params.pop("rope_theta")
    hf["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in params.items()}
    assert ModelConfig.from_hf(hf) == ModelConfig.from_dir(checkpoint_dirs["llama"])
    plain = {**hf, "rope_scaling": None, "rope_theta": 500000.0}
    assert ModelConfig.from_hf(plain).rope_scaling is None
    assert ModelConfig.from_hf(plain).rope_theta == 500000.0


@pytest.mark.parametrize(
    ("name", "change", "field"),
    [
        ("llama", {"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
         "rope_type"),
        ("llama", {"rope_parameters": {"rope_type": "default", "mrope_section": [2]}},
         "mrope_section"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ("llama", {"num_key_value_heads": 3}, "num_kv_heads"),
        ("llama", {"vocab_size": None}, "vocab_size"),
        ("mistral", {"sliding_window": 512}, "sliding_window"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 1,
                   "layer_types": None}, "sliding_window"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 128,
                   "layer_types": ["full_attention", "sliding_attention"]}, "sliding_window"),
    ],
)
def test_config_refusals_name_the_field(checkpoint_dirs, name: str, change: dict, field: str) -> None:
    hf = {**_hf_config(checkpoint_dirs[name]), **change}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(hf)


def test_mistral_window_defaults_like_transformers(checkpoint_dirs) -> None:
    hf = _hf_config(checkpoint_dirs["mistral"])
    # Absent, the window is transformers' 4096: no effect while max_position_embeddings=1024.
    del hf["sliding_window"]
    assert ModelConfig.from_hf(hf).architecture == "MistralForCausalLM"
    del hf["max_position_embeddings"]  # default 131072: the 4096 window is in effect
    with pytest.raises(ValueError, match="sliding_window=4096"):
        ModelConfig.from_hf(hf)
    # A Qwen2 window that never engages (its layers are below max_window_layers) is fine.
    qwen = {**_hf_config(checkpoint_dirs["qwen2"]), "use_sliding_window": True,
            "sliding_window": 128, "layer_types": None}
    assert ModelConfig.from_hf(qwen).num_layers == 2


def test_generation_config_eos_ids_are_added(tmp_path: Path) -> None:
    path = write_llama(tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, EOS_TOKEN_ID]}))
    assert ModelConfig.from_dir(path).eos_token_ids == (EOS_TOKEN_ID, 7)


def test_loading_does_not_import_transformers(checkpoint_dirs) -> None:
    import subprocess
    import sys

    code = (
        "import sys; from model.checkpoint import load_model; "
        f"load_model({str(checkpoint_dirs['qwen2'])!r}); "
        "sys.exit(int('transformers' in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
