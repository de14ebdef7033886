"""Decode step time of the continuous-batching engine, with no transfer in the way.

Requests start with a random KV context already in the pool and decode
together, so tokens/s here is batch / step time. On CUDA the engine's step is
a captured graph (``step_ms``) and is also timed eager (``eager_step_ms``).
In the same run, the ceilings: reading the weights a step reads once at the
device-read rate (``weight_read_floor_ms`` per batch: the embedding counts the
rows the batch looks up, not the table, by ``bench.stats.step_weight_bytes``,
the rule bench/deepseek.py uses), and transformers' LlamaForCausalLM on the
same shapes with a static cache under ``torch.compile(mode="reduce-overhead")``
(``hf_compiled_step_ms``; skipped with a printed reason where it cannot run).
Both are timed alike (``bench.stats.time_steps``): CUDA events around
``--steps`` back-to-back steps, the median of ``--runs`` runs.
Also prints where the host time of one eager step goes (torch profiler).
``--pdl both`` times every batch with the kernels' programmatic dependent launch off,
then on (``kernels.pdl``; each row says which, and why where it could not be on).

    python bench/decode_step.py --llama3-8b --batches 1 16 64 --context 1024 --json out.json
    python bench/decode_step.py --tiny --batches 1 16
    python bench/decode_step.py --llama3-8b --batches 1 16 --pdl both
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.decode.engine import DecodeEngine  # noqa: E402
from lanekv.decode.pool import PagePool, PageTable  # noqa: E402
from lanekv.model.checkpoint import load_dummy_model  # noqa: E402
from lanekv.model.sampling import SamplingParams  # noqa: E402

from bench.pdl_flag import add_pdl_flag, pdl_env, pdl_label, pdl_modes  # noqa: E402
from bench.prefill import LLAMA3_8B, TINY  # noqa: E402
from bench.stats import step_weight_bytes, time_steps  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--llama3-8b", action="store_true")
    which.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5, help="timed runs of --steps steps; the median is reported")
    ap.add_argument("--json", type=Path, default=None)
    add_pdl_flag(ap)
    ap.add_argument("--hf-batches", type=int, nargs="*", default=None,
                    help="batches to time transformers compiled at (default: those <= 16); "
                         "none given: skip it")
    args = ap.parse_args()
    cfg_json = LLAMA3_8B if args.llama3_8b else TINY
    dtype = torch.bfloat16 if args.llama3_8b else torch.float32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg_json))
        loaded = load_dummy_model(d, dtype=dtype, device=device)
    cfg = loaded.config
    per_req = -(-(args.context + args.steps * (args.runs + 1) + 8) // args.page_size)
    pool = PagePool.for_model(cfg, max(args.batches) * per_req + 8, args.page_size, dtype, device)
    pool.tensor.normal_()
    rows = []
    for batch in args.batches:
        for pdl in pdl_modes(args.pdl):  # each engine built, captured and timed in its setting
            with pdl_env(pdl):
                rows.append(_time_batch(loaded, pool, batch, pdl, args, device))
    # the ceiling: reading what a step reads once, at the device's read rate (half a copy's traffic)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    read_gbps = None
    if device.type == "cuda":
        src = torch.empty(weight_bytes // 2, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        copy = time_steps(lambda: dst.copy_(src), 5, args.runs, device)
        read_gbps = 2 * src.numel() * src.element_size() / (copy.ms / 1e3) / 1e9
        del src, dst
    for row in rows:
        read = step_weight_bytes(loaded.model, row["batch"])
        row["weight_bytes_read"] = read.dense + read.experts
        row["weight_read_floor_ms"] = (None if read_gbps is None
                                       else row["weight_bytes_read"] / (read_gbps * 1e9) * 1e3)
        row["step_over_floor"] = (None if read_gbps is None
                                  else row["step_ms"] / row["weight_read_floor_ms"])
    timing_note = (f"median of {args.runs} runs of {args.steps} back-to-back steps, "
                   f"{'cuda events' if device.type == 'cuda' else 'perf_counter'}")

    def write(hf: dict) -> None:
        if args.json:
            args.json.write_text(json.dumps(dict(
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
                model="Llama-3-8B shapes" if args.llama3_8b else "tiny", dtype=str(dtype),
                rows=rows, device_read_gbps=read_gbps, timing=timing_note, hf_skipped=hf.get("skipped")),
                indent=2))

    for r in rows:
        r["hf_compiled_step_ms"] = None
    write({})  # the engine's figures are kept even if transformers' run never ends
    del pool
    hf_batches = ([b for b in args.batches if b <= 16] if args.hf_batches is None
                  else args.hf_batches)
    hf = hf_compiled_steps(cfg_json, dtype, device, hf_batches, args) if hf_batches else {}
    for r in rows:
        r["hf_compiled_step_ms"] = hf.get(r["batch"])
    print(f"\ndecode step, {'Llama-3-8B shapes' if args.llama3_8b else 'tiny'}, context {args.context}, {device}")
    print(f"{'batch':>5} {'pdl':>4} {'step ms':>8} {'eager ms':>9} {'hf compiled':>11} {'tok/s':>9} "
          f"{'floor ms':>9} {'step/floor':>10}")
    nan = float("nan")
    for r in rows:
        eager, hfc = r.get("eager_step_ms"), r["hf_compiled_step_ms"]
        print(f"{r['batch']:>5} {r['pdl']:>4} {r['step_ms']:>8.2f} {eager or nan:>9.2f} "
              f"{hfc or nan:>11.2f} {r['tokens_per_s']:>9,.0f} {r['weight_read_floor_ms'] or nan:>9.2f} "
              f"{r['step_over_floor'] or nan:>10.2f}")
    print(f"every step time: {timing_note} (ours and transformers' alike)")
    for status in dict.fromkeys(r["pdl_status"] for r in rows):
        print(f"PDL {status}")
    if read_gbps:
        print(f"floor: the weight bytes a step reads (embedding: the rows it looks up) at the device read "
              f"rate, {read_gbps:.0f} GB/s")
    write(hf)


def _time_steps(engine: DecodeEngine, pool: PagePool, batch: int, args, device):
    """``bench.stats.StepTiming`` of steps of ``batch`` requests with ``args.context`` tokens of context."""
    for i in range(batch):
        table = PageTable.allocate(pool, args.context)
        engine.add(f"r{i}", table, 11 + i, SamplingParams(), args.steps * (args.runs + 1) + 4)
    engine.step()  # admit (the warm-up step, kernel compilation on the eager path, is time_steps')
    timing = time_steps(engine.step, args.steps, args.runs, device)
    while engine.has_work:
        engine.step()
    return timing


def _profile(engine: DecodeEngine, pool: PagePool, batch: int, args, device) -> None:
    from torch.profiler import ProfilerActivity, profile

    for i in range(batch):
        engine.add(f"p{i}", PageTable.allocate(pool, args.context), 11 + i, SamplingParams(), 4)
    engine.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        engine.step()
        sync(device)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    while engine.has_work:
        engine.step()


def _time_batch(loaded, pool: PagePool, batch: int, pdl: str, args, device: torch.device) -> dict:
    row = dict(batch=batch, context=args.context, pdl=pdl, pdl_status=pdl_label(device, pdl, batch))
    for mode in ("eager", "graph") if device.type == "cuda" else ("eager",):
        engine = DecodeEngine(loaded.model, pool, max_batch_size=batch, eos_token_ids=(),
                              graph_sizes=(batch,) if mode == "graph" else ())
        if mode == "graph":
            t0 = time.perf_counter()
            graphs = engine.capture_graphs()
            row["graph_capture_s"] = time.perf_counter() - t0
            row["graph_memory_mib"] = graphs.memory_bytes / 2**20
        timing = _time_steps(engine, pool, batch, args, device)
        key = "step_ms" if mode == "graph" or device.type != "cuda" else "eager_step_ms"
        row[key], row[f"{key}_runs"] = timing.ms, timing.runs_ms
        if mode == "eager" and batch == min(args.batches) and pdl == pdl_modes(args.pdl)[0]:
            _profile(engine, pool, batch, args, device)
        del engine
    row["tokens_per_s"] = batch / (row["step_ms"] / 1e3)
    return row


def hf_compiled_steps(cfg_json: dict, dtype: torch.dtype, device: torch.device,
                      batches: list[int], args) -> dict:
    """transformers' decode step (static cache, torch.compile reduce-overhead) in ms
    per batch; {"skipped": reason} where it cannot run."""
    if device.type != "cuda":
        print("transformers compiled: skipped (needs CUDA for CUDA graphs)")
        return {"skipped": "no CUDA"}
    try:
        from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

        config = LlamaConfig(**{k: v for k, v in cfg_json.items() if k != "architectures"})
        with torch.device(device):
            hf = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
        out = {}
        for batch in batches:
            cache = StaticCache(config=config, max_cache_len=args.context + args.steps * (args.runs + 6) + 16)
            prompt = torch.randint(0, config.vocab_size, (batch, args.context), device=device)
            with torch.inference_mode():
                hf(input_ids=prompt, past_key_values=cache, use_cache=True,
                   cache_position=torch.arange(args.context, device=device))
            torch._dynamo.reset()  # one static shape per compile
            compiled = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)
            tok = torch.randint(0, config.vocab_size, (batch, 1), device=device)
            # Positions advance on the device, as our engine's do: no host sync between steps.
            pos = torch.tensor([args.context], device=device)

            def step(compiled=compiled, tok=tok, cache=cache, pos=pos, batch=batch) -> None:
                compiled(input_ids=tok, past_key_values=cache, use_cache=True,
                         cache_position=pos, position_ids=pos[None].expand(batch, 1))
                pos.add_(1)

            with torch.inference_mode():
                for _ in range(4):  # compile and record the graphs outside the timing
                    step()
                timing = time_steps(step, args.steps, args.runs, device)
            out[batch] = timing.ms
            print(f"transformers compiled, batch {batch}: {out[batch]:.2f} ms/step")
            del cache, step
        del hf
        torch.cuda.empty_cache()
        return out
    except Exception as err:  # noqa: BLE001 (any failure to compile is reported, not fatal)
        reason = f"{type(err).__name__}: {str(err)[:300]}"
        print(f"transformers compiled: skipped ({reason})")
        return {"skipped": reason}


if __name__ == "__main__":
    main()
