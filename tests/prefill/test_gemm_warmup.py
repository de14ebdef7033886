"""The GEMM ladder of the prefill warm-up (``prefill.cp.gemm_warmup``): the row
counts it covers, and that it runs exactly the GEMMs a prefill's forward runs
(checked against the forward itself, through module hooks), each at every row
count of the ladder."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

from model.deepseek import Router
from model.llama import FusedLinear
from prefill.cp.gemm_warmup import (
    COARSE_STEP,
    FINE_ROWS,
    LOGIT_ROWS,
    model_gemms,
    row_ladder,
    warm_gemms,
)
from prefill.cp.launcher import PrefillInput
from prefill.cp.threaded import ThreadedPrefillEngine
from prefill.engine_config import EngineConfig
from prefill.warmup import warm_up
from tests.checkpoints import (
    VOCAB_SIZE,
    write_deepseek_v3,
    write_deepseek_v32,
    write_llama,
    write_qwen3_moe,
)


@pytest.mark.parametrize("page_size", [1, 16, 48, 64, 256])
@pytest.mark.parametrize("max_rows", [1, 100, 2048, 5000, 16384])
def test_the_ladder_covers_every_page_multiple_up_to_the_fine_rows_then_coarse_whole_pages(page_size, max_rows):
    rows = row_ladder(page_size, max_rows)
    top = -(-max_rows // page_size) * page_size
    assert rows == sorted(set(rows)) and rows[-1] == top
    assert all(r % page_size == 0 for r in rows)
    fine = [r for r in rows if r <= FINE_ROWS]
    assert fine == list(range(page_size, min(top, FINE_ROWS) + 1, page_size))
    coarse = [r for r in rows if r > FINE_ROWS]
    if coarse:  # gaps of one coarse step (whole pages), then the top itself
        step = page_size * max(1, COARSE_STEP // page_size)
        gaps = {b - a for a, b in zip([fine[-1], *coarse[:-1]], coarse[:-1])}
        assert gaps <= {step, step - fine[-1] % step}, gaps
        assert top - coarse[-2] <= step if len(coarse) > 1 else True


@pytest.mark.parametrize("page_size, max_rows, field", [(0, 10, "page_size"), (16, 0, "max_rows")])
def test_a_bad_ladder_names_the_field(page_size, max_rows, field):
    with pytest.raises(ValueError, match=f"{field}="):
        row_ladder(page_size, max_rows)


def _key(module: nn.Module) -> tuple:
    bias = getattr(module, "bias", None) is not None
    return type(module), tuple(module.weight.shape), module.weight.dtype, bias


def _record(model: nn.Module) -> tuple[dict[tuple, set[int]], list]:
    """Row counts each kind of GEMM module was called with, from forward hooks."""
    seen: dict[tuple, set[int]] = defaultdict(set)
    hooks = []
    for module in model.modules():
        if isinstance(module, (nn.Linear, FusedLinear, Router)):
            hooks.append(module.register_forward_hook(
                lambda mod, args, out: seen[_key(mod)].add(args[0].shape[0])))
    return seen, hooks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("write", [write_llama, write_qwen3_moe, write_deepseek_v3, write_deepseek_v32],
                         ids=["llama", "qwen3_moe", "deepseek_v3", "deepseek_v32"])
def test_the_ladder_runs_the_gemms_the_forward_runs_at_every_rung(tmp_path, write):
    engine = ThreadedPrefillEngine(EngineConfig(str(write(tmp_path / "ckpt")), cp_size=2,
                                                page_size=16, pages_per_lane=64))
    try:
        model = engine.loaded.model
        seen, hooks = _record(model)
        try:
            engine.prefill([PrefillInput(list(range(3, 40))), PrefillInput(list(range(5, 90)))])
            in_forward = set(seen)
            seen.clear()
            done = warm_gemms(model, 16, 300)
        finally:
            for hook in hooks:
                hook.remove()
        warmed = {_key(m) for m in model_gemms(model)}
        assert set(seen) == warmed
        # Every kind of GEMM the forward ran (not the views of fused weights, not the head);
        # DSA's prefill multiplies by kv_b_proj's weight absorbed into q, not as a module:
        # the ladder still runs the module (one shape more, harmless).
        extra = warmed - in_forward
        assert extra == ({_key(model.model.layers[0].self_attn.kv_b_proj)} if model.config.dsa else set())
        # ... each at every row count of the ladder, and the head at 1..LOGIT_ROWS rows.
        ladder = row_ladder(16, 300)
        assert all(rows == set(ladder) for rows in seen.values()), dict(seen)
        assert done == done._replace(calls=len(warmed) * len(ladder) + LOGIT_ROWS,
                                     shapes=len(warmed), max_rows=ladder[-1])
    finally:
        engine.close()


def test_the_ladder_leaves_the_model_as_it_was(tmp_path):
    engine = ThreadedPrefillEngine(EngineConfig(str(write_llama(tmp_path / "llama")), cp_size=1,
                                                page_size=16, pages_per_lane=64))
    try:
        prompt = [PrefillInput(list(range(3, 60)))]
        before = engine.prefill(prompt, return_logits=True)[0]
        engine.free([p.page for p in before.pages])
        state = {k: v.clone() for k, v in engine.loaded.model.state_dict().items()}
        warm_up(engine, VOCAB_SIZE, max_tokens=1024, max_batch_tokens=200)
        after = engine.prefill(prompt, return_logits=True)[0]
        assert all(torch.equal(v, state[k]) for k, v in engine.loaded.model.state_dict().items())
        assert after.first_token == before.first_token
        torch.testing.assert_close(after.logits, before.logits, rtol=0, atol=0)
    finally:
        engine.close()
