"""Tiny random-weight checkpoints for tests, written by ``transformers``.

Each writer saves a Hugging Face folder (``config.json``, safetensors weights,
``generation_config.json`` and, on request, a ``tokenizer.json``) that both
``model.checkpoint.load_model`` and ``transformers`` read, so tests can hold
the project's model against the reference implementation. Weights are a pure
function of the arguments (a private seeded RNG), and are drawn wider than
transformers' default init (std 0.02 leaves the logits nearly uniform) so that
greedy tokens are decisive rather than decided by rounding.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 300
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
INIT_STD = 0.2

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "initializer_range": INIT_STD,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
}
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With head_dim 16 and theta 10000 the wavelengths span 6 to 20,000
    # positions: some kept, one smoothed, the rest divided by the factor.
    "original_max_position_embeddings": 256,
}


def write_llama(path: str | Path, *, num_layers: int = 2, attention_bias: bool = False,
                seed: int = 0, max_shard_size: str | None = None,
                tokenizer: bool = False) -> Path:
    """Llama with llama3 RoPE scaling, GQA (4 query / 2 KV heads), head_dim 16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**_COMMON, "num_hidden_layers": num_layers},
                         head_dim=16, attention_bias=attention_bias, rope_theta=10000.0,
                         rope_scaling=dict(LLAMA3_ROPE_SCALING), tie_word_embeddings=False)
    return _write(path, LlamaForCausalLM, config, seed, max_shard_size, tokenizer)


def write_qwen2(path: str | Path, *, num_layers: int = 2, seed: int = 1,
                max_shard_size: str | None = None, tokenizer: bool = False) -> Path:
    """Qwen2: bias on q/k/v, tied embeddings, plain RoPE with theta 1e6."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**_COMMON, "num_hidden_layers": num_layers},
                         rope_theta=1_000_000.0, tie_word_embeddings=True,
                         use_sliding_window=False)
    return _write(path, Qwen2ForCausalLM, config, seed, max_shard_size, tokenizer)


def write_mistral(path: str | Path, *, num_layers: int = 2, seed: int = 2,
                  max_shard_size: str | None = None, tokenizer: bool = False) -> Path:
    """Mistral without a sliding window, one KV head, explicit head_dim 32
    (so the q width 128 differs from hidden_size 64)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**{**_COMMON, "num_hidden_layers": num_layers,
                              "num_key_value_heads": 1},
                           head_dim=32, sliding_window=None,
                           rope_theta=10000.0, tie_word_embeddings=False)
    return _write(path, MistralForCausalLM, config, seed, max_shard_size, tokenizer)


def write_qwen3(path: str | Path, *, num_layers: int = 2, seed: int = 3,
                max_shard_size: str | None = None, tokenizer: bool = False) -> Path:
    """Qwen3: per-head q/k RMSNorm before RoPE, head_dim 24 (not hidden / heads)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**_COMMON, "num_hidden_layers": num_layers}, head_dim=24,
                         rope_theta=1_000_000.0, tie_word_embeddings=False,
                         use_sliding_window=False)
    return _write(path, Qwen3ForCausalLM, config, seed, max_shard_size, tokenizer)


def write_qwen3_moe(path: str | Path, *, num_layers: int = 2, seed: int = 7,
                    max_shard_size: str | None = None, tokenizer: bool = False) -> Path:
    """Qwen3-MoE: Qwen3's attention (head_dim 24) and, in every layer, softmax
    top-2 of 8 experts renormalised (norm_topk_prob), no shared experts."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{**_COMMON, "num_hidden_layers": num_layers}, head_dim=24,
                            rope_theta=1_000_000.0, tie_word_embeddings=False,
                            use_sliding_window=False, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, norm_topk_prob=True)
    return _write(path, Qwen3MoeForCausalLM, config, seed, max_shard_size, tokenizer)


WRITERS = {"llama": write_llama, "qwen2": write_qwen2, "qwen3": write_qwen3,
           "qwen3_moe": write_qwen3_moe, "mistral": write_mistral}

# MLA dims: latent row 32 + 8 = 40, qk head 16 + 8 = 24, v head 16 (differs from qk).
_MLA: dict[str, Any] = {
    "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "moe_intermediate_size": 32, "n_routed_experts": 8,
}


