"""Serving benchmark: requests through the public API, as a user sends them
(in the manner of vLLM's benchmark_serving and SGLang's bench_serving).

By default it starts a prefill daemon and a decode daemon (dummy weights of the
chosen shape), each in its own process through the CLI as they are deployed
(``--in-process``: both inside the benchmark's process, sharing its GIL), and
sends every request to the decode daemon's Generate stream.
With ``--openai URL`` it starts nothing and streams ``POST URL/v1/completions``
(``stream: true``, prompt as token ids) from any OpenAI-compatible server.
``--front`` also starts ``lanekv serve`` over the daemons it started and runs
each level through both APIs, gRPC then HTTP, so the front's cost shows.

For each concurrency it sends ``--num-prompts`` requests with at most that many
in flight, all at once or at a Poisson ``--request-rate`` (requests/s), with
``--prompt-len`` / ``--output-len`` tokens (``--range-ratio`` r draws each
uniformly in [len * (1 - r), len]). Per request: TTFT (send to first token),
ITL (gaps between tokens; a reply carrying k tokens after a gap g counts k gaps
of g / k), end-to-end latency. Reported at p50/p90/p99 (interpolated, each with
its sample count: ``bench.stats.percentiles``), with output tokens/s
(every output token over the run's wall time). One warm-up request first.
Output lengths are fixed: every request sends ``ignore_eos`` (gRPC
``SamplingParams.ignore_eos``, HTTP ``"ignore_eos": true``), so each decodes
exactly its output length. Each completed request's output is counted as the
server counts it (gRPC: the token ids of its replies; HTTP: ``usage.completion_tokens``
of the stream, asked with ``stream_options.include_usage``) and must equal its
output length: a level where one does not (``outputs_wrong_length``), or an HTTP
stream without usage, ends the benchmark with an error before any figure is
written, since its tokens/s would not be of the stated lengths.

    python bench/serving.py --llama3-8b --concurrency 1 16 64 --prompt-len 1024 --output-len 128 \\
        --json bench/results/serving_h200.json
    python bench/serving.py --tiny --concurrency 1 4 --num-prompts 8 --output-len 16
    python bench/serving.py --openai http://127.0.0.1:8000 --model m --concurrency 1 8
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prefill import LLAMA3_8B, TINY  # noqa: E402
from bench.stats import percentiles  # noqa: E402


class Outcome(NamedTuple):
    sent: float  # perf_counter when the request went out
    arrivals: list[tuple[float, int]]  # (time, tokens in that reply), in order
    error: str | None
    stages: dict[str, float] | None = None  # gRPC: the decode daemon's prefill / rank compute / transfer ms
    completion_tokens: int | None = None  # output tokens as the server counts them; None: the replies'


class Request(NamedTuple):
    prompt: list[int]
    output_len: int


def _grpc_sender(endpoint: str) -> Callable[[Request], Outcome]:
    import grpc
    from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
    from lanekv.runtime.status import grpc_options

    channel = grpc.insecure_channel(endpoint, options=grpc_options())
    # Connected before the first request: its TTFT is then the daemon's, not this
    # client's connection set-up (which a serving client pays once, not per request).
    grpc.channel_ready_future(channel).result(timeout=60)
    stub = lanekv_pb2_grpc.DecodeServiceStub(channel)

    def send(req: Request) -> Outcome:
        # ignore_eos: every request decodes exactly output_len tokens (checked by run_level).
        msg = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=req.prompt),
                                         max_new_tokens=req.output_len,
                                         sampling=lanekv_pb2.SamplingParams(ignore_eos=True))
        sent, arrivals = time.perf_counter(), []
        call = stub.Generate(msg, timeout=600)
        try:
            for reply in call:
                if reply.token_ids:
                    arrivals.append((time.perf_counter(), len(reply.token_ids)))
        except grpc.RpcError as err:
            return Outcome(sent, arrivals, f"{err.code().name}: {err.details()}")
        meta = dict(call.trailing_metadata() or ())
        stages = {name: float(meta[key]) * 1e3 for name, key in (
            ("prefill_ms", "lanekv-prefill-seconds"), ("compute_ms", "lanekv-prefill-compute-seconds"),
            ("transfer_ms", "lanekv-transfer-seconds"))
            if key in meta}
        return Outcome(sent, arrivals, None, stages, sum(k for _, k in arrivals))

    return send


def _openai_sender(url: str, model: str, words_are_tokens: bool = False) -> Callable[[Request], Outcome]:
    """Streamed completions. A chunk counts as one token unless it carries
    ``token_ids``, or ``words_are_tokens`` (the word-level tokenizer of ``--front``:
    a chunk of k words is k tokens, as a gRPC reply of k ids is)."""
    parts = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    path = parts.path.rstrip("/") + "/v1/completions"

    def send(req: Request) -> Outcome:
        body = json.dumps(dict(model=model, prompt=req.prompt, max_tokens=req.output_len,
                               stream=True, temperature=0.0, ignore_eos=True,
                               stream_options={"include_usage": True}))
        conn = conn_cls(parts.hostname, parts.port, timeout=600)
        sent, arrivals, usage = time.perf_counter(), [], None
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                return Outcome(sent, arrivals, f"HTTP {resp.status}: {resp.read(200)!r}")
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("token_ids")):
                    ids = choices[0].get("token_ids")
                    k = len(ids) if ids else (
                        max(1, len(choices[0]["text"].split())) if words_are_tokens else 1)
                    arrivals.append((time.perf_counter(), k))
        except (OSError, ValueError, http.client.HTTPException) as err:
            return Outcome(sent, arrivals, f"{type(err).__name__}: {err}")
        finally:
            conn.close()
        if not isinstance(usage, dict) or not isinstance(usage.get("completion_tokens"), int):
            return Outcome(sent, arrivals, "the stream carried no usage.completion_tokens "
                           "(stream_options.include_usage): its output length cannot be checked")
        return Outcome(sent, arrivals, None, None, usage["completion_tokens"])

    return send


def _requests(args, vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)

    def draw(length: int) -> int:
        return max(1, rng.randint(int(length * (1 - args.range_ratio)), length))

    return [Request([rng.randrange(10, vocab - 10) for _ in range(draw(args.prompt_len))],
                    draw(args.output_len)) for _ in range(args.num_prompts)]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _split(stages: dict[str, float] | None) -> str:
    """``", prefill 36.3, compute 29.5, transfer 33.2"`` for a request's stages (ms)."""
    return "".join(f", {name[:-3]} {_ms(stages[name])}" for name in _STAGES if name in (stages or {}))


