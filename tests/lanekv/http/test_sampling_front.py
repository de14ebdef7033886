"""Sampling fields and logprobs through the whole PD path with the official openai client.

Prefill samples the first token (with every processor) and computes its
logprobs; decode adds the rest. Greedy outputs with penalties equal a plain
reference over transformers' logits; logprobs equal transformers'
log_softmax within 1e-4 (fp32, CPU). A benchmark client's shape (stream,
``ignore_eos``) gets exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import math

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
    decode_daemon,
    hf_model,
    openai_client,
    running_front,
    write_chat_checkpoint,
)

pytestmark = pytest.mark.timeout(300)
PROMPT = "w17 w42 w99 w5 w250 w42"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("front-sampling") / "tiny")


@pytest.fixture(scope="module")
def front(checkpoint, tmp_path_factory):
    engine = EngineConfig(str(checkpoint), cp_size=2, page_size=PAGE_SIZE, pages_per_lane=200,
                          start_timeout_s=120)
    prefill = PrefillDaemon(engine, DaemonConfig(lease_s=600, security=SECURITY))
    decode = None
    try:
        decode = decode_daemon(checkpoint, [prefill.endpoint])
        with running_front(checkpoint, [decode.endpoint], tmp_path_factory.mktemp("f"),
                           *AUTH, env=ENV) as url:
            yield url
    finally:
        if decode is not None:
            decode.stop(grace_s=1.0)
        prefill.stop()


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_completion_logprobs_and_penalties_equal_transformers(front, checkpoint):
    model, tok = hf_model(checkpoint), load_tokenizer(checkpoint)
    ids = tok.encode(PROMPT)
    reply = openai_client(front).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, frequency_penalty=0.7,
        presence_penalty=0.3, logit_bias={"42": 1.5},
        extra_body={"repetition_penalty": 1.4, "ignore_eos": True})
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 == reply.usage.completion_tokens
    out: list[int] = []
    for k in range(6):
        logits = _logits(model, ids + out)
        x = logits.clone()
        x[42] += 1.5
        for t in set(ids) | set(out):
            x[t] = x[t] / 1.4 if x[t] > 0 else x[t] * 1.4
        for t in set(out):
            x[t] -= 0.7 * out.count(t) + 0.3
        token = int(x.argmax())
        ref = torch.log_softmax(logits, -1)
        assert lp.tokens[k] == tok.decode([token], skip_special_tokens=False)
        assert abs(lp.token_logprobs[k] - ref[token].item()) < 1e-4
        best = {tok.decode([int(t)], skip_special_tokens=False): ref[t].item() for t in ref.topk(3).indices}
        for text, value in best.items():
            assert abs(lp.top_logprobs[k][text] - value) < 1e-4
        out.append(token)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_stream_and_whole(front, checkpoint):
    client = openai_client(front)
    messages = [{"role": "user", "content": "w33 w34 w35"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                                 temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True, extra_body={"ignore_eos": True}))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [
        (c.token, round(c.logprob, 5)) for c in content]


def test_benchmark_shape_ignore_eos_gives_exactly_max_tokens(front):
    """SGLang's bench_serving / vLLM's benchmark requests, with EOS made the likeliest token."""
    client = openai_client(front)
    for max_tokens in (1, 3, 9):
        chunks = list(client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, logit_bias={str(EOS_TOKEN_ID): 100},
            extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens == max_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=max_tokens,
            temperature=1.0, logit_bias={str(EOS_TOKEN_ID): 100}, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == max_tokens and chat.choices[0].finish_reason == "length"
    # Without ignore_eos the same request stops at once; min_tokens holds EOS back.
    stopped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=9, temperature=0,
                                        logit_bias={str(EOS_TOKEN_ID): 100})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=9, temperature=0,
                                     logit_bias={str(EOS_TOKEN_ID): 100}, extra_body={"min_tokens": 4})
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"


def test_min_p_and_seeded_sampling_through_pd(front):
    client = openai_client(front)
    texts = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.2,
                                       seed=77, logprobs=1, extra_body={"min_p": 0.3, "ignore_eos": True})
             for _ in range(2)]
    assert texts[0].choices[0].text == texts[1].choices[0].text
    lp = texts[0].choices[0].logprobs
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert (chosen - max(top.values())) / 1.2 >= math.log(0.3) - 1e-4
