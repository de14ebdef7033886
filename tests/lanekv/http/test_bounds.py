"""The front's refusals that must stay 4xx and cheap, whatever a client sends: deep JSON,
reserved template variables, lone surrogates, huge bodies and prompts (refused before any
tokenizing, without stalling ``/health``), the bound's own field name, and connections that
send their headers slowly or not at all.

The front runs as ``lanekv serve`` over a daemon address nobody listens on: every case
here is refused before a decode daemon would be asked.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest

from tests.lanekv.http.front import running_front, write_chat_checkpoint

pytestmark = pytest.mark.timeout(120)
HEADER_TIMEOUT_S = 1.0
MAX_BODY_BYTES = 6_000_000
MAX_POSITIONS = 1024  # tests.checkpoints' llama
CHAT = [{"role": "user", "content": "w5 w6"}]


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounds")
    model = write_chat_checkpoint(tmp / "tiny")
    with running_front(model, ["127.0.0.1:1"], tmp, "--header-timeout-s", str(HEADER_TIMEOUT_S),
                       "--max-body-bytes", str(MAX_BODY_BYTES)) as url:
        yield url


def _post(url: str, path: str, body: bytes | str, timeout: float = 60.0) -> tuple[int, dict]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _refused(url: str, path: str, body: bytes | str, status: int = 400) -> dict:
    got, reply = _post(url, path, body)
    assert got == status, reply
    error = reply["error"]
    assert error["message"].startswith(error["param"]), error
    return error


def test_deep_json_is_a_400_on_the_body(front):
    for depth in (100_000, 3_000):
        error = _refused(front, "/v1/completions", "[" * depth + "]" * depth)
        assert error["param"] == "body"
    deep = {"model": "tiny", "prompt": "w5", "stop": json.loads("[" * 500 + "]" * 500)}
    assert _refused(front, "/v1/completions", json.dumps(deep))["param"] == "stop"


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "tools"])
def test_template_kwargs_may_not_set_the_requests_own_variables(front, name):
    body = {"model": "tiny", "messages": CHAT, "chat_template_kwargs": {name: True}}
    error = _refused(front, "/v1/chat/completions", json.dumps(body))
    assert error["param"] == f"chat_template_kwargs.{name}"


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", '"prompt": "w5 \\ud800"', "prompt"),
    ("/v1/completions", '"prompt": "w5", "stop": ["a", "\\udc00b"]', "stop"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "\\ud800"}]', "messages[0].content"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\ud800"}]}]',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "w5"}], '
     '"chat_template_kwargs": {"bos_token": "\\ud800"}', "messages"),
])
def test_lone_surrogates_are_a_400_naming_the_field(front, path, fields, param):
    error = _refused(front, path, '{"model": "tiny", ' + fields + "}")
    assert error["param"] == param
    assert "surrogate" in error["message"] or "Unicode" in error["message"]


def test_too_many_tokens_names_the_field_the_client_sent(front):
    for path, extra in (("/v1/completions", {"prompt": "w5"}), ("/v1/chat/completions", {"messages": CHAT})):
        for field in ("max_tokens", "max_completion_tokens"):
            body = {"model": "tiny", field: MAX_POSITIONS + 5, **extra}
            assert _refused(front, path, json.dumps(body))["param"] == field


def test_huge_prompts_are_refused_untokenized_while_health_answers(front):
    """A 4 MB prompt takes the tiny tokenizer about 3 s: refused by its length instead, off the
    event loop, while another client's /health answers in well under a second."""
    prompt = "w17 " * 1_000_000
    results, latencies = [], []

    def big(path, body):
        results.append((path, *_post(front, path, json.dumps(body))))

    senders = [threading.Thread(target=big, args=("/v1/completions", {"model": "tiny", "prompt": prompt})),
               threading.Thread(target=big, args=("/v1/chat/completions", {
                   "model": "tiny", "messages": [{"role": "user", "content": prompt}]}))]
    for t in senders:
        t.start()
    while any(t.is_alive() for t in senders):
        started = time.monotonic()
        status, _ = _post_get(front, "/health")
        latencies.append(time.monotonic() - started)
        assert status == 503  # no decode daemon is up; it answers all the same
        time.sleep(0.02)
    for t in senders:
        t.join(60)
    assert sorted((p, s, r["error"]["param"]) for p, s, r in results) == [
        ("/v1/chat/completions", 400, "messages"), ("/v1/completions", 400, "prompt")]
    assert all("characters is more than this server tokenizes" in r["error"]["message"] for *_, r in results)
    assert latencies and max(latencies) < 1.0, latencies


def test_bodies_over_the_bound_are_413(front):
    error = _refused(front, "/v1/completions", b'{"prompt": "' + b"w" * MAX_BODY_BYTES + b'"}', status=413)
    assert error["param"] == "body"
    # Declared too large: refused from the headers, before the body is read.
    with _socket(front) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{" % (MAX_BODY_BYTES + 1))
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")


def test_slow_headers_and_idle_connections_are_closed(front):
    # Slow loris: a header line every 0.2 s, never finishing.
    with _socket(front) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        closed_after = None
        for i in range(50):
            try:
                sock.sendall(b"X-Slow-%d: 1\r\n" % i)
            except OSError:
                closed_after = time.monotonic() - started
                break
            sock.settimeout(0.2)
            try:
                closed = sock.recv(4096) == b""
            except TimeoutError:
                closed = False
            except ConnectionResetError:  # closed with our last header bytes unread: a reset
                closed = True
            if closed:
                closed_after = time.monotonic() - started
                break
        assert closed_after is not None and closed_after < HEADER_TIMEOUT_S + 1.0, closed_after
    # Opened and silent; and idle after an answered request (kept alive, then silent).
    for first in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"):
        with _socket(front) as sock:
            sock.sendall(first)
            started = time.monotonic()
            sock.settimeout(HEADER_TIMEOUT_S + 2.0)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            assert time.monotonic() - started < HEADER_TIMEOUT_S + 1.0
            assert data.startswith(b"HTTP/1.1 503") == bool(first)


def _socket(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def _post_get(url: str, path: str) -> tuple[int, dict]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()
