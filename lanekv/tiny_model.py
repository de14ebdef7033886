"""``lanekv tiny-model DIR``: a small random-weight Llama checkpoint to try lanekv without real weights.

The folder holds what a Hugging Face checkpoint holds and both lanekv and
``transformers`` load: ``config.json`` (``torch_dtype`` float32, so ``--dtype
auto`` serves it in float32 on a CPU), ``model.safetensors`` (seeded random
weights, drawn wide enough that greedy tokens are decisive),
``generation_config.json``, ``tokenizer.json`` (a byte-level BPE trained here
on a few sentences: every ASCII text, indeed any UTF-8 text, spells out in its
bytes) and ``tokenizer_config.json`` with the special tokens and a chat
template. The weights are random: the text it writes is noise, the serving
path around it is real.

Exit codes: 0 written, 1 the folder could not be written, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# Small enough to start in seconds on a CPU.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float32",
}
INIT_STD = 0.2
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")  # ids 0..5
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# What the BPE merges are learnt from (a tokenizer needs only its bytes to spell any text).
_CORPUS = (
    "Hello, world! How are you today? The quick brown fox jumps over the lazy dog.",
    "lanekv serves a model with a prefill daemon, a decode daemon and an OpenAI-compatible front.",
    "What is the capital of France? Paris is the capital of France.",
    "Once upon a time, there was a small model with random weights that wrote noise.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000; a + b = c; (x, y) -> [z]; {\"key\": \"value\"}",
)


def write_tiny_model(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint to ``path`` (made if missing); the folder."""
    from safetensors.torch import save_file

    from lanekv.model.config import ModelConfig
    from lanekv.model.llama import CausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2) + "\n")
    shapes = CausalLM(ModelConfig.from_dir(path), device="meta").state_dict()
    gen = torch.Generator().manual_seed(seed)
    weights = {name: torch.ones(t.shape) if name.endswith("norm.weight")
               else torch.randn(t.shape, generator=gen) * INIT_STD for name, t in shapes.items()}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    generation = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _tokenizer(TINY_CONFIG["vocab_size"]).save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "clean_up_tokenization_spaces": False,
        "model_max_length": TINY_CONFIG["max_position_embeddings"], "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return path


def _tokenizer(vocab_size: int):
    """Byte-level BPE: the 256 byte symbols, the special tokens, merges up to ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", SPECIAL_TOKENS.index("<s>"))])
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"the tokenizer has {tok.get_vocab_size()} tokens, more than vocab_size={vocab_size}")
    return tok


def main(args: argparse.Namespace) -> int:
    try:
        path = write_tiny_model(args.dir, seed=args.seed)
    except OSError as err:
        print(f"lanekv tiny-model: cannot write {args.dir}: {err}", file=sys.stderr)
        return 1
    print(f"wrote a tiny random-weight Llama checkpoint (float32, vocab {TINY_CONFIG['vocab_size']}, "
          f"{TINY_CONFIG['num_hidden_layers']} layers) with a tokenizer and a chat template to {path}")
    return 0
