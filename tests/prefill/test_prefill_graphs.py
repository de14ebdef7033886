"""Piecewise prefill graphs (``prefill.cp.graphs``): the sizes, which models take
them, and that a prefill through the pieces and their padded static buffers
gives what the eager model gives: the same logits, the same pages written and
nothing else (the CPU runs the pieces eagerly through the same buffers; on the
GPU they are replayed graphs)."""

from __future__ import annotations

import math

import pytest
import torch
from lanekv.model.checkpoint import load_checkpoint
from lanekv.prefill.cp.graphs import PrefillGraphs, capture_graphs, graph_sizes, takes_graphs
from lanekv.prefill.cp.launcher import PrefillInput
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.engine_config import EngineConfig
from lanekv.prefill.warmup import warm_up

from tests.checkpoints import (
    VOCAB_SIZE,
    write_deepseek_v3,
    write_llama,
    write_qwen2,
    write_qwen3,
    write_qwen3_moe,
)
from tests.markers import requires_gpu
from tests.prefill.oracle import hf_last_logits, random_prompts

# With page 16 and cp 2, these give each rank from one page of rows to a few hundred.
PROMPT_LENS = [1, 17, 40, 130, 301]
BF16_TOL = 1.6e-2  # two bf16 ulps: see test_replayed_graphs_give_the_eager_prefill_gpu


def test_sizes_step_by_whole_pages_and_cover_the_largest():
    assert graph_sizes(64, 2048) == (*range(64, 513, 64), *range(640, 2049, 128))
    assert graph_sizes(16, 100) == (64, 128)
    assert graph_sizes(48, 600) == (96, 192, 288, 384, 480, 576, 720)  # 64 and 128 rows in whole pages
    assert graph_sizes(16, 0) == ()
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match=f"max_rows={bad!r}"):
            graph_sizes(16, bad)


def test_only_dense_llama_family_models_take_graphs(tmp_path):
    takes = {name: takes_graphs(load_checkpoint(write(tmp_path / name), torch.float32, "cpu").model)
             for name, write in (("llama", write_llama), ("qwen3", write_qwen3),
                                 ("qwen3_moe", write_qwen3_moe), ("deepseek_v3", write_deepseek_v3))}
    assert takes == {"llama": True, "qwen3": True, "qwen3_moe": False, "deepseek_v3": False}
    model = load_checkpoint(tmp_path / "deepseek_v3", torch.float32, "cpu").model
    with pytest.raises(ValueError, match="architecture='DeepseekV3ForCausalLM'"):
        PrefillGraphs(model, (64,))


def test_graph_max_rows_is_checked(tmp_path):
    with pytest.raises(ValueError, match="graph_max_rows=-1"):
        EngineConfig(str(write_llama(tmp_path / "llama")), graph_max_rows=-1)


def _engine(ckpt, cp, page, **kw):
    cfg = EngineConfig(str(ckpt), cp_size=cp, page_size=page, pages_per_lane=256, pool_fill=math.nan, **kw)
    return ThreadedPrefillEngine(cfg)


def _with_graphs(engine, max_rows, calls):
    """Each rank runs its prefills through pieces whose buffers start as NaN (a padding
    row that reached a real one would show); ``calls`` gets each one's row count."""
    for runner in engine.runners:
        graphs = runner.graphs = PrefillGraphs(runner.model, graph_sizes(runner.page_size, max_rows))
        for name in ("cos", "sin", "q", "k", "v", "o", "residual", "hidden"):
            getattr(graphs, name).fill_(math.nan)

        def counted(ids, positions, attention, forward=graphs.forward):
            calls.append(ids.numel())
            return forward(ids, positions, attention)

        graphs.forward = counted
    return engine


