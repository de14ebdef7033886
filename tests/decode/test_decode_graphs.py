"""Captured decode steps (decode.cuda.graphs) against the eager step.

On the GPU the steps are CUDA graphs; on the CPU the same static-buffer step
runs eagerly (the engine never builds one there), so padding, the static
page table and the ladder are covered without a GPU too. Tokens must equal the
eager engine's, through admissions and cancellations mid-run and across page
boundaries, and padding rows must leave every page untouched (poisoned pool).
Every step kind is covered: Llama's (GQA), DeepSeek's (MLA latent pages and
the MoE, routed on the device on the GPU) and DeepSeek-V3.2's (DSA: index-K rows
beside the latent, ``index_topk`` 5 below most contexts, so the selection decides
the tokens; on the GPU the captured selection runs over the graph's full page-table
width, the eager one over the batch's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lanekv.decode.colocated import prefill_into_pool
from lanekv.decode.cuda.graphs import DecodeGraphs, check_ladder, default_ladder
from lanekv.decode.engine import DecodeEngine
from lanekv.decode.pool import PagePool, PageTable
from lanekv.kernels.dsa.select import select_fixed_width
from lanekv.model.attention import dsa as dsa_kind
from lanekv.model.checkpoint import LoadedModel, load_model
from lanekv.model.sampling import SamplingParams

from tests.checkpoints import VOCAB_SIZE, write_deepseek_v3, write_deepseek_v32, write_llama
from tests.markers import requires_gpu

POISON = 0x7FC0DEAD  # a NaN bit pattern: read by mistake, it would poison every logit


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graph-ckpt")
    return {"llama": write_llama(root / "llama"), "deepseek_v3": write_deepseek_v3(root / "v3"),
            "deepseek_v32": write_deepseek_v32(root / "v32")}


@pytest.fixture(params=["llama", "deepseek_v3", "deepseek_v32"])
def checkpoint(request: pytest.FixtureRequest, checkpoints: dict[str, Path]) -> Path:
    return checkpoints[request.param]


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=gen).tolist()


def test_default_ladder_and_checks():
    assert default_ladder(256) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128,
                                   144, 160, 176, 192, 208, 224, 240, 256)
    assert default_ladder(20) == (1, 2, 4, 8, 16)
    assert default_ladder(3) == (1, 2)
    assert check_ladder([4, 1], 8) == (1, 4)
    for bad in ([0], [9], [2, 2], [1.5]):
        with pytest.raises(ValueError, match="graph batch size"):
            check_ladder(bad, 8)


def _poisoned_pool(loaded: LoadedModel, num_pages: int, page_size: int, device) -> PagePool:
    pool = PagePool.for_model(loaded.config, num_pages, page_size, loaded.model.dtype, device)
    pool.tensor.view(torch.int32).fill_(POISON)
    return pool


def _scenario(loaded: LoadedModel, device, graphs: bool, num_requests: int, sizes,
              page_size: int = 4, overlap: bool = True, stops: dict[str, int] | None = None,
              queued: list | None = None, sampling=None,
              logprobs: dict[str, list] | None = None) -> tuple[dict[str, list[int]], int]:
    """Requests of mixed lengths, a third added mid-run, some cancelled mid-run;
    returns each request's tokens (``logprobs``: filled with each request's token
    logprobs, for those that ask). Page 0 is free throughout (padding rows'
    page-table entries point at it), and checked poisoned at the end."""
    model = loaded.model
    pool = _poisoned_pool(loaded, num_pages=num_requests * 14 + 8, page_size=page_size,
                          device=device)
    hold = PageTable.allocate(pool, 1)  # keeps page 0 out of every request
    engine = DecodeEngine(model, pool, max_batch_size=max(sizes), eos_token_ids=(),
                          graph_sizes=sizes, overlap=overlap)
    commits = []
    commit = engine._commit
    engine._commit = lambda plan: commits.append(plan) or commit(plan)
    if queued is not None:  # the steps queued before the ids of the one before were read
        queue_next = engine._queue_next
        engine._queue_next = lambda *a: (lambda got: (got is not None and queued.append(got)) or got)(
            queue_next(*a))
    if graphs:
        if device.type == "cuda":
            assert engine.capture_graphs() is not None
        else:
            engine._graphs = DecodeGraphs(model, pool, engine.graph_sizes, engine.sampler)
            engine._graphs.capture()
    adds: dict[int, list] = {}
    for i in range(num_requests):
        length = 1 + (i * 7) % 29  # 1..29 tokens: some end on a page boundary
        params = SamplingParams() if sampling is None else sampling(i)
        table, first = prefill_into_pool(model, pool, _prompt(length, seed=i), params)
        adds.setdefault(0 if i % 3 else 2 + i % 5, []).append(
            (f"r{i}", table, first, params, 6 + i % 9))
    hold.release()
    cancels = {3: [f"r{i}" for i in range(1, num_requests, 5)]}
    tokens: dict[str, list[int]] = {}
    for step in range(60):
        for args in adds.get(step, []):
            engine.add(*args, stop_token_ids=() if stops is None or args[0] not in stops
                       else (stops[args[0]],))
        for rid in cancels.get(step, []):
            engine.cancel(rid)
        for event in engine.step():
            tokens.setdefault(event.request_id, []).append(event.token_id)
            if logprobs is not None and event.logprobs is not None:
                logprobs.setdefault(event.request_id, []).append(event.logprobs)
        if step > max(adds) and not engine.has_work:
            break
    assert not engine.has_work
    assert pool.free_count == pool.num_pages
    # Page 0, which no request held and every padding row's table points at, is untouched.
    assert (pool.tensor[:, :, :page_size].view(torch.int32) == POISON).all()
    return tokens, len(commits)


def _engine_with_static_steps(checkpoints, num_requests: int = 3):
    """A CPU engine over the static-buffer step, with ``num_requests`` greedy
    requests of 12 new tokens added; its pool too."""
    loaded = load_model(checkpoints["llama"])
    pool = PagePool.for_model(loaded.config, 32, 4, loaded.model.dtype, "cpu")
    engine = DecodeEngine(loaded.model, pool, max_batch_size=4, eos_token_ids=(), graph_sizes=(4,))
    engine._graphs = DecodeGraphs(loaded.model, pool, engine.graph_sizes)
    engine._graphs.capture()
    for i in range(num_requests):
        table, first = prefill_into_pool(loaded.model, pool, _prompt(5 + i, seed=i), SamplingParams())
        engine.add(f"r{i}", table, first, SamplingParams(), 12)
    return engine, pool


def test_a_step_launches_the_next_before_it_returns_cpu(checkpoints):
    """With overlap, a step whose staged successor holds launches it before its
    events go out; the next call finishes that step. Cancelling every request
    under a step launched ahead leaves work (the step must land) until the next
    call, which emits nothing for them and frees their pages."""
    engine, pool = _engine_with_static_steps(checkpoints)
    first = engine.step()  # runs step 1 (prepared as usual), stages step 2 and launches it
    assert [e.request_id for e in first] == ["r0", "r1", "r2"] and engine._overlap.launched is not None
    assert [r.request_id for r in engine._in_flight] == ["r0", "r1", "r2"]
    second = engine.step()
    assert [e.step for e in second] == [2, 2, 2]  # step 2's events: finished, not run again
    for rid in ("r0", "r1", "r2"):
        assert engine.cancel(rid)
    assert engine.num_running == 0 and engine.has_work  # step 3 runs: its pages are still written
    assert pool.free_count < pool.num_pages
    assert engine.step() == [] and not engine.has_work
    assert pool.free_count == pool.num_pages


def test_a_failed_launch_ahead_fails_the_next_step_not_this_one_cpu(checkpoints):
    engine, pool = _engine_with_static_steps(checkpoints, num_requests=2)
    run = engine._run
    calls = []

    def run_then_fail(batch):
        calls.append(batch)
        if len(calls) == 2:  # the launch ahead of step 2
            raise RuntimeError("launch failed")
        return run(batch)

    engine._run = run_then_fail
    assert [e.step for e in engine.step()] == [1, 1]  # step 1's events are not lost
    with pytest.raises(RuntimeError, match="launch failed"):
        engine.step()
    assert engine._overlap.launched is None and engine._in_flight == []
    engine._run = run
    assert [e.step for e in engine.step()] == [2, 2]  # the engine steps on
    for rid in ("r0", "r1"):
        engine.cancel(rid)
    while engine.has_work:
        engine.step()
    assert pool.free_count == pool.num_pages


def _queued_through_stop_tokens(loaded: LoadedModel, device: torch.device, num_requests: int,
                                sizes) -> None:
    """A step queued behind the one before it (its ids fed on the device) while a
    request of that step samples its stop token: the request ends there, its extra
    row is dropped, and every token equals the eager engine's (pages all back,
    page 0 still poisoned: checked in ``_scenario``)."""
    plain, _ = _scenario(loaded, device, False, num_requests, sizes)
    # each request with 4+ tokens stops at its third token (unless it came earlier)
    stops = {rid: out[2] for rid, out in plain.items() if len(out) >= 4}
    assert len(stops) >= 5
    eager, _ = _scenario(loaded, device, False, num_requests, sizes, stops=stops)
    queued: list = []
    captured, _ = _scenario(loaded, device, True, num_requests, sizes, stops=stops, queued=queued)
    assert captured == eager
    cancelled = {f"r{i}" for i in range(1, num_requests, 5)}  # _scenario's cancels
    # Each ends at its stop token within 3 tokens; None: prefill's own first token
    # was it (done when added).
    ended = [eager[rid][-1] for rid in stops if rid not in cancelled]
    assert all(eager[rid][-1] in (stops[rid], None) and len(eager[rid]) <= 3
               for rid in stops if rid not in cancelled)
    assert sum(token is not None for token in ended) >= 3
    assert len(queued) >= 2  # the queued path ran (requests end at most steps here)


def test_steps_queued_before_the_ids_equal_eager_through_stop_tokens_cpu(checkpoints):
    _queued_through_stop_tokens(load_model(checkpoints["llama"]), torch.device("cpu"), 11,
                                (1, 2, 4, 8, 16))


@requires_gpu
def test_steps_queued_before_the_ids_equal_eager_through_stop_tokens_gpu(checkpoint):
    loaded = load_model(checkpoint, dtype=torch.float32, device="cuda")
    _queued_through_stop_tokens(loaded, torch.device("cuda"), 64, default_ladder(64))


@pytest.mark.parametrize("overlap", [True, False])
def test_static_step_equals_eager_on_cpu(checkpoint, overlap):
    """Steps above the ladder run eager, the rest padded; with overlap, most
    steps run the plan staged during the step before."""
    loaded = load_model(checkpoint)
    sizes = (1, 2, 4, 8, 16)
    eager, _ = _scenario(loaded, torch.device("cpu"), False, 11, sizes[:-1])
    captured, planned = _scenario(loaded, torch.device("cpu"), True, 11, sizes, overlap=overlap)
    assert captured == eager
    assert (planned > 5) if overlap else planned == 0
    assert len(eager) == 10  # r6 is cancelled on the step it is added: no token


def test_static_dsa_step_with_the_cuda_selection_equals_eager_cpu(checkpoints, monkeypatch):
    """Both runs take the selection a CUDA step runs (scores over the page table's
    whole width, -inf past each request, ``first_topk``, -1 slots skipped by sparse
    attention; torch-scored here): the static step over the graph's fixed width
    gives the eager step's tokens over each batch's own width. The tiny indexer
    scores many keys exactly 0, so ties are decided inside every request's top 5;
    they go to the lowest positions whatever the width."""
    loaded = load_model(checkpoints["deepseek_v32"])
    sizes = (1, 2, 4, 8, 16)
    widths: dict[str, list[int]] = {"eager": [], "static": []}

    def patched(run: str):
        def fixed_width(q, weights, index_pool, page_table, *args):
            widths[run].append(page_table.shape[1])
            return select_fixed_width(q, weights, index_pool, page_table, *args)
        monkeypatch.setattr(dsa_kind, "decode_select", fixed_width)

    patched("eager")
    eager, _ = _scenario(loaded, torch.device("cpu"), False, 11, sizes[:-1])
    patched("static")
    captured, _ = _scenario(loaded, torch.device("cpu"), True, 11, sizes)
    assert captured == eager
    assert len(set(widths["static"])) == 1 and len(set(widths["eager"])) > 3
    assert widths["static"][0] > max(widths["eager"])  # the graph's width, wider than any batch


def test_padding_rows_write_nothing_cpu(checkpoint):
    """Three requests at captured size 8: five padding rows per step. Every page
    no request holds keeps its poison, rows past a request's tokens too."""
    loaded = load_model(checkpoint)
    pool = _poisoned_pool(loaded, 16, 4, "cpu")
    graphs = DecodeGraphs(loaded.model, pool, (8,))
    graphs.capture()
    greedy = SamplingParams()
    tables = [prefill_into_pool(loaded.model, pool, _prompt(n, n), greedy)[0] for n in (3, 4, 9)]
    before = pool.tensor.clone()
    locs = [t.append_slot() for t in tables]
    graphs.stage(0, tables, [t.seq_len - 1 for t in tables], locs, [t.seq_len for t in tables])
    out = graphs.replay(0, [5, 6, 7], 8)
    assert out.logits.shape == (3, VOCAB_SIZE) and torch.isfinite(out.logits).all()
    changed = (pool.tensor.view(torch.int32) != before.view(torch.int32)).any(-1).any(-1)
    rows = changed.nonzero()[:, 2].unique().tolist()  # [L, 2, R] -> the rows written
    assert sorted(rows) == sorted(locs)


