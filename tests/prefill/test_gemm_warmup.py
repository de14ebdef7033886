"""The GEMM ladder of the prefill warm-up (``prefill.cp.gemm_warmup``): the row
counts it covers, and that it runs exactly the GEMMs a prefill's forward runs
(checked against the forward itself, through module hooks), each at every row
count of the ladder."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from lanekv.model.deepseek import Router
from lanekv.model.llama import FusedLinear
from lanekv.prefill.cp.gemm_warmup import (
    COARSE_STEP,
    FINE_ROWS,
    GROWTH,
    LINEAR_ROWS,
    LOGIT_ROWS,
    model_gemms,
    row_ladder,
    warm_gemms,
)
from lanekv.prefill.cp.launcher import PrefillInput
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.engine_config import EngineConfig
from lanekv.prefill.warmup import warm_up
from torch import nn

from tests.checkpoints import (
    VOCAB_SIZE,
    write_deepseek_v3,
    write_deepseek_v32,
    write_llama,
    write_qwen3_moe,
)


@pytest.mark.parametrize("page_size", [1, 16, 48, 64, 256])
@pytest.mark.parametrize("max_rows", [1, 100, 2048, 5000, 16384, 20000, 131072])
def test_the_ladder_covers_every_page_multiple_up_to_the_fine_rows_then_coarser_whole_pages(page_size, max_rows):
    rows = row_ladder(page_size, max_rows)
    top = -(-max_rows // page_size) * page_size
    assert rows == sorted(set(rows)) and rows[-1] == top
    assert all(r % page_size == 0 for r in rows)
    fine = [r for r in rows if r <= FINE_ROWS]
    assert fine == list(range(page_size, min(top, FINE_ROWS) + 1, page_size))
    step = page_size * max(1, COARSE_STEP // page_size)
    for before, after in zip(rows, rows[1:]):
        if after > LINEAR_ROWS:  # growing rungs, each at least 1/GROWTH past the one before
            assert after == top or max(step, before // GROWTH) <= after - before < \
                max(step, before // GROWTH) + page_size, (before, after)
        elif before >= FINE_ROWS:  # one coarse step of whole pages (the first one up to a multiple of it)
            assert after - before <= step, (before, after)
    # bounded: the rungs past LINEAR_ROWS grow geometrically
    assert len([r for r in rows if r > LINEAR_ROWS]) <= 2 + math.log(top / LINEAR_ROWS + 1) / math.log(1 + 1 / GROWTH)


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


class _RunsOutAbove(nn.Linear):
    """A linear whose GEMM runs out of device memory above ``limit`` rows."""

    limit = 100

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return super().forward(x)


def test_a_rung_out_of_device_memory_ends_the_ladder_and_says_so(tmp_path, caplog):
    """The daemon still starts; the answer and the log say how far the ladder got."""
    engine = ThreadedPrefillEngine(EngineConfig(str(write_llama(tmp_path / "llama")), cp_size=1,
                                                page_size=16, pages_per_lane=64))
    try:
        model = engine.loaded.model
        down = model.model.layers[0].mlp.down_proj
        down.__class__ = _RunsOutAbove
        with caplog.at_level("WARNING", logger="lanekv.prefill"):
            done = warm_gemms(model, 16, 300)
        assert done.max_rows == 96  # the last rung at or under 100 rows
        assert "GEMMs at 112 rows ran out of device memory" in caplog.text
        assert "stops at 96 rows" in caplog.text
        down.__class__ = nn.Linear
        out = engine.prefill([PrefillInput(list(range(3, 60)))])  # the engine still serves
        assert out[0].num_tokens == 57
    finally:
        engine.close()
