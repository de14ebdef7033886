"""MLA prefill attention against SDPA, every kernel variant in one run.

Shapes: DeepSeek-V3's decompressed prefill attention, 128 heads, qk 192 (128 nope + 64 rope),
v 128, causal, bf16, one sequence of each ``--tokens`` (default 8k and 32k). Rows:

- ``sdpa``: torch SDPA on ``[1, H, N, D]`` views of the same tensors, one backend at a time
  (``--backends``: cuDNN and FlashAttention where the device's torch has them), v as is
  (128) and v zero-padded to 192 (what backends that want one head dim need; the extra
  columns are cut off). Each backend's figure is its fastest form that ran.
- ``kernel``: ``launch_cp_prefill_attention`` with each config of ``MLA_PREFILL_SWEEP``
  (``kernels/prefill/config.py``; ``--configs`` to pick others, any of
  ``MLA_PREFILL_VARIANTS`` or new ones, written
  ``block_m,block_n,warps,stages[+tma][+overlap][+heads_fast][+warp_specialize][+exp_bf16]``),
  and (with the cuDNN backend) lanekv's cuDNN path, ``sdpa_prefill_attention``
  (``kernels/prefill/sdpa.py``) as the model calls it with ``LANEKV_PREFILL_ATTENTION=cudnn``:
  host segments, the output in ``[N, H, 128]``.

FLOPs count the causal work at v 128: ``2 * H * (192 + 128) * N * (N + 1) / 2``, the same
count for every row (a padded SDPA run does more work than it is credited with).

Correctness before speed: each variant first runs a small bf16 batch of three segments of
odd lengths (two requests, chunked) against the torch reference
``cp_prefill_attention_ref``, output and log-sum-exp; at each length its output is compared
with SDPA's (relative Frobenius error < 1e-2). A variant that fails either is marked
``ok: False`` and ranks nowhere.

Each job runs in a worker process: a variant that crashes its process (a compiler abort)
or hangs (nothing printed for ``--job-timeout`` seconds: the worker is killed) is recorded
and the sweep goes on in a fresh worker; the JSON is rewritten after every row. Times: the
median of CUDA-event-timed calls after two warm-up calls (about one second of calls per row).
Each kernel row also records the compiled kernel's registers, spills and shared memory.

Compiles first, in parallel (``--precompile`` worker processes, default 8): each compiles
its share of the kernel configs by running the reference check and one small launch of
the timed call's specialization (1,024 tokens), so Triton's disk cache holds every kernel
before the timing worker starts and compile time is paid once, on many cores. A config
that fails there (a compile error, a wrong reference check, no result within
``--precompile-timeout``: a hang) is recorded at each length and not timed.

    python bench/mla_prefill_sweep.py --json bench/results/mla_prefill_sweep_h200.json  # ~150 s
    python bench/mla_prefill_sweep.py --tokens 8192 --configs 128,128,8,2 128,64,8,4+tma+overlap
"""

from __future__ import annotations

import argparse
import datetime
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from lanekv.kernels.prefill.attention import launch_cp_prefill_attention  # noqa: E402
from lanekv.kernels.prefill.config import (  # noqa: E402
    LAUNCH_SWITCHES,
    MLA_PREFILL_SWEEP,
    AttnLaunchConfig,
)
from lanekv.kernels.prefill.reference import AttnSegments, cp_prefill_attention_ref  # noqa: E402
from lanekv.kernels.prefill.sdpa import sdpa_prefill_attention  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

QK_DIM, V_DIM = 192, 128
MAX_REL_ERR = 1e-2
BACKENDS = ("cudnn", "flash")
TARGET = 1.0  # x the fastest SDPA (issue 37)
# lanekv's cuDNN path (kernels/prefill/sdpa.py), timed beside the kernel configs
PATH_JOB, PATH_LABEL = "path:cudnn", "sdpa_prefill_attention (cuDNN)"


def parse_config(text: str) -> AttnLaunchConfig:
    """``block_m,block_n,warps,stages[+switch...]`` (the ``label`` of a config)."""
    tile, *flags = text.split("+")
    parts = tile.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"config {text!r}: want block_m,block_n,warps,stages[+switch]")
    unknown = [f for f in flags if f not in LAUNCH_SWITCHES]
    if unknown:
        raise argparse.ArgumentTypeError(f"config {text!r}: unknown switch {unknown[0]!r}; "
                                         f"known: {', '.join(LAUNCH_SWITCHES)}")
    return AttnLaunchConfig(*(int(p) for p in parts), **{f: True for f in flags})


