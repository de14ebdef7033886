"""Where the warp-specialized prefill attention goes wrong on a GPU (issue 37, item 3).

The H200 sweep of the tenth session found every ``warp_specialize`` variant wrong on its
reference check (``bench/mla_prefill_sweep.py``: the output, filled with NaN first, kept
NaN somewhere), while the interpreter tests pass. This probe launches each variant three
times with the output filled with a sentinel and names every (segment, query block, head)
left unstored, holding NaN or wrong against the torch reference, and the worst error of
the good ones: at 2 and 3 stages, qk 128 (no tail part), heads on the grid's fast axis,
128x128 tiles, and one 8k request.

Usage (a GPU): python3 bench/probe_ws_prefill.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lanekv.kernels.prefill.attention import launch_cp_prefill_attention  # noqa: E402
from lanekv.kernels.prefill.config import AttnLaunchConfig  # noqa: E402
from lanekv.kernels.prefill.reference import AttnSegments, cp_prefill_attention_ref  # noqa: E402

SENTINEL = 7.0  # the output's fill: rows still holding it were never stored
REPEATS = 3  # launches per variant: the failures differ from launch to launch


def probe(config: AttnLaunchConfig, segs, kv_starts, tk, heads, qk_dim, v_dim) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(3)
    tq = sum(s[2] for s in segs)
    q = torch.randn(tq, heads, qk_dim, generator=gen, device="cuda").bfloat16()
    k = torch.randn(tk, heads, qk_dim, generator=gen, device="cuda").bfloat16()
    v = torch.randn(tk, heads, v_dim, generator=gen, device="cuda").bfloat16()
    starts, row = [], 0
    for s in segs:
        starts.append(row)
        row += s[2]
    cols = (starts, [s[2] for s in segs], [s[1] for s in segs], [kv_starts[s[0]] for s in segs])
    seg = AttnSegments(*(torch.tensor(c, dtype=torch.int32, device="cuda") for c in cols))
    scale = qk_dim**-0.5
    want = cp_prefill_attention_ref(q, k, v, seg, scale, return_lse=True)
    bad_blocks, worst_good = [], 0.0
    for rep in range(REPEATS):
        out = torch.full((tq, heads, v_dim), SENTINEL, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((tq, heads), SENTINEL, dtype=torch.float32, device="cuda")
        try:
            launch_cp_prefill_attention(q, k, v, seg, scale, None, 0, out, lse, config)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a probe reports every failure
            return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        for i, (start, s) in enumerate(zip(starts, segs, strict=True)):
            for b0 in range(0, s[2], config.block_m):
                rows = slice(start + b0, start + min(b0 + config.block_m, s[2]))
                for h in range(heads):
                    o = out[rows, h].float()
                    err = (o - want.out[rows, h].float()).abs().amax().item()
                    kind = ("unstored" if bool((o == SENTINEL).all()) else
                            "nan" if bool(o.isnan().any()) else "wrong" if err > 0.1 else None)
                    if not kind:
                        worst_good = max(worst_good, err)
                    else:
                        bad_blocks.append(f"rep {rep} seg {i} block {b0 // config.block_m} head {h}: "
                                          f"{kind} (lse {lse[rows, h][:2].tolist()})")
    return {"bad_blocks": bad_blocks, "max_abs_err_good": worst_good}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    two_requests = ([(0, 0, 300), (0, 437, 263), (1, 299, 34)], (0, 705), 1041)
    one_short = ([(0, 0, 300)], (0,), 300)
    long_one = ([(0, 0, 8192)], (0,), 8192)
    ws = dict(tma=True, warp_specialize=True)
    cases = {
        "ws 128x64 s2 qk192 two requests": (AttnLaunchConfig(128, 64, 4, 2, **ws), two_requests, 192),
        "ws 128x64 s3 qk192 two requests": (AttnLaunchConfig(128, 64, 4, 3, **ws), two_requests, 192),
        "ws 128x64 s2 qk128 two requests": (AttnLaunchConfig(128, 64, 4, 2, **ws), two_requests, 128),
        "ws 128x64 s2 qk192 300 rows": (AttnLaunchConfig(128, 64, 4, 2, **ws), one_short, 192),
        "ws 128x64 s2 heads fast two": (AttnLaunchConfig(128, 64, 4, 2, heads_fast=True, **ws),
                                        two_requests, 192),
        "ws 128x128 s2 qk192 two requests": (AttnLaunchConfig(128, 128, 4, 2, **ws), two_requests, 192),
        "ws 128x64 s2 qk192 8k": (AttnLaunchConfig(128, 64, 4, 2, **ws), long_one, 192),
    }
    results = {}
    for name, (cfg, (segs, kv_starts, tk), qk) in cases.items():
        res = probe(cfg, segs, kv_starts, tk, 4, qk, 128)
        results[name] = res
        if "error" in res:
            print(f"{name}: {res['error']}")
            continue
        print(f"{name}: {len(res['bad_blocks'])} bad (block, head) over {REPEATS} launches; "
              f"max abs err of the good blocks {res['max_abs_err_good']}")
        for line in res["bad_blocks"][:6]:
            print(f"  {name}: {line}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
