"""Compile the MLA prefill attention variants for Hopper without a GPU.

Each config of ``MLA_PREFILL_VARIANTS`` (or ``--configs``) is compiled for ``sm_90`` as the
sweep's timed call launches it (128 heads, qk 192 = 128 + 64, v 128, bf16, contiguous K/V,
one segment, no log-sum-exp) and reported: shared memory, registers and local (spill) bytes
per thread (cuobjdump, as ``bench/mla_chain_compile.py`` reads them), ptxas's spill stores,
whether the loop was
warp-specialized (a ``ttg.warp_specialize`` region in the TTGIR, with its partitions' warp
counts), the ``wgmma`` waits in the PTX, and ptxas's own warnings when it serializes the
wgmma pipeline (C7514/C7515, from re-assembling the PTX with ``-v``).

Run it with the device's Triton first on the path to see the device's compiler, e.g.

    PYTHONPATH=/tmp/tri36/site python bench/mla_prefill_compile.py --json compile.json
    python bench/mla_prefill_compile.py --configs 128,128,8,2 128,64,8,3+tma+rescale_lazy
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import lanekv  # noqa: F401  (the package first)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from lanekv.kernels.prefill.attention import kernel_constexprs  # noqa: E402
from lanekv.kernels.prefill.config import MLA_PREFILL_VARIANTS, AttnLaunchConfig  # noqa: E402
from lanekv.kernels.prefill.kernel import _cp_prefill_attention_kernel  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.mla_chain_compile import resource_usage  # noqa: E402
from bench.mla_prefill_sweep import parse_config  # noqa: E402

HEADS, QK_DIM, V_DIM = 128, 192, 128
# 8k tokens of [N, 128, D] tensors: every stride but the last is a multiple of 16 elements
_STRIDES = dict(stride_qt=HEADS * QK_DIM, stride_qh=QK_DIM, stride_kt=HEADS * QK_DIM,
                stride_kh=QK_DIM, stride_vt=HEADS * V_DIM, stride_vh=V_DIM,
                stride_ot=HEADS * V_DIM, stride_oh=V_DIM, stride_lt=0, stride_lh=0, stride_pt=0)


def signature(config: AttnLaunchConfig) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attributes) of the sweep's timed launch of ``config``."""
    consts = kernel_constexprs(config, heads=HEADS, kv_heads=HEADS, qk_dim=QK_DIM, v_dim=V_DIM,
                               paged=False, page_size=0, store_lse=False, num_segments=1,
                               float32=False, interpret=False)
    bn = config.block_n
    descs = ((f"tensordesc<bf16[{bn}, 128]>", f"tensordesc<bf16[{bn}, 64]>",
              f"tensordesc<bf16[{bn}, 128]>") if config.tma else ("*bf16",) * 3)
    sig = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", LSE="*bf16", k_desc=descs[0],
               k_tail_desc=descs[1], v_desc=descs[2], seg_q_start="*i32", seg_q_len="*i32",
               seg_q_pos="*i32", seg_kv_start="*i32", num_segments="i32", q_rows="i32",
               page_table="*i32",
               **{name: "i32" for name in _STRIDES}, qk_scale="fp32")
    sig.update({name: "constexpr" for name in consts})
    names = list(sig)
    divisible = [n for n, t in sig.items() if t.startswith("*")]
    divisible += [n for n, v in _STRIDES.items() if v and v % 16 == 0]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    return sig, consts, attrs


def ptxas_report(ptx: str) -> dict:
    """Re-assemble the PTX with ``ptxas -v``: spill stores (bytes; cuobjdump's LOCAL misses
    spills inside a warp-specialized kernel's setmaxnreg regions) and the wgmma
    serialization warnings (C7514/C7515), one line each."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True)
    text = run.stdout + run.stderr
    spills = re.search(r"(\d+) bytes spill stores", text)
    warnings = sorted({re.sub(r"^.*?\(C75", "(C75", ln).strip()[:160] for ln in text.splitlines()
                       if "C751" in ln})
    return dict(spill_stores=int(spills.group(1)) if spills else None, ptxas=warnings)


def schedule(ptx: str) -> str:
    """The PTX's order of tensor-core work and exponentials, compressed: ``W8`` eight
    wgmma in a row, ``w0`` a wgmma.wait_group 0, ``ex2`` a run of exponentials, ``|`` a
    basic block's label (loops show as repeated spans)."""
    out: list[str] = []
    for line in ptx.splitlines():
        t = line.strip()
        if t.startswith("wgmma.mma_async"):
            if out and out[-1].startswith("W"):
                out[-1] = f"W{int(out[-1][1:]) + 1}"
            else:
                out.append("W1")
        elif t.startswith("wgmma.wait_group"):
            out.append("w" + t.split()[-1].rstrip(";"))
        elif t.startswith("ex2.approx") and (not out or out[-1] != "ex2"):
            out.append("ex2")
        elif re.match(r"^\$L__BB\d+_\d+:", t) and (not out or out[-1] != "|"):
            out.append("|")
    return " ".join(out)


def compile_config(config: AttnLaunchConfig) -> dict:
    sig, consts, attrs = signature(config)
    kernel = triton.compile(ASTSource(_cp_prefill_attention_kernel, sig, consts, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    regs, local = resource_usage(kernel)
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    ws = re.findall(r"partition\d+\(.*?num_warps\((\d+)\)", ttgir)
    return dict(config=config.label, shared=kernel.metadata.shared, registers=regs,
                local_bytes=local, warp_specialized="ttg.warp_specialize" in ttgir,
                partition_warps=[int(w) for w in ws],
                setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                wgmma_waits=len(re.findall(r"wgmma\.wait_group", ptx)), **ptxas_report(ptx),
                schedule=schedule(ptx))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=parse_config, nargs="+", default=list(MLA_PREFILL_VARIANTS))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    print(f"triton {triton.__version__}, sm_90", flush=True)
    for config in args.configs:
        try:
            row = compile_config(config)
        except Exception as exc:  # noqa: BLE001 - a compiler failure is a result here
            row = dict(config=config.label, error=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(triton=triton.__version__, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
