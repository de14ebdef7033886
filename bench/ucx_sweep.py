"""UCX settings for NIXL on one host: a raw NIXL read of the same bytes under each.

Each row runs ``bench.nixl_transfer.raw_nixl_gbps`` (two NIXL agents of one
process, one reading the other's registered buffer in 64 MiB descriptors) in
a fresh process with the row's UCX environment, since UCX reads its variables
when an agent starts. Host memory over UCX TCP is the cross-host TCP data
plane's own rate; GPU memory adds the staging through host buffers
(``cuda_copy``) or, where UCX has it, ``cuda_ipc``. README.md's UCX knobs cite
this table.

    python bench/ucx_sweep.py --mib 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# (name, memory, UCX environment)
SEG = {"UCX_TCP_TX_SEG_SIZE": "512k", "UCX_TCP_RX_SEG_SIZE": "512k"}
ROWS = [
    ("tcp", "cpu", {"UCX_TLS": "tcp,self"}),
    ("tcp seg512k", "cpu", {"UCX_TLS": "tcp,self", **SEG}),
    ("tcp seg512k buf16m", "cpu", {"UCX_TLS": "tcp,self", **SEG, "UCX_TCP_SNDBUF": "16m", "UCX_TCP_RCVBUF": "16m"}),
    ("tcp seg2m", "cpu", {"UCX_TLS": "tcp,self", "UCX_TCP_TX_SEG_SIZE": "2m", "UCX_TCP_RX_SEG_SIZE": "2m"}),
    ("tcp seg512k zcopy", "cpu", {"UCX_TLS": "tcp,self", **SEG, "UCX_RNDV_SCHEME": "get_zcopy"}),
    ("shared memory", "cpu", {"UCX_TLS": "posix,cma,self"}),
    ("default", "cpu", {}),
    ("tcp+cuda_copy", "cuda", {"UCX_TLS": "tcp,cuda_copy,self"}),
    ("tcp+cuda_copy seg512k", "cuda", {"UCX_TLS": "tcp,cuda_copy,self", **SEG}),
    ("tcp+cuda_copy seg512k frag8m", "cuda",
     {"UCX_TLS": "tcp,cuda_copy,self", **SEG, "UCX_RNDV_FRAG_SIZE": "host:8m,cuda:8m"}),
    ("cuda_ipc", "cuda", {"UCX_TLS": "cuda_ipc,cuda_copy,self,sm"}),
    ("default", "cuda", {}),
]

ONE = """
import sys, torch
from bench.nixl_transfer import raw_nixl_gbps
print("GBPS", raw_nixl_gbps(int(sys.argv[1]), torch.device(sys.argv[2]), 2, None))
"""


def one(nbytes: int, memory: str, env: dict[str, str], timeout_s: float) -> tuple[float | None, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")} | env
    try:
        done = subprocess.run([sys.executable, "-c", ONE, str(nbytes), memory], env=full, capture_output=True,
                              text=True, timeout=timeout_s, cwd=Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        return None, f"over {timeout_s:.0f} s"
    for line in done.stdout.splitlines():
        if line.startswith("GBPS "):
            return float(line.split()[1]), ""
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return None, last[:120]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--timeout-s", type=float, default=30.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import torch

    rows = []
    for name, memory, env in ROWS:
        if memory == "cuda" and not torch.cuda.is_available():
            continue
        gbps, error = one(args.mib << 20, memory, env, args.timeout_s)
        rows.append({"setting": name, "memory": memory, "env": env, "gbps": gbps, "error": error})
        print(f"{name:32s} {memory:5s} {'' if gbps is None else f'{gbps:7.2f}'} {error}", flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "mib": args.mib, "rows": rows,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if args.json is not None:
        if args.json.exists():
            raise SystemExit(f"--json {args.json} exists; every run writes a new file")
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
