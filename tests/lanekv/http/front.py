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
