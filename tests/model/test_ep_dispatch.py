"""The all-to-all dispatch and combine of prefill EP (``model.parallel.dispatch``) over
gloo ranks, against one process running every expert on every rank's tokens
(``moe_experts_ref``), with uneven routing: a rank with no tokens, experts and a
whole rank that receive no rows, an uneven split of the experts."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lanekv.kernels.moe.experts import moe_experts_ref
from lanekv.model.parallel.dispatch import dispatch_combine, exchange_counts
from lanekv.model.parallel.ep import expert_bounds, expert_span

from tests.markers import requires_gpu

HIDDEN, INTER = 16, 8


def _case(name: str) -> dict:
    """Every rank's tokens, routing and the whole experts, the same in every process."""
    gen = torch.Generator().manual_seed(11)
    if name == "uneven":  # 3 ranks over 8 experts (2, 3, 3); rank 1 has no tokens and gets no rows
        size, experts, top_k, tokens = 3, 8, 2, (5, 0, 4)
        allowed = torch.tensor([0, 1, 5, 7])  # expert 6 gets none either
        ids = [allowed[torch.stack([torch.randperm(4, generator=gen)[:top_k] for _ in range(n)])]
               if n else torch.empty((0, top_k), dtype=torch.int64) for n in tokens]
    else:  # 2 ranks, top-3 of 8 at random
        size, experts, top_k, tokens = 2, 8, 3, (7, 6)
        ids = [torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(n)]) for n in tokens]
    return {
        "size": size,
        "xs": [torch.randn(n, HIDDEN, generator=gen) for n in tokens],
        "weights": [torch.rand(n, top_k, generator=gen) for n in tokens],
        "ids": ids,
        "w13": torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) / 4,
        "w2": torch.randn(experts, HIDDEN, INTER, generator=gen) / 3,
    }


def _rank(rank: int, name: str, dtype: torch.dtype, kernels: str, store: str, out: str) -> None:
    if kernels == "triton":  # the interpreted Triton experts on what the rank received
        os.environ["LANEKV_CPU_KERNELS"] = "triton"
    case = _case(name)
    size = case["size"]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        span = expert_span(len(case["w13"]), rank, size)
        bounds = expert_bounds(len(case["w13"]), size)
        x, ids = case["xs"][rank].to(dtype), case["ids"][rank]
        per_expert = torch.bincount(ids.reshape(-1), minlength=bounds[-1])
        splits = exchange_counts(per_expert, bounds, rank, dist.group.WORLD)
        got = dispatch_combine(x, case["weights"][rank], ids, case["w13"][span.start:span.stop].to(dtype),
                               case["w2"][span.start:span.stop].to(dtype), bounds, dist.group.WORLD)
        torch.save({"out": got, "send": splits.send, "recv": splits.recv}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "dtype", "kernels"), [
    ("uneven", torch.float32, "torch"), ("random", torch.bfloat16, "torch"), ("uneven", torch.float32, "triton")])
def test_dispatch_combine_equals_one_process(tmp_path, name: str, dtype: torch.dtype, kernels: str) -> None:
    case = _case(name)
    size = case["size"]
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(size)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, name, dtype, kernels, str(tmp_path / "store"), outs[r]))
             for r in range(size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(90)
    assert [proc.exitcode for proc in procs] == [0] * size
    results = [torch.load(out) for out in outs]

    x = torch.cat(case["xs"]).to(dtype)
    want = moe_experts_ref(x, case["w13"].to(dtype), case["w2"].to(dtype), torch.cat(case["weights"]),
                           torch.cat(case["ids"]))
    got = torch.cat([r["out"] for r in results])
    assert got.dtype == dtype and got.shape == want.shape
    # the same rows through the same experts: only the order of a token's k additions differs
    # (one rounding of the model dtype); the Triton GEMMs also sum in another order
    ulp = torch.finfo(dtype).eps * (1 if kernels == "torch" else 16)
    torch.testing.assert_close(got, want, rtol=ulp, atol=ulp)

    bounds = expert_bounds(len(case["w13"]), size)
    owner = torch.bucketize(torch.cat(case["ids"]).reshape(-1), torch.tensor(bounds[1:]), right=True)
    # each pair crosses to its expert's owner only: what each rank sends and receives
    for r, ids in enumerate(case["ids"]):
        mine = torch.bucketize(ids.reshape(-1), torch.tensor(bounds[1:]), right=True)
        assert results[r]["send"] == torch.bincount(mine, minlength=size).tolist()
    assert [sum(r["recv"]) for r in results] == torch.bincount(owner, minlength=size).tolist()
    if name == "uneven":
        assert results[1]["recv"] == [0, 0, 0] and results[1]["send"] == [0, 0, 0]
        assert results[1]["out"].shape == (0, HIDDEN)


@requires_gpu
@pytest.mark.timeout(120)
def test_dispatch_on_cuda_syncs_once_and_equals_the_kernel(tmp_path) -> None:
    """One GPU, one NCCL rank (NCCL refuses two ranks on one GPU): the dispatch's device
    ops and the Triton experts on what was received equal ``moe_experts`` on the whole
    batch, and the counts' read to the host is the layer's only synchronizing op."""
    import warnings

    from lanekv.kernels.moe.experts import moe_experts

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        gen = torch.Generator().manual_seed(5)
        tokens, experts, top_k, dtype = 200, 16, 4, torch.bfloat16
        x = torch.randn(tokens, 128, generator=gen).to("cuda", dtype)
        w13 = (torch.randn(experts, 2 * 64, 128, generator=gen) / 8).to("cuda", dtype)
        w2 = (torch.randn(experts, 128, 64, generator=gen) / 6).to("cuda", dtype)
        ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:top_k] for _ in range(tokens)]).cuda()
        weights = torch.rand(tokens, top_k, generator=gen).cuda()  # expert 15 gets no rows
        bounds = expert_bounds(experts, 1)
        dispatch_combine(x, weights, ids, w13, w2, bounds, dist.group.WORLD)  # compile the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = dispatch_combine(x, weights, ids, w13, w2, bounds, dist.group.WORLD)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) == 1, syncs
        want = moe_experts(x, w13, w2, weights, ids)
        # the kernel rounds acc * weight once; the combine weighs the rounded output: one ulp per pair
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got, want, rtol=2 * eps, atol=2 * eps * float(want.abs().max()))
    finally:
        dist.destroy_process_group()
