"""The deduplicated all-to-all dispatch and combine of prefill EP (``model.parallel.dispatch``)
over gloo ranks, with uneven routing (a rank with no tokens, experts and a whole rank that
receive no rows, an uneven split of the experts): against one process running every expert
on every rank's tokens (``moe_experts_ref``), and, with each (row, choice) pair through its
expert alone so that a pair's output has the same bits in any batch, against the documented
order (bit for bit) and the per-choice dispatch it replaced (bit for bit where no rank holds
two choices of a token). Every all-to-all's sizes are recorded: rows sent are the distinct
(token, rank) pairs."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lanekv.kernels.moe.experts import moe_experts_ref
from lanekv.model.parallel.dispatch import dispatch_combine
from lanekv.model.parallel.ep import expert_bounds, expert_span

from tests.markers import requires_gpu

HIDDEN, INTER = 16, 8


def _case(name: str) -> dict:
    """Every rank's tokens, routing and the whole experts, the same in every process."""
    gen = torch.Generator().manual_seed(11)
    if name == "uneven":  # 3 ranks over 8 experts (2, 3, 3); rank 1 has no tokens and gets no rows
        size, experts, top_k, tokens = 3, 8, 2, (5, 0, 4)
        allowed = torch.tensor([0, 1, 5, 7])  # expert 6 gets none either; 0 and 1 share rank 0
        ids = [allowed[torch.stack([torch.randperm(4, generator=gen)[:top_k] for _ in range(n)])]
               if n else torch.empty((0, top_k), dtype=torch.int64) for n in tokens]
    elif name == "distinct":  # 3 ranks over 8 experts, each token's 3 choices on 3 ranks, in any order
        size, experts, top_k, tokens = 3, 8, 3, (4, 3, 5)
        spans = [expert_span(experts, r, size) for r in range(size)]
        ids = [torch.stack([torch.tensor([s[int(torch.randint(len(s), (), generator=gen))] for s in spans])[
            torch.randperm(size, generator=gen)] for _ in range(n)]) for n in tokens]
    else:  # 2 ranks, top-3 of 8 at random: most tokens have two choices on one rank
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


