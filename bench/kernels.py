"""All kernel benchmarks in one run (needs a CUDA GPU): prefill attention
against SDPA flash/cuDNN, and the KV copies and paged decode against a
device-to-device copy of the same bytes.

    python bench/kernels.py --json bench/results/kernels_h200.json

Each part also runs alone with more options: bench/kernels_attention.py
(tile sweeps) and bench/kernels_copy.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import kernels_attention, kernels_copy  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py times the compiled Triton kernels and needs a CUDA GPU", file=sys.stderr)
        return 2
    attention: list[dict] = []
    copies: list[dict] = []
    kernels_attention.run(attention)
    kernels_copy.run(copies)
    for name, rows in (("attention", attention), ("copies and decode", copies)):
        print(f"\n== {name} ==")
        for row in rows:
            print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.json:
        args.json.write_text(json.dumps(
            dict(device=torch.cuda.get_device_name(0), attention=attention, copies=copies), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