def causal_flops(heads: int, n: int) -> float:
    return 2.0 * heads * (QK_DIM + V_DIM) * n * (n + 1) / 2


def time_ms(fn, device: str = "cuda", budget_ms: float = 1000.0, max_reps: int = 20) -> float:
    """Median of per-call times (CUDA events on the GPU); two warm-up calls (the first compiles)."""
    fn()
    fn()
    if device != "cuda":  # a dry run on the CPU (interpreter): wall time of a few calls
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(3, min(max_reps, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:160]}" if text else type(exc).__name__


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


# ---- worker side -----------------------------------------------------------------------


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name]


class Env(NamedTuple):
    """Where the worker runs: the GPU in bf16, or the CPU (interpreter) in float32 for a dry run."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    check_kv: tuple[int, int] = (700, 333)  # the reference check's two requests


def _env(spec: dict) -> Env:
    return Env(spec.get("device", "cuda"), getattr(torch, spec.get("dtype", "bfloat16")),
               tuple(spec.get("check_kv", (700, 333))))


def _randn(gen, env: Env, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=env.device).to(env.dtype)


def _triton(config: AttnLaunchConfig):
    """A check's call of the Triton kernel with ``config``."""
    def run(q, k, v, seg, host, scale, out, lse):
        return launch_cp_prefill_attention(q, k, v, seg, scale, None, 0, out, lse, config)
    return run


def _cudnn_path(q, k, v, seg, host, scale, out, lse):
    """A check's call of lanekv's cuDNN path (``sdpa_prefill_attention``) on host segments."""
    got = sdpa_prefill_attention(q, k, v, host, scale, return_lse=True)
    out.copy_(got.out)
    lse.copy_(got.lse)


def _check_small(run, heads: int, env: Env) -> dict:
    """A variant (``run``: ``_triton(config)`` or ``_cudnn_path``) against the torch reference
    on a small batch: two requests, three segments of odd lengths (a chunk from 0, a later
    chunk, a request's tail)."""
    gen = torch.Generator(device=env.device).manual_seed(11)
    kv0, kv1 = env.check_kv
    segs = [(0, 0, kv0 * 3 // 7), (0, kv0 * 5 // 8, kv0 - kv0 * 5 // 8),
            (1, kv1 * 9 // 10, kv1 - kv1 * 9 // 10)]  # (request, q_pos, q_len)
    kv_starts = (0, kv0 + 5)
    tk = kv_starts[1] + kv1 + 3
    tq = sum(s[2] for s in segs)
    q = _randn(gen, env, tq, heads, QK_DIM)
    k = _randn(gen, env, tk, heads, QK_DIM)
    v = _randn(gen, env, tk, heads, V_DIM)
    starts, row = [], 0
    for s in segs:
        starts.append(row)
        row += s[2]
    cols = (starts, [s[2] for s in segs], [s[1] for s in segs], [kv_starts[s[0]] for s in segs])
    seg = AttnSegments(*(torch.tensor(c, dtype=torch.int32, device=env.device) for c in cols))
    scale = QK_DIM**-0.5
    out = torch.full((tq, heads, V_DIM), float("nan"), dtype=env.dtype, device=env.device)
    lse = torch.empty(tq, heads, dtype=torch.float32, device=env.device)
    run(q, k, v, seg, list(zip(*cols, strict=True)), scale, out, lse)
    want = cp_prefill_attention_ref(q, k, v, seg, scale, return_lse=True)
    out_err = rel_err(out, want.out) if not out.isnan().any() else float("nan")
    lse_err = (lse - want.lse).abs().max().item()
    return {"ref_err": out_err, "ref_lse_err": lse_err,
            "ref_ok": bool(out_err < MAX_REL_ERR and lse_err < 2e-2)}


def _inputs(n: int, heads: int, env: Env):
    gen = torch.Generator(device=env.device).manual_seed(4)
    q, k = (_randn(gen, env, n, heads, QK_DIM) for _ in "qk")
    return q, k, _randn(gen, env, n, heads, V_DIM)


def _sdpa_call(backend: str, padded: bool, q, k, v):
    qh, kh = (t.transpose(0, 1)[None] for t in (q, k))
    vh = (F.pad(v, (0, QK_DIM - V_DIM)) if padded else v).transpose(0, 1)[None]
    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def call():
        with sdpa_kernel([kind]):
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=QK_DIM**-0.5)
    return call


def _reference_out(q, k, v) -> torch.Tensor:
    """SDPA's output in [N, H, 128], v padded (every fused backend takes that form; the
    math backend only where none runs, as on a CPU dry run)."""
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, F.pad(v, (0, QK_DIM - V_DIM))))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                      SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=QK_DIM**-0.5)
    return out[0, :, :, :V_DIM].transpose(0, 1).contiguous()