@requires_gpu
def test_graph_replay_equals_eager_greedy_64_requests_gpu(checkpoint):
    loaded = load_model(checkpoint, dtype=torch.float32, device="cuda")
    sizes = default_ladder(64)
    eager, _ = _scenario(loaded, torch.device("cuda"), False, 64, sizes)
    captured, planned = _scenario(loaded, torch.device("cuda"), True, 64, sizes)
    assert captured == eager and planned > 5
    assert _scenario(loaded, torch.device("cuda"), True, 64, sizes, overlap=False)[0] == eager
    assert len(eager) >= 60


@requires_gpu
def test_graph_padding_rows_write_nothing_gpu(checkpoint):
    loaded = load_model(checkpoint, dtype=torch.bfloat16, device="cuda")
    pool = _poisoned_pool(loaded, 16, 4, "cuda")
    graphs = DecodeGraphs(loaded.model, pool, (8,))
    graphs.capture()
    assert (pool.tensor.view(torch.int32) == POISON).all()  # capture wrote nothing either
    greedy = SamplingParams()
    tables = [prefill_into_pool(loaded.model, pool, _prompt(n, n), greedy)[0] for n in (3, 4, 9)]
    before = pool.tensor.clone()
    locs = [t.append_slot() for t in tables]
    graphs.stage(0, tables, [t.seq_len - 1 for t in tables], locs, [t.seq_len for t in tables])
    out = graphs.replay(0, [5, 6, 7], 8)
    assert torch.isfinite(out.logits).all()
    changed = (pool.tensor.view(torch.int16) != before.view(torch.int16)).any(-1).any(-1)
    assert sorted(changed.nonzero()[:, 2].unique().tolist()) == sorted(locs)


