"""``lanekv tiny-model DIR``: the folder loads in transformers (model, tokenizer, chat
template) and in lanekv (checkpoint loader, tokenizer, chat template), and both agree."""

from __future__ import annotations

import pytest
import torch
from lanekv.decode.colocated import generate_colocated
from lanekv.decode.pool import PagePool
from lanekv.model.checkpoint import load_model
from lanekv.model.dtypes import resolve_dtype
from lanekv.model.sampling import SamplingParams

from lanekv.cli import main as lanekv
from lanekv.http.chat import ChatTemplate


@pytest.mark.timeout(120)
def test_tiny_model_loads_in_transformers_and_lanekv(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "tiny"
    assert lanekv(["tiny-model", str(folder)]) == 0
    assert str(folder) in capsys.readouterr().out
    assert resolve_dtype("auto", folder) == "float32"

    hf_tok = AutoTokenizer.from_pretrained(folder)
    ours = load_model(folder)
    text = "Hello, world! Any ASCII text spells out: ~`|\\{}[]<>^_ 0123456789 xyzzy."
    ids = ours.tokenizer.encode(text)
    assert ids == hf_tok(text).input_ids and ids[0] == 1  # BOS, then the bytes' merges
    assert ours.tokenizer.decode(ids) == text == hf_tok.decode(ids, skip_special_tokens=True)
    assert max(ids) < ours.config.vocab_size

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ChatTemplate.from_dir(folder).render(messages, add_generation_prompt=True) == want
    assert want.endswith("<|assistant|>\n")

    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    pool = PagePool.for_model(ours.config, 64, 16, torch.float32)
    assert generate_colocated(ours.model, pool, [ids], SamplingParams(), 4)[0] == want

    # Written again over itself: the same bytes (seeded), so make tiny-model is repeatable.
    before = (folder / "model.safetensors").read_bytes()
    assert lanekv(["tiny-model", str(folder)]) == 0
    assert (folder / "model.safetensors").read_bytes() == before
