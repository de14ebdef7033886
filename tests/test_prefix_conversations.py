"""Multi-turn conversations through both prefix caches, as a chat client sends them
(each turn's prompt is the last prompt, the reply and a new user turn): greedy
tokens equal transformers on every turn; the decode side hits past the last
prompt into the reply pages it generated, so only the pages after them move;
the prefill side skips the last prompt's whole pages and ``cached_tokens`` says
exactly that; a prompt all in the decode cache (whole pages of an earlier prompt
and its reply) moves nothing and asks no prefill daemon; hits of 0 pages, 1
page, many pages and a strict prefix of a cached prompt; conversations at once
sharing a system prompt. Page sizes 1, 5 and 16, cp 1-3, gRPC and the fast path
(with ``tests/test_prefix_cache_e2e.py``: cp 2 and 3 at page size 5)."""

from __future__ import annotations

import threading

import grpc
import pytest
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2_grpc

from tests.checkpoints import write_llama
from tests.daemons import running_pair
from tests.markers import GPU_CASE
from tests.prefix_checks import generate, load_hf, page_bytes, random_ids, reference, settled

MAX_NEW = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("conversation-llama"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


@pytest.fixture(scope="module", params=[
    pytest.param((1, 1, "grpc", "cpu"), id="cp1-ps1-grpc"),
    pytest.param((2, 16, "auto", "cpu"), id="cp2-ps16-fastpath"),
    pytest.param((3, 5, "auto", "cpu"), id="cp3-ps5-fastpath"),
    # CUDA: the fast path is CUDA IPC, the decode step runs captured graphs with the overlap.
    pytest.param((1, 16, "auto", "cuda"), id="cuda-cp1-ps16-fastpath", marks=GPU_CASE),
    pytest.param((1, 5, "grpc", "cuda"), id="cuda-cp1-ps5-grpc", marks=GPU_CASE),
])
def pair(request, checkpoint):
    cp, ps, transport, device = request.param
    engine = EngineConfig(str(checkpoint), cp_size=cp, page_size=ps, pages_per_lane=max(40, 400 // (cp * ps)),
                          device=device, start_timeout_s=300)
    with running_pair(engine, pool_pages=max(60, 600 // ps), transport=transport, device=device) as daemons:
        yield daemons, "grpc" if transport == "grpc" else "shm" if device == "cpu" else "cuda_ipc"


def _whole(n: int, ps: int) -> int:
    return n // ps


def _pages(n: int, ps: int) -> int:
    return -(-n // ps)


def _check(decode, got, ids: list[int], want: list[int], held: int, cached: int, what: str) -> None:
    """``held``: pages the decode cache serves (nothing moves when they are the whole
    prompt); ``cached``: prompt tokens whose compute the caches skip."""
    ps = decode.config.page_size
    assert got.tokens == want, what
    assert got.cached_tokens == cached, what
    assert got.moved_bytes == (_pages(len(ids), ps) - held) * page_bytes(decode), what
    assert got.held_tokens == _whole(len(ids), ps) * ps, what  # every whole page is cached once it is in


def _shared(ids: list[int], cached: list[int], ps: int) -> tuple[int, int]:
    """(held, cached) for ``ids`` when both caches hold the whole pages of ``cached`` only:
    a prompt all of whose pages are cached is served by the decode side alone (the first
    token from its own step: every token but the last counts as skipped); otherwise the
    page of the last token is prefilled again."""
    common = 0
    while common < min(len(ids), len(cached)) and ids[common] == cached[common]:
        common += 1
    pages = _whole(common, ps)
    if pages * ps == len(ids):
        return pages, len(ids) - 1
    held = min(pages, (len(ids) - 1) // ps)
    return held, held * ps


@pytest.mark.timeout(120)
def test_a_conversation_hits_the_reply_pages_and_matches_transformers(pair, hf):
    (prefill, decode), transport = pair
    ps = decode.config.page_size
    usable = lambda n: (n - 1) // ps  # noqa: E731 - the page of the last token is always prefilled
    system = random_ids(3 * ps - 2 if ps > 1 else 9, 100 + ps)  # the first reply crosses a page boundary
    prompt, known = system, 0  # known: tokens whose K/V the decode cache holds (prompt + reply but its last)
    with grpc.insecure_channel(decode.endpoint) as channel:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
        last_prompt: list[int] = []
        for turn in range(3):
            want = reference(hf, prompt, MAX_NEW)
            got = generate(stub, prompt, MAX_NEW)
            held = min(_whole(known, ps), usable(len(prompt)))
            cached = min(_whole(len(last_prompt), ps), usable(len(prompt))) * ps  # the prefill side's pages
            _check(decode, got, prompt, want, held, cached, f"turn {turn}")
            if turn == 1:
                assert held * ps > len(last_prompt), "the hit reaches into the last reply"
                assert held * ps > cached  # more than the prefill side holds: fewer pages move
            if got.moved_bytes:
                assert {p.split(":")[1] for p in got.paths.split(",")} == {transport}, got.paths
            known = len(prompt) + len(want) - 1
            last_prompt, reply = prompt, want
            prompt = prompt + reply + random_ids(3, 200 + turn)
        # The last prompt and its reply, cut to whole pages: all in the decode cache. Nothing
        # moves, no prefill daemon is asked, and the decode step samples the first token.
        whole = last_prompt + reply[:-1]
        whole = whole[: _whole(len(whole), ps) * ps]
        lookups = prefill.cache.stats.lookups
        got = generate(stub, whole, MAX_NEW)
        assert got.tokens == reference(hf, whole, MAX_NEW)
        assert got.moved_bytes == 0 and got.cached_tokens == len(whole) - 1 and got.held_tokens == len(whole)
        assert prefill.cache.stats.lookups == lookups
    settled(prefill, decode)


@pytest.mark.timeout(120)
def test_hits_of_no_page_one_page_many_pages_and_a_strict_prefix(pair, hf):
    (prefill, decode), _ = pair
    ps = decode.config.page_size
    base = random_ids(4 * ps + 3, 300 + ps)
    with grpc.insecure_channel(decode.endpoint) as channel:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
        generate(stub, base, 1)  # cached on both sides: its whole pages (one token: no reply page)
        one = base[:ps] + random_ids(ps + 2, 301)
        strict = base[: 2 * ps + 1]
        many = base + random_ids(2, 302)
        cases = [  # (prompt, pages the decode cache serves, what)
            (random_ids(2 * ps + 1, 303), 0, "no shared page"),
            (one, 1, "one page"),
            (strict, 3 if ps == 1 else 2, "a strict prefix of a cached prompt"),  # page size 1: all cached
            (base[: 2 * ps], 2, "a strict prefix of whole pages"),
            (many, _whole(len(base), ps), "many pages"),
        ]
        for ids, pages, what in cases:
            held, cached = _shared(ids, base, ps)
            assert held == pages, what
            _check(decode, generate(stub, ids, MAX_NEW), ids, reference(hf, ids, MAX_NEW), held, cached, what)
    settled(prefill, decode)


@pytest.mark.timeout(120)
def test_conversations_at_once_share_the_system_prompt(pair, hf):
    (prefill, decode), _ = pair
    ps = decode.config.page_size
    system = random_ids(3 * ps, 400 + ps)
    prompts = [system + random_ids(2 + i, 410 + i) for i in range(4)]
    out: list = [None] * len(prompts)
    with grpc.insecure_channel(decode.endpoint) as channel:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
        generate(stub, system + [7], 1)  # the system prompt's pages, cached on both sides

        def run(i: int) -> None:
            out[i] = generate(stub, prompts[i], MAX_NEW)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(100)
    for ids, got in zip(prompts, out):
        assert got is not None
        _check(decode, got, ids, reference(hf, ids, MAX_NEW), 3, 3 * ps, f"prompt of {len(ids)} tokens")
    settled(prefill, decode)
