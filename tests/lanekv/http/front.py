"""Helpers of the HTTP front's tests: a checkpoint with a chat template, daemons, ``lanekv serve``.

The front runs as its own process (``python -m lanekv.cli serve``) on a free
port, over decode and prefill daemons started in the test's process as
``tests.daemons`` starts them; every start has a timeout and everything
started is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from lanekv.runtime.security import SecurityConfig

from tests.checkpoints import write_llama

ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 60.0
# Several lines, indentation and a loop variable: trim_blocks and lstrip_blocks matter.
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
w10 {{ message['content'] }}
    {% elif message['role'] == 'user' %}
w11 {{ message['content'] }}
    {% else %}
w12 {{ message['content'] }}{% if not loop.last %} {{ eos_token }}{% endif %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
w12
{% endif %}"""


def write_chat_checkpoint(path: Path) -> Path:
    """The tiny llama of ``tests.checkpoints`` with its word-level tokenizer and a chat template
    in ``tokenizer_config.json``, as transformers reads it."""
    write_llama(path, tokenizer=True)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
    }))
    return path


@contextmanager
def running_front(model: Path, decode: Sequence[str], tmp: Path, *extra: str,
                  env: dict[str, str] | None = None) -> Iterator[str]:
    """``lanekv serve`` over ``decode``; yields its base URL (``http://host:port``)."""
    ready = tmp / f"front-{time.monotonic_ns()}.ready"
    args = [sys.executable, "-m", "lanekv.cli", "serve", "--model", str(model), "--port", "0",
            "--ready-file", str(ready), "--health-interval-s", "0.2", *extra]
    for endpoint in decode:
        args += ["--decode", endpoint]
    process = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if process.poll() is not None:
                raise RuntimeError(f"lanekv serve exited {process.returncode}: {process.stdout.read()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"lanekv serve did not start in {START_TIMEOUT_S}s")
            time.sleep(0.05)
        scheme = "https" if "--tls-cert" in extra else "http"
        yield f"{scheme}://{ready.read_text()}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


TOKEN = "front-test-token"
TOKEN_ENV = "LANEKV_FRONT_TEST_TOKEN"
SECURITY = SecurityConfig(token=TOKEN)  # the daemons' security, token included
ENV = {TOKEN_ENV: TOKEN}  # the front's environment: it reads the token from it
AUTH = ("--auth-token-env", TOKEN_ENV)  # the front's flags for that
PAGE_SIZE = 4


def decode_daemon(checkpoint: Path, endpoints: Sequence[str], **config):
    """A CPU decode daemon with ``SECURITY`` over the prefill daemons at ``endpoints``
    (``config``: DecodeConfig fields beyond those)."""
    from lanekv.decode.config import DecodeConfig
    from lanekv.decode.daemon import DecodeDaemon

    return DecodeDaemon(DecodeConfig(str(checkpoint), endpoints[0], extra_prefill_endpoints=tuple(endpoints[1:]),
                                     **{"page_size": PAGE_SIZE, "device": "cpu", "pool_pages": 400,
                                        "security": SECURITY, **config}))


def hf_model(checkpoint: Path):
    """transformers' model of the checkpoint, float32, eager attention (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager",
                                                dtype=torch.float32).eval()


def openai_client(url: str, **kwargs):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=kwargs.pop("api_key", TOKEN),
                         max_retries=0, timeout=kwargs.pop("timeout", 120.0), **kwargs)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s}s")
        time.sleep(interval_s)


def hf_greedy(model, ids: Sequence[int], max_new_tokens: int, eos_token_id: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` (the oracle)."""
    import torch

    with torch.inference_mode():
        x = torch.tensor([list(ids)])
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=eos_token_id)
    return out[0, len(ids):].tolist()
