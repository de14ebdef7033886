"""Clients nobody here wrote, through the whole PD path (CP 2 prefill, decode, ``lanekv serve``).

- lm-evaluation-harness's ``local-completions`` request shapes, sent as it sends them:
  loglikelihood (``echo``, ``logprobs: 1``, ``max_tokens`` 1 or 0, ``temperature`` 0,
  ``seed``, the prompt a batch of one list of token ids) read as its ``parse_logprobs``
  reads them, and generate_until (``stop`` list, ``max_tokens``) on both endpoints.
  Prompt logprobs equal transformers' log-softmax within 1e-4 (fp32, CPU), also for a
  prompt both prefix caches hold (it is prefilled whole).
- SGLang's ``bench_serving`` payloads of its ``vllm``/``sglang-oai`` (completions) and
  ``vllm-chat`` (chat) backends: streamed, ``ignore_eos`` true, ``max_tokens`` N, with EOS
  the likeliest token; every output has exactly N tokens (usage.completion_tokens).
- The official ``openai`` client over the surface lanekv claims: both endpoints, stream
  and not, logprobs, n, stop, seed, max_tokens, echo, usage with cached tokens.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest
import torch
from lanekv.model.tokenizer import load_tokenizer
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig

from tests.checkpoints import EOS_TOKEN_ID
from tests.lanekv.http.front import (
    AUTH,
    ENV,
    PAGE_SIZE,
    SECURITY,
    TOKEN,
    decode_daemon,
    hf_model,
    openai_client,
    running_front,
    write_chat_checkpoint,
)

pytestmark = pytest.mark.timeout(300)
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("front-clients") / "tiny")


@pytest.fixture(scope="module")
def hf(checkpoint):
    return hf_model(checkpoint)


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    """(the front's URL, the decode daemon's endpoint)."""
    engine = EngineConfig(str(checkpoint), cp_size=2, page_size=PAGE_SIZE, pages_per_lane=200,
                          start_timeout_s=120)
    prefill = PrefillDaemon(engine, DaemonConfig(lease_s=600, security=SECURITY))
    decode = None
    try:
        decode = decode_daemon(checkpoint, [prefill.endpoint])
        with running_front(checkpoint, [decode.endpoint], tmp_path_factory.mktemp("f"),
                           *AUTH, env=ENV) as url:
            yield url, decode.endpoint
    finally:
        if decode is not None:
            decode.stop(grace_s=1.0)
        prefill.stop()


@pytest.fixture(scope="module")
def front(cluster):
    return cluster[0]


def _open(url: str, path: str, body: dict):
    """POST ``body`` as JSON, as the clients' HTTP libraries send it (a 4xx/5xx raises)."""
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={**HEADERS, "Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=120.0)


def _post(url: str, path: str, body: dict) -> dict:
    with _open(url, path, body) as reply:
        return json.loads(reply.read())


def _events(url: str, path: str, body: dict) -> Iterator[dict]:
    """A streamed reply's JSON events, read line by line as bench_serving reads them."""
    with _open(url, path, body) as reply:
        for line in reply:
            chunk = line.decode().strip().removeprefix("data: ")
            if chunk and chunk != "[DONE]":
                yield json.loads(chunk)


def _prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)  # [len, vocab]


