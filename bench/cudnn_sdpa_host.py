"""What one cuDNN attention call costs the host, on the prefill path's shapes.

In the model, the cuDNN prefill path (``kernels/prefill/sdpa.py``) ran slower than the
Triton kernel although cuDNN's kernel is faster (bench/prefill_attention.py, sixteenth
session): the profile showed about 1.5 ms of host time in each
``aten::_cudnn_attention_forward`` against about 0.2 ms of device time. torch keeps
cuDNN's attention graphs in a per-thread cache, and the threaded CP prefill then ran each
rank on a thread started per call (``ThreadGroup.run``; its rank threads last since). This
probe times the host side of one
call (launched back to back, no sync) and its device time, on the path's own call
(``attend_cudnn``) with ``[rows, heads, dim]`` views as the model passes them:

- ``same thread``: every call on the thread that made the first (the cache warm);
- ``fresh thread``: each batch of calls on a new thread (as ``ThreadGroup.run`` did);
- ``fresh thread, 1 call``: the first call on a new thread alone;
- ``new lengths``: the first call at each of a few other lengths of the same power-of-two
  bucket, on the warm thread (a new shape builds a new graph, unless torch's
  ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` keys its cache by the bucket: run the probe with
  and without it; torch reads it once per process).

    python bench/cudnn_sdpa_host.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import lanekv  # noqa: F401  (the package first: the repository's lanekv/ folder alone is not it)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.kernels.prefill.sdpa import attend_cudnn  # noqa: E402

# (name, heads, qk dim, v dim, query rows, key rows, causal, with the log-sum-exp)
CASES = (
    ("v2-lite 8k causal", 16, 192, 128, 8192, 8192, True, False),
    ("v2-lite 4k chunk, keys before", 16, 192, 128, 4096, 4096, False, True),
    ("v2-lite 4k chunk, own keys", 16, 192, 128, 4096, 4096, True, True),
    ("llama 8k causal (kv repeated)", 32, 128, 128, 8192, 8192, True, False),
)


def _inputs(heads: int, dqk: int, dv: int, rows: int, keys: int) -> tuple[torch.Tensor, ...]:
    """``[1, H, rows, D]`` views of ``[rows, H, D]`` tensors, as the path makes them."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    q = torch.randn(rows, heads, dqk, device=dev, dtype=dt)
    k = torch.randn(keys, heads, dqk, device=dev, dtype=dt)
    v = torch.randn(keys, heads, dv, device=dev, dtype=dt)
    return tuple(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))


def _host_us(call, n: int) -> float:
    """Host microseconds per call, ``n`` calls launched back to back (after a sync)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def _on_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def probe(calls: int) -> list[dict]:
    rows = []
    for name, heads, dqk, dv, n, keys, causal, lse in CASES:
        q, k, v = _inputs(heads, dqk, dv, n, keys)
        scale = dqk ** -0.5

        def call(q=q, k=k, v=v, causal=causal, lse=lse, scale=scale):
            return attend_cudnn(q, k, v, causal, scale, lse)

        first_us = _host_us(call, 1)  # this thread's first: the graph is built
        same_us = _host_us(call, calls)
        fresh_us = _on_thread(lambda call=call: _host_us(call, calls))
        fresh_first_us = _on_thread(lambda call=call: _host_us(call, 1))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        device_us = start.elapsed_time(end) / calls * 1e3
        new_us = []
        for cut in (1, 7, 100, 1000):  # shorter prompts in the same power-of-two bucket
            qs, ks, vs = q[:, :, cut:], k[:, :, cut:], v[:, :, cut:]
            new_us.append(_host_us(lambda qs=qs, ks=ks, vs=vs, causal=causal, lse=lse, scale=scale:
                                   attend_cudnn(qs, ks, vs, causal, scale, lse), 1))
        row = dict(case=name, heads=heads, qk_dim=dqk, v_dim=dv, rows=n, keys=keys, causal=causal,
                   with_lse=lse, first_call_host_us=first_us, same_thread_host_us=same_us,
                   fresh_thread_host_us=fresh_us, fresh_thread_first_call_host_us=fresh_first_us,
                   device_us=device_us, new_length_first_call_host_us=new_us,
                   avoid_recompile=os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", ""))
        rows.append(row)
        print(f"{name:>32}: first {first_us:9.0f} us, same thread {same_us:7.0f} us, fresh thread "
              f"{fresh_us:7.0f} us (its first {fresh_first_us:7.0f}), device {device_us:7.0f} us, "
              f"new lengths {' '.join(f'{u:.0f}' for u in new_us)} us",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None, help="a new file (refused if it exists)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/cudnn_sdpa_host.py needs a CUDA device")
    if args.calls < 1:
        ap.error(f"--calls must be at least 1, got {args.calls}")
    if args.json is not None and args.json.exists():
        ap.error(f"--json {args.json} exists; results are never overwritten")
    rows = probe(args.calls)
    if args.json is not None:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                             cudnn=torch.backends.cudnn.version(),
                                             date=time.strftime("%Y-%m-%d", time.gmtime()),
                                             rows=rows), indent=1))


if __name__ == "__main__":
    main()
