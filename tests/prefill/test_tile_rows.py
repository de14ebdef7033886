"""The row counts at which the prefill kernels change tiles (``prefill.cp.tile_rows``),
and the warm-up's prefills on both sides of them (``prefill.warmup``).

Each tile set is its own compiled Triton kernel, and so is each power of two of
a batch's segment count (the attention's ``SEG_BLOCK``). The CPU tests check
that the warm-up reaches every (segment block, side of the switch) a random
stream of batches then reaches, at a stand-in switch; the GPU tests check the
boundaries against the launchers' own choice (``tests/prefill/test_no_compile.py``
checks that nothing compiles)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import lanekv.model.attention.base as attention_base
import pytest
import torch
import triton
from lanekv.kernels.moe.experts import default_moe_tiles, prefill_tile_min_pairs
from lanekv.kernels.prefill.config import big_tile_min_rows, default_config
from lanekv.model.config import ModelConfig
from lanekv.prefill.cp.launcher import PrefillInput
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.cp.tile_rows import tile_switch_rows
from lanekv.prefill.engine_config import EngineConfig
from lanekv.prefill.warmup import warm_up

from tests.checkpoints import VOCAB_SIZE, write_deepseek_v3, write_llama, write_qwen3_moe
from tests.markers import requires_gpu


@pytest.fixture
def h200_sms(monkeypatch):
    """``torch.cuda.get_device_properties`` answers an H200's 132 SMs (no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))


@pytest.mark.parametrize("heads", [1, 4, 8, 32, 33, 64, 128, 528, 1000])
def test_big_tile_min_rows_is_the_first_row_count_with_enough_programs(h200_sms, heads):
    rows = big_tile_min_rows(heads, 128, torch.bfloat16, torch.device("cuda"))
    enough = [r for r in range(1, 140_000) if triton.cdiv(r, 128) * heads >= 4 * 132]
    assert rows == enough[0]


def test_the_attention_tile_does_not_depend_on_rows_off_cuda_or_for_wide_heads(h200_sms):
    cuda = torch.device("cuda")
    assert big_tile_min_rows(32, 128, torch.bfloat16, torch.device("cpu")) is None
    assert big_tile_min_rows(32, 128, torch.float32, cuda) is None
    assert big_tile_min_rows(128, 192, torch.bfloat16, cuda) is None  # DeepSeek-V3's MLA heads
    assert big_tile_min_rows(16, 256, torch.bfloat16, cuda) is None  # past the MLA tiles
    # fewer MLA heads (V2-Lite's 16) switch where 128-row blocks fill the chip, as GQA's do
    assert big_tile_min_rows(16, 192, torch.bfloat16, cuda) == big_tile_min_rows(16, 128, torch.bfloat16, cuda)


