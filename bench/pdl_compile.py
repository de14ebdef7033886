"""Compile every kernel ``kernels.pdl`` converted for Hopper, with PDL on, without a GPU.

Each case of ``bench/pdl_cases.py`` runs its launcher on CPU tensors with the switch
forced on and its launches recorded instead of run (the arguments, constexprs and launch
options each kernel gets: the signature comes from the launcher, not from a copy of
it). Every launch must carry ``USE_PDL=True`` and ``launch_pdl=True``; each is then
compiled for ``sm_90`` with Triton's own toolchain, and its PTX must hold
``griddepcontrol.wait`` and ``griddepcontrol.launch_dependents``. Prints one line per
kernel and exits 1 on a miss. Run with the interpreter off:

    python bench/pdl_compile.py [--only add_rmsnorm] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import lanekv  # noqa: F401  (the package first)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from lanekv.kernels import pdl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from bench.pdl_cases import CASES  # noqa: E402

WAIT, LAUNCH = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8",
          torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl")


class Launch(NamedTuple):
    """One kernel launch as a launcher made it: every parameter bound (defaults applied)
    and the launch options (``num_warps``, ``launch_pdl``, ...)."""

    kernel: Any  # JITFunction, or InterpretedFunction under the interpreter
    name: str
    args: dict[str, Any]
    options: dict[str, Any]


@contextlib.contextmanager
def recording(run: bool) -> Iterator[list[Launch]]:
    """Every Triton launch inside is appended to the yielded list; ``run=False`` skips
    the kernels themselves (what the launchers compute is then garbage)."""
    seen: list[Launch] = []
    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def recorder(original):
        def record(self, *args, grid, warmup, **kwargs):
            params = inspect.signature(self.fn).parameters
            bound = inspect.signature(self.fn).bind(
                *args, **{k: v for k, v in kwargs.items() if k in params})
            bound.apply_defaults()
            seen.append(Launch(self, self.fn.__name__, dict(bound.arguments),
                               {k: v for k, v in kwargs.items() if k not in params}))
            if run:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            return None
        return record

    try:
        for cls, original in originals.items():
            cls.run = recorder(original)
        yield seen
    finally:
        for cls, original in originals.items():
            cls.run = original


@contextlib.contextmanager
def pdl_forced_on() -> Iterator[None]:
    """The switch on whatever the device (CPU tensors included): what a launch would pass."""
    original = pdl.pdl_enabled
    pdl.pdl_enabled = lambda device: True
    try:
        yield
    finally:
        pdl.pdl_enabled = original


def record_case(name: str, dtype: torch.dtype = torch.bfloat16) -> list[Launch]:
    """The launches of one case with PDL forced on, none of them run."""
    with pdl_forced_on(), recording(run=False) as seen:
        CASES[name](dtype)
    return seen


def _arg_type(name: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"{name}: no compile signature for a {type(value).__name__}")


def compile_ptx(launch: Launch, *, use_pdl: bool = True) -> str:
    """``launch``'s kernel compiled for sm_90 with its arguments' types and constexprs
    (``USE_PDL`` as given), every 16-byte aligned tensor declared so; its PTX."""
    fn: JITFunction = launch.kernel
    sig, consts, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = launch.args[param.name]
        if param.name == "USE_PDL":
            value = use_pdl
        if param.is_constexpr or value is None:
            sig[param.name], consts[param.name] = "constexpr", value
            continue
        sig[param.name] = _arg_type(param.name, value)
        if isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: launch.options[k] for k in _OPTIONS if k in launch.options}
    if not use_pdl:
        options.pop("launch_pdl", None)
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    return kernel.asm["ptx"]


def check_case(name: str, control: bool = False) -> list[dict]:
    """A row per launch of the case; ``control``: each also compiled with ``USE_PDL=False``
    (whose PTX must hold neither instruction: the constexpr is the switch)."""
    rows = []
    for launch in record_case(name):
        start = time.perf_counter()
        ptx = compile_ptx(launch)
        row = dict(case=name, kernel=launch.name, use_pdl=launch.args.get("USE_PDL"),
                   launch_pdl=launch.options.get("launch_pdl"), wait=WAIT in ptx,
                   launch_dependents=LAUNCH in ptx,
                   compile_s=round(time.perf_counter() - start, 2))
        if control:
            off = compile_ptx(launch, use_pdl=False)
            row.update(wait_when_off=WAIT in off, launch_dependents_when_off=LAUNCH in off)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(CASES),
                        help="a case of bench/pdl_cases.py (repeatable); default: all")
    parser.add_argument("--control", action="store_true",
                        help="also compile each with USE_PDL=False (its PTX must lack both)")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    from lanekv.kernels.backend import interpreter_enabled
    if interpreter_enabled():
        sys.exit("bench/pdl_compile.py compiles for sm_90: run it with TRITON_INTERPRET unset")
    rows = [row for name in (args.only or CASES) for row in check_case(name, args.control)]
    for row in rows:
        print(f"{row['case']:26} {row['kernel']:34} USE_PDL={row['use_pdl']!s:5} "
              f"launch_pdl={row['launch_pdl']!s:5} wait={row['wait']!s:5} "
              f"launch_dependents={row['launch_dependents']!s:5} {row['compile_s']:6.2f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if not (r["use_pdl"] is True and r["launch_pdl"] is True and r["wait"]
                                   and r["launch_dependents"]) or r.get("wait_when_off")
           or r.get("launch_dependents_when_off")]
    print(f"triton {triton.__version__}, sm_90: {len(rows)} launches of "
          f"{len({r['kernel'] for r in rows})} kernels, {len(bad)} missing PDL")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
