"""``make demo``: prefill -> KV transfer -> decode across processes, checked against one process.

    python -m lanekv.demo [--model DIR] [--cp-size 2] [--page-size 16] [--dtype float32] ...

Starts a prefill daemon (``--cp-size`` rank processes) and a decode daemon as
separate ``lanekv`` processes on free loopback ports, runs one greedy
generation through the decode daemon, prints the tokens, the KV bytes moved
and the transfer throughput, stops both daemons (SIGTERM, then SIGKILL after
a timeout) and finally checks the tokens against a colocated single-process
run (``decode.colocated.generate_colocated``) on the same checkpoint. Without
``--model`` it writes a tiny random-weight Llama checkpoint (and a word-level
tokenizer) to a temporary folder first. Exit code 0 when the tokens match.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import grpc
import torch

_ENDPOINT = re.compile(r"^[\w.\-\[\]:]+:\d+$")
START_TIMEOUT_S = 600.0  # a large checkpoint takes minutes to load
STOP_TIMEOUT_S = 30.0
# The tiny model: small enough to start in seconds on a CPU, with weights drawn
# wide enough (std 0.2) that greedy tokens are decisive, not decided by rounding.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}
TINY_INIT_STD = 0.2


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and why."""


@dataclass(frozen=True)
class Daemon:
    name: str
    process: subprocess.Popen
    endpoint: str
    log_path: Path