def _parse_logprobs(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval's local-completions makes of a loglikelihood reply (its parse_logprobs)."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(token_logprobs), all(t == max(d.values()) for t, d in zip(token_logprobs, top))


def test_lm_eval_loglikelihood_equals_transformers(front, hf, checkpoint):
    tok = load_tokenizer(checkpoint)
    context, continuation = tok.encode("w17 w42 w99 w5"), tok.encode("w250 w42 w3", add_special_tokens=False)
    ids = context + continuation
    ref = _prompt_logprobs(hf, ids)
    for max_tokens in (1, 0):
        body = {"model": "tiny", "prompt": [ids], "temperature": 0, "max_tokens": max_tokens,
                "logprobs": 1, "seed": 1234, "echo": True}
        reply = _post(front, "/v1/completions", body)
        choice = reply["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][:len(ids)] == [tok.decode([t], skip_special_tokens=False) for t in ids]
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < 1e-4, p
            best = int(ref[p - 1].argmax())
            top = lp["top_logprobs"][p]
            # The best token and the prompt's own token, as vLLM gives them.
            assert abs(top[tok.decode([best], skip_special_tokens=False)] - ref[p - 1, best].item()) < 1e-4
            assert tok.decode([ids[p]], skip_special_tokens=False) in top
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        assert reply["usage"]["prompt_tokens"] == len(ids)
        assert reply["usage"]["completion_tokens"] == max_tokens
        ctx = len(context)
        if max_tokens == 1:  # lm-eval drops the last entry (the generated token)
            total, greedy = _parse_logprobs(choice, ctx)
            want = sum(ref[p - 1, ids[p]].item() for p in range(ctx, len(ids)))
            is_greedy = all(int(ref[p - 1].argmax()) == ids[p] for p in range(ctx, len(ids)))
            assert abs(total - want) < 1e-3 and greedy == is_greedy
        else:
            assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"


def test_echo_after_both_prefix_caches_hold_the_prompt(front, hf, checkpoint):
    """A prompt on a page boundary, sent plainly twice (so the prefill and decode caches hold
    its pages), then with echo: every prompt token still has its logprob."""
    tok = load_tokenizer(checkpoint)
    ids = tok.encode("w21 w22 w23 w24 w25 w26 w27")
    assert len(ids) % PAGE_SIZE == 0
    client = openai_client(front)
    for _ in range(2):
        client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    echoed = client.completions.create(model="tiny", prompt=ids, max_tokens=0, temperature=0, echo=True,
                                       logprobs=2)
    ref = _prompt_logprobs(hf, ids)
    got = echoed.choices[0].logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids)
    assert max(abs(got[p] - ref[p - 1, ids[p]].item()) for p in range(1, len(ids))) < 1e-4
    assert echoed.usage.prompt_tokens_details.cached_tokens == 0  # computed whole


def test_echo_with_generation_and_streamed(front, hf, checkpoint):
    tok = load_tokenizer(checkpoint)
    prompt = "w31 w32 w33"
    ids = tok.encode(prompt)
    client = openai_client(front)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                      echo=True, extra_body={"ignore_eos": True})
    lp = whole.choices[0].logprobs
    assert whole.choices[0].text == prompt + plain.choices[0].text
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids] + plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[len(ids):] == plain.choices[0].logprobs.token_logprobs
    ref = _prompt_logprobs(hf, ids)
    assert max(abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) for p in range(1, len(ids))) < 1e-4
    assert whole.usage.completion_tokens == 3 and whole.usage.prompt_tokens == len(ids)
    # Streamed: the prompt (with its logprobs) first, then the output.
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                            logprobs=2, echo=True, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == prompt and "".join(texts) == whole.choices[0].text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    assert chunks[-1].usage.completion_tokens == 3
    only = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, stream=True,
                                          stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in only if c.choices) == prompt
    assert [c.choices[0].finish_reason for c in only if c.choices][-1] == "length"
    assert only[-1].usage.completion_tokens == 0
    # echo without logprobs: the text alone; max_tokens 0 without echo is refused by name.
    bare = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True)
    assert bare.choices[0].text == prompt and bare.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)


def test_lm_eval_generate_until_shapes(front, hf, checkpoint):
    tok = load_tokenizer(checkpoint)
    prompt = "w17 w42 w99 w5"
    ids = tok.encode(prompt)
    with torch.inference_mode():
        x = torch.tensor([ids])
        greedy = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=6,
                             pad_token_id=EOS_TOKEN_ID)[0, len(ids):].tolist()
    text = tok.decode(greedy)
    words = text.split()
    stop = words[2] if len(words) > 2 else "w999"
    # local-completions: prompt (token ids, a batch of one), max_tokens, temperature, stop, seed.
    body = {"prompt": [ids], "model": "tiny", "max_tokens": 6, "temperature": 0, "stop": [stop, "\n\n"],
            "seed": 1234}
    reply = _post(front, "/v1/completions", body)
    out = reply["choices"][0]["text"]
    assert stop not in out and text.startswith(out)
    # local-chat-completions: messages, max_tokens, temperature, stop[:4], seed.
    chat = _post(front, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "w5 w6"}], "model": "tiny", "max_tokens": 6,
        "temperature": 0, "stop": ["w1", "w2", "w3", "w4"], "seed": 1234})
    content = chat["choices"][0]["message"]["content"]
    assert chat["choices"][0]["finish_reason"] in ("stop", "length")
    assert not any(s in content.split() for s in ("w1", "w2", "w3", "w4"))


