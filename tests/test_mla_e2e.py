"""DeepSeek (MLA latent pages), Qwen3 and Qwen3-MoE end to end: greedy tokens through
prefill -> transfer -> decode equal transformers' generate.

Many (cp_size, page_size) shapes run with rank threads (``ThreadedPrefillEngine``)
whose latent pages are gathered in the wire order and scattered into a decode
pool through the decode remap, as a fetch places them; one pair of real daemons
per model (rank processes, gRPC and the same-host fast path) runs concurrent
prompts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lanekv.prefill.engine_config import EngineConfig

from tests.checkpoints import (
    DEEPSEEK_WRITERS,
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    write_qwen3,
    write_qwen3_moe,
)
from tests.daemons import generate_concurrently, running_pair
from tests.threaded_e2e import threaded_generate

REPO = Path(__file__).resolve().parents[1]
PROMPT_LENS = [1, 8, 27, 61]
MAX_NEW_TOKENS = 8
WRITERS = {**DEEPSEEK_WRITERS, "qwen3": write_qwen3, "qwen3_moe": write_qwen3_moe}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-e2e")
    return {name: WRITERS[name](root / name) for name in ("deepseek_v2", "deepseek_v3", "qwen3",
                                                            "qwen3_moe")}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(checkpoints) -> dict[str, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    out = {}
    for name, path in checkpoints.items():
        hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                  dtype=torch.float32).eval()
        with torch.inference_mode():
            out[name] = [hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                     dtype=torch.long), do_sample=False,
                                     max_new_tokens=MAX_NEW_TOKENS,
                                     pad_token_id=EOS_TOKEN_ID)[0, len(ids):].tolist()
                         for ids in _prompts()]
    return out


@pytest.mark.parametrize("name,cp_size,page_size", [
    ("deepseek_v2", 3, 1), ("deepseek_v3", 1, 4), ("deepseek_v3", 4, 16), ("qwen3", 2, 4),
    ("qwen3_moe", 2, 4),
])
def test_threaded_prefill_transfer_decode(checkpoints, reference, name, cp_size, page_size):
    assert threaded_generate(checkpoints[name], cp_size, page_size, _prompts(),
                             MAX_NEW_TOKENS) == reference[name]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,cp_size,page_size,transport", [
    ("deepseek_v3", 2, 4, "auto"), ("deepseek_v2", 3, 16, "grpc")])
def test_daemons_generate_like_transformers(checkpoints, reference, name, cp_size, page_size,
                                            transport, tmp_path):
    engine = EngineConfig(str(checkpoints[name]), cp_size=cp_size, page_size=page_size,
                          pages_per_lane=-(-200 // page_size), start_timeout_s=120)
    with running_pair(engine, pool_pages=-(-600 // page_size), transport=transport) as (pre, dec):
        assert (dec.agreement.attention, dec.agreement.kv_planes) == ("mla", 1)
        results = generate_concurrently(dec.endpoint, _prompts(), MAX_NEW_TOKENS)
        used = {dec.fastpath.transport(e) for e in pre.topology.endpoints} if dec.fastpath else {
            "grpc"}
        assert used == ({"shm"} if transport == "auto" else {"grpc"})
        if name == "deepseek_v3":
            _other_mla_dims_are_refused(checkpoints[name], pre.endpoint, page_size, tmp_path)
    assert results == reference[name]


def _other_mla_dims_are_refused(checkpoint: Path, endpoint: str, page_size: int,
                                tmp_path: Path) -> None:
    """A decode daemon of an MLA model with another kv_lora_rank does not start
    against this MLA prefill daemon, and says which field differs."""
    other = tmp_path / "other-dims"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    config["kv_lora_rank"] = 24
    (other / "config.json").write_text(json.dumps(config))
    ready = tmp_path / "ready"
    result = subprocess.run(
        [sys.executable, "-m", "lanekv.cli", "decode", "--model", str(other), "--prefill", endpoint,
         "--page-size", str(page_size), "--device", "cpu", "--load-format", "dummy",
         "--ready-file", str(ready)], cwd=REPO, capture_output=True, text=True, timeout=150)
    assert result.returncode == 1, result.stderr
    assert "disagree on the layout contract" in result.stderr
    assert "\nkv_lora_rank: decode=24 prefill=32" in result.stderr, result.stderr
    assert not ready.exists()