def run_level(send: Callable[[Request], Outcome], requests: list[Request], concurrency: int,
              rate: float, seed: int) -> dict:
    """Send ``requests`` with at most ``concurrency`` in flight; the level's figures."""
    rng = random.Random(seed)
    slots = threading.Semaphore(concurrency)

    def one(req: Request) -> Outcome:
        try:
            return send(req)
        finally:
            slots.release()

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = []
        for req in requests:
            if rate != float("inf"):
                time.sleep(rng.expovariate(rate))
            slots.acquire()
            futures.append(pool.submit(one, req))
        outcomes = [f.result() for f in futures]
    wall = time.perf_counter() - start
    ok = [o for o in outcomes if o.error is None and o.arrivals]
    ttft = [(o.arrivals[0][0] - o.sent) * 1e3 for o in ok]
    e2e = [(o.arrivals[-1][0] - o.sent) * 1e3 for o in ok]
    itl: list[float] = []
    for o in ok:
        for (t0, _), (t1, k) in zip(o.arrivals, o.arrivals[1:]):
            itl.extend([(t1 - t0) * 1e3 / k] * k)
    out_tokens = sum(k for o in ok for _, k in o.arrivals)
    wrong = [(made, r.output_len) for o, r in zip(outcomes, requests) if o.error is None
             and (made := sum(k for _, k in o.arrivals) if o.completion_tokens is None
                  else o.completion_tokens) != r.output_len]
    row = dict(concurrency=concurrency, request_rate=None if rate == float("inf") else rate,
               num_requests=len(requests), completed=len(ok),
               errors=sorted({o.error for o in outcomes if o.error})[:3],
               duration_s=wall, output_tokens=out_tokens, output_tokens_per_s=out_tokens / wall,
               requests_per_s=len(ok) / wall, outputs_wrong_length=len(wrong),
               wrong_lengths=wrong[:5], output_length_fixed=True,
               mean_prompt_tokens=statistics.mean(len(r.prompt) for r in requests))
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl), ("e2e_ms", e2e)):
        row.update(percentiles(name, values))  # interpolated, with the sample count (name_n)
        row[f"{name}_mean"] = statistics.mean(values) if values else None
    staged = [o.stages for o in ok if o.stages]
    row["stages_ms_p50"] = ({name: statistics.median(st[name] for st in staged) for name in staged[0]}
                            if staged else None)
    return row