def _run_job(job: str, n: int, heads: int, tensors, want, checked: dict, env: Env) -> list[dict]:
    q, k, v = tensors
    flops = causal_flops(heads, n)
    rows = []
    if job.startswith("sdpa:"):
        backend = job.split(":", 1)[1]
        for padded in (False, True):
            row = {"tokens": n, "kind": "sdpa", "config": backend,
                   "form": "v padded 192" if padded else "v 128"}
            try:
                call = _sdpa_call(backend, padded, q, k, v)
                got = call()[0, :, :, :V_DIM].transpose(0, 1)
                ms = time_ms(call, env.device)
            except RuntimeError as exc:  # the backend refuses these shapes: recorded
                row["error"] = _one_line(exc)
                rows.append(row)
                continue
            err = rel_err(got, want)
            rows.append(dict(row, ms=ms, tflops=flops / ms / 1e9, rel_err=err, ok=err < MAX_REL_ERR))
            del got
        return rows
    if job == PATH_JOB:
        return [_run_path(n, heads, tensors, want, checked, env, flops)]
    config = parse_config(job.split(":", 1)[1])
    row = {"tokens": n, "kind": "kernel", "config": config.label, "form": "v 128"}
    try:
        if config.label not in checked:
            checked[config.label] = _check_small(_triton(config), heads, env)
        row.update(checked[config.label])
        seg = AttnSegments(*(torch.tensor([x], dtype=torch.int32, device=env.device)
                             for x in (0, n, 0, 0)))
        out = torch.empty(n, heads, V_DIM, dtype=env.dtype, device=env.device)

        def call():
            return launch_cp_prefill_attention(q, k, v, seg, QK_DIM**-0.5, None, 0, out, None, config)
        row.update(_compiled_facts(call()))
        if env.device == "cuda":
            torch.cuda.synchronize()
        err = rel_err(out, want)
        ms = time_ms(call, env.device)
    except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit: recorded
        row["error"] = _one_line(exc)
        return [row]
    ok = bool(err < MAX_REL_ERR and row.get("ref_ok", False))
    return [dict(row, ms=ms, tflops=flops / ms / 1e9, rel_err=err, ok=ok)]


def _run_path(n: int, heads: int, tensors, want, checked: dict, env: Env, flops: float) -> dict:
    """lanekv's cuDNN path as the model calls it on one whole prompt (host segments; its
    output in [N, H, 128], so a copy from SDPA's layout counts where one is made)."""
    q, k, v = tensors
    row = {"tokens": n, "kind": "kernel", "config": PATH_LABEL, "form": "v 128"}
    try:
        if PATH_LABEL not in checked:
            checked[PATH_LABEL] = _check_small(_cudnn_path, heads, env)
        row.update(checked[PATH_LABEL])

        def call():
            return sdpa_prefill_attention(q, k, v, [(0, n, 0, 0)], QK_DIM**-0.5)
        err = rel_err(call(), want)
        ms = time_ms(call, env.device)
    except Exception as exc:  # noqa: BLE001 - a backend that refuses these shapes: recorded
        row["error"] = _one_line(exc)
        return row
    return dict(row, ms=ms, tflops=flops / ms / 1e9, rel_err=err,
                ok=bool(err < MAX_REL_ERR and row.get("ref_ok", False)))


