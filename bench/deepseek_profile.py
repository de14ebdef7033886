"""Kernels per layer of one DeepSeek decode step (the launches the step's CUDA graph replays).

Builds the model of ``bench/deepseek.py`` (dummy weights), a pool with ``--context``
random rows per request, and runs one decode step (``decode.cuda.step.step_hidden``,
what the engine runs eagerly and captures) after a warm-up:

- on CUDA under ``torch.profiler``: every device kernel, memcpy and memset, each
  attributed to the decoder layer whose forward launched it (a ``record_function``
  range per layer; launches outside every layer are "outside"), counted by name;
- on CPU (and with ``--ops`` on CUDA too): the aten ops each layer dispatches (a
  ``TorchDispatchMode``; views and allocations, which launch nothing, apart), a proxy for
  the launches (on CPU it includes the launchers' range checks, ``item``, ``min``, ``max``
  and the like, which CUDA tensors skip).
  On CPU the kernels run their torch references, unless ``--interpret``: then the
  Triton kernels run under the interpreter (as the tests run them) and each launch
  counts by kernel name, beside the aten ops outside the kernels: the CUDA step's
  launches, counted on a CPU.

Prints a table of the first dense layer, the first MoE layer and the outside part
(kernel names with their counts and total device time), the count per layer, and
writes everything to ``--json``; on CUDA also layer 0's kernels in launch order with
their device times, and with ``--fp8`` the config and the quantization (inside the
GEMM or first) each FP8 linear of layer 0 and of the first MoE layer launches with at
``--batch`` rows.

GPU:  python bench/deepseek_profile.py --v2-lite --batch 1 --context 1024 --json prof_v2.json
      python bench/deepseek_profile.py --llama3-8b --fp8 --batch 64 --json prof_llama_fp8.json
      python bench/deepseek_profile.py --v32 --batch 1 --context 32768 --json prof_v32.json
CPU:  python bench/deepseek_profile.py --tiny --batch 1 --context 40 --interpret
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--interpret" in sys.argv:  # before the kernel modules are imported
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["LANEKV_CPU_KERNELS"] = "triton"

import torch  # noqa: E402
from lanekv.decode.cuda.step import step_hidden  # noqa: E402
from lanekv.decode.pool import PagePool  # noqa: E402
from lanekv.model.checkpoint import load_dummy_model  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.deepseek import CONFIGS as DEEPSEEK_CONFIGS  # noqa: E402
from bench.deepseek import fill_pool  # noqa: E402
from bench.fp8 import FP8_CONFIG  # noqa: E402  (--fp8: the dummy weights quantized blockwise)
from bench.prefill import LLAMA3_8B  # noqa: E402

CONFIGS = {**DEEPSEEK_CONFIGS, "llama3_8b": LLAMA3_8B}

OUTSIDE = "outside"
_LAYER_PREFIX = "lanekv.layer."
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# aten ops that only make a view (no kernel on CUDA)
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "slice", "select", "split", "split_with_sizes", "chunk", "unsqueeze",
    "squeeze", "expand", "permute", "transpose", "t", "as_strided", "alias", "detach", "unbind",
    "numpy_T", "view_as", "unflatten", "flatten", "narrow", "diagonal", "resolve_conj",
    "resolve_neg", "lift_fresh", "_reshape_alias",
})
# aten ops that only allocate (no kernel on CUDA)
ALLOC_OPS = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})


class LayerMarks:
    """Forward hooks on every decoder layer: ``current`` names the layer now running,
    and on CUDA a ``record_function`` range spans its forward."""

    def __init__(self, layers, ranges: bool):
        self.current = OUTSIDE
        self._open = []
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._enter(i, ranges)))
            self._handles.append(layer.register_forward_hook(self._leave(ranges)))

    def _enter(self, index: int, ranges: bool):
        def hook(module, args):
            self.current = f"layer {index}"
            if ranges:
                rf = torch.profiler.record_function(f"{_LAYER_PREFIX}{index}")
                rf.__enter__()
                self._open.append(rf)
        return hook

    def _leave(self, ranges: bool):
        def hook(module, args, output):
            self.current = OUTSIDE
            if ranges and self._open:
                self._open.pop().__exit__(None, None, None)
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched, per the layer ``marks`` says is running (views as
    ``view:<name>``); with the interpreter on, each Triton launch as ``triton:<kernel>``
    and none of the ops the interpreter runs inside it."""

    def __init__(self, marks: LayerMarks):
        super().__init__()
        self.marks = marks
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.inside = 0
        self._restore = None

    def __enter__(self):
        if os.environ.get("TRITON_INTERPRET") == "1":
            from triton.runtime.interpreter import InterpretedFunction

            real, counter = InterpretedFunction.run, self

            def run(fn_self, *args, **kwargs):
                counter.counts[counter.marks.current][f"triton:{fn_self.fn.__name__}"] += 1
                counter.inside += 1
                try:
                    return real(fn_self, *args, **kwargs)
                finally:
                    counter.inside -= 1

            InterpretedFunction.run = run
            self._restore = lambda: setattr(InterpretedFunction, "run", real)
        return super().__enter__()

    def __exit__(self, *exc):
        if self._restore is not None:
            self._restore()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            name = str(func.overloadpacket.__name__)
            kind = "view:" if name in VIEW_OPS else "alloc:" if name in ALLOC_OPS else ""
            self.counts[self.marks.current][kind + name] += 1
        return func(*args, **(kwargs or {}))