class _Process(NamedTuple):
    """A daemon run as ``lanekv prefill|decode`` in its own process."""
    daemon: object  # lanekv.demo.Daemon
    endpoint: str

    def stop(self) -> None:
        from lanekv.demo import stop_daemon
        stop_daemon(self.daemon)


def _daemons(args, model_cfg: dict, workdir: str):
    """Start a prefill daemon (cp ``--cp``) and a decode daemon on dummy weights: each in its
    own process through the CLI, as they are deployed (``--in-process``: both in this one)."""
    dtype = "bfloat16" if args.llama3_8b else "float32"
    (Path(workdir) / "config.json").write_text(json.dumps(model_cfg))
    per_request = -(-(args.prompt_len + args.output_len + 1) // args.page_size)
    pool_pages = max(args.concurrency) * per_request + 64
    max_batch = max(64, max(args.concurrency))
    if args.in_process:
        return _daemons_in_process(args, workdir, dtype, pool_pages, max_batch)
    from lanekv.demo import start_daemon

    common = ["--model", workdir, "--page-size", str(args.page_size), "--dtype", dtype,
              "--load-format", "dummy"]
    t0 = time.perf_counter()
    level = "INFO" if args.keep_logs else "WARNING"
    prefill = start_daemon("prefill", ["prefill", *common, "--cp-size", str(args.cp),
                                       "--pool-pages", str(pool_pages // args.cp + 64),
                                       "--lease-s", "600"], Path(workdir), 900, level)
    prefill_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        decode = start_daemon("decode", ["decode", *common, "--prefill", prefill.endpoint,
                                         "--pool-pages", str(pool_pages),
                                         "--max-batch-size", str(max_batch),
                                         *_WARM_UP_FLAGS[args.warm_up_request]],
                              Path(workdir), 900, level)
        decode_s = time.perf_counter() - t0
    except BaseException:
        _Process(prefill, prefill.endpoint).stop()
        raise
    print(f"daemons up: prefill {prefill_s:.1f} s, decode {decode_s:.1f} s (warm-up included)")
    return (_Process(prefill, prefill.endpoint), _Process(decode, decode.endpoint),
            dict(prefill_start_s=prefill_s, decode_start_s=decode_s, daemons="processes"))


def _write_tokenizer(workdir: str, vocab: int) -> None:
    """A word-level tokenizer of ``vocab`` words (one word a token, so each token's
    text is not empty), for the daemons and the front to detokenize with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(Path(workdir) / "tokenizer.json"))


def _front(decode: str, workdir: str) -> _Process:
    """``lanekv serve`` over the decode daemon (the tokenizer written before the daemons)."""
    from lanekv.demo import start_daemon

    front = start_daemon("front", ["serve", "--decode", decode, "--model", workdir, "--port", "0",
                                   "--served-model-name", "default"], Path(workdir), 120)
    return _Process(front, front.endpoint)


def _daemons_in_process(args, workdir: str, dtype: str, pool_pages: int, max_batch: int):
    from lanekv.decode.config import DecodeConfig
    from lanekv.decode.daemon import DecodeDaemon
    from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
    from lanekv.prefill.engine_config import EngineConfig

    t0 = time.perf_counter()
    prefill = PrefillDaemon(
        EngineConfig(workdir, cp_size=args.cp, page_size=args.page_size, dtype=dtype,
                     load_format="dummy", pages_per_lane=pool_pages // args.cp + 64,
                     start_timeout_s=900),
        DaemonConfig(lease_s=600))
    prefill_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        decode = DecodeDaemon(DecodeConfig(workdir, prefill.endpoint, page_size=args.page_size,
                                           dtype=dtype, load_format="dummy", pool_pages=pool_pages,
                                           max_batch_size=max_batch))
        if args.warm_up_request == "on" or (args.warm_up_request == "auto" and decode.warms_up_by_default):
            decode.warm_up()  # as `lanekv decode` does before its ready file
        decode_s = time.perf_counter() - t0
    except BaseException:
        prefill.stop()
        raise
    print(f"daemons up (in this process): prefill {prefill_s:.1f} s, decode {decode_s:.1f} s")
    return prefill, decode, dict(prefill_start_s=prefill_s, decode_start_s=decode_s,
                                 daemons="in-process")


# bench --warm-up-request -> the flags of `lanekv decode`
_WARM_UP_FLAGS = {"auto": [], "on": ["--warm-up-request"], "off": ["--no-warm-up-request"]}
_STAGES = ("prefill_ms", "compute_ms", "transfer_ms")  # a Generate's trailing metadata


def _new_shapes(send: Callable[[Request], Outcome], args, vocab: int) -> dict:
    """What a new shape costs: for each of ``--new-shapes`` prompt lengths not sent
    before, the TTFT of its first request against the median of five more of that
    length (each sent alone, one after another). One ratio per length, so the
    request-to-request spread shows beside any cost of the first."""
    base = args.prompt_len
    lengths = [max(1, base * num // 16 + extra) for num, extra in
               ((12, 1), (10, 3), (14, 5), (9, 7), (13, 11), (11, 13), (15, 2), (8, 9))]
    shapes = []
    for n, length in enumerate(dict.fromkeys(lengths[:args.new_shapes])):
        reqs = _requests(argparse.Namespace(**{**vars(args), "num_prompts": 6, "prompt_len": length,
                                               "range_ratio": 0.0}), vocab, 777 + n)
        outs = [send(req) for req in reqs]
        ttfts = [(o.arrivals[0][0] - o.sent) * 1e3 if o.arrivals else None for o in outs]
        later = [t for t in ttfts[1:] if t is not None]
        shape = dict(prompt_len=length, first_ttft_ms=ttfts[0], ttft_ms=ttfts,
                     later_ttft_ms_p50=statistics.median(later) if later else None,
                     stages=[o.stages for o in outs])
        if ttfts[0] is not None and later:
            shape["ratio"] = ttfts[0] / shape["later_ttft_ms_p50"]
            # where a later one stands against the others, for the spread
            shape["later_max_ratio"] = max(later) / shape["later_ttft_ms_p50"]
        shapes.append(shape)
    ratios = [s["ratio"] for s in shapes if "ratio" in s]
    return dict(new_shapes=shapes, new_shape_ratio_p50=statistics.median(ratios) if ratios else None,
                new_shape_ratio_max=max(ratios) if ratios else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--llama3-8b", action="store_true")
    which.add_argument("--tiny", action="store_true")
    which.add_argument("--openai", metavar="URL", help="an OpenAI-compatible server to drive")
    ap.add_argument("--model", default="default", help="model name sent in --openai mode")
    ap.add_argument("--vocab", type=int, default=None, help="prompt ids below this (--openai)")
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="requests per concurrency level (default: 2 x concurrency, at least 8)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals at this many requests/s (default inf: all at once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--front", action="store_true",
                    help="also start `lanekv serve` over the decode daemon and run every level "
                         "through it too (OpenAI completions), beside the gRPC API")
    ap.add_argument("--warm-level", action="store_true",
                    help="first run the largest concurrency once, unmeasured (for comparing "
                         "APIs: neither then pays for the first growth of the daemons' memory)")
    ap.add_argument("--new-shapes", type=int, default=4,
                    help="prompt lengths not sent before whose first request is timed (0: none)")
    ap.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                    help="the daemons log at INFO (each prefill's seconds, each transfer's) and "
                         "their logs are copied into DIR at the end")
    ap.add_argument("--warm-up-request", choices=tuple(_WARM_UP_FLAGS), default="auto",
                    help="the decode daemon's warm-up request before its ready file (lanekv decode "
                         "--[no-]warm-up-request; auto: its default, on with a GPU); off shows what "
                         "the first request pays without it")
    ap.add_argument("--in-process", action="store_true",
                    help="run both daemons in this process (default: each in its own, by the CLI)")
    args = ap.parse_args()
    for name in ("prompt_len", "output_len", "page_size", "cp"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.front and args.openai:
        ap.error("--front starts a front over the daemons it starts; --openai starts none")
    if not 0 <= args.range_ratio < 1 or min(args.concurrency) < 1 or not args.request_rate > 0:
        ap.error("--range-ratio must be in [0, 1), --concurrency >= 1, --request-rate > 0")
    model_cfg = LLAMA3_8B if args.llama3_8b else TINY
    vocab = args.vocab or (model_cfg["vocab_size"] if not args.openai else 32000)
    started: dict = {}
    with tempfile.TemporaryDirectory() as workdir:
        daemons = []
        if args.openai:
            send = _openai_sender(args.openai, args.model)
            apis = [("openai", send)]
        else:
            if args.front:
                _write_tokenizer(workdir, vocab)
            *daemons, started = _daemons(args, model_cfg, workdir)
            send = _grpc_sender(daemons[1].endpoint)
            apis = [("grpc", send)]
        try:
            if args.front:
                daemons.append(_front(daemons[1].endpoint, workdir))
                apis.append(("openai", _openai_sender(f"http://{daemons[-1].endpoint}", "default",
                                                        words_are_tokens=True)))
                apis[-1][1](_requests(argparse.Namespace(**{**vars(args), "num_prompts": 1}), vocab,
                                      998)[0])  # the front's own first request
            first = _requests(argparse.Namespace(**{**vars(args), "num_prompts": 2}), vocab, 999)
            t0 = time.perf_counter()
            warm = send(first[0])
            started["first_request_ttft_ms"] = ((warm.arrivals[0][0] - warm.sent) * 1e3
                                                if warm.arrivals else None)
            started["first_request_s"] = time.perf_counter() - t0
            started["first_request_stages"] = warm.stages
            started.update(_new_shapes(send, args, vocab))
            if args.warm_level:  # unmeasured: the allocators grow to the largest level here
                top = max(args.concurrency)
                run_level(send, _requests(argparse.Namespace(**{**vars(args), "num_prompts": top}),
                                          vocab, 555), top, float("inf"), 555)
            rows = []
            for i, conc in enumerate(args.concurrency):
                n = args.num_prompts or max(8, 2 * conc)
                reqs = _requests(argparse.Namespace(**{**vars(args), "num_prompts": n}), vocab,
                                 args.seed + i)
                for api, sender in apis:
                    rows.append(dict(api=api, **run_level(sender, reqs, conc, args.request_rate,
                                                          args.seed + i)))
                    r = rows[-1]
                    if r["outputs_wrong_length"]:
                        raise SystemExit(
                            f"concurrency {conc} ({api}): {r['outputs_wrong_length']} of {r['completed']} "
                            f"outputs did not have the asked length (made, asked: {r['wrong_lengths']}); "
                            "the server does not honour ignore_eos, so no figure is reported")
                    print(f"concurrency {conc} ({api}): {r['output_tokens_per_s']:,.0f} tok/s, "
                          f"TTFT p50 {r['ttft_ms_p50'] or float('nan'):.1f} ms, "
                          f"ITL p50 {r['itl_ms_p50'] or float('nan'):.2f} ms", flush=True)
        finally:
            for daemon in reversed(daemons):
                daemon.stop()
            if args.keep_logs:
                import shutil

                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for log_file in Path(workdir).glob("*.log"):
                    shutil.copy(log_file, args.keep_logs / log_file.name)
    target = args.openai or ("Llama-3-8B shapes" if args.llama3_8b else "tiny")
    print(f"first request after start: TTFT {_ms(started.get('first_request_ttft_ms'))} ms"
          + _split(started.get("first_request_stages")))
    if rows and rows[0]["ttft_ms_p50"] and started.get("first_request_ttft_ms") is not None:
        # The first level sends prompts of the same length: its p50 is "a later request".
        later = rows[0]
        started["first_request_ratio"] = started["first_request_ttft_ms"] / later["ttft_ms_p50"]
        print(f"  against the concurrency-{later['concurrency']} level's p50: TTFT {_ms(later['ttft_ms_p50'])} ms"
              + _split(later.get("stages_ms_p50")) + f" ({started['first_request_ratio']:.2f}x)")
    for shape in started.get("new_shapes", ()):
        first, later = shape["stages"][0] or {}, [st for st in shape["stages"][1:] if st]
        split = ", ".join(f"{name[:-3]} {_ms(first.get(name))} / "
                          f"{_ms(statistics.median(st[name] for st in later) if later else None)}"
                          for name in _STAGES if name in first)
        print(f"new length {shape['prompt_len']}: first TTFT {_ms(shape['first_ttft_ms'])} ms, "
              f"later p50 {_ms(shape['later_ttft_ms_p50'])} ms ({shape.get('ratio', float('nan')):.2f}x; "
              f"slowest later {shape.get('later_max_ratio', float('nan')):.2f}x)"
              + (f"; first / later ms: {split}" if split else ""))
    if started.get("new_shape_ratio_p50") is not None:
        print(f"first of a new length over later ones: p50 {started['new_shape_ratio_p50']:.2f}x, "
              f"max {started['new_shape_ratio_max']:.2f}x over {len(started['new_shapes'])} lengths")
    print(f"\nserving, {target}, prompt {args.prompt_len}, output {args.output_len} "
          f"(fixed: ignore_eos on both APIs, every output's length checked), rate {args.request_rate}")
    print(f"{'api':>6} {'conc':>5} {'done':>5} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} {'n':>5} {'ITL p50':>8} "
          f"{'p90':>7} {'p99':>7} {'n':>7} {'E2E p50':>9} {'n':>5}")
    for r in rows:
        def f(key: str, width: int, digits: int = 1, r: dict = r) -> str:
            return f"{r[key]:>{width}.{digits}f}" if r[key] is not None else f"{'-':>{width}}"
        print(f"{r['api']:>6} {r['concurrency']:>5} {r['completed']:>5} {r['output_tokens_per_s']:>8,.0f} "
              f"{f('ttft_ms_p50', 9)} {f('ttft_ms_p99', 8)} {r['ttft_ms_n']:>5} {f('itl_ms_p50', 8, 2)} "
              f"{f('itl_ms_p90', 7, 2)} {f('itl_ms_p99', 7, 2)} {r['itl_ms_n']:>7} {f('e2e_ms_p50', 9)} "
              f"{r['e2e_ms_n']:>5}")
        if r["errors"]:
            print(f"      errors: {r['errors']}")
    print("percentiles interpolate between ranks; n: the samples each is over")
    if args.json:
        import torch

        device = (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
        args.json.write_text(json.dumps(dict(
            date=time.strftime("%Y-%m-%d"), device=device, target=target, cp_size=args.cp,
            page_size=args.page_size, prompt_len=args.prompt_len, output_len=args.output_len,
            range_ratio=args.range_ratio, startup=started, rows=rows), indent=2))


if __name__ == "__main__":
    main()