def _compiled_facts(kernel) -> dict:
    """Registers per thread, spilled bytes and shared memory of the compiled kernel
    (absent under the interpreter, or where this Triton names them otherwise)."""
    facts = {}
    for key, get in (("regs", lambda: kernel.n_regs), ("spills", lambda: kernel.n_spills),
                     ("smem", lambda: kernel.metadata.shared)):
        try:
            value = get()
        except AttributeError:
            continue
        if isinstance(value, int):
            facts[key] = value
    return facts


_CONTEXT_LOST = 3


def _context_alive(env: Env) -> bool:
    if env.device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
    except Exception:  # noqa: BLE001 - any CUDA error here means the context is gone
        return False
    return True


PRECOMPILE_TOKENS = 1024  # a multiple of 16, as 8k and 32k: the same specialization


def _precompile(jobs: list[str], heads: int, env: Env, tokens: int) -> int:
    """Compile each kernel job's two specializations (the check's three segments, the
    timed call's one) by launching them on ``tokens`` tokens; ``COMPILED {...}`` per job."""
    tensors = _inputs(tokens, heads, env)
    for job in jobs:
        config = parse_config(job.split(":", 1)[1])
        t0 = time.perf_counter()
        rec = {"config": config.label}
        try:
            rec.update(_check_small(_triton(config), heads, env))
            q, k, v = tensors
            seg = AttnSegments(*(torch.tensor([x], dtype=torch.int32, device=env.device)
                                 for x in (0, tokens, 0, 0)))
            out = torch.empty(tokens, heads, V_DIM, dtype=env.dtype, device=env.device)
            rec.update(_compiled_facts(launch_cp_prefill_attention(q, k, v, seg, QK_DIM**-0.5, None,
                                                                   0, out, None, config)))
            if env.device == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - recorded; the timed run meets it again
            rec["error"] = _one_line(exc)
        rec["s"] = round(time.perf_counter() - t0, 1)
        print("COMPILED " + json.dumps(rec), flush=True)
    return 0


def worker(spec: dict) -> int:
    """Run spec["jobs"] at each of spec["tokens"] except the [tokens, job] pairs in
    spec["skip"], printing ``START [n, job]`` before each and ``ROW {...}`` per result.
    With spec["precompile"], only compile the kernel jobs (``_precompile``)."""
    heads, env = spec["heads"], _env(spec)
    if spec.get("precompile"):
        return _precompile([j for j in spec["jobs"] if j.startswith("kernel:")], heads, env,
                           spec.get("precompile_tokens", PRECOMPILE_TOKENS))
    checked: dict = {}
    for n in spec["tokens"]:
        todo = [job for job in spec["jobs"] if [n, job] not in spec["skip"]]
        if not todo:
            continue
        tensors = _inputs(n, heads, env)
        want = _reference_out(*tensors)
        for job in todo:
            print("START " + json.dumps([n, job]), flush=True)
            for row in _run_job(job, n, heads, tensors, want, checked, env):
                print("ROW " + json.dumps(row), flush=True)
            if not _context_alive(env):  # a fault (illegal address) sticks to the context
                return _CONTEXT_LOST
            if env.device == "cuda":
                torch.cuda.empty_cache()
        del tensors, want
    return 0


# ---- parent side -------------------------------------------------------------------------


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)  # the worker closed its output


