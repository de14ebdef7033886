"""The DSA indexer (model/dsa.py) against transformers' DeepseekV32 on tiny random checkpoints."""

import pytest
import torch
from lanekv.model.checkpoint import read_state_dict
from lanekv.model.dsa import DSAConfig, Indexer, indexer_tensor_names, load_indexer

SEQ_LEN = 24


def _v32_config(index_n_heads, index_topk):
    from transformers import DeepseekV32Config

    return DeepseekV32Config(
        vocab_size=120, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, index_topk=index_topk, index_head_dim=32,
        index_n_heads=index_n_heads, initializer_range=0.2, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def _write_v32(path, index_n_heads, index_topk, seed):
    from transformers import DeepseekV32ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(_v32_config(index_n_heads, index_topk)).float().eval()
    with torch.no_grad():  # LayerNorms off their identity init, so loading them shows
        for layer in model.model.layers:
            norm = layer.self_attn.indexer.k_norm
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


def _capture_indexer_calls(model, input_ids):
    calls = []

    def hook(module, args, kwargs, output):
        calls.append((args, output))

    handles = [layer.self_attn.indexer.register_forward_hook(hook, with_kwargs=True)
               for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=input_ids, use_cache=False)
    for handle in handles:
        handle.remove()
    return calls


def _formula_scores(inputs, scale):
    q, k, w = (t.double() for t in inputs)
    dots = torch.einsum("thd,sd->ths", q, k) * scale
    scores = (w[:, :, None] * dots.clamp_min(0)).sum(1)
    return scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))


@pytest.mark.parametrize("index_n_heads,index_topk", [
    (4, 7),  # the selection decides: most queries see more keys than they keep
    (1, 14),  # one head: about half the keys score exactly 0, so the cut falls in ties
])
def test_indexer_matches_transformers_scores_and_topk(tmp_path, index_n_heads, index_topk):
    hf = _write_v32(tmp_path, index_n_heads, index_topk, seed=index_topk)
    config = DSAConfig.from_hf(hf.config.to_dict())
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (
        index_n_heads, 32, index_topk)
    state, _ = read_state_dict(tmp_path, torch.float32, "cpu")
    input_ids = torch.randint(3, 120, (1, SEQ_LEN), generator=torch.Generator().manual_seed(7))
    calls = _capture_indexer_calls(hf, input_ids)
    assert len(calls) == 2
    positions = torch.arange(SEQ_LEN)
    ties = 0
    for layer, (args, hf_topk) in enumerate(calls):
        hidden, q_resid, (cos, sin) = args[0][0], args[1][0], args[2]
        indexer = Indexer(config)
        load_indexer(indexer, state, layer)
        half = cos.shape[-1] // 2
        with torch.no_grad():
            inputs = indexer.project(hidden, q_resid, cos[0, :, :half], sin[0, :, :half])
            scores = indexer.scores(inputs.q, inputs.weights, inputs.k, positions)
            mine = indexer.select(inputs.q, inputs.weights, inputs.k, positions)
        want = _formula_scores(inputs, config.softmax_scale)
        assert torch.equal(scores.isinf(), want.isinf())
        torch.testing.assert_close(scores[want.isfinite()].double(), want[want.isfinite()],
                                   atol=1e-5, rtol=1e-5)
        assert mine.shape == (SEQ_LEN, index_topk)
        for p in range(SEQ_LEN):
            theirs = {i for i in hf_topk[0, p].tolist() if i <= p}  # the rest are masked keys
            assert {i for i in mine[p].tolist() if i >= 0} == theirs, (layer, p)
            assert len(theirs) == min(p + 1, index_topk)
            row = scores[p, : p + 1]
            if p + 1 > index_topk:
                kth = row.topk(index_topk).values[-1]
                ties += int((row == kth).sum()) > 1
    if index_n_heads == 1:
        assert ties > 0  # the tie case was exercised, not just assumed


def test_indexer_keys_and_queries_are_what_transformers_scores(tmp_path):
    # Project as transformers does, step by step, on the layer's own weights.
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    hf = _write_v32(tmp_path, 2, 5, seed=3)
    config = DSAConfig.from_hf(hf.config.to_dict())
    state, _ = read_state_dict(tmp_path, torch.float32, "cpu")
    args, _ = _capture_indexer_calls(hf, torch.arange(3, 3 + 12)[None])[1]
    hidden, q_resid, (cos, sin) = args[0], args[1], args[2]
    indexer = Indexer(config)
    load_indexer(indexer, state, 1)
    with torch.no_grad():
        ours = indexer.project(hidden[0], q_resid[0], cos[0, :, :4], sin[0, :, :4])
        theirs = hf.model.layers[1].self_attn.indexer
        k = theirs.k_norm(theirs.wk(hidden))[:, :, None]
        q = theirs.wq_b(q_resid).view(1, 12, 2, 32)
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :8], k[..., :8], cos, sin, unsqueeze_dim=2)
        w = theirs.weights_proj(hidden).float() * 2 ** -0.5
    assert torch.equal(ours.q, torch.cat([q_rot, q[..., 8:]], -1)[0])
    assert torch.equal(ours.k, torch.cat([k_rot, k[..., 8:]], -1)[0, :, 0])
    assert torch.equal(ours.weights, w[0])
    assert ours.weights.dtype == torch.float32


def test_load_indexer_names_the_missing_or_misshapen_tensor():
    config = DSAConfig(hidden_size=16, q_lora_rank=8, index_n_heads=2, index_head_dim=16,
                       index_topk=4, qk_rope_head_dim=4)
    indexer = Indexer(config)
    names = indexer_tensor_names(3)
    state = {name: torch.zeros(1) for name in names}
    with pytest.raises(ValueError, match="model.layers.3.self_attn.indexer.wq_b.weight has shape"):
        load_indexer(indexer, state, 3)
    del state[names[1]]
    with pytest.raises(ValueError, match="checkpoint lacks model.layers.3.self_attn.indexer.wk"):
        load_indexer(indexer, state, 3)
    good = {f"model.layers.3.self_attn.indexer.{k}": v.clone() + 1
            for k, v in indexer.state_dict().items()}
    load_indexer(indexer, good, 3)
    assert sorted(good) == sorted(names)
    assert torch.equal(indexer.wk.weight, good[names[1]])


@pytest.mark.parametrize("field,value,match", [
    ("index_topk", 0, "index_topk must be a positive int, got 0"),
    ("index_n_heads", "8", "index_n_heads must be a positive int, got '8'"),
    ("index_head_dim", 4, "qk_rope_head_dim must be even and at most index_head_dim 4"),
    ("q_lora_rank", None, "q_lora_rank must be set"),
])
def test_config_refuses_bad_fields(field, value, match):
    base = {"hidden_size": 64, "q_lora_rank": 32, "qk_rope_head_dim": 8, "index_n_heads": 4,
            "index_head_dim": 32, "index_topk": 6}
    with pytest.raises(ValueError, match=match):
        DSAConfig.from_hf({**base, field: value})
