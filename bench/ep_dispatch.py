"""Prefill EP: one MoE layer's routed experts over N ranks, the all-to-all dispatch
(``model.parallel.dispatch``: a token once per owner rank, split sizes read on the
host) against its capturable twin (``model.parallel.dispatch_capturable``: fixed
``[N, capacity]`` padded all-to-alls, no host read; on CUDA with NCCL also replayed as
a captured CUDA graph) and the all-gather + all-reduce exchange it replaced.

GPU (N GPUs, NCCL; DeepSeek-V3's expert shapes, 8k tokens over the ranks):
    python bench/ep_dispatch.py --device cuda --ranks 8 --tokens 8192 --json bench/results/ep_dispatch.json
One GPU (one NCCL rank; or several gloo ranks sharing it, --backend gloo):
    python bench/ep_dispatch.py --device cuda --ranks 1 --tokens 512
CPU (gloo):
    python bench/ep_dispatch.py --device cpu --ranks 2 --tokens 256 --hidden 256 --inter 128 --experts 16 \
        --top-k 4 --n-group 4 --topk-group 2

Each rank holds ``tokens / ranks`` random rows routed as DeepSeek-V3 routes
(``moe_route_ref`` on random logits: sigmoid scores, the top-k within the
``--topk-group`` best of ``--n-group`` groups), and ``experts / ranks`` experts. Per
way, the median of ``--repeat`` layer times after one warm-up (a barrier, then the
layer, then the device synchronized; the slowest rank's time), and the rows the
busiest rank received per layer (the exchanged bytes; for the dispatch also what the
per-choice dispatch it replaced received, a row per (token, choice)). The gather way: the row counts all-gathered, every rank's rows (padded to the
largest count) all-gathered, each rank's experts run over all rows (the other ranks'
choices at weight 0, on its first expert), an all-reduce, each rank keeping its rows.
The capturable way sends ``capacity = tokens / ranks`` rows to every rank and gets as
many partials back (its rows per rank: ``2 (N - 1) capacity``); its output is compared
bit for bit with the dispatch's (equal unless the grouped GEMMs took other tiles, see
the module doc). Printed: every way's times and rows, and the outputs' largest differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from lanekv.kernels.moe.experts import moe_experts  # noqa: E402
from lanekv.kernels.moe.route import moe_route_ref  # noqa: E402
from lanekv.model.dtypes import DTYPES  # noqa: E402
from lanekv.model.parallel.dispatch import dispatch_combine, route  # noqa: E402
from lanekv.model.parallel.dispatch_capturable import dispatch_combine_capturable  # noqa: E402
from lanekv.model.parallel.ep import expert_bounds  # noqa: E402


def gather_combine(x, weights, ids, w13, w2, bounds, group) -> tuple[torch.Tensor, int]:
    """The exchange the dispatch replaced; its output and the rows this rank received."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    counts = [torch.empty_like(count) for _ in range(size)]
    dist.all_gather(counts, count, group=group)
    counts = [int(c) for c in counts]
    padded = x.new_zeros((max(counts), x.shape[1]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    rows = torch.cat([part[:n] for part, n in zip(parts, counts)])
    all_ids = torch.cat([p for p in _gathered(ids, counts, group)])
    all_weights = torch.cat([p for p in _gathered(weights, counts, group)])
    first, last = bounds[rank], bounds[rank + 1]
    mine = (all_ids >= first) & (all_ids < last)
    local = torch.where(mine, all_ids - first, torch.zeros_like(all_ids))
    routed = moe_experts(rows, w13, w2, torch.where(mine, all_weights, torch.zeros_like(all_weights)), local)
    dist.all_reduce(routed, group=group)
    start = sum(counts[:rank])
    # rows of the all-gather (padded), then the ring all-reduce's 2 (N-1)/N of the block
    received = (size - 1) * max(counts) + 2 * (size - 1) * rows.shape[0] // size
    return routed[start:start + x.shape[0]], received


def _gathered(t: torch.Tensor, counts: list[int], group) -> list[torch.Tensor]:
    """The router's output of every rank (the old way routed all rows on every rank; the
    bench hands it the same choices the dispatch way used, so the outputs compare)."""
    padded = t.new_zeros((max(counts), *t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(len(counts))]
    dist.all_gather(parts, padded, group=group)
    return [part[:n] for part, n in zip(parts, counts)]


def _time(fn, device: torch.device, group) -> float:
    dist.barrier(group=group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def _graph(fn, device: torch.device) -> tuple[torch.cuda.CUDAGraph | None, str]:
    """``fn`` captured in a CUDA graph (after it ran eagerly), or None and why not."""
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()  # warm on the side stream, as torch.cuda.graphs' docs ask
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize(device)
        return graph, ""
    except RuntimeError as err:  # a capture the backend refuses: reported, not fatal
        return None, str(err).splitlines()[0][:200]


def _rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    nccl = args.device == "cuda" and args.backend == "nccl"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, args.threads))
    dist.init_process_group("nccl" if nccl else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=args.ranks, **({"device_id": device} if nccl else {}))
    group = dist.group.WORLD
    try:
        dtype = DTYPES[args.dtype]
        gen = torch.Generator().manual_seed(100 + rank)
        bounds = expert_bounds(args.experts, args.ranks)
        mine = bounds[rank + 1] - bounds[rank]
        tokens = args.tokens // args.ranks
        x = torch.randn(tokens, args.hidden, generator=gen).to(device, dtype)
        logits = torch.randn(tokens, args.experts, generator=gen)
        weights, ids = moe_route_ref(logits, torch.zeros(args.experts), args.top_k, args.n_group, args.topk_group,
                                     "sigmoid", True, 1.0)
        weights, ids = weights.to(device), ids.to(device)
        w13 = (torch.randn(mine, 2 * args.inter, args.hidden, generator=gen) / args.hidden ** 0.5).to(device, dtype)
        w2 = (torch.randn(mine, args.hidden, args.inter, generator=gen) / args.inter ** 0.5).to(device, dtype)
        a = dispatch_combine(x, weights, ids, w13, w2, bounds, group)
        b, gather_rows = gather_combine(x, weights, ids, w13, w2, bounds, group)

        def capturable() -> torch.Tensor:
            return dispatch_combine_capturable(x, weights, ids, w13, w2, bounds, group, tokens)

        c = capturable()
        diff = torch.tensor([float((a.float() - b.float()).abs().max()) if tokens else 0.0,
                             float((a.float() - c.float()).abs().max()) if tokens else 0.0,
                             float(not torch.equal(a, c))], device=device)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
        graph, why = _graph(capturable, device) if nccl else (None, "eager only: needs CUDA and NCCL")
        captured = torch.tensor([float(graph is not None)], device=device)
        dist.all_reduce(captured, op=dist.ReduceOp.MIN, group=group)  # every rank replays, or none
        if not captured.item():
            graph = None
        per_slot = route(ids, bounds).per_slot  # [N, k]: my tokens with more than s choices on each rank
        sends = torch.stack((per_slot[:, 0], per_slot.sum(1)))  # [2, N]: rows, and (token, choice) pairs
        matrix = [torch.empty_like(sends) for _ in range(args.ranks)]
        dist.all_gather(matrix, sends, group=group)
        own = torch.eye(args.ranks, dtype=torch.bool, device=device)[:, None]  # a rank's own rows stay
        matrix = torch.stack(matrix).masked_fill(own, 0)  # [source, rows or pairs, owner]
        # rows in from the other ranks for my experts, then my rows' partials back
        received = (matrix.sum(0) + matrix.sum(2).T).max(1).values.tolist()
        dispatch_rows, per_choice_rows = int(received[0]), int(received[1])
        times = {way: [] for way in WAYS if way != "graph" or graph is not None}
        for _ in range(args.repeat):
            times["dispatch"].append(_time(lambda: dispatch_combine(x, weights, ids, w13, w2, bounds, group),
                                           device, group))
            times["capturable"].append(_time(capturable, device, group))
            if graph is not None:
                times["graph"].append(_time(graph.replay, device, group))
            times["gather"].append(_time(lambda: gather_combine(x, weights, ids, w13, w2, bounds, group),
                                         device, group))
        if rank == 0:
            row_bytes = args.hidden * dtype.itemsize
            result = {way: {"ms_p50": 1e3 * statistics.median(t), "ms_min": 1e3 * min(t), "n": len(t)}
                      for way, t in times.items()}
            result["dispatch"]["rows_per_rank"] = dispatch_rows
            result["dispatch"]["per_choice_rows_per_rank"] = per_choice_rows
            result["gather"]["rows_per_rank"] = gather_rows
            result["capturable"]["rows_per_rank"] = 2 * (args.ranks - 1) * tokens  # capacity rows each way
            if graph is not None:
                result["graph"]["rows_per_rank"] = result["capturable"]["rows_per_rank"]
            for way in result:
                result[way]["mib_per_rank"] = result[way]["rows_per_rank"] * row_bytes / 2**20
            result["max_abs_diff"] = float(diff[0])
            result["capturable_max_abs_diff"] = float(diff[1])
            result["capturable_bit_equal"] = not diff[2].item()
            result["graph_note"] = why
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


WAYS = ("dispatch", "capturable", "graph", "gather")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens over all ranks")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048, help="moe_intermediate_size")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--n-group", type=int, default=8, help="expert groups (DeepSeek-V3: 8)")
    ap.add_argument("--topk-group", type=int, default=4, help="groups a token's experts come from (V3: 4)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                    help="CUDA: NCCL (a GPU per rank; the graph way) or gloo (ranks may share GPUs)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.ranks < 1 or args.experts < args.ranks:
        raise SystemExit(f"--ranks={args.ranks} needs 1 <= ranks <= --experts={args.experts}")
    if args.device == "cuda" and args.backend == "nccl" and torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"--ranks={args.ranks} needs one GPU each, {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.start_processes(_rank, args=(args, str(Path(tmp) / "store"), out), nprocs=args.ranks,
                           start_method="spawn")
        result = json.loads(Path(out).read_text())
    print(f"{args.ranks} ranks, {args.tokens} tokens, hidden {args.hidden}, inter {args.inter}, "
          f"{args.experts} experts, top-{args.top_k}, {args.dtype} on {args.device}")
    print(f"{'way':<10}{'ms p50':>10}{'ms min':>10}{'rows/rank':>12}{'MiB/rank':>10}")
    for way in (w for w in WAYS if w in result):
        r = result[way]
        print(f"{way:<10}{r['ms_p50']:>10.2f}{r['ms_min']:>10.2f}{r['rows_per_rank']:>12}{r['mib_per_rank']:>10.1f}")
    if result["graph_note"]:
        print(f"graph: {result['graph_note']}")
    print(f"the per-choice dispatch it replaced: {result['dispatch']['per_choice_rows_per_rank']} rows/rank")
    print(f"outputs' largest difference: gather {result['max_abs_diff']:.3g}, capturable "
          f"{result['capturable_max_abs_diff']:.3g} (bit-equal: {result['capturable_bit_equal']})")
    if args.json:
        args.json.write_text(json.dumps(dict(vars(args) | {"json": str(args.json)}, date=time.strftime("%Y-%m-%d"),
                                             **result), indent=1))


if __name__ == "__main__":
    main()
