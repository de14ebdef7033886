"""xPyD through the HTTP front: one decode daemon over two prefill daemons.

The prefill daemons of the load test run as ``lanekv prefill`` processes, each
in a session of its own so that one can be killed with its rank processes at
once; the decode daemon runs in this process, so the test can read its pool.
The official openai client talks to ``lanekv serve`` over the decode daemon.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack

import openai
import pytest
from lanekv.decode.daemon import DecodeDaemon
from lanekv.model.tokenizer import load_tokenizer
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig

from tests.checkpoints import EOS_TOKEN_ID
from tests.lanekv.http.front import (
    AUTH,
    ENV,
    PAGE_SIZE,
    ROOT,
    SECURITY,
    START_TIMEOUT_S,
    TOKEN,
    decode_daemon,
    hf_greedy,
    hf_model,
    openai_client,
    running_front,
    wait_for,
    write_chat_checkpoint,
)

pytestmark = pytest.mark.timeout(360)
LOAD_REQUESTS = 16
MAX_TOKENS = 12
REQUEST_TIMEOUT_S = 120.0  # each client call's; a hung request fails the test, not the suite


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefillProcess:
    """``lanekv prefill`` (cp 1) in a session of its own, on ``port``, with /metrics.
    Started here; ``wait_ready`` waits for its endpoint (several start at once)."""

    def __init__(self, checkpoint, tmp, name: str, port: int = 0) -> None:
        self.ready = ready = tmp / f"{name}-{time.monotonic_ns()}.ready"
        self.metrics_port = _free_port()
        args = [sys.executable, "-m", "lanekv.cli", "prefill", "--model", str(checkpoint), "--cp-size", "1",
                "--page-size", str(PAGE_SIZE), "--pool-pages", "200", "--port", str(port),
                "--transfer-port-base", "0", "--lease-s", "600", "--ready-file", str(ready),
                "--metrics-port", str(self.metrics_port), *AUTH]
        self.log = tmp / f"{name}-{time.monotonic_ns()}.log"
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(args, cwd=ROOT, start_new_session=True, stdout=out,
                                            stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONPATH": str(ROOT), **ENV})

    def wait_ready(self) -> PrefillProcess:
        deadline = time.monotonic() + 2 * START_TIMEOUT_S
        while not self.ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"lanekv prefill did not start (exit {self.process.returncode}): "
                                   f"{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.endpoint = self.ready.read_text()
        return self

    def metric(self, name: str, labels: str) -> float:
        request = urllib.request.Request(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as r:
            text = r.read().decode()
        found = re.search(rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def prefills_served(self) -> float:
        """Prompts it has prefilled (each samples one first token)."""
        return self.metric("lanekv_tokens_total", 'kind="generated"')

    def free_pages(self) -> float:
        return self.metric("lanekv_pool_pages_free", 'rank="0"')

    def kill(self) -> None:
        """SIGKILL to the daemon and its rank processes: no drain, no goodbye."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("xpyd") / "tiny")


@pytest.fixture(scope="module")
def references(checkpoint):
    """Each load request's prompt and transformers' greedy text for it."""
    model, tok = hf_model(checkpoint), load_tokenizer(checkpoint)
    prompts = [" ".join(f"w{3 + (i * 37 + j * 11) % 290}" for j in range(4 + i % 5)) for i in range(LOAD_REQUESTS)]
    return [(p, tok.decode(hf_greedy(model, tok.encode(p), MAX_TOKENS, EOS_TOKEN_ID), skip_special_tokens=True))
            for p in prompts]


def _settled(decode: DecodeDaemon) -> bool:
    s = decode.stats()
    return s.active_requests == 0 and s.reserved_pages == 0 and s.free_pages == s.total_pages


def _complete(client, prompt):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)