def _one_by_one(w13: torch.Tensor, w2: torch.Tensor):
    """Experts run one (row, choice) pair at a time: each pair's output the same bits in
    any batch, so the exact comparisons test the dispatch's order, not the GEMMs'."""
    def run(rows: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([moe_experts_ref(rows[i:i + 1], w13, w2, weights[i:i + 1], ids[i:i + 1])
                          for i in range(rows.shape[0])] + [rows[:0]])
    return run


def _rank(rank: int, name: str, dtype: torch.dtype, kernels: str, store: str, out: str) -> None:
    if kernels == "triton":  # the interpreted Triton experts on what the rank received
        os.environ["LANEKV_CPU_KERNELS"] = "triton"
    case = _case(name)
    size = case["size"]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    calls, real = [], dist.all_to_all_single

    def recording(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        calls.append((input_split_sizes or [input.shape[0] // size] * size,
                      math.prod(input.shape[1:]) * input.element_size()))  # rows per rank, row bytes
        return real(output, input, output_split_sizes, input_split_sizes, group=group)

    try:
        span = expert_span(len(case["w13"]), rank, size)
        bounds = expert_bounds(len(case["w13"]), size)
        x, ids, weights = case["xs"][rank].to(dtype), case["ids"][rank], case["weights"][rank]
        w13, w2 = case["w13"][span.start:span.stop].to(dtype), case["w2"][span.start:span.stop].to(dtype)
        got = dispatch_combine(x, weights, ids, w13, w2, bounds, dist.group.WORLD)
        dist.all_to_all_single = recording
        exact = dispatch_combine(x, weights, ids, w13, w2, bounds, dist.group.WORLD, _one_by_one(w13, w2))
        torch.save({"out": got, "exact": exact, "calls": calls}, out)
    finally:
        dist.all_to_all_single = real
        dist.destroy_process_group()


def _pair_outputs(x, weights, ids, w13, w2) -> torch.Tensor:
    """``[T, k, H]``: each choice's weighted output in the model dtype, one pair at a time."""
    tokens, top_k = ids.shape
    run = _one_by_one(w13, w2)
    rows = x.repeat_interleave(top_k, 0)
    return run(rows, weights.reshape(-1, 1), ids.reshape(-1, 1)).view(tokens, top_k, x.shape[1])


def _documented_order(pairs: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """The module doc's order in plain loops: each (token, rank) partial the float32 sum of
    its choices in choice order, rounded once, at the token's first choice on that rank."""
    slots = torch.zeros_like(pairs)
    for t in range(pairs.shape[0]):
        for r in owner[t].unique().tolist():
            choices = (owner[t] == r).nonzero().flatten().tolist()
            total = torch.zeros(pairs.shape[2])
            for j in choices:
                total += pairs[t, j].float()
            slots[t, choices[0]] = total.to(pairs.dtype)
    return slots.sum(1)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("name", "dtype", "kernels"), [
    ("uneven", torch.float32, "torch"), ("random", torch.bfloat16, "torch"), ("distinct", torch.bfloat16, "torch"),
    ("uneven", torch.float32, "triton")])
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
        proc.join(150)
    assert [proc.exitcode for proc in procs] == [0] * size
    results = [torch.load(out) for out in outs]
    bounds = expert_bounds(len(case["w13"]), size)
    w13, w2 = case["w13"].to(dtype), case["w2"].to(dtype)
    eps = torch.finfo(dtype).eps

    # the rows a token needs, its choices' outputs, summed in the documented order (bit for bit)
    # and as the per-choice dispatch summed them (bit for bit where no rank holds two choices)
    for r, result in enumerate(results):
        x, weights, ids = case["xs"][r].to(dtype), case["weights"][r], case["ids"][r]
        owner = torch.bucketize(ids, torch.tensor(bounds[1:]), right=True)
        pairs = _pair_outputs(x, weights, ids, w13, w2)
        assert torch.equal(result["exact"], _documented_order(pairs, owner))
        per_choice = pairs.sum(1)
        if name == "distinct":
            assert torch.equal(result["exact"], per_choice)
        else:  # a partial rounded once more, then both sums rounded: three half-ulps of sum |pairs| at most
            scale = pairs.float().abs().sum(1)
            assert ((result["exact"].float() - per_choice.float()).abs() <= 1.5 * eps * scale).all()

        # the counts (a row of k int64 to each rank), then one row per distinct (token, rank) and its k slots,
        # then one partial back per row received
        distinct = {(t, int(o)) for t in range(ids.shape[0]) for o in owner[t]}
        rows = [sum(1 for _, o in distinct if o == dest) for dest in range(size)]
        top_k = ids.shape[1]
        assert [c[0] for c in result["calls"][:3]] == [[1] * size, rows, rows]
        assert [c[1] for c in result["calls"]] == [8 * top_k, HIDDEN * x.element_size(), 8 * top_k,
                                                  HIDDEN * x.element_size()]
        assert sum(result["calls"][3][0]) == sum(res["calls"][1][0][r] for res in results)
    if name == "uneven":
        assert results[1]["calls"][1][0] == [0, 0, 0] and results[1]["calls"][3][0] == [0, 0, 0]
        assert results[1]["out"].shape == (0, HIDDEN)

    x = torch.cat(case["xs"]).to(dtype)
    want = moe_experts_ref(x, w13, w2, torch.cat(case["weights"]), torch.cat(case["ids"]))
    got = torch.cat([r["out"] for r in results])
    assert got.dtype == dtype and got.shape == want.shape
    # the same pairs through the same experts: the reference rounds after each of a token's
    # k additions (index_add_ in the model dtype), the dispatch a partial and the sum (seen:
    # 0.62 of this bound in bf16); the Triton GEMMs also sum in another order
    ulp = eps * (1 if kernels == "torch" else 16)
    torch.testing.assert_close(got, want, rtol=ulp, atol=ulp)


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
        # one rank holds every choice: the token's k outputs are added in float32 in choice
        # order (the kernel's .sum(1) may pair them otherwise), then rounded once
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got, want, rtol=2 * eps, atol=2 * eps * float(want.abs().max()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("experts", "n_group", "topk_group", "top_k", "size"), [
    (64, 8, 4, 8, 8),  # DeepSeek-V3's ratios at EP 8 (256 experts in 8 groups, top 8 in the best 4): a group a rank
    (64, 8, 4, 8, 4),  # the same at EP 4: two groups a rank
    (8, 4, 2, 3, 3),  # the tests' tiny DeepSeek-V3 (tests/checkpoints.py) at cp 3: 2, 3 and 3 experts
])
def test_rows_sent_are_the_distinct_token_rank_pairs(experts: int, n_group: int, topk_group: int, top_k: int,
                                                     size: int) -> None:
    """DeepSeek-V3's routing (sigmoid scores, top-k within the best groups: ``moe_route_ref``
    on random logits) on every rank of an EP group, counted by ``route``, which sizes
    ``dispatch_combine``'s all-to-alls (the test above records the real ones): each rank
    sends one row per distinct (token, rank), at most ``topk_group`` a token where each
    group lies on one rank; the bytes a layer moves between ranks (hidden 7168, bf16)
    against the per-choice dispatch it replaced."""
    from lanekv.kernels.moe.route import moe_route_ref
    from lanekv.model.parallel.dispatch import route

    tokens, row_bytes = 256, 7168 * 2
    bounds = expert_bounds(experts, size)
    gen = torch.Generator().manual_seed(7)
    before = after = rows_off = pairs_off_all = 0
    for rank in range(size):
        logits = torch.randn(tokens, experts, generator=gen)
        _, ids = moe_route_ref(logits, torch.zeros(experts), top_k, n_group, topk_group, "sigmoid", True, 2.5)
        routes = route(ids, bounds)
        owner = torch.bucketize(ids, torch.tensor(bounds[1:]), right=True)
        distinct = {(t, int(o)) for t in range(tokens) for o in owner[t]}
        rows = [sum(1 for _, o in distinct if o == dest) for dest in range(size)]
        assert routes.per_slot[:, 0].tolist() == rows  # the rows dispatch_combine sends each rank
        assert routes.per_slot.sum(1).tolist() == torch.bincount(owner.reshape(-1), minlength=size).tolist()
        if all(b % (experts // n_group) == 0 for b in bounds):  # whole groups on a rank: topk_group ranks at most
            assert max(len({int(o) for o in owner[t]}) for t in range(tokens)) <= topk_group
        off = sum(rows) - rows[rank]  # a rank's own rows stay
        pairs_off = int((owner != rank).sum())
        # per-choice: a row each way per pair, [E] int64 counts; dedup: a row and its k slots
        # (int32 id, float32 weight) out, a partial back, [size, k] int64 counts
        before += 2 * pairs_off * row_bytes + 8 * (experts - bounds[rank + 1] + bounds[rank])
        after += off * (row_bytes + 8 * top_k) + off * row_bytes + (size - 1) * 8 * top_k
        rows_off += off
        pairs_off_all += pairs_off
    print(f"\n{experts} experts top-{top_k} (best {topk_group} of {n_group} groups) over {size} ranks, "
          f"{tokens} tokens a rank: rows off-rank a token {rows_off / (size * tokens):.2f} "
          f"(per choice {pairs_off_all / (size * tokens):.2f}); "
          f"MiB a layer {before / 2**20:.1f} -> {after / 2**20:.1f} ({after / before:.2f}x)")
    assert after < before
