"""``lanekv``: one entry point, one subcommand per role.

    lanekv prefill  --model DIR --cp-size N --page-size P --port PORT ...
    lanekv decode   --model DIR --prefill HOST:PORT [--prefill ...] --page-size P --port PORT ...
    lanekv generate --decode HOST:PORT "prompt"
    lanekv handshake --prefill HOST:PORT --decode HOST:PORT
    lanekv serve    --decode HOST:PORT [--decode ...] --model DIR --host H --port P
    lanekv tiny-model DIR

Defaults come from the frozen config dataclasses of each role, so the CLI and
the Python API cannot drift apart; ``--help`` shows each one. ``--log-level``
goes before or after the subcommand; ``--version``. The daemons size their KV
pool with ``add_sizing_args`` (``model.pool_sizing.size_pool``) and take ``--dtype
auto``, the checkpoint's own, by default. Every subcommand takes the security options
of ``runtime.security.add_security_args`` (TLS, mutual TLS, a shared token
read from a file or an environment variable, or ``--api-key``); the daemons take
``--metrics-port`` for Prometheus ``/metrics``. ``serve`` is the OpenAI-compatible
HTTP front (``lanekv.http``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import logging
import re
import sys

from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import STOP_GRACE_S
from lanekv.http.config import FrontConfig
from lanekv.model.dtypes import DTYPES
from lanekv.prefill.daemon import DaemonConfig
from lanekv.prefill.engine_config import EP_DISPATCHES, EngineConfig
from lanekv.runtime.security import add_security_args

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# subcommand -> (module, function(args) -> exit code); imported on use so that
# `lanekv generate` does not load torch models.
COMMANDS = {
    "prefill": ("lanekv.prefill.serve", "main"),
    "decode": ("lanekv.decode.serve", "main"),
    "generate": ("lanekv.client_commands", "generate"),
    "handshake": ("lanekv.client_commands", "handshake"),
    "serve": ("lanekv.http.serve", "main"),
    "tiny-model": ("lanekv.tiny_model", "main"),
}


def _default(cls, name):
    return {f.name: f.default for f in dataclasses.fields(cls)}[name]


_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``8GiB`` (binary), ``8GB`` or ``8G`` (decimal), or a plain count of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = _BYTE_UNITS.get(match.group(2).lower()) if match else None
    if unit is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 8GiB, 500MB, 1073741824)")
    value = int(float(match.group(1)) * unit)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1]")
    return value


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def version() -> str:
    try:
        return importlib.metadata.version("lanekv")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = lambda name: _default(EngineConfig, name)
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--page-size", type=int, default=d("page_size"), help="tokens per KV page")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="weights and KV dtype; auto: the checkpoint's torch_dtype (float32 when it names none)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d("device"),
                   help="auto: cuda when a GPU is visible, else cpu")
    p.add_argument("--load-format", choices=["safetensors", "dummy"], default=d("load_format"),
                   help="dummy: config.json's shapes with seeded random weights (benchmarks)")
    p.add_argument("--index-cache-dtype", choices=["fp8_e4m3", "model"], default=d("index_cache_dtype"),
                   help="DeepSeek-V3.2 index-K rows: fp8 e4m3 with a float32 scale per 128 values, "
                        "or the model dtype (both daemons must agree)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default=d("kv_cache_dtype"),
                   help="KV rows: auto (the model dtype) or fp8_e4m3 (e4m3 values with float32 "
                        "scales: per token and head for GQA, FlashMLA's 656-byte row for MLA; "
                        "both daemons must agree)")


def add_sizing_args(p: argparse.ArgumentParser, default_pages: int, scope: str) -> None:
    """The pool's size: --pool-pages, else --kv-cache-memory, else --gpu-memory-utilization,
    else ``default_pages`` (``model.pool_sizing.size_pool``)."""
    g = p.add_argument_group("KV pool size (precedence: --pool-pages, --kv-cache-memory, "
                             "--gpu-memory-utilization, the default page count)")
    g.add_argument("--pool-pages", type=int, default=None,
                   help=f"physical KV pages {scope}; overrides the two memory flags "
                        f"(none of the three given: {default_pages})")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help=f"bytes of KV pool {scope} (e.g. 8GiB, 500MB); on the CPU the memory budget; "
                        "overrides --gpu-memory-utilization")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                   help="fraction of each GPU's memory this daemon may use: the pool gets that share (at "
                        "most the memory free at start) less the weights and a 2 GiB allowance for "
                        "activations and graphs (GPU only)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output a request may have; checked at start against the model's "
                        "max_position_embeddings and the pool's tokens (default: the model's)")


def add_prefix_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="keep whole prompt pages for later requests with the same prefix (default: on; "
                        "--no-prefix-cache: compute and move every prompt)")
    p.add_argument("--prefix-cache-share", type=float, default=1.0,
                   help="the largest share of the pool's pages the prefix cache may hold, in [0, 1] (default 1)")


def add_metrics_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on --host at this port (0 = a free port; off when absent)")


def _subparser(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # Also after the subcommand; SUPPRESS keeps the top-level value when absent here.
    p.add_argument("--log-level", type=_log_level, default=argparse.SUPPRESS,
                   help=f"log level, one of {', '.join(LOG_LEVELS)} (default: INFO)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lanekv", description="Disaggregated prefill/decode KV-cache daemon.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--log-level", type=_log_level, default="INFO",
                        help=f"log level, one of {', '.join(LOG_LEVELS)}")
    parser.add_argument("--version", action="version", version=f"lanekv {version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _subparser(sub, "prefill", "run a CP prefill daemon (N rank processes)")
    add_engine_args(p)
    dd = lambda name: _default(DaemonConfig, name)
    p.add_argument("--cp-size", type=int, default=_default(EngineConfig, "cp_size"),
                   help="context-parallel ranks (processes; one GPU each on CUDA)")
    p.add_argument("--ep", action="store_true",
                   help="expert parallelism: a MoE model's routed experts sharded over the CP ranks, each "
                        "rank reading only its experts (docs/parallelism.md)")
    p.add_argument("--ep-dispatch", choices=EP_DISPATCHES, default=_default(EngineConfig, "ep_dispatch"),
                   help="with --ep, how a MoE layer exchanges rows: sized (the rows each rank needs, split "
                        "sizes read on the host once a layer) or capturable (a fixed padded buffer, no host "
                        "sync, up to cp_size / D times the bytes; docs/parallelism.md)")
    add_sizing_args(p, _default(EngineConfig, "pages_per_lane"), "in each rank's pool")
    p.add_argument("--host", default=dd("host"), help="bind address (default loopback)")
    p.add_argument("--advertise-host", default=None,
                   help="host the ranks' endpoints and the ready file name for peers (default: --host, or for "
                        "a wildcard --host such as 0.0.0.0 this host's primary address)")
    p.add_argument("--port", type=int, default=dd("port"), help="Prefill + Handshake port (0 = free port)")
    p.add_argument("--transfer-port-base", type=int, default=dd("transfer_port_base"),
                   help="rank r serves KVTransfer on BASE + r (0 = free ports)")
    p.add_argument("--lease-s", type=float, default=dd("lease_s"), help="seconds pages stay pinned without a Release")
    p.add_argument("--batch-wait-ms", type=float, default=dd("batch_wait_ms"),
                   help="milliseconds a prompt waits for others to share its prefill batch")
    p.add_argument("--graph-max-rows", type=int, default=_default(EngineConfig, "graph_max_rows"),
                   help="CUDA: prefills of up to this many rows per rank replay CUDA graphs captured at "
                        "start (0 = always eager)")
    p.add_argument("--fetch-relays", type=int, default=_default(EngineConfig, "fetch_relays"),
                   help="sender relays per rank: processes of the rank's host that send its FetchKV bytes "
                        "outside the rank's GIL; a decode's i-th stream of a rank goes to relay i (0 = none)")
    p.add_argument("--ready-file", default=None, help="write 'host:port' here once serving")
    add_prefix_cache_args(p)
    add_metrics_arg(p)
    add_security_args(p)

    p = _subparser(sub, "decode", "run a decode daemon paired with one or more prefill daemons")
    add_engine_args(p)
    dc = lambda name: _default(DecodeConfig, name)
    p.add_argument("--prefill", required=True, action="append", metavar="HOST:PORT",
                   help="a prefill daemon; repeat for several (xPyD): each request goes to the healthy one "
                        "with the fewest queued prompt tokens")
    p.add_argument("--host", default=dc("host"), help="bind address (default loopback)")
    p.add_argument("--advertise-host", default=None,
                   help="host the ready file and banner name for peers (default: --host, or for a wildcard "
                        "--host this host's primary address)")
    p.add_argument("--port", type=int, default=dc("port"), help="DecodeService port (0 = a free port)")
    add_sizing_args(p, dc("pool_pages"), "in the decode pool")
    p.add_argument("--max-num-seqs", "--max-batch-size", dest="max_batch_size", type=int,
                   default=dc("max_batch_size"),
                   help="requests decoded at once (the decode batch); more wait for a slot")
    p.add_argument("--graph-batch-sizes", type=int, nargs="*", default=None,
                   help="batch sizes whose decode step is captured as a CUDA graph at start "
                        "(default: 1 2 4 8 16 ... 64 80 96 ... up to --max-num-seqs; none given: no graphs)")
    p.add_argument("--ready-file", default=None, help="write 'host:port' here once serving")
    p.add_argument("--page-wait-s", type=float, default=None,
                   help=f"seconds a request waits for pages while the pool is full, then RESOURCE_EXHAUSTED "
                        f"(default: {dc('page_wait_s')})")
    p.add_argument("--connect-timeout-s", type=float, default=None,
                   help=f"seconds start-up waits for the prefill daemons to answer "
                        f"(default: {dc('connect_timeout_s')})")
    p.add_argument("--prefill-health-interval-s", type=float, default=None,
                   help="seconds between health checks of each prefill daemon (one out of the pick "
                        f"rejoins once SERVING and its handshake passes; default: "
                        f"{dc('prefill_health_interval_s')})")
    p.add_argument("--transport", choices=("auto", "grpc", "nixl"), default=None,
                   help="auto (default): read prefill ranks on this host in place (CUDA IPC or /dev/shm), "
                        "the others over gRPC; grpc: every rank over gRPC; nixl: read every rank through "
                        "NIXL (UCX: RDMA, TCP or shared memory; pip install 'lanekv[nixl]'), over gRPC where "
                        "a rank offers no NIXL or a page does not verify")
    p.add_argument("--tp-size", type=int, default=None,
                   help="tensor parallelism: decode rank processes, one GPU each (gloo on the CPU); "
                        "must divide the model's KV heads; each rank fetches its KV heads, by the "
                        "same-host fast path, gRPC or NIXL (default: 1)")
    p.add_argument("--fetch-processes", type=int, default=None,
                   help="processes that receive prefill ranks' gRPC streams, each outside this process's GIL "
                        "(default with a GPU pool: one per stream of a fetch, --fetch-streams x the largest "
                        "prefill CP, at least 4, at most 16; else 0: threads of the daemon)")
    p.add_argument("--fetch-streams", type=int, default=None,
                   help="gRPC streams from each prefill rank, each a run of its pages sent layer by layer as "
                        "the prefill writes them (default: 2 with a GPU pool, else 1)")
    p.add_argument("--grace-s", type=float, default=None,
                   help=f"on SIGINT/SIGTERM, seconds open streams get to finish (default: {STOP_GRACE_S})")
    p.add_argument("--warm-up-request", action=argparse.BooleanOptionalAction, default=None,
                   help="before the ready file, send one short request through each prefill daemon and "
                        "the whole pipeline, so the first client's does not pay for first use "
                        "(default: on with a GPU pool, off on the CPU)")
    add_prefix_cache_args(p)
    add_metrics_arg(p)
    add_security_args(p)

    p = _subparser(sub, "generate", "stream a generation from a decode daemon")
    p.add_argument("--decode", required=True, help="HOST:PORT of the decode daemon")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text")
    p.add_argument("--ids", default=None, help="comma-separated prompt token ids instead of text")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = all)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (a reproducible stream)")
    p.add_argument("--print-ids", action="store_true", help="print token ids, not text")
    p.add_argument("--stop-ids", default=None, help="comma-separated token ids that end the generation")
    p.add_argument("--request-id", default=None, help="request id (the server picks one when absent)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the whole call may take")
    add_security_args(p)

    p = _subparser(sub, "handshake", "compare a prefill and a decode daemon's layout contracts")
    p.add_argument("--prefill", required=True, help="HOST:PORT of the prefill daemon")
    p.add_argument("--decode", required=True, help="HOST:PORT of the decode daemon")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds each contract read may take")
    add_security_args(p)

    p = _subparser(sub, "serve", "serve the OpenAI API (HTTP) in front of decode daemons")
    df = lambda name: _default(FrontConfig, name)
    p.add_argument("--decode", action="append", required=True, metavar="HOST:PORT",
                   help="a decode daemon (repeat for several)")
    p.add_argument("--model", required=True, help="checkpoint folder (tokenizer, chat template, limits)")
    p.add_argument("--served-model-name", default=None, help="the model id clients name (default: the folder's name)")
    p.add_argument("--host", default=df("host"), help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=df("port"), help="HTTP port (0 = a free port)")
    p.add_argument("--max-running-per-decode", type=int, default=df("max_running_per_decode"),
                   help="requests at once per decode daemon; beyond that, 429")
    p.add_argument("--health-interval-s", type=float, default=df("health_interval_s"),
                   help="seconds between health checks of each decode daemon")
    p.add_argument("--request-timeout-s", type=float, default=df("request_timeout_s"),
                   help="deadline of one generation")
    p.add_argument("--max-body-bytes", type=int, default=df("max_body_bytes"),
                   help="largest request body read (beyond it, 413)")
    p.add_argument("--header-timeout-s", type=float, default=df("header_timeout_s"),
                   help="a connection's request headers must arrive within this; then it is closed")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file, or the template itself, instead of the checkpoint's")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per request (by default each request logs its id, route and sizes)")
    p.add_argument("--ready-file", default=None, help="write 'host:port' here once serving")
    add_security_args(p)

    p = _subparser(sub, "tiny-model", "write a small random-weight Llama checkpoint with a tokenizer and "
                   "a chat template (to try lanekv without real weights)")
    p.add_argument("dir", help="folder to write (made if missing; files there are replaced)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    module, func = COMMANDS[args.command]
    return int(getattr(importlib.import_module(module), func)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