def test_tile_switch_rows_per_model(tmp_path, h200_sms):
    cuda = torch.device("cuda")
    llama = ModelConfig.from_dir(write_llama(tmp_path / "llama"))
    moe = ModelConfig.from_dir(write_qwen3_moe(tmp_path / "moe"))
    mla = ModelConfig.from_dir(write_deepseek_v3(tmp_path / "v3"))
    # 4 heads: 132 * 4 / 4 programs of 128 rows
    assert tile_switch_rows(llama, torch.bfloat16, cuda) == (131 * 128 + 1,)
    assert tile_switch_rows(llama, torch.bfloat16, torch.device("cpu")) == ()
    assert tile_switch_rows(llama, torch.float32, cuda) == ()
    # 8 experts, 2 a token: 33 pairs from 17 rows
    assert tile_switch_rows(moe, torch.bfloat16, cuda) == (17, 131 * 128 + 1)
    experts, top_k = mla.moe.num_experts, mla.moe.top_k
    moe_rows = -(-(4 * experts + 1) // top_k)
    attention = () if mla.num_heads >= 64 else (big_tile_min_rows(mla.num_heads, 192, torch.bfloat16, cuda),)
    assert tile_switch_rows(mla, torch.bfloat16, cuda) == tuple(sorted((moe_rows, *attention)))


def _recording_attention(monkeypatch):
    """Records (segment block, rows) of every rank's attention call."""
    calls: list[tuple[int, int]] = []
    real = attention_base.cp_prefill_attention

    def record(q, k, v, segments, softmax_scale):
        calls.append((triton.next_power_of_2(segments.q_len.shape[0]), q.shape[0]))
        return real(q, k, v, segments, softmax_scale)

    monkeypatch.setattr(attention_base, "cp_prefill_attention", record)
    return calls


@pytest.mark.parametrize("cp", [1, 2])
def test_warm_up_reaches_both_sides_of_a_switch_with_every_segment_block(tmp_path, monkeypatch, cp):
    switch = 40  # a stand-in: the CPU has no switch (the GPU test below has the real one)
    ckpt = write_llama(tmp_path / "llama", num_layers=1)
    engine = ThreadedPrefillEngine(EngineConfig(str(ckpt), cp_size=cp, page_size=4, pages_per_lane=800,
                                                device="cpu"))
    monkeypatch.setattr(engine, "tile_switch_rows", lambda: (switch,))
    calls = _recording_attention(monkeypatch)
    try:
        warm_up(engine, VOCAB_SIZE, max_tokens=1024, max_batch_tokens=2048, gemm_ladder=False)
        warmed = {(block, rows >= switch) for block, rows in calls}
        calls.clear()
        rng = random.Random(0)
        for _ in range(60):
            lengths = [rng.randint(1, rng.choice((8, 60, 300))) for _ in range(rng.randint(1, 64))]
            while sum(lengths) > 2048:
                lengths.pop()
            inputs = [PrefillInput([(3 + 7 * t) % VOCAB_SIZE for t in range(n)]) for n in lengths]
            for res in engine.prefill(inputs):
                engine.free(res.new_pages)
        served = {(block, rows >= switch) for block, rows in calls}
        assert {side for _, side in served} == {False, True}  # the stream crossed the switch
        assert served <= warmed, f"served shapes the warm-up missed: {sorted(served - warmed)}"
    finally:
        engine.close()


def test_a_switch_past_the_limits_adds_nothing(tmp_path, monkeypatch):
    ckpt = write_llama(tmp_path / "llama", num_layers=1)
    engine = ThreadedPrefillEngine(EngineConfig(str(ckpt), cp_size=1, page_size=4, pages_per_lane=400,
                                                device="cpu"))
    try:
        plain = warm_up(engine, VOCAB_SIZE, max_tokens=1024, max_batch_tokens=1024, gemm_ladder=False)
        monkeypatch.setattr(engine, "tile_switch_rows", lambda: (5000,))
        assert warm_up(engine, VOCAB_SIZE, max_tokens=1024, max_batch_tokens=1024,
                       gemm_ladder=False).prefills == plain.prefills
    finally:
        engine.close()


@requires_gpu
@pytest.mark.parametrize(("heads", "qk_dim"), [(4, 128), (32, 128), (16, 192)])
def test_the_attention_switch_is_where_default_config_changes_gpu(heads, qk_dim):
    rows = big_tile_min_rows(heads, qk_dim, torch.bfloat16, torch.device("cuda"))
    below = torch.empty((rows - 1, heads, qk_dim), dtype=torch.bfloat16, device="cuda")
    at = torch.empty((rows, heads, qk_dim), dtype=torch.bfloat16, device="cuda")
    assert default_config(below).block_m == 64
    assert default_config(at).block_m == 128


@requires_gpu
def test_the_moe_switch_is_where_default_moe_tiles_changes_gpu():
    x = torch.empty((1, 64), dtype=torch.bfloat16, device="cuda")
    pairs = prefill_tile_min_pairs(8)
    assert default_moe_tiles(pairs - 1, 8, x).block_m == 16
    assert default_moe_tiles(pairs, 8, x).block_m == 64