def write_deepseek_v2(path: str | Path, *, q_lora: bool = False, num_layers: int = 2,
                      seed: int = 4, max_shard_size: str | None = None,
                      tokenizer: bool = False) -> Path:
    """DeepSeek-V2: softmax top-2 of 8 experts plus 2 shared, the first layer dense.
    Without q_lora: q_proj, YaRN (mscale = mscale_all_dim, as V2-Lite) and greedy
    routing; with q_lora: plain RoPE and group-limited routing (2 of 4 groups)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    if q_lora:
        extra = {"q_lora_rank": 48, "topk_method": "group_limited_greedy", "n_group": 4,
                 "topk_group": 2, "rope_parameters": {"rope_type": "default",
                                                      "rope_theta": 10000.0}}
    else:
        extra = {"q_lora_rank": None, "topk_method": "greedy", "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 0.707,
            "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
            "original_max_position_embeddings": 128}}
    config = DeepseekV2Config(**{**_COMMON, **_MLA, "num_hidden_layers": num_layers,
                                 "num_attention_heads": 4}, **extra,
                              num_experts_per_tok=2, n_shared_experts=2,
                              first_k_dense_replace=1, routed_scaling_factor=1.5,
                              norm_topk_prob=False, tie_word_embeddings=False)
    return _write(path, DeepseekV2ForCausalLM, config, seed, max_shard_size, tokenizer)


def write_deepseek_v3(path: str | Path, *, num_layers: int = 3, seed: int = 6,
                      max_shard_size: str | None = None, tokenizer: bool = False, num_experts: int = 8) -> Path:
    """DeepSeek-V3: q_lora, sigmoid routing with e_score_correction_bias over 4
    groups (top 2 groups, 3 of ``num_experts``, a multiple of 4), 1 shared expert,
    YaRN with mscale != mscale_all_dim, interleaved RoPE, the first layer dense."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**{**_COMMON, **_MLA, "num_hidden_layers": num_layers,
                                 "n_routed_experts": num_experts},
                              q_lora_rank=48, n_group=4, topk_group=2, num_experts_per_tok=3,
                              n_shared_experts=1, first_k_dense_replace=1,
                              routed_scaling_factor=2.5, norm_topk_prob=True,
                              rope_interleave=True, tie_word_embeddings=False,
                              rope_parameters={
                                  "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32,
                                  "beta_slow": 1, "original_max_position_embeddings": 256})
    return _write(path, DeepseekV3ForCausalLM, config, seed, max_shard_size, tokenizer)


def write_deepseek_v32(path: str | Path, *, index_topk: int = 5, index_n_heads: int = 4,
                       num_layers: int = 2, seed: int = 12, tokenizer: bool = False) -> Path:
    """DeepSeek-V3.2: the V3 decoder (q_lora, sigmoid routing, plain RoPE) whose
    attention reads only the top ``index_topk`` keys of its indexer (32-dim index
    keys, LayerNorm weights and biases off their init)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    config = DeepseekV32Config(**{**_COMMON, **_MLA, "num_hidden_layers": num_layers},
                               q_lora_rank=48, n_group=1, topk_group=1, num_experts_per_tok=2,
                               n_shared_experts=1, first_k_dense_replace=1,
                               routed_scaling_factor=2.5, norm_topk_prob=True,
                               tie_word_embeddings=False, index_topk=index_topk,
                               index_head_dim=32, index_n_heads=index_n_heads,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _write(path, DeepseekV32ForCausalLM, config, seed, None, tokenizer)


DEEPSEEK_WRITERS = {
    "deepseek_v2": write_deepseek_v2,
    "deepseek_v2_qlora": lambda path, **kw: write_deepseek_v2(path, q_lora=True, **kw),
    "deepseek_v3": write_deepseek_v3,
}


def write_tokenizer(path: str | Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """A word-level ``tokenizer.json``: ``<unk>``=0, ``<s>``=1, ``</s>``=2, then
    ``w3`` ... ``w{vocab_size-1}``; whitespace-split, BOS prepended."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": BOS_TOKEN_ID, "</s>": EOS_TOKEN_ID}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS_TOKEN_ID)]
    )
    file = Path(path) / "tokenizer.json"
    tok.save(str(file))
    return file


def _write(path: str | Path, model_class: Any, config: Any, seed: int,
           max_shard_size: str | None, tokenizer: bool) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).eval()
        with torch.no_grad():
            # transformers starts biases at 0 and norms at 1; perturb them so a
            # bias or norm weight that fails to load changes the logits.
            for name, param in model.named_parameters():
                if name.endswith(".bias") or name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param) * 0.1)
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # 0 at init: make it matter
                    buffer.add_(torch.randn_like(buffer) * 0.1)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        write_tokenizer(path, config.vocab_size)
    return path


def write_llama_4kv(path: str | Path) -> Path:
    """Llama with 8 query / 4 KV heads: splits over 1, 2 and 4 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**_COMMON, "num_attention_heads": 8, "num_key_value_heads": 4},
                         head_dim=8, rope_theta=10000.0, tie_word_embeddings=False)
    return _write(path, LlamaForCausalLM, config, 4, None, False)


def reference_weights_digest(path: Path) -> str:
    """The weights digest by its definition, from hashlib: each tensor file's length
    (8 bytes, little-endian), then its bytes, in file-name order."""
    digest = hashlib.sha256()
    for file in sorted(Path(path).glob("*.safetensors")):
        data = file.read_bytes()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()