def device_events(trace: dict) -> list[tuple[str, dict]]:
    """From a Chrome trace of the profiler: ``(layer, event)`` of every device kernel,
    memcpy and memset, in device order. A device event belongs to the layer whose
    range holds the host launch with the same correlation id (on the launching thread)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ranges = [(e["ts"], e["ts"] + e.get("dur", 0), e.get("tid"), e["name"][len(_LAYER_PREFIX):])
              for e in events if e.get("ph") == "X" and e.get("name", "").startswith(_LAYER_PREFIX)]
    launch_at = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {}):
            launch_at[e["args"]["correlation"]] = (e["ts"], e.get("tid"))
    out = []
    for e in sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATS),
                    key=lambda e: e["ts"]):
        where = OUTSIDE
        launch = launch_at.get(e.get("args", {}).get("correlation"))
        if launch is not None:
            ts, tid = launch
            for start, end, rtid, layer in ranges:
                if start <= ts <= end and rtid == tid:
                    where = f"layer {layer}"
                    break
        out.append((where, e))
    return out


def kernels_by_layer(trace: dict) -> dict[str, dict[str, list[float]]]:
    """layer -> kernel name -> [count, device us] (``device_events`` summed by name)."""
    table: dict[str, dict[str, list[float]]] = collections.defaultdict(dict)
    for where, e in device_events(trace):
        slot = table[where].setdefault(e["name"], [0, 0.0])
        slot[0] += 1
        slot[1] += float(e.get("dur", 0.0))
    return table


def kernel_sequence(trace: dict, layer: str) -> list[dict]:
    """One layer's device events in launch order: name, device us and, where the
    trace has them, grid, block, registers and shared memory (the FP8 GEMMs share
    one kernel name; the grid and the shared memory tell their configs apart)."""
    keys = ("grid", "block", "registers per thread", "shared memory")
    return [{"name": e["name"], "device_us": float(e.get("dur", 0.0)),
             **{k: e["args"][k] for k in keys if k in e.get("args", {})}}
            for where, e in device_events(trace) if where == layer]


def fp8_plans(layer: torch.nn.Module, rows: int, device: torch.device) -> list[dict]:
    """The block-FP8 linears a decoder layer runs through ``fp8_linear`` at ``rows``,
    in module order, each with the config and the quantization it launches with (a
    down projection with a w8a8 config takes ``silu_mul_quant_fp8``'s output, quantized
    first; with a w8a16 or gemv one it computes the SiLU product in its activation load:
    ``fused_silu``). Fused
    projections count once (their parts share the fused weight); experts, which run
    the grouped MoE kernels, are left out, and so is a block-FP8 shared expert that a
    decode-sized batch runs inside the experts' kernels (``MoE._fp8_shared``); MLA's
    ``kv_b_proj``, which decode reads as a dequantized matrix, is listed all the same."""
    from lanekv.kernels.fp8.gemm import linear_plan
    from lanekv.kernels.fp8.gemm_configs import select_config
    from lanekv.model.quant.linear import Fp8Linear

    def fused_fp8(mod) -> bool:
        return (isinstance(getattr(mod, "fp8", None), Fp8Linear)
                and getattr(mod, "weight_scale_inv", None) is not None)

    from lanekv.model.deepseek import MOE_DECODE_MAX_TOKENS

    fused_storage = {mod.weight.untyped_storage().data_ptr() for mod in layer.modules()
                     if fused_fp8(mod)}
    mlp = getattr(layer, "mlp", None)
    shared_in_experts = (rows <= MOE_DECODE_MAX_TOKENS and hasattr(mlp, "_fp8_shared")
                         and mlp._fp8_shared() is not None)
    out = []
    for name, mod in layer.named_modules():
        weight = getattr(mod, "weight", None)
        if shared_in_experts and name.startswith("mlp.shared_experts"):
            continue
        if fused_fp8(mod):
            block = mod.fp8.block
        elif (isinstance(mod, Fp8Linear) and ".experts." not in f".{name}." and
              weight.untyped_storage().data_ptr() not in fused_storage):
            block = mod.block
        else:
            continue
        n, k = weight.shape
        down = name.endswith("down_proj")
        if down:
            cfg, fused = select_config(rows, n, k, block, device), False
        else:
            cfg, fused = linear_plan(rows, n, k, block, device)
        out.append({"linear": name, "n": n, "k": k, "rows": rows, "config": cfg.name(),
                    "fused_quant": fused, "fused_silu": down and (cfg.w8a16 or cfg.gemv)})
    return out


def build(name: str, batch: int, context: int, page_size: int, device: torch.device, model_dir: str,
          table_pages: int = 0, fp8: bool = False):
    dtype = torch.bfloat16 if name in ("v2_lite", "v32", "llama3_8b") and device.type == "cuda" else torch.float32
    cfg = dict(CONFIGS[name], **({"quantization_config": FP8_CONFIG} if fp8 else {}))
    (Path(model_dir) / "config.json").write_text(json.dumps(cfg))
    loaded = load_dummy_model(model_dir, dtype=dtype, device=device)
    per_req = -(-(context + 1) // page_size)
    pool = PagePool.for_model(loaded.config, batch * per_req + 1, page_size, dtype, device)
    fill_pool(pool)
    table = torch.arange(batch * per_req, dtype=torch.int32, device=device).view(batch, per_req)
    if table_pages > per_req:  # as wide as a captured graph's (zeros past each request's pages)
        table = torch.cat((table, table.new_zeros(batch, table_pages - per_req)), dim=1)
    seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=device)
    locs = table[:, context // page_size].long() * page_size + context % page_size
    ids = torch.arange(batch, device=device) + 11
    positions = torch.full((batch,), context, dtype=torch.int64, device=device)

    def step() -> torch.Tensor:
        with torch.inference_mode():
            return step_hidden(loaded.model, pool, ids, positions, locs, table, seq_lens)

    return loaded, step, dtype


def moe_layer_index(model) -> int | None:
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            return i
    return None


def summarize(table: dict[str, dict[str, list[float]]]) -> dict[str, int]:
    """Launches per layer (views left out)."""
    return {where: int(sum(v[0] for n, v in names.items() if not n.startswith(("view:", "alloc:"))))
            for where, names in table.items()}


def print_table(title: str, names: dict[str, list[float]], with_time: bool) -> None:
    launches = int(sum(v[0] for n, v in names.items() if not n.startswith(("view:", "alloc:"))))
    print(f"\n{title}: {launches} launches (views and allocations apart)")
    print("| count | " + ("device us | " if with_time else "") + "name |")
    print("|---:|" + ("---:|" if with_time else "") + "---|")
    for name, (count, us) in sorted(names.items(), key=lambda kv: (-kv[1][0], kv[0])):
        short = name if len(name) <= 90 else name[:87] + "..."
        print(f"| {count} | " + (f"{us:.1f} | " if with_time else "") + f"{short} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    for flag in ("--v2-lite", "--tiny", "--v32", "--tiny-v32", "--llama3-8b"):
        which.add_argument(flag, action="store_true")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 weights (quantization_config)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--table-pages", type=int, default=0,
                    help="page-table width (0: the request's own pages); a captured graph's is "
                         "the model's positions over the page size (2560 for V2-Lite at 64), "
                         "which sets the split count the MLA decode kernel runs")
    ap.add_argument("--ops", action="store_true", help="count aten ops per layer on CUDA too")
    ap.add_argument("--interpret", action="store_true",
                    help="on CPU: run the Triton kernels interpreted and count their launches")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.batch < 1 or args.context < 1:
        raise SystemExit(f"--batch and --context must be >= 1, got {args.batch}, {args.context}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = next(n for n in CONFIGS if getattr(args, n))
    result = {"model": name, "fp8_weights": args.fp8, "batch": args.batch, "context": args.context,
              "table_pages": args.table_pages,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as model_dir:
        loaded, step, dtype = build(name, args.batch, args.context, args.page_size, device,
                                    model_dir, args.table_pages, fp8=args.fp8)
        result["dtype"] = str(dtype).removeprefix("torch.")
        layers = loaded.model.model.layers
        if args.fp8:  # layer 0 and the first MoE layer (V2-Lite's layer 0 is dense)
            moe_at = moe_layer_index(loaded.model)
            result["fp8_plans"] = [
                {"layer": i, **plan} for i in sorted({0, moe_at or 0})
                for plan in fp8_plans(layers[i], args.batch, device)]
        step()  # compile and warm up
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            marks = LayerMarks(layers, ranges=True)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                step()
                torch.cuda.synchronize()
            marks.remove()
            trace_path = Path(model_dir) / "trace.json"
            prof.export_chrome_trace(str(trace_path))
            trace = json.loads(trace_path.read_text())
            kernels = kernels_by_layer(trace)
            result["layer0_sequence"] = kernel_sequence(trace, "layer 0")
            result["kernels"] = {w: {n: {"count": c, "device_us": us} for n, (c, us) in t.items()}
                                 for w, t in kernels.items()}
            result["kernels_per_layer"] = summarize(kernels)
        if device.type != "cuda" or args.ops:
            marks = LayerMarks(layers, ranges=False)
            with OpCounter(marks) as counter:
                step()
            marks.remove()
            ops = {w: {n: [c, 0.0] for n, c in names.items()} for w, names in counter.counts.items()}
            result["aten_ops"] = {w: dict(names) for w, names in counter.counts.items()}
            result["aten_ops_per_layer"] = summarize(ops)
    moe = moe_layer_index(loaded.model)
    show = ["layer 0"] + ([f"layer {moe}"] if moe not in (None, 0) else []) + [OUTSIDE]
    for key, label, timed in (("kernels", "device kernels", True), ("aten_ops", "aten ops", False)):
        if key not in result:
            continue
        table = result[key]
        for where in show:
            if where in table:
                names = {n: ([v["count"], v["device_us"]] if isinstance(v, dict) else [v, 0.0])
                         for n, v in table[where].items()}
                print_table(f"{label}, {where} ({name}, batch {args.batch}, context {args.context})",
                            names, timed)
        per = result[f"{key}_per_layer"] if key == "kernels" else result["aten_ops_per_layer"]
        print(f"\n{label} per layer: " + ", ".join(f"{w}: {n}" for w, n in sorted(
            per.items(), key=lambda kv: (kv[0] == OUTSIDE, int(kv[0].split()[-1])
                                         if kv[0] != OUTSIDE else 0))))
    if "fp8_plans" in result:
        print(f"\nFP8 linears of layer 0 and the first MoE layer at {args.batch} rows "
              "(config, quantization):")
        for plan in result["fp8_plans"]:
            how = ("none (w8a16)" if plan["config"].endswith("W") else "inside the GEMM"
                   if plan["fused_quant"] else "first (own kernel)")
            print(f"  layer {plan['layer']} {plan['linear']:>24} [{plan['n']}, {plan['k']}] "
                  f"{plan['config']:>26} {how}")
    if "layer0_sequence" in result:
        print(f"\nlayer 0's device kernels in launch order ({name}, batch {args.batch}):")
        for event in result["layer0_sequence"]:
            launch = " ".join(f"{k.split()[0]}={event[k]}" for k in
                              ("grid", "registers per thread", "shared memory") if k in event)
            print(f"  {event['device_us']:8.1f} us  {event['name'][:80]}  {launch}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
