"""``lanekv``: one entry point, one subcommand per role.

    lanekv prefill  --model DIR --cp-size N --page-size P --port PORT ...
    lanekv decode   --model DIR --prefill HOST:PORT [--prefill ...] --page-size P --port PORT ...
    lanekv generate --decode HOST:PORT "prompt"
    lanekv handshake --prefill HOST:PORT --decode HOST:PORT
    lanekv serve    --decode HOST:PORT [--decode ...] --model DIR --host H --port P

Defaults come from the frozen config dataclasses of each role, so the CLI and
the Python API cannot drift apart. Every subcommand takes the security options
of ``runtime.security.add_security_args`` (TLS, mutual TLS, a shared token
read from a file or an environment variable); the daemons take
``--metrics-port`` for Prometheus ``/metrics``. ``serve`` is the OpenAI-compatible
HTTP front (``lanekv.http``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys

from lanekv.http.config import FrontConfig
from lanekv.prefill.daemon import DaemonConfig
from lanekv.prefill.engine_config import DTYPES, EngineConfig
from lanekv.runtime.security import add_security_args

# subcommand -> (module, function(args) -> exit code); imported on use so that
# `lanekv generate` does not load torch models.
COMMANDS = {
    "prefill": ("lanekv.prefill.serve", "main"),
    "decode": ("lanekv.decode.serve", "main"),
    "generate": ("lanekv.client_commands", "generate"),
    "handshake": ("lanekv.client_commands", "handshake"),
    "serve": ("lanekv.http.serve", "main"),
}


def _default(cls, name):
    return {f.name: f.default for f in dataclasses.fields(cls)}[name]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = lambda name: _default(EngineConfig, name)
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--page-size", type=int, default=d("page_size"), help="tokens per KV page")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d("dtype"), help="weights and KV dtype")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d("device"))
    p.add_argument("--load-format", choices=["safetensors", "dummy"], default=d("load_format"),
                   help="dummy: config.json's shapes with seeded random weights (benchmarks)")
    p.add_argument("--index-cache-dtype", choices=["fp8_e4m3", "model"], default=d("index_cache_dtype"),
                   help="DeepSeek-V3.2 index-K rows: fp8 e4m3 with a float32 scale per 128 values, "
                        "or the model dtype (both daemons must agree)")


def add_metrics_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on --host at this port (0 = a free port; off when absent)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lanekv", description="Disaggregated prefill/decode KV-cache daemon.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prefill", help="run a CP prefill daemon (N rank processes)")
    add_engine_args(p)
    dd = lambda name: _default(DaemonConfig, name)
    p.add_argument("--cp-size", type=int, default=_default(EngineConfig, "cp_size"))
    p.add_argument("--pool-pages", type=int, default=_default(EngineConfig, "pages_per_lane"),
                   help="physical KV pages in each rank's pool")
    p.add_argument("--host", default=dd("host"), help="bind address (default loopback)")
    p.add_argument("--advertise-host", default=None,
                   help="host the ranks' endpoints and the ready file name for peers (default: --host, or for "
                        "a wildcard --host such as 0.0.0.0 this host's primary address)")
    p.add_argument("--port", type=int, default=dd("port"), help="Prefill + Handshake port (0 = free port)")
    p.add_argument("--transfer-port-base", type=int, default=dd("transfer_port_base"),
                   help="rank r serves KVTransfer on BASE + r (0 = free ports)")
    p.add_argument("--lease-s", type=float, default=dd("lease_s"), help="seconds pages stay pinned without a Release")
    p.add_argument("--batch-wait-ms", type=float, default=dd("batch_wait_ms"))
    p.add_argument("--graph-max-rows", type=int, default=_default(EngineConfig, "graph_max_rows"),
                   help="CUDA: prefills of up to this many rows per rank replay CUDA graphs captured at "
                        "start (0 = always eager)")
    p.add_argument("--ready-file", default=None, help="write 'host:port' here once serving")
    add_metrics_arg(p)
    add_security_args(p)

    p = sub.add_parser("decode", help="run a decode daemon paired with one or more prefill daemons")
    add_engine_args(p)
    p.add_argument("--prefill", required=True, action="append", metavar="HOST:PORT",
                   help="a prefill daemon; repeat for several (xPyD): each request goes to the healthy one "
                        "with the fewest queued prompt tokens")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--advertise-host", default=None,
                   help="host the ready file and banner name for peers (default: --host, or for a wildcard "
                        "--host this host's primary address)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--pool-pages", type=int, default=4096, help="physical KV pages in the decode pool")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--graph-batch-sizes", type=int, nargs="*", default=None,
                   help="batch sizes whose decode step is captured as a CUDA graph at start "
                        "(default: 1 2 4 8 16 ... 64 80 96 ... up to --max-batch-size; none given: no graphs)")
    p.add_argument("--ready-file", default=None, help="write 'host:port' here once serving")
    p.add_argument("--page-wait-s", type=float, default=None,
                   help="seconds a request waits for pages while the pool is full (then RESOURCE_EXHAUSTED)")
    p.add_argument("--connect-timeout-s", type=float, default=None,
                   help="seconds start-up waits for the prefill daemons to answer")
    p.add_argument("--prefill-health-interval-s", type=float, default=None,
                   help="seconds between health checks of each prefill daemon (one out of the pick "
                        "rejoins once SERVING and its handshake passes)")
    p.add_argument("--transport", choices=("auto", "grpc"), default=None,
                   help="auto (default): read prefill ranks on this host in place (CUDA IPC or /dev/shm), "
                        "the others over gRPC; grpc: every rank over gRPC")
    p.add_argument("--fetch-processes", type=int, default=None,
                   help="processes that receive prefill ranks' gRPC streams, each outside this process's GIL "
                        "(default: 4 with a GPU pool, else 0: threads of the daemon)")
    p.add_argument("--grace-s", type=float, default=None,
                   help="on SIGINT/SIGTERM, seconds open streams get to finish")
    p.add_argument("--warm-up-request", action=argparse.BooleanOptionalAction, default=None,
                   help="before the ready file, send one short request through each prefill daemon and "
                        "the whole pipeline, so the first client's does not pay for first use "
                        "(default: on with a GPU pool, off on the CPU)")
    add_metrics_arg(p)
    add_security_args(p)

    p = sub.add_parser("generate", help="stream a generation from a decode daemon")
    p.add_argument("--decode", required=True, help="HOST:PORT of the decode daemon")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text")
    p.add_argument("--ids", default=None, help="comma-separated prompt token ids instead of text")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--print-ids", action="store_true", help="print token ids, not text")
    p.add_argument("--stop-ids", default=None, help="comma-separated token ids that end the generation")
    p.add_argument("--request-id", default=None, help="request id (the server picks one when absent)")
    p.add_argument("--timeout", type=float, default=600.0)
    add_security_args(p)

    p = sub.add_parser("handshake", help="compare a prefill and a decode daemon's layout contracts")
    p.add_argument("--prefill", required=True, help="HOST:PORT of the prefill daemon")
    p.add_argument("--decode", required=True, help="HOST:PORT of the decode daemon")
    p.add_argument("--timeout", type=float, default=10.0)
    add_security_args(p)

    p = sub.add_parser("serve", help="serve the OpenAI API (HTTP) in front of decode daemons")
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
    p.add_argument("--ready-file", default=None, help="write 'host:port' here once serving")
    add_security_args(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    module, func = COMMANDS[args.command]
    return int(getattr(importlib.import_module(module), func)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