def test_one_decode_over_two_prefills_kill_one_under_load(checkpoint, references, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lanekv.decode")
    doomed_port = _free_port()
    with ExitStack() as stack:
        steady = PrefillProcess(checkpoint, tmp_path, "steady")
        stack.callback(steady.stop)
        doomed = PrefillProcess(checkpoint, tmp_path, "doomed", port=doomed_port)
        stack.callback(lambda: doomed.stop())
        steady.wait_ready()  # the two have been starting at once
        doomed.wait_ready()
        steady_free = steady.free_pages()
        # Health is asked only when the test says so (``check``): the killed daemon is
        # found out by the calls sent to it, each of which must then go to the other one.
        # Prefix cache off: the prompts repeat, and a cached prompt would need no prefill
        # daemon at all (routing by prefix is tested in tests/decode/test_prefix_cache.py).
        decode = decode_daemon(checkpoint, [steady.endpoint, doomed.endpoint], pool_pages=600,
                               prefill_health_interval_s=600.0, prefix_cache=False)
        stack.callback(decode.stop, grace_s=1.0)
        lost = decode.prefills.targets[1]
        url = stack.enter_context(running_front(checkpoint, [decode.endpoint], tmp_path, *AUTH, env=ENV))
        client = openai_client(url, timeout=REQUEST_TIMEOUT_S)

        # Both prefill daemons take prompts (idle ones take turns), and the text is transformers'.
        for prompt, text in references[:4]:
            assert _complete(client, prompt).choices[0].text == text
        assert steady.prefills_served() >= 1 and doomed.prefills_served() >= 1

        results: dict[int, object] = {}

        def one(i):
            try:
                results[i] = _complete(client, references[i][0])
            except openai.APIError as err:
                results[i] = err

        threads = [threading.Thread(target=one, args=(i,)) for i in range(LOAD_REQUESTS)]
        for t in threads:
            t.start()
        wait_for(lambda: decode.stats().active_requests >= 4, 30, "requests in flight")
        doomed.kill()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S + 10)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert len(results) == LOAD_REQUESTS
        for i, result in results.items():
            if isinstance(result, openai.APIError):  # failed clearly: a status and one line
                assert result.message and "\n" not in result.message and "Traceback" not in result.message
            else:
                assert result.choices[0].text == references[i][1]
        # A prefill that failed before any token was sent went to the other daemon: only a
        # request already decoding when its daemon died may fail, and none did here
        # (the KV was ours by then).
        assert all(not isinstance(r, openai.APIError) for r in results.values()), results
        # Then every request succeeds: one sent to the dead daemon since is retried on the
        # steady one, and the dead one leaves the pick.
        for prompt, text in references[4:8]:
            assert _complete(client, prompt).choices[0].text == text
        retried = [r.getMessage() for r in caplog.records if "retrying on another prefill daemon" in r.getMessage()]
        assert retried and all(doomed.endpoint in m for m in retried), retried
        assert not lost.healthy and lost.retried == len(retried)
        assert "UNAVAILABLE" in lost.problem

        # No pages leak: the decode pool is whole again, the surviving prefill holds none.
        wait_for(lambda: _settled(decode), 20, "the decode pool whole again")
        wait_for(lambda: steady.free_pages() == steady_free, 20, "the surviving prefill daemon's pages back")

        # The daemon restarted on its port (its rank on a new one) joins again once its
        # health says SERVING and a new handshake passes; its prompts' KV comes from its new rank.
        doomed = PrefillProcess(checkpoint, tmp_path, "restarted", port=doomed_port).wait_ready()
        restarted_free = doomed.free_pages()

        def rejoined():
            decode.prefills.check(lost)
            return lost.healthy

        wait_for(rejoined, 30, "the restarted prefill daemon back in the pick", interval_s=0.2)
        assert lost.topology.endpoints != () and lost.problem == ""
        for prompt, text in references[8:12]:
            assert _complete(client, prompt).choices[0].text == text
        assert doomed.prefills_served() >= 1
        wait_for(lambda: _settled(decode), 20, "the decode pool whole again")
        wait_for(lambda: doomed.free_pages() == restarted_free and steady.free_pages() == steady_free, 20,
                 "both prefill daemons' pages back")


def test_mismatched_prefill_refused_with_fields_named(checkpoint, tmp_path, caplog):
    good_engine = EngineConfig(str(checkpoint), cp_size=1, page_size=PAGE_SIZE, pages_per_lane=100,
                               start_timeout_s=120)
    other_engine = EngineConfig(str(checkpoint), cp_size=1, page_size=2 * PAGE_SIZE, pages_per_lane=100,
                                start_timeout_s=120)
    with ExitStack() as stack:
        other = PrefillDaemon(other_engine, DaemonConfig(lease_s=600, security=SECURITY))
        stack.callback(other.stop)
        good = PrefillDaemon(good_engine, DaemonConfig(lease_s=600, security=SECURITY))
        stack.callback(good.stop)
        with caplog.at_level(logging.ERROR, logger="lanekv.decode"):
            decode = decode_daemon(checkpoint, [other.endpoint, good.endpoint], pool_pages=600)
        stack.callback(decode.stop, grace_s=1.0)
        refused = [r.getMessage() for r in caplog.records if other.endpoint in r.getMessage()]
        # One line per differing field, each naming the daemon.
        assert refused == [f"prefill daemon {other.endpoint} refused, its layout contract differs: "
                           f"page_size: decode={PAGE_SIZE} prefill={2 * PAGE_SIZE}"], caplog.text
        assert [t.endpoint for t in decode.prefills.targets] == [good.endpoint]
        url = stack.enter_context(running_front(checkpoint, [decode.endpoint], tmp_path, *AUTH, env=ENV))
        reply = openai_client(url).completions.create(model="tiny", prompt="w5 w6", max_tokens=3)
        assert reply.usage.completion_tokens == 3

        # None accepts (one refuses, one is not there): ``lanekv decode`` exits 1, naming the field.
        result = subprocess.run(
            [sys.executable, "-m", "lanekv.cli", "decode", "--model", str(checkpoint), "--prefill", other.endpoint,
             "--prefill", f"127.0.0.1:{_free_port()}", "--page-size", str(PAGE_SIZE), "--device", "cpu",
             "--connect-timeout-s", "2", "--ready-file", str(tmp_path / "never.ready"), *AUTH],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **ENV}, capture_output=True, text=True,
            timeout=150)
        assert result.returncode == 1, result.stderr
        assert "disagree on the layout contract; nothing was served" in result.stderr
        assert f"\npage_size: decode={PAGE_SIZE} prefill={2 * PAGE_SIZE}" in result.stderr
        assert "Traceback" not in result.stderr and not (tmp_path / "never.ready").exists()