def _mixed_sampling(i: int) -> SamplingParams:
    """Greedy, penalised, biased, min-p and sampled requests side by side, some with logprobs."""
    kinds = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.4),
        SamplingParams(temperature=0.9, top_k=40, min_p=0.05, seed=i),
        SamplingParams(logit_bias=((5, 4.0), (9, -3.0)), min_tokens=3, stop_token_ids=(5,), logprobs=3),
        SamplingParams(temperature=1.1, top_p=0.8, seed=100 + i, repetition_penalty=1.2, logprobs=0),
    ]
    return kinds[i % len(kinds)]


def test_full_step_static_buffers_equal_eager_with_processors(checkpoints):
    """The full step (processors, draw, counts on the device) over the static buffers
    equals the eager engine's, requests coming, going and cancelled mid-run."""
    loaded = load_model(checkpoints["llama"])
    eager_lp, static_lp = {}, {}
    eager, _ = _scenario(loaded, torch.device("cpu"), False, 10, (4, 8), sampling=_mixed_sampling,
                         logprobs=eager_lp)
    static, _ = _scenario(loaded, torch.device("cpu"), True, 10, (4, 8), sampling=_mixed_sampling,
                          logprobs=static_lp)
    assert static == eager and len(eager) >= 8  # one is cancelled before its first step
    _same_logprobs(static_lp, eager_lp)


