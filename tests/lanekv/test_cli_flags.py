"""The ``lanekv`` command line's flags: help and defaults on every one, ``--version``,
``--log-level`` on either side of the subcommand, pool sizing (precedence, memory
arithmetic, ``--max-model-len``), ``--dtype auto``, ``--api-key`` and
``--chat-template``. In-process and fast: nothing here starts a daemon."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch
from lanekv.model.config import ModelConfig
from lanekv.model.dtypes import resolve_dtype
from lanekv.model.pool_sizing import (
    GIB,
    GPU_RESERVE_BYTES,
    check_max_model_len,
    page_bytes,
    size_pool,
    weight_bytes,
)
from lanekv.runtime.security import SecurityConfig

from lanekv.cli import build_parser, parse_bytes
from lanekv.cli import main as lanekv
from lanekv.http.chat import ChatTemplate
from tests.checkpoints import write_llama
from tests.markers import requires_gpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("flags-llama"), tokenizer=True)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_flag_of_every_subcommand_has_help_and_help_shows_defaults(capsys):
    parser = build_parser()
    subs = _subparsers(parser)
    assert {"prefill", "decode", "generate", "handshake", "serve", "tiny-model"} <= set(subs)
    missing = []
    for name, sub in [("lanekv", parser), *subs.items()]:
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"flags without help: {missing}"
    for name, sub in subs.items():
        assert sub.formatter_class is argparse.ArgumentDefaultsHelpFormatter, name
    with pytest.raises(SystemExit) as done:
        lanekv(["decode", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 16)" in text  # --page-size
    assert "(default: auto)" in text  # --dtype
    assert "(default: 256)" in text  # --max-num-seqs
    assert "--kv-cache-memory" in text and "--gpu-memory-utilization" in text and "--api-key" in text


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        lanekv(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("lanekv ")


def test_log_level_before_or_after_the_subcommand():
    parser = build_parser()
    base = ["generate", "--decode", "127.0.0.1:1", "hi"]
    assert parser.parse_args(base).log_level == "INFO"
    assert parser.parse_args(["--log-level", "debug", *base]).log_level == "DEBUG"
    assert parser.parse_args([*base, "--log-level", "warning"]).log_level == "WARNING"
    assert parser.parse_args(["--log-level", "debug", *base, "--log-level", "error"]).log_level == "ERROR"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--log-level", "loud"])


def test_vllm_names_parse():
    parser = build_parser()
    args = parser.parse_args(["decode", "--model", "m", "--prefill", "h:1", "--max-num-seqs", "7",
                              "--kv-cache-memory", "1GiB", "--gpu-memory-utilization", "0.5",
                              "--max-model-len", "64", "--api-key", "k"])
    assert (args.max_batch_size, args.kv_cache_memory, args.gpu_memory_utilization, args.max_model_len,
            args.api_key, args.dtype, args.pool_pages) == (7, GIB, 0.5, 64, "k", "auto", None)
    assert parser.parse_args(["decode", "--model", "m", "--prefill", "h:1", "--max-batch-size", "9"]) \
        .max_batch_size == 9  # the old name still works
    args = parser.parse_args(["serve", "--model", "m", "--decode", "h:1", "--chat-template", "t.jinja",
                              "--disable-log-requests"])
    assert args.chat_template == "t.jinja" and args.disable_log_requests
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["decode", "--model", "m", "--prefill", "h:1", "--gpu-memory-utilization", bad])


def test_ep_dispatch_flag():
    parser = build_parser()
    base = ["prefill", "--model", "m", "--cp-size", "2", "--ep"]
    assert parser.parse_args(base).ep_dispatch == "sized"
    assert parser.parse_args([*base, "--ep-dispatch", "capturable"]).ep_dispatch == "capturable"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--ep-dispatch", "padded"])


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 << 30
    assert parse_bytes("8G") == 8 * 10**9 and parse_bytes("8gb") == 8 * 10**9
    assert parse_bytes("1.5MiB") == 3 << 19
    assert parse_bytes("1073741824") == 1 << 30
    for bad in ("", "GiB", "8 parsecs", "-1GiB", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_size_pool_precedence_and_memory_arithmetic(checkpoint):
    model = ModelConfig.from_dir(checkpoint)
    unit = page_bytes(model, torch.float32, 16)
    # 2 layers x K,V x 16 tokens x 2 KV heads x head_dim 16 x 4 bytes
    assert unit == 2 * 2 * 16 * 2 * 16 * 4
    sizes = dict(pool_pages=None, kv_cache_memory=None, gpu_memory_utilization=None, default_pages=99)
    assert size_pool(unit, **sizes).pages == 99
    assert size_pool(unit, **{**sizes, "kv_cache_memory": 10 * unit + 1}).pages == 10
    assert size_pool(unit, **{**sizes, "kv_cache_memory": 10 * unit, "pool_pages": 3}) == (3, "--pool-pages")
    with pytest.raises(ValueError, match="kv_cache_memory=5 bytes holds no page"):
        size_pool(unit, **{**sizes, "kv_cache_memory": 5})
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.9 needs a GPU"):
        size_pool(unit, **{**sizes, "gpu_memory_utilization": 0.9})
    total, weights = 100 * GIB, 10 * GIB
    gpus = [(90 * GIB, total), (40 * GIB, total)]  # the second has less free than half: it decides
    got = size_pool(unit, **{**sizes, "gpu_memory_utilization": 0.5}, memory=lambda: gpus, weights=weights)
    assert got.pages == (40 * GIB - weights - GPU_RESERVE_BYTES) // unit
    roomy = [(90 * GIB, total)]  # half the GPU, though more is free
    assert size_pool(unit, **{**sizes, "gpu_memory_utilization": 0.5}, memory=lambda: roomy,
                     weights=weights).pages == (50 * GIB - weights - GPU_RESERVE_BYTES) // unit
    assert "--gpu-memory-utilization 0.5" in got.how
    # --kv-cache-memory wins over the fraction
    assert size_pool(unit, **{**sizes, "gpu_memory_utilization": 0.5, "kv_cache_memory": 4 * unit},
                     memory=lambda: gpus).pages == 4
    with pytest.raises(ValueError, match="leaves no room for the KV pool"):
        size_pool(unit, **{**sizes, "gpu_memory_utilization": 0.1}, memory=lambda: gpus, weights=weights)
    with pytest.raises(ValueError, match="leaves no room"):  # a GPU another process filled
        size_pool(unit, **{**sizes, "gpu_memory_utilization": 0.9}, memory=lambda: [(GIB, total)])


def test_max_model_len_is_checked_against_the_model_and_the_pool(checkpoint, capsys):
    check_max_model_len(None, 1024, 16)
    check_max_model_len(64, 1024, 64)
    with pytest.raises(ValueError, match="max_model_len=2048 is more than the model's max_position_embeddings=1024"):
        check_max_model_len(2048, 1024, 10**6)
    with pytest.raises(ValueError, match="max_model_len=65 does not fit the KV pool's 64 tokens"):
        check_max_model_len(65, 1024, 64)
    common = ["decode", "--model", str(checkpoint), "--prefill", "127.0.0.1:1", "--device", "cpu"]
    assert lanekv([*common, "--max-model-len", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "max_model_len=4096" in err and "max_position_embeddings=1024" in err
    assert lanekv([*common, "--pool-pages", "4", "--page-size", "16", "--max-model-len", "100"]) == 2
    assert "does not fit the KV pool's 64 tokens" in capsys.readouterr().err
    assert lanekv([*common, "--gpu-memory-utilization", "0.9"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    assert lanekv(["prefill", "--model", str(checkpoint), "--device", "cpu", "--cp-size", "2",
                   "--pool-pages", "2", "--page-size", "16", "--max-model-len", "65"]) == 2
    assert "does not fit the KV pool's 64 tokens" in capsys.readouterr().err  # 2 ranks x 2 pages x 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_decode_on_cuda_without_a_gpu_is_one_line(checkpoint, capsys):
    assert lanekv(["decode", "--model", str(checkpoint), "--prefill", "127.0.0.1:1", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no GPU is visible" in err, err


def test_dtype_auto_reads_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert resolve_dtype("auto", tmp_path) == "bfloat16"
    assert resolve_dtype("float16", tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))
    assert resolve_dtype("auto", tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert resolve_dtype("auto", tmp_path) == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float8_e4m3fn"}))
    with pytest.raises(ValueError, match="torch_dtype='float8_e4m3fn' is not one of"):
        resolve_dtype("auto", tmp_path)


def test_api_key_wins_and_warns_once(tmp_path, caplog):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    with caplog.at_level(logging.WARNING, logger="lanekv.runtime.security"):
        config = SecurityConfig.from_args(argparse.Namespace(api_key="from-flag", auth_token_file=str(token_file)))
    assert config.token == "from-flag"
    warnings = [r.getMessage() for r in caplog.records if "--api-key" in r.getMessage()]
    assert len(warnings) == 1 and "ps" in warnings[0] and "--auth-token-file ignored" in warnings[0]
    assert "from-flag" not in warnings[0]
    assert SecurityConfig.from_args(argparse.Namespace(auth_token_file=str(token_file))).token == "from-file"
    with pytest.raises(ValueError, match="token must be printable ASCII"):
        SecurityConfig.from_args(argparse.Namespace(api_key="with space"))


def test_chat_template_flag_is_a_file_or_a_template(checkpoint, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    literal = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    assert ChatTemplate.from_flag(literal, tmp_path).render(messages) == "[user] hi</s>"
    file = tmp_path / "t.jinja"
    file.write_text("<{{ messages[0]['content'] }}>")
    assert ChatTemplate.from_flag(str(file), tmp_path).render(messages) == "<hi>"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        ChatTemplate.from_flag(str(tmp_path / "missing.jinja"), tmp_path)
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.from_flag("{% for %}", tmp_path)


@requires_gpu
def test_gpu_memory_utilization_sizes_both_pools_from_free_memory(checkpoint):
    from lanekv.decode.serve import pool_size as decode_pool_size
    from lanekv.prefill.serve import _pool_size as prefill_pool_size

    model = ModelConfig.from_dir(checkpoint)
    unit = page_bytes(model, torch.float32, 16)
    weights = weight_bytes(model, torch.float32)
    for role, flags, size_of in (("decode", ["--prefill", "127.0.0.1:1"], decode_pool_size),
                                 ("prefill", [], prefill_pool_size)):
        args = build_parser().parse_args([role, "--model", str(checkpoint), "--device", "cuda", *flags,
                                          "--gpu-memory-utilization", "0.5"])
        size = size_of(args, "float32")
        free, total = torch.cuda.mem_get_info(0)
        want = (min(int(0.5 * total), free) - weights - GPU_RESERVE_BYTES) // unit
        assert size.pages > 0 and abs(size.pages - want) <= max(16, want // 100), (role, size, want)
        assert size.pages * unit <= 0.5 * total