@pytest.mark.parametrize("write", [write_llama, write_qwen2, write_qwen3], ids=["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("cp", [1, 2])
def test_pieces_give_the_eager_prefill_and_write_only_its_pages(tmp_path, write, cp):
    ckpt = write(tmp_path / "ckpt")
    prompts = random_prompts(PROMPT_LENS)
    eager = _engine(ckpt, cp, 16)
    # 96 rows at most: the longer prompts' ranks run eager, the others through the pieces
    calls = []
    graphed = _with_graphs(_engine(ckpt, cp, 16), 96, calls)
    batches = [[p] for p in prompts] + [prompts[:3], prompts]
    hf = hf_last_logits(ckpt, prompts)
    for batch in batches:
        want = eager.prefill([PrefillInput(p) for p in batch], return_logits=True)
        got = graphed.prefill([PrefillInput(p) for p in batch], return_logits=True)
        for g, w in zip(got, want):
            assert [p.page for p in g.pages] == [p.page for p in w.pages]
            assert g.first_token == w.first_token
            torch.testing.assert_close(g.logits, w.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(g.logits, hf[g.num_tokens], rtol=1e-4, atol=1e-4)
    for rank in range(cp):
        # Pools poisoned with NaN: the same rows written, the same K/V in them.
        torch.testing.assert_close(graphed.pool_snapshot(rank), eager.pool_snapshot(rank),
                                   rtol=1e-5, atol=1e-5, equal_nan=True)
    # Both paths ran: the pieces for every rank's prefill of up to 96 rows, eager above.
    assert calls and max(calls) <= 96 and len(calls) < len(batches) * cp


def test_the_attention_sees_only_the_real_rows(tmp_path):
    model = load_checkpoint(write_llama(tmp_path / "llama"), torch.float32, "cpu").model
    graphs = PrefillGraphs(model, (32, 64))
    seen = []

    def attention(layer, q, k, v, cos, sin):
        seen.append((layer, q.shape[0], k.shape[0], v.shape[0], cos.shape[0]))
        return torch.zeros_like(q)

    ids = torch.arange(3, 40)
    out = graphs.forward(ids, torch.arange(37), attention)
    assert out.shape == (37, model.config.hidden_size)
    assert seen == [(layer, 37, 37, 37, 37) for layer in range(model.config.num_layers)]
    with pytest.raises(ValueError, match=r"1\.\.64 rows, got ids \(65,\)"):
        graphs.forward(torch.arange(65), torch.arange(65), attention)


def test_nothing_is_captured_on_the_cpu(tmp_path):
    engine = _engine(write_llama(tmp_path / "llama"), 1, 16)
    assert capture_graphs(engine.runners[0].model, 16, 2048) == (None, (0, 0, 0, 0.0, 0))
    assert engine.capture_graphs(2048)[0].graphs == 0
    assert engine.runners[0].graphs is None  # the CPU path stays the eager one


@requires_gpu
@pytest.mark.timeout(300)
def test_replayed_graphs_give_the_eager_prefill_gpu(tmp_path):
    ckpt = write_llama(tmp_path / "llama")
    prompts = random_prompts([1, 17, 40, 130, 301, 700])
    cfg = dict(device="cuda", dtype="bfloat16")
    eager = _engine(ckpt, 1, 16, graph_max_rows=0, **cfg)
    graphed = _engine(ckpt, 1, 16, graph_max_rows=512, **cfg)
    warm_up(graphed, VOCAB_SIZE, max_tokens=2048, max_batch_tokens=4096, forget=None)
    graphs = graphed.runners[0].graphs
    assert graphs is not None and graphs.sizes[-1] == 512 and len(graphs._graphs) == len(graphs.sizes)
    for name in ("q", "k", "v", "o", "residual", "hidden"):  # padding rows hold NaN from here on
        getattr(graphs, name).fill_(math.nan)
    for batch in [[p] for p in prompts] + [prompts[:4]]:
        want = eager.prefill([PrefillInput(p) for p in batch], return_logits=True)
        got = graphed.prefill([PrefillInput(p) for p in batch], return_logits=True)
        for g, w in zip(got, want):
            assert not g.logits.isnan().any()
            # The replay runs the eager path's kernels on the same inputs, but its GEMMs see the
            # row count padded to the graph's size, for which cuBLAS may pick another split of
            # the reduction: each bf16 output may then round the other way, one ulp (2^-8
            # relative, 8-bit mantissa) per layer. BF16_TOL is two ulps (torch's own bf16
            # rtol), also as atol for values near zero; the CPU test, in float32 through the
            # same buffers, holds to 1e-5. A wrong row, offset or stale padding is off by O(1).
            torch.testing.assert_close(g.logits.float(), w.logits.float(), rtol=BF16_TOL, atol=BF16_TOL)
            n = g.num_tokens  # the K/V rows written (the CPU test checks no other row is)
            kv_got = graphed.read_pages([p.page for p in g.pages])[:, :, :n].float()
            kv_want = eager.read_pages([p.page for p in w.pages])[:, :, :n].float()
            torch.testing.assert_close(kv_got, kv_want, rtol=BF16_TOL, atol=BF16_TOL)
