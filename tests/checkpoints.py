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


WRITERS = {"llama": write_llama, "qwen2": write_qwen2, "mistral": write_mistral}


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
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        write_tokenizer(path, config.vocab_size)
    return path