def _bench_completion(url: str, prompt: str, output_len: int) -> int:
    """SGLang bench_serving's openai-completions request (vllm, sglang-oai backends), its
    stream read as it reads it; usage.completion_tokens."""
    payload = {"model": "tiny", "prompt": prompt, "temperature": 0.0, "best_of": 1, "max_tokens": output_len,
               "stream": True, "ignore_eos": True, "logit_bias": {str(EOS_TOKEN_ID): 100},
               "stream_options": {"include_usage": True}}
    usage = None
    for data in _events(url, "/v1/completions", payload):
        assert data["choices"] or data["usage"]  # a chunk holds a choice, or the usage at the end
        usage = data.get("usage") or usage
    return usage["completion_tokens"]


def _bench_chat(url: str, prompt: str, output_len: int) -> int:
    """SGLang bench_serving's vllm-chat request; usage.completion_tokens."""
    payload = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "temperature": 0.0,
               "max_completion_tokens": output_len, "stream": True, "ignore_eos": True,
               "logit_bias": {str(EOS_TOKEN_ID): 100}, "stream_options": {"include_usage": True}}
    usage = None
    for data in _events(url, "/v1/chat/completions", payload):
        usage = data.get("usage") or usage
    return usage["completion_tokens"]


def test_benchmark_client_shapes_give_exactly_max_tokens(front):
    """EOS is made the likeliest token (logit_bias): only ignore_eos keeps the length fixed."""
    for n, prompt in zip((1, 4, 11, 16), ("w5 w6", "w7 w8 w9", "w10", "w11 w12 w13 w14 w15")):
        assert _bench_completion(front, prompt, n) == n
        assert _bench_chat(front, prompt, n) == n
    # Without ignore_eos the same request stops at EOS: the check above can fail.
    stopped = _post(front, "/v1/completions", {"model": "tiny", "prompt": "w5 w6", "max_tokens": 8,
                                                "logit_bias": {str(EOS_TOKEN_ID): 100}})
    assert stopped["usage"]["completion_tokens"] < 8 and stopped["choices"][0]["finish_reason"] == "stop"


def test_openai_client_surface(front):
    client = openai_client(front)
    msgs = [{"role": "user", "content": "w40 w41"}]
    # Chat: whole and streamed agree; n=1 accepted, n=2 refused by name; seed repeats a sample.
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0, n=1,
                                           extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 5 and whole.usage.total_tokens == whole.usage.prompt_tokens + 5
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    with pytest.raises(openai.BadRequestError, match="n"):
        client.chat.completions.create(model="tiny", messages=msgs, n=2)
    seeded = [client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=1.0,
                                             seed=77).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1]
    # Completions: stop, logprobs, max_tokens, seed.
    base = client.completions.create(model="tiny", prompt="w40 w41", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert base.object == "text_completion" and base.choices[0].finish_reason == "length"
    words = base.choices[0].text.split()
    assert len(words) >= 2, base.choices[0].text
    cut = client.completions.create(model="tiny", prompt="w40 w41", max_tokens=6, temperature=0, stop=[words[1]])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text.split() == words[:1]
    lp = client.completions.create(model="tiny", prompt="w40 w41", max_tokens=3, temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(lp.tokens) == 3 and all(len(t) >= 2 for t in lp.top_logprobs)
    streamed = list(client.completions.create(model="tiny", prompt="w40 w41", max_tokens=6, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == base.choices[0].text
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="tiny", prompt="w40", extra_body={"prompt_logprobs": 1})


def test_grpc_prompt_logprobs_alone_move_no_kv(cluster, hf):
    """Generate with max_new_tokens 0 and prompt logprobs: one reply with the prompt's
    logprobs, no token, finished by length, and no KV byte moved; 0 without them is refused."""
    import grpc
    from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc

    ids = [1, 40, 41, 42, 43, 44, 45, 46, 47]
    auth = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(cluster[1]) as channel:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
        request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=0,
                                             prompt_logprobs=2, has_prompt_logprobs=True)
        call = stub.Generate(request, timeout=60, metadata=auth)
        replies = list(call)
        meta = dict(call.trailing_metadata() or ())
        assert len(replies) == 1 and replies[0].finished and replies[0].finish_reason == "length"
        assert list(replies[0].token_ids) == [] and meta["lanekv-transfer-bytes"] == "0"
        got = replies[0].prompt_logprobs
        ref = _prompt_logprobs(hf, ids)
        assert [e.token_id for e in got] == ids[1:]
        assert max(abs(e.logprob - ref[p, ids[p + 1]].item()) for p, e in enumerate(got)) < 1e-4
        assert all(list(e.top_ids) == ref[p].topk(2).indices.tolist() for p, e in enumerate(got))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids)),
                               timeout=60, metadata=auth))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in err.value.details()
