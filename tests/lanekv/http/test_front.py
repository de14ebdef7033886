"""``lanekv serve`` end to end: the official openai client against the front over real
daemons (two prefill daemons, two decode daemons each over both: xPyD, all behind
one token), held to transformers' greedy output on the same tiny checkpoint.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
from urllib.parse import urlsplit

import grpc
import openai
import pytest
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.model.tokenizer import load_tokenizer
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.runtime.security import SecurityConfig

from tests.checkpoints import EOS_TOKEN_ID
from tests.lanekv.http.front import (
    AUTH,
    ENV,
    PAGE_SIZE,
    SECURITY,
    TOKEN,
    decode_daemon,
    hf_greedy,
    hf_model,
    openai_client,
    running_front,
    wait_for,
    write_chat_checkpoint,
)
from tests.reflection import list_services

pytestmark = pytest.mark.timeout(240)
PROMPT = "w17 w42 w99 w5 w250"
MESSAGES = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w33 w34 w35"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("front") / "tiny")


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoTokenizer

    return hf_model(checkpoint), AutoTokenizer.from_pretrained(checkpoint)


def decode_over(checkpoint, prefills, port: int = 0) -> DecodeDaemon:
    """A decode daemon over every prefill daemon of ``prefills``."""
    return decode_daemon(checkpoint, [p.endpoint for p in prefills], port=port)


def prefills_done(prefill: PrefillDaemon) -> float:
    """Prompts the prefill daemon has prefilled (each samples one first token)."""
    return prefill.metrics.tokens.labels(kind="generated").value


@pytest.fixture(scope="module")
def cluster(checkpoint):
    engine = EngineConfig(str(checkpoint), cp_size=1, page_size=PAGE_SIZE, pages_per_lane=400,
                          start_timeout_s=120)
    prefills, decodes = [], []
    try:
        prefills = [PrefillDaemon(engine, DaemonConfig(lease_s=600, security=SECURITY)) for _ in range(2)]
        decodes = [decode_over(checkpoint, prefills) for _ in range(2)]
        yield prefills, decodes
    finally:
        for d in decodes:
            d.stop(grace_s=1.0)
        for p in prefills:
            p.stop()


@pytest.fixture(scope="module")
def front(checkpoint, cluster, tmp_path_factory):
    _, decodes = cluster
    with running_front(checkpoint, [d.endpoint for d in decodes], tmp_path_factory.mktemp("f"),
                       *AUTH, env=ENV) as url:
        yield url


def _expected(hf, ids, max_tokens):
    model, tok = hf
    out = hf_greedy(model, ids, max_tokens, EOS_TOKEN_ID)
    finish = "stop" if out and out[-1] == EOS_TOKEN_ID else "length"
    return out, tok.decode(out, skip_special_tokens=True), finish


def _settled(decodes):
    """Every decode daemon idle with its whole pool free (nothing leaked)."""
    return all(s.active_requests == 0 and s.reserved_pages == 0 and s.free_pages == s.total_pages
               for s in (d.stats() for d in decodes))


def test_completions_equal_transformers(front, hf, checkpoint, cluster):
    client = openai_client(front)
    prefilled = [prefills_done(p) for p in cluster[0]]
    ids = load_tokenizer(checkpoint).encode(PROMPT)
    out, text, finish = _expected(hf, ids, 12)
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert reply.choices[0].text == text and reply.choices[0].finish_reason == finish
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(out))
    assert reply.usage.total_tokens == len(ids) + len(out)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == text

    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(out)
    assert len({c.id for c in chunks}) == 1
    # The same prompt three times: prefix routing may send the repeats where the first went
    # (its pages are cached there), so at least one prefill ran, and the text was the same.
    assert sum(prefills_done(p) - b for p, b in zip(cluster[0], prefilled)) >= 1
    assert 0 <= by_ids.usage.prompt_tokens_details.cached_tokens < len(ids)


def test_chat_completions_equal_transformers(front, hf):
    client = openai_client(front)
    ids = hf[1].apply_chat_template(MESSAGES, tokenize=True, return_dict=False, add_generation_prompt=True)
    out, text, finish = _expected(hf, ids, 10)
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=10,
                                           temperature=0)
    choice = reply.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, finish)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(out))

    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish and chunks[-1].usage is None


def test_stop_strings_are_not_returned(front, hf, checkpoint):
    client = openai_client(front)
    tok = load_tokenizer(checkpoint)
    ids = tok.encode(PROMPT)
    out, text, _ = _expected(hf, ids, 12)
    stop = text.split()[4]
    at = text.find(stop)
    # The tokens it takes for the text to hold the whole stop string.
    tokens = next(k for k in range(1, len(out) + 1) if len(tok.decode(out[:k])) >= at + len(stop))
    for stream in (False, True):
        call = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "never"])
        if stream:
            chunks = list(client.completions.create(**call, stream=True, stream_options={"include_usage": True}))
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            reply = client.completions.create(**call)
            got, reason, usage = reply.choices[0].text, reply.choices[0].finish_reason, reply.usage
        assert (got, reason) == (text[:at], "stop")
        assert usage.completion_tokens == tokens


def test_stop_token_ids_and_seeded_sampling(front, hf, checkpoint):
    client = openai_client(front)
    out, _, _ = _expected(hf, load_tokenizer(checkpoint).encode(PROMPT), 12)
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"stop_token_ids": [out[2]]})
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 3
    sampled = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0,
                                         top_p=0.9, seed=1234, extra_body={"top_k": 50}).choices[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_bad_requests_name_the_field(front):
    client = openai_client(front)
    cases = [
        (dict(prompt=PROMPT, max_tokens=2000), "max_tokens"),
        (dict(prompt=PROMPT, n=2), "n"),
        (dict(prompt=PROMPT, temperature=-1), "temperature"),
        (dict(prompt=[5, 100000]), "prompt"),
        (dict(prompt=PROMPT, extra_body={"stop_token_ids": [100000]}), "stop_token_ids"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", **kwargs)
        body = err.value.body
        assert body["param"] == param and body["message"].startswith(param), body
        assert body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    assert err.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="other", prompt=PROMPT)
    assert err.value.body["code"] == "model_not_found"
    status, body = _raw(front, "POST", "/v1/completions", b"{not json", TOKEN)
    assert status == 400 and body["error"]["param"] == "body"
    status, body = _raw(front, "GET", "/v1/nothing", None, TOKEN)
    assert status == 404 and "error" in body


def test_models_health_metrics_and_token(front, cluster):
    client = openai_client(front)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.AuthenticationError):
        openai_client(front, api_key="wrong").models.list()
    status, body = _raw(front, "GET", "/v1/models", None, None)
    assert status == 401 and "missing 'Authorization: Bearer <token>'" in body["error"]["message"]
    status, body = _raw(front, "GET", "/health", None, None)  # open to probes
    assert status == 200 and body["status"] == "ok"
    assert all(v["healthy"] for v in body["decode"].values()) and len(body["decode"]) == 2
    assert _raw(front, "GET", "/metrics", None, None)[0] == 401
    status, text = _raw(front, "GET", "/metrics", None, TOKEN, parse=False)
    assert status == 200 and 'lanekv_http_requests_total{route="completions",status="200"}' in text
    for d in cluster[1]:
        assert f'lanekv_http_decode_healthy{{decode="{d.endpoint}"}} 1.0' in text


def test_reflection_on_every_daemon_port(cluster):
    prefills, decodes = cluster
    prefill = prefills[0]
    ranks = prefill.topology.endpoints
    want = {decodes[0].endpoint: {"lanekv.v1.DecodeService", "lanekv.v1.KVTransfer"},
            prefill.endpoint: {"lanekv.v1.PrefillService", "lanekv.v1.KVTransfer"},
            **{rank: {"lanekv.v1.KVTransfer"} for rank in ranks}}
    for endpoint, services in want.items():
        listed = list_services(endpoint, SECURITY)
        assert services | {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} == set(listed)
    with pytest.raises(grpc.RpcError) as err:
        list_services(decodes[0].endpoint, SecurityConfig())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_two_decode_daemons_share_the_load(front, cluster):
    prefills, decodes = cluster
    before = [d.stats().finished for d in decodes]
    prefilled = [prefills_done(p) for p in prefills]
    client, errors, replies = openai_client(front), [], []

    def one(i):
        try:
            replies.append(client.completions.create(model="tiny", prompt=f"w{10 + i} w20", max_tokens=16,
                                                     temperature=0))
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(replies) == 8
    # A daemon counts a request finished once its engine lets it go, which can come just
    # after the client has the last token.
    wait_for(lambda: sum(d.stats().finished for d in decodes) - sum(before) == 8, 10,
             "both decode daemons count the 8 requests finished")
    served = [d.stats().finished - b for d, b in zip(decodes, before)]
    assert sum(served) == 8 and min(served) >= 2, served
    # Each decode daemon sends its prompts to the prefill daemon with fewer queued tokens:
    # both prefill daemons take some.
    prefilled = [prefills_done(p) - b for p, b in zip(prefills, prefilled)]
    assert sum(prefilled) == 8 and min(prefilled) >= 1, prefilled
    wait_for(lambda: _settled(decodes), 10, "decode daemons idle with every page free")


def test_client_disconnect_cancels_generation(front, cluster):
    decodes = cluster[1]
    cancelled = sum(d.stats().cancelled for d in decodes)
    # Streamed: read two chunks, then hang up.
    conn, response = _open_stream(front, {"model": "tiny", "prompt": PROMPT, "max_tokens": 900,
                                          "temperature": 0, "stream": True})
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    conn.close()
    wait_for(lambda: sum(d.stats().cancelled for d in decodes) == cancelled + 1, 20,
             "the streamed request cancelled at the decode daemon")
    # Not streamed: the client gives up before the reply.
    conn = _connection(front, timeout=1.0)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 900,
                                                        "temperature": 0}),
                 {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with pytest.raises(TimeoutError):
        conn.getresponse()
    conn.close()
    wait_for(lambda: sum(d.stats().cancelled for d in decodes) == cancelled + 2, 20,
             "the unstreamed request cancelled at the decode daemon")
    wait_for(lambda: _settled(decodes), 10, "decode daemons idle with every page free")


def test_full_and_no_daemon(checkpoint, cluster, tmp_path):
    decode = cluster[1][0]
    with running_front(checkpoint, [decode.endpoint], tmp_path, *AUTH, "--max-running-per-decode", "1",
                       env=ENV) as url:
        conn, response = _open_stream(url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 900,
                                            "temperature": 0, "stream": True})
        try:
            assert response.readline().startswith(b"data: ")
            with pytest.raises(openai.RateLimitError):
                openai_client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        finally:
            conn.close()
        wait_for(lambda: _settled([decode]), 20, "the decode daemon idle again")
        assert openai_client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices
    with running_front(checkpoint, ["127.0.0.1:1"], tmp_path, *AUTH, env=ENV) as url:
        with pytest.raises(openai.InternalServerError) as err:
            openai_client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert err.value.status_code == 503 and "no healthy decode daemon" in err.value.body["message"]
        assert _raw(url, "GET", "/health", None, None)[0] == 503


def test_daemon_leaves_rotation_and_comes_back(checkpoint, cluster, tmp_path):
    prefills, (steady, _) = cluster
    moving = decode_over(checkpoint, prefills)
    port = moving.port
    try:
        with running_front(checkpoint, [steady.endpoint, moving.endpoint], tmp_path, *AUTH, env=ENV) as url:
            client = openai_client(url)
            wait_for(lambda: _raw(url, "GET", "/health", None, None)[1]["decode"][moving.endpoint]["healthy"],
                     10, "both daemons in rotation")
            moving.stop(grace_s=0.5)
            for _ in range(4):  # every request answered by the one left
                assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3).choices
            health = _raw(url, "GET", "/health", None, None)[1]["decode"]
            assert not health[f"127.0.0.1:{port}"]["healthy"] and health[steady.endpoint]["healthy"]
            moving = decode_over(checkpoint, prefills, port=port)
            wait_for(lambda: _raw(url, "GET", "/health", None, None)[1]["decode"][moving.endpoint]["healthy"],
                     10, "the restarted daemon back in rotation")
            for _ in range(4):  # idle daemons take turns
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
            assert moving.stats().finished >= 1
    finally:
        moving.stop(grace_s=0.5)


# -- raw HTTP -----------------------------------------------------------------


def _connection(url: str, timeout: float = 30.0) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def _raw(url, method, path, body, token, parse=True):
    conn = _connection(url)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body, headers)
        response = conn.getresponse()
        data = response.read().decode()
        return response.status, json.loads(data) if parse else data
    finally:
        conn.close()


def _open_stream(url, body):
    conn = _connection(url)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_tls_and_client_certificates(checkpoint, tmp_path):
    """TLS end to end: clients -> front (client certificates required) -> decode -> prefill."""
    from tests.tls import make_certs, openssl_or_skip

    openssl_or_skip()
    certs = make_certs(tmp_path)
    security = SecurityConfig(tls_cert=certs.server.cert, tls_key=certs.server.key, tls_ca=certs.ca,
                              token=TOKEN)
    engine = EngineConfig(str(checkpoint), cp_size=1, page_size=PAGE_SIZE, pages_per_lane=100,
                          start_timeout_s=120)
    prefill = PrefillDaemon(engine, DaemonConfig(lease_s=600, security=security))
    decode = None
    try:
        decode = DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=PAGE_SIZE,
                                           device="cpu", pool_pages=100, security=security))
        tls = ("--tls-cert", certs.server.cert, "--tls-key", certs.server.key, "--tls-ca", certs.ca)
        with running_front(checkpoint, [decode.endpoint], tmp_path, *AUTH, *tls, "--tls-require-client-cert",
                           env=ENV) as url:
            assert url.startswith("https://")
            context = ssl.create_default_context(cafile=certs.ca)
            context.load_cert_chain(certs.client.cert, certs.client.key)
            good = openai.DefaultHttpxClient(verify=context)
            reply = openai_client(url, http_client=good).completions.create(model="tiny", prompt=PROMPT,
                                                                             max_tokens=2)
            assert reply.usage.completion_tokens == 2
            without_cert = openai.DefaultHttpxClient(verify=certs.ca)
            with pytest.raises(openai.APIConnectionError):
                openai_client(url, http_client=without_cert).models.list()
    finally:
        if decode is not None:
            decode.stop(grace_s=0.5)
        prefill.stop()