def _same_logprobs(got: dict[str, list], want: dict[str, list], tol: float = 1e-5) -> None:
    """Each request's token logprobs and top tokens, equal within ``tol``."""
    assert got.keys() == want.keys() and got, "no request reported logprobs"
    for rid, entries in want.items():
        assert len(got[rid]) == len(entries), rid
        for g, w in zip(got[rid], entries):
            assert abs(g.logprob - w.logprob) <= tol, rid
            assert [t for t, _ in g.top] == [t for t, _ in w.top], rid
            assert all(abs(a - b) <= tol for (_, a), (_, b) in zip(g.top, w.top)), rid


@requires_gpu
def test_graph_replay_equals_eager_with_penalties_bias_min_p_gpu(checkpoint):
    """Captured full steps (processors, the draw from staged uniforms, logprobs and the
    device-side counts) equal the eager engine token for token, overlapped or not."""
    loaded = load_model(checkpoint, dtype=torch.float32, device="cuda")
    eager_lp = {}
    eager, _ = _scenario(loaded, torch.device("cuda"), False, 24, (1, 2, 4, 8, 16, 32), sampling=_mixed_sampling,
                         logprobs=eager_lp)
    for overlap in (True, False):
        graphs_lp = {}
        graphs, _ = _scenario(loaded, torch.device("cuda"), True, 24, (1, 2, 4, 8, 16, 32), overlap=overlap,
                              sampling=_mixed_sampling, logprobs=graphs_lp)
        assert graphs == eager
        _same_logprobs(graphs_lp, eager_lp, tol=1e-4)
