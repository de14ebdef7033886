"""The decode engine against transformers, continuous batching, cancel, page pressure.

float32 tiny random-weight checkpoints, so greedy tokens must match token for token.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from lanekv.decode.colocated import generate_colocated, prefill_into_pool
from lanekv.decode.engine import FINISH_LENGTH, FINISH_STOP, DecodeEngine, TokenEvent
from lanekv.decode.pool import PagePool, PageTable
from lanekv.model.checkpoint import LoadedModel, load_model
from lanekv.model.sampling import SamplingParams

from tests.checkpoints import EOS_TOKEN_ID, VOCAB_SIZE, write_llama, write_mistral, write_qwen2

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decode-ckpt")
    return {"llama": write_llama(root / "llama"), "qwen2": write_qwen2(root / "qwen2"),
            "mistral": write_mistral(root / "mistral")}


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path]) -> dict[str, LoadedModel]:
    return {name: load_model(path) for name, path in checkpoints.items()}


def prompt(length: int, seed: int) -> list[int]:
    # Ids from 3 up: no prompt token is BOS/EOS.
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=gen).tolist()


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:  # one at a time: no padding in the reference
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=EOS_TOKEN_ID)
            outs.append(out[0, len(ids):].tolist())
    return outs


def make_pool(loaded: LoadedModel, num_pages: int, page_size: int) -> PagePool:
    return PagePool.for_model(loaded.config, num_pages, page_size, torch.float32)


def run_alone(loaded: LoadedModel, ids: list[int], sampling: SamplingParams,
              max_new_tokens: int, page_size: int = 4) -> list[int]:
    pool = make_pool(loaded, 64, page_size)
    return generate_colocated(loaded.model, pool, [ids], sampling, max_new_tokens)[0]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_batch_matches_transformers(checkpoints, models, page_size: int) -> None:
    loaded = models["llama"]
    prompts = [prompt(1, 1), prompt(23, 2), prompt(100, 3)]
    pool = make_pool(loaded, num_pages=-(-160 // page_size) + 3, page_size=page_size)
    ours = generate_colocated(loaded.model, pool, prompts, GREEDY, max_new_tokens=12)
    assert ours == hf_greedy(checkpoints["llama"], prompts, 12)
    assert pool.free_count == pool.num_pages


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_greedy_matches_transformers_other_architectures(checkpoints, models, name) -> None:
    loaded = models[name]
    prompts = [prompt(5, 4), prompt(40, 5), prompt(17, 6)]
    pool = make_pool(loaded, num_pages=40, page_size=4)
    ours = generate_colocated(loaded.model, pool, prompts, GREEDY, max_new_tokens=9)
    assert ours == hf_greedy(checkpoints[name], prompts, 9)
    assert pool.free_count == pool.num_pages


def drive(engine: DecodeEngine, adds: dict[int, list[tuple]], max_steps: int = 200
          ) -> dict[str, list[TokenEvent]]:
    """Step the engine, adding ``adds[step]`` (add() argument tuples) before that step."""
    events: dict[str, list[TokenEvent]] = {}
    for step in range(max_steps):
        for args in adds.get(step, []):
            engine.add(*args)
        if step > max(adds) and not engine.has_work:
            return events
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def test_requests_added_at_different_steps_match_running_alone(models) -> None:
    loaded = models["llama"]
    specs = {  # id: (prompt, sampling, max_new_tokens, step added)
        "a": (prompt(30, 7), GREEDY, 14, 0),
        "b": (prompt(3, 8), SamplingParams(temperature=0.9, top_k=50, seed=11), 10, 2),
        "c": (prompt(61, 9), SamplingParams(temperature=0.7, top_p=0.9, seed=12), 8, 5),
        "d": (prompt(9, 10), GREEDY, 6, 5),
    }
    pool = make_pool(loaded, num_pages=64, page_size=4)
    engine = DecodeEngine(loaded.model, pool)
    adds: dict[int, list[tuple]] = {}
    firsts = {}
    for rid, (ids, sp, max_new, at) in specs.items():
        table, first = prefill_into_pool(loaded.model, pool, ids, sp)
        firsts[rid] = first
        adds.setdefault(at, []).append((rid, table, first, sp, max_new))
    events = drive(engine, adds)
    for rid, (ids, sp, max_new, _) in specs.items():
        got = [firsts[rid]] + [e.token_id for e in events[rid]]
        assert got == run_alone(loaded, ids, sp, max_new), rid
        assert [e.step for e in events[rid]] == list(range(1, len(got)))
        assert [e.finished for e in events[rid]] == [False] * (len(got) - 2) + [True]
    assert pool.free_count == pool.num_pages


def test_cancel_and_finish_free_every_page(models) -> None:
    loaded = models["llama"]
    pool = make_pool(loaded, num_pages=40, page_size=4)
    engine = DecodeEngine(loaded.model, pool, max_batch_size=2)
    for rid, length in (("r0", 10), ("r1", 7), ("r2", 5)):
        table, first = prefill_into_pool(loaded.model, pool, prompt(length, 20), GREEDY)
        engine.add(rid, table, first, GREEDY, max_new_tokens=30, ignore_eos=True)
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (2, 1)  # max_batch_size
    told = []
    assert engine.cancel("r2", on_freed=lambda: told.append("r2")) and engine.cancel("r0")  # one waiting, one running
    assert told == ["r2"]  # nothing in flight: freed, and told, at once
    assert not engine.cancel("r0") and not engine.cancel("nope", on_freed=lambda: told.append("nope"))
    assert told == ["r2"]
    duplicate = PageTable.allocate(pool, 1)
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add("r1", duplicate, 5, GREEDY, 4)
    duplicate.release()  # a refused add leaves the table with the caller
    events = []
    while engine.has_work:
        events += engine.step()
    assert {e.request_id for e in events} == {"r1"}
    assert events[-1].finished and events[-1].finish_reason == FINISH_LENGTH
    assert len(events) == 30 - 2  # one step ran before cancel, prefill's token is step 0
    assert pool.free_count == pool.num_pages


def test_pool_too_small_for_two_makes_the_second_wait(models) -> None:
    loaded = models["llama"]
    ids_a, ids_b = prompt(8, 30), prompt(6, 31)
    max_new = 17  # a ends at 8 + 16 = 24 tokens = 6 pages; b at 22 = 6 pages
    alone = [run_alone(loaded, ids, GREEDY, max_new) for ids in (ids_a, ids_b)]
    pool = make_pool(loaded, num_pages=8, page_size=4)  # both prompts fit, not both runs
    engine = DecodeEngine(loaded.model, pool)
    tables = [prefill_into_pool(loaded.model, pool, ids, GREEDY) for ids in (ids_a, ids_b)]
    for rid, (table, first) in zip("ab", tables):
        engine.add(rid, table, first, GREEDY, max_new)
    out = {"a": [tables[0].first_token], "b": [tables[1].first_token]}
    waited = 0
    for _ in range(100):
        if not engine.has_work:
            break
        events = engine.step()
        assert events
        waited += engine.num_waiting
        for event in events:
            out[event.request_id].append(event.token_id)
    assert waited >= max_new - 2  # b waited while a ran
    assert [out["a"], out["b"]] == alone
    assert pool.free_count == 8
    # A pool that can never fit the request: generate_colocated says so instead of looping.
    tiny = make_pool(loaded, num_pages=3, page_size=4)
    with pytest.raises(RuntimeError, match="no progress"):
        generate_colocated(loaded.model, tiny, [ids_a], GREEDY, max_new, ignore_eos=True)
    assert tiny.free_count == 3


def test_pages_taken_outside_the_engine_stall_but_never_corrupt(models) -> None:
    loaded = models["llama"]
    ids = prompt(4, 40)
    expected = run_alone(loaded, ids, GREEDY, 10)
    pool = make_pool(loaded, num_pages=6, page_size=4)
    engine = DecodeEngine(loaded.model, pool)
    table, first = prefill_into_pool(loaded.model, pool, ids, GREEDY)
    engine.add("r", table, first, GREEDY, 10)
    out, stolen, stalls = [first], [], 0
    for _ in range(40):
        if not engine.has_work:
            break
        if len(out) == 5 and not stalls:
            # Position 8 opens a new page: another allocator empties the pool first.
            stolen = pool.allocate(pool.free_count)
        events = engine.step()
        if stolen:
            assert events == []
            stalls += 1
            pool.free(stolen)
            stolen = []
        out += [e.token_id for e in events]
    assert stalls == 1
    assert out == expected and pool.free_count == 6


def test_finish_on_stop_token_and_at_add(models) -> None:
    loaded = models["llama"]
    ids = prompt(12, 50)
    full = run_alone(loaded, ids, GREEDY, 8)
    stop = full[3]
    assert stop not in full[:3]
    pool = make_pool(loaded, num_pages=16, page_size=4)
    got = generate_colocated(loaded.model, pool, [ids], GREEDY, 8, stop_token_ids=[stop])
    assert got == [full[:4]]
    engine = DecodeEngine(loaded.model, pool)
    for rid, max_new, stops in (("one", 1, ()), ("stop", 5, (full[0],))):
        table, first = prefill_into_pool(loaded.model, pool, ids, GREEDY)
        engine.add(rid, table, first, GREEDY, max_new, stop_token_ids=stops)
    assert pool.free_count == 16  # nothing to decode: freed at add
    assert engine.step() == [TokenEvent("one", None, 0, True, FINISH_LENGTH),
                             TokenEvent("stop", None, 0, True, FINISH_STOP)]
    assert not engine.has_work


def test_add_checks_its_input(models) -> None:
    loaded = models["llama"]
    pool = make_pool(loaded, num_pages=8, page_size=4)
    engine = DecodeEngine(loaded.model, pool)
    table = PageTable.allocate(pool, 3)
    other = PageTable.allocate(make_pool(loaded, 4, 4), 3)
    for kwargs, match in (({"request_id": ""}, "request_id"),
                          ({"page_table": other}, "this engine's pool"),
                          ({"page_table": PageTable(pool)}, "seq_len=0"),
                          ({"last_token": VOCAB_SIZE}, "last_token"),
                          ({"max_new_tokens": 0}, "max_new_tokens")):
        args = {"request_id": "x", "page_table": table, "last_token": 5,
                "sampling": GREEDY, "max_new_tokens": 4, **kwargs}
        with pytest.raises(ValueError, match=match):
            engine.add(**args)
    with pytest.raises(ValueError, match="dtype"):
        DecodeEngine(loaded.model, PagePool.for_model(loaded.config, 4, 4, torch.float16))
    assert not engine.has_work and pool.free_count == 7


def test_add_and_cancel_from_threads_while_the_loop_steps(models) -> None:
    loaded = models["llama"]
    pool = make_pool(loaded, num_pages=48, page_size=4)
    engine = DecodeEngine(loaded.model, pool)
    specs = {f"t{i}": prompt(3 + 9 * i, 60 + i) for i in range(4)}
    expected = {rid: run_alone(loaded, ids, GREEDY, 9) for rid, ids in specs.items()}
    prefilled = {rid: prefill_into_pool(loaded.model, pool, ids, GREEDY)
                 for rid, ids in specs.items()}
    out = {rid: [p.first_token] for rid, p in prefilled.items()}
    out["victim"] = [7]
    stop = threading.Event()
    errors: list[Exception] = []

    def loop() -> None:
        deadline = time.monotonic() + 60
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                if engine.wait_for_work(timeout=0.05):
                    for event in engine.step():
                        out[event.request_id].append(event.token_id)
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        for rid, (table, first) in prefilled.items():
            engine.add(rid, table, first, GREEDY, 9)
            time.sleep(0.01)
        engine.add("victim", PageTable.allocate(pool, 5), 7, GREEDY, 50, ignore_eos=True)
        while len(out["victim"]) < 3 and not errors and thread.is_alive():
            time.sleep(0.005)
        assert not errors, errors
        # When step() held the engine lock through the model run, this cancel could
        # wait until the victim had run to its end (and find it gone).
        assert engine.cancel("victim"), f"victim unknown after tokens {out['victim']}"
        deadline = time.monotonic() + 30
        while engine.has_work and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive() and not errors
    assert not engine.has_work
    assert 3 <= len(out["victim"]) < 50  # it ran, and stopped when cancelled
    assert {rid: out[rid] for rid in specs} == expected
    assert pool.free_count == 48


def test_through_interpreted_triton_kernels(models, monkeypatch) -> None:
    loaded = models["llama"]
    ids = prompt(6, 70)
    expected = run_alone(loaded, ids, GREEDY, 4)
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    pool = make_pool(loaded, num_pages=8, page_size=4)
    assert generate_colocated(loaded.model, pool, [ids], GREEDY, 4) == [expected]


def test_cancel_during_a_step_returns_at_once_and_frees_pages_after_it(models) -> None:
    """cancel does not wait for the model run in flight; the cancelled request gets no event
    from that step and its pages are freed once the step has written its last token."""
    loaded = models["llama"]
    pool = make_pool(loaded, num_pages=24, page_size=4)
    engine = DecodeEngine(loaded.model, pool)
    for rid, ids in (("keep", prompt(5, 71)), ("victim", prompt(7, 72))):
        table, first = prefill_into_pool(loaded.model, pool, ids, GREEDY)
        engine.add(rid, table, first, GREEDY, 8)
    run = engine._run
    during: dict = {}

    freed_at: list[int] = []  # the pool's free pages when on_freed ran

    def run_and_cancel(batch):
        free_before = pool.free_count
        canceller = threading.Thread(target=lambda: during.update(cancelled=engine.cancel(
            "victim", on_freed=lambda: freed_at.append(pool.free_count))))
        canceller.start()
        canceller.join(timeout=10)  # returns while the step's model run has not started
        during.update(returned=not canceller.is_alive(), freed_early=pool.free_count != free_before,
                      told_early=bool(freed_at))
        return run(batch)

    engine._run = run_and_cancel
    free_in_step = pool.free_count
    events = engine.step()
    assert during == dict(cancelled=True, returned=True, freed_early=False, told_early=False)
    # on_freed ran once, when the step landed and the victim's pages were back (the
    # daemon gives back the request's page budget then, not before)
    assert len(freed_at) == 1 and freed_at[0] > free_in_step
    assert [e.request_id for e in events] == ["keep"]
    engine._run = run
    assert not engine.cancel("victim")  # gone
    while engine.has_work:
        engine.step()
    assert pool.free_count == 24


def test_a_finished_request_offers_the_rows_its_steps_wrote_and_a_cancelled_one_none(models) -> None:
    """``on_finish`` (the prefix cache's admission of reply pages) gets the prompt and every
    output token but the last, whose row no step wrote, with the request's pages, only when
    it ends by stop or length; pages still held then."""
    loaded = models["llama"]
    pool = make_pool(loaded, 32, 4)
    engine = DecodeEngine(loaded.model, pool, max_batch_size=4)
    offered: list = []
    engine.on_finish = lambda ids, pages: offered.append((list(ids), list(pages), [pool.refs(p) for p in pages]))
    ids = prompt(9, 7)
    res = prefill_into_pool(loaded.model, pool, ids, SamplingParams())
    engine.add("kept", res.page_table, res.first_token, SamplingParams(), 6, cache_ids=ids)
    untracked = prefill_into_pool(loaded.model, pool, ids, SamplingParams())
    engine.add("untracked", untracked.page_table, untracked.first_token, SamplingParams(), 6)
    cancelled = prefill_into_pool(loaded.model, pool, ids, SamplingParams())
    engine.add("cancelled", cancelled.page_table, cancelled.first_token, SamplingParams(), 6, cache_ids=ids)
    out: dict[str, list[int]] = {"kept": [res.first_token]}
    for _ in range(2):
        for event in engine.step():
            out.setdefault(event.request_id, []).append(event.token_id)
    assert engine.cancel("cancelled")
    while engine.has_work:
        for event in engine.step():
            out.setdefault(event.request_id, []).append(event.token_id)
    assert len(out["kept"]) == 6 and len(offered) == 1
    got_ids, pages, refs = offered[0]
    assert got_ids == ids + out["kept"][:-1]  # 14 rows: 9 prompt + 5 fed
    assert len(pages) == 4 and all(r >= 1 for r in refs)  # held while offered
    short = PageTable.allocate(pool, 5)
    with pytest.raises(ValueError, match="cache_ids has 2 ids for seq_len=5"):
        engine.add("short", short, 3, SamplingParams(), 2, cache_ids=[1, 2])
    short.release()  # refused: still the caller's
    assert pool.free_count == pool.num_pages  # every request's pages back