def write_tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    """A random-weight Llama folder (config.json, model.safetensors, tokenizer.json)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from lanekv.model.config import ModelConfig
    from lanekv.model.llama import CausalLM

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    names = CausalLM(ModelConfig.from_dir(path), device="meta").state_dict()
    gen = torch.Generator().manual_seed(seed)
    weights = {
        name: torch.ones(t.shape) if name.endswith("norm.weight") else torch.randn(t.shape, generator=gen) * TINY_INIT_STD
        for name, t in names.items()
    }
    save_file(weights, str(path / "model.safetensors"))
    # Word-level: <unk>=0, <s>=1, </s>=2, then w3 ... w511; BOS prepended.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_CONFIG["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    return path


def start_daemon(name: str, cli_args: list[str], workdir: Path, timeout_s: float,
                 log_level: str = "WARNING") -> Daemon:
    """Run ``lanekv <cli_args>`` and wait until its ready file names its endpoint
    (its log, at ``log_level``, in ``workdir/<name>.log``)."""
    ready, log_path = workdir / f"{name}.ready", workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "lanekv.cli", "--log-level", log_level, *cli_args, "--ready-file", str(ready)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists() and _ENDPOINT.match(ready.read_text().strip()):
            return Daemon(name, process, ready.read_text().strip(), log_path)
        if process.poll() is not None:
            raise DemoError(f"the {name} daemon exited with code {process.returncode}:\n{_tail(log_path)}")
        time.sleep(0.1)
    stop_daemon(Daemon(name, process, "", log_path))
    raise DemoError(f"the {name} daemon was not serving after {timeout_s:.0f}s:\n{_tail(log_path)}")


def stop_daemon(daemon: Daemon) -> None:
    if daemon.process.poll() is not None:
        return
    daemon.process.send_signal(signal.SIGTERM)
    try:
        daemon.process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"the {daemon.name} daemon did not stop within {STOP_TIMEOUT_S:.0f}s; killing it", file=sys.stderr)
        daemon.process.kill()
        daemon.process.wait(STOP_TIMEOUT_S)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Generation(NamedTuple):
    tokens: list[int]
    text: str
    seconds: float  # from the call to the last reply
    metadata: dict[str, str]  # the stream's trailing metadata (transfer stats)


def generate_remote(endpoint: str, prompt: list[int], max_new_tokens: int) -> Generation:
    """One greedy generation through the decode daemon, printed as it streams."""
    from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc

    request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=prompt), max_new_tokens=max_new_tokens)
    tokens, text = [], ""
    start = time.perf_counter()
    with grpc.insecure_channel(endpoint) as channel:
        call = lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=START_TIMEOUT_S)
        try:
            for reply in call:
                for token in reply.token_ids:
                    print(token, end=" ", flush=True)
                tokens += reply.token_ids
                text += reply.text
            metadata = dict(call.trailing_metadata() or ())
        except grpc.RpcError as err:
            raise DemoError(f"Generate failed: {err.code().name}: {err.details()}") from err
    print()
    return Generation(tokens, text, time.perf_counter() - start, metadata)


def generate_colocated_run(args: argparse.Namespace, model_path: str, prompt: list[int]) -> list[int]:
    from lanekv.decode.colocated import generate_colocated
    from lanekv.decode.pool import PagePool
    from lanekv.model.checkpoint import load_dummy_model, load_model
    from lanekv.model.sampling import SamplingParams
    from lanekv.prefill.engine_config import DTYPES

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    load = load_dummy_model if args.load_format == "dummy" else load_model
    loaded = load(model_path, dtype=DTYPES[args.dtype], device=device)
    pages = -(-(len(prompt) + args.max_new_tokens) // args.page_size) + 1
    pool = PagePool.for_model(loaded.config, pages, args.page_size, DTYPES[args.dtype], device)
    return generate_colocated(loaded.model, pool, [prompt], SamplingParams(), args.max_new_tokens)[0]


def prompt_ids(args: argparse.Namespace, model_path: str) -> list[int]:
    from lanekv.model.config import ModelConfig
    from lanekv.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    if args.prompt is not None:
        if tokenizer is None:
            raise DemoError(f"{model_path} has no tokenizer.json; give --prompt-len instead of --prompt")
        return tokenizer.encode(args.prompt)
    vocab = ModelConfig.from_dir(model_path).vocab_size
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()


def run(args: argparse.Namespace, workdir: Path) -> int:
    model = args.model or str(write_tiny_checkpoint(workdir / "tiny-llama"))
    what = args.model or f"a tiny random-weight Llama ({TINY_CONFIG['num_hidden_layers']} layers) in {model}"
    print(f"model: {what}\ncp_size {args.cp_size}, page_size {args.page_size}, {args.dtype}, device {args.device}")
    prompt = prompt_ids(args, model)
    common = ["--model", model, "--page-size", str(args.page_size), "--dtype", args.dtype,
              "--device", args.device, "--load-format", args.load_format]
    # Pools sized to the request, so a large checkpoint does not reserve GBs it never uses.
    prefill_pages = -(-len(prompt) // args.page_size) // args.cp_size + 8
    decode_pages = -(-(len(prompt) + args.max_new_tokens) // args.page_size) + 8
    daemons: list[Daemon] = []
    try:
        daemons.append(start_daemon("prefill", ["prefill", *common, "--cp-size", str(args.cp_size),
                                                "--pool-pages", str(prefill_pages)], workdir, START_TIMEOUT_S))
        print(f"prefill daemon ({args.cp_size} CP ranks): {daemons[0].endpoint}")
        daemons.append(start_daemon("decode", ["decode", *common, "--prefill", daemons[0].endpoint,
                                               "--pool-pages", str(decode_pages)], workdir, START_TIMEOUT_S))
        print(f"decode daemon: {daemons[1].endpoint}")
        print(f"prompt: {len(prompt)} tokens; generating {args.max_new_tokens} greedily:")
        out = generate_remote(daemons[1].endpoint, prompt, args.max_new_tokens)
    finally:
        for daemon in reversed(daemons):
            stop_daemon(daemon)
    if out.text:
        print(f"text: {out.text!r}")
    _print_transfer(out)
    print("colocated single-process run ...", flush=True)
    want = generate_colocated_run(args, model, prompt)
    if out.tokens == want:
        print(f"check: the {len(want)} tokens equal the colocated run: OK")
        return 0
    print(f"check FAILED: the colocated run gives {want}")
    return 1


def _print_transfer(out: Generation) -> None:
    meta = out.metadata
    nbytes, seconds = int(meta.get("lanekv-transfer-bytes", 0)), float(meta.get("lanekv-transfer-seconds", 0))
    rate = nbytes / seconds / 1e6 if seconds > 0 else float("nan")
    prefill_ms = float(meta.get("lanekv-prefill-seconds", 0)) * 1e3
    print(f"KV transfer: {nbytes:,} bytes in {seconds * 1e3:.2f} ms ({rate:.1f} MB/s), "
          f"{meta.get('lanekv-transfer-chunks', '?')} chunks, by rank:path {meta.get('lanekv-transfer-paths', '?')}; "
          f"prefill {prefill_ms:.1f} ms")
    print(f"end to end: {len(out.tokens)} tokens in {out.seconds * 1e3:.0f} ms "
          f"({len(out.tokens) / out.seconds:.1f} tokens/s incl. prefill and transfer)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lanekv.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: write a tiny random one)")
    p.add_argument("--cp-size", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    p.add_argument("--prompt", default=None, help="prompt text (needs the checkpoint's tokenizer.json)")
    p.add_argument("--prompt-len", type=int, default=45, help="random prompt ids of this length, without --prompt")
    p.add_argument("--max-new-tokens", type=int, default=24)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("cp_size", "page_size", "prompt_len", "max_new_tokens"):
        if getattr(args, name) < 1:
            print(f"lanekv demo: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        with tempfile.TemporaryDirectory(prefix="lanekv-demo-") as workdir:
            return run(args, Path(workdir))
    except (DemoError, OSError, ValueError) as err:
        print(f"lanekv demo: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