def run_jobs(jobs: list[str], tokens: list[int], heads: int,
             worker_argv: tuple[str, ...] = (sys.executable, __file__, "--worker"),
             job_timeout_s: float = 240.0, on_row=None) -> list[dict]:
    """All (tokens, job) pairs in worker processes. A job whose worker dies, or that
    prints nothing for ``job_timeout_s`` (a hung kernel: the worker is killed), is
    recorded and skipped at every length, and a fresh worker takes the rest.
    ``on_row(rows)`` runs after each new row (the caller saves what it has)."""
    rows: list[dict] = []
    done: list[list] = []
    dead: set[str] = set()
    while True:
        skip = done + [[n, j] for n in tokens for j in dead]
        if all([n, j] in skip for n in tokens for j in jobs):
            return rows
        spec = {"jobs": jobs, "tokens": tokens, "heads": heads, "skip": skip}
        proc = subprocess.Popen([*worker_argv, json.dumps(spec)], stdout=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
        current, done_before, hung = None, len(done), False
        while True:
            try:
                line = lines.get(timeout=job_timeout_s)
            except queue.Empty:
                hung = True
                proc.kill()
                break
            if line is None:
                break
            if line.startswith("START "):
                current = json.loads(line[6:])
                print(f"  {current[0]:>6} tokens: {current[1]}", file=sys.stderr, flush=True)
            elif line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
                if current is not None and current not in done:
                    done.append(current)
                if on_row is not None:
                    on_row(rows)
        code = proc.wait()
        if code == 0 and not hung:
            return rows
        why = (f"no output for {job_timeout_s:.0f} s: worker killed" if hung
               else f"worker process died (exit status {code})")
        if current is not None and current not in done:
            n, job = current
            kind, config = job.split(":", 1)
            rows.append({"tokens": n, "kind": "kernel" if kind == "kernel" else "sdpa",
                         "config": parse_config(config).label if kind == "kernel" else config,
                         "form": "v 128", "error": why})
            done.append(current)
            dead.add(job)
            if on_row is not None:
                on_row(rows)
        elif len(done) == done_before:  # died before its first job: give up on the rest
            rows.append({"tokens": None, "kind": "worker", "config": "-",
                         "error": f"{why} before any job"})
            return rows
        # else: the worker left after a job broke its CUDA context; a fresh one goes on


def precompile(jobs: list[str], heads: int, processes: int, timeout_s: float,
               worker_argv: tuple[str, ...] = (sys.executable, __file__, "--worker")) -> list[dict]:
    """Compile the kernel jobs in up to ``processes`` concurrent workers (round-robin
    shares); their ``COMPILED`` records. A worker past ``timeout_s`` is killed."""
    kernel_jobs = [j for j in jobs if j.startswith("kernel:")]
    shares = [kernel_jobs[i::processes] for i in range(max(1, processes))]
    procs = [subprocess.Popen([*worker_argv, json.dumps({"jobs": share, "tokens": [], "heads": heads,
                                                          "skip": [], "precompile": True})],
                              stdout=subprocess.PIPE, text=True) for share in shares if share]
    deadline = time.monotonic() + timeout_s
    records = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        records += [json.loads(x[9:]) for x in out.splitlines() if x.startswith("COMPILED ")]
    return records


def drop_failed_compiles(jobs: list[str], records: list[dict], tokens: list[int],
                         ) -> tuple[list[str], list[dict]]:
    """The jobs worth timing after the parallel compile, and an error row per length for
    each kernel job it failed: an error, a wrong answer on the reference check, or no
    record at all (its worker died or ran out of time: a hang is not met twice)."""
    seen = {rec["config"]: rec for rec in records}
    keep, refused = [], []
    for job in jobs:
        kind, name = job.split(":", 1)
        rec = seen.get(parse_config(name).label) if kind == "kernel" else {"ref_ok": True}
        why = ("no result from the parallel compile" if rec is None else
               rec.get("error") or (None if rec.get("ref_ok") else
                                    f"wrong on the reference check (ref_err {rec.get('ref_err')})"))
        if why is None:
            keep.append(job)
        else:
            refused += [{"tokens": n, "kind": "kernel", "config": parse_config(name).label,
                         "form": "v 128", "error": f"precompile: {why}"} for n in tokens]
    return keep, refused


def summarize(rows: list[dict]) -> dict:
    """Per length: each backend's fastest form, the fastest SDPA, and every kernel row against it."""
    summary = {}
    for n in sorted({r["tokens"] for r in rows if r.get("tokens")}):
        sdpa = {}
        for r in rows:
            if r["tokens"] == n and r["kind"] == "sdpa" and "ms" in r and r.get("ok"):
                if r["config"] not in sdpa or r["ms"] < sdpa[r["config"]]["ms"]:
                    sdpa[r["config"]] = r
        best_sdpa = min(sdpa.values(), key=lambda r: r["ms"]) if sdpa else None
        kernels = [r for r in rows if r["tokens"] == n and r["kind"] == "kernel"]
        for r in kernels:
            if "ms" in r:
                for backend, s in sdpa.items():
                    r[f"vs_{backend}"] = s["ms"] / r["ms"]
                if best_sdpa is not None:
                    r["vs_best_sdpa"] = best_sdpa["ms"] / r["ms"]
        good = [r for r in kernels if r.get("ok") and "ms" in r]
        best = min(good, key=lambda r: r["ms"]) if good else None
        summary[str(n)] = {
            "sdpa": {b: {"form": s["form"], "ms": s["ms"], "tflops": s["tflops"]} for b, s in sdpa.items()},
            "best_sdpa": None if best_sdpa is None else f"{best_sdpa['config']} ({best_sdpa['form']})",
            "best_kernel": None if best is None else best["config"],
            "best_kernel_tflops": None if best is None else best["tflops"],
            "best_vs_sdpa": None if best is None else best.get("vs_best_sdpa"),
            "meets_target": None if best is None or best_sdpa is None else best["vs_best_sdpa"] >= TARGET,
        }
    return summary


def print_table(title: str, rows: list[dict], keys: list[str]) -> None:
    print(f"\n== {title} ==")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = []
        for key in keys:
            v = r.get(key, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--configs", type=parse_config, nargs="+", default=list(MLA_PREFILL_SWEEP))
    ap.add_argument("--backends", nargs="*", choices=BACKENDS, default=list(BACKENDS))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--job-timeout", type=float, default=240.0,
                    help="seconds a job may print nothing (compile included) before its worker is killed")
    ap.add_argument("--precompile-timeout", type=float, default=90.0,
                    help="seconds the parallel compile may take in all; configs it has not "
                         "finished by then are recorded and not timed")
    ap.add_argument("--precompile", type=int, default=8,
                    help="worker processes compiling the kernel configs first (0: compile as timed)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(json.loads(args.worker))
    if not torch.cuda.is_available():
        print("bench/mla_prefill_sweep.py times compiled kernels and needs a CUDA GPU", file=sys.stderr)
        return 2
    for n in args.tokens:
        if n < 1:
            print(f"--tokens must be >= 1, got {n}", file=sys.stderr)
            return 2
    jobs = [f"sdpa:{b}" for b in args.backends] + [f"kernel:{c.label}" for c in args.configs]
    if "cudnn" in args.backends:
        jobs.append(PATH_JOB)
    head = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cudnn": torch.backends.cudnn.version(),
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "heads": args.heads, "qk_dim": QK_DIM, "v_dim": V_DIM}

    started = time.monotonic()
    refused: list[dict] = []
    if args.precompile > 0:
        head["precompile"] = precompile(jobs, args.heads, args.precompile, args.precompile_timeout)
        for rec in head["precompile"]:
            print(f"  compiled {rec['config']} in {rec['s']} s"
                  + (f": {rec['error']}" if "error" in rec else ""), file=sys.stderr, flush=True)
        jobs, refused = drop_failed_compiles(jobs, head["precompile"], args.tokens)

    def save(rows: list[dict]) -> None:  # after every row, so a cut-off run keeps its rows
        if args.json:
            args.json.write_text(json.dumps(dict(head, rows=refused + rows), indent=2))
    rows = refused + run_jobs(jobs, args.tokens, args.heads, job_timeout_s=args.job_timeout,
                              on_row=save)
    summary = summarize(rows)
    result = dict(head, rows=rows, summary=summary)
    print_table("sdpa", [r for r in rows if r["kind"] != "kernel"],
                ["tokens", "config", "form", "ms", "tflops", "rel_err", "ok", "error"])
    cols = ["tokens", "config", "ms", "tflops", "vs_best_sdpa"] + [f"vs_{b}" for b in args.backends] + [
        "rel_err", "ref_err", "ok", "regs", "spills", "smem", "error"]
    print_table("kernel variants", [r for r in rows if r["kind"] == "kernel"], cols)
    print()
    for n, s in summary.items():
        ratio = s["best_vs_sdpa"]
        print(f"{n} tokens: best kernel {s['best_kernel']} at "
              f"{s['best_kernel_tflops'] or 0:.0f} TFLOP/s, "
              f"{'-' if ratio is None else f'{ratio:.3f}'}x the fastest SDPA ({s['best_sdpa']}); "
              f"target >= {TARGET}x: {'met' if s['meets_target'] else 'not met'}")
    result["wall_s"] = round(time.monotonic() - started, 1)
    print(f"wall time {result['wall_s']} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
