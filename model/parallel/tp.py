"""Tensor parallelism of the Llama-family decoder: one rank's shard of the weights.

A rank of ``size`` holds ``num_heads / size`` query heads and ``num_kv_heads / size``
KV heads (``size`` must divide ``num_kv_heads``, so no KV head is split or
copied), and ``intermediate_size / size`` MLP columns:

- q/k/v and gate/up are column-parallel: the rank's rows of each weight (and bias);
- o_proj and down_proj are row-parallel: the rank's columns, and one all-reduce
  (sum) of each's output, made by a forward hook (``attach_all_reduce``), so the
  decoder's code is the same with or without TP; a bias of o_proj is kept on
  rank 0 only (the sum adds it once);
- the embedding, the norms and lm_head are replicated (the logits are whole on
  every rank; only rank 0 computes them, see ``decode.tp``).

The shard is a model of ``shard_config(config, size)`` (the same class, its head
and MLP counts divided), loaded by ``load_shard`` from the safetensors files with
``safe_open(...).get_slice(name)[rows]``: a rank materializes only its rows or
columns, never a whole sharded tensor (``ShardLoad.bytes_read`` counts them).
MoE blocks (Qwen3-MoE, DeepSeek) shard their routed experts whole over the same
ranks (``model.parallel.ep``: expert parallelism, the block's output all-reduced).
MLA (DeepSeek-V2/V3) splits only its query heads (q_proj or q_b_proj, kv_b_proj,
o_proj): the latent row is shared by every head, so every rank holds it whole
(the pool rows are the same on every rank). DSA (DeepSeek-V3.2) adds the indexer,
replicated: its inputs (the hidden row after the all-reduce, the replicated q_a
latent) are the same on every rank, so every rank picks the same top-k keys from
the same index-K rows (each rank's pool row holds the whole latent and index row).
Block-FP8 weights are cut with their block scales (``shard_scale_index``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from lanekv.kernels.fp8.weights import FP8_DTYPE
from lanekv.model.attention import kind_of
from lanekv.model.checkpoint import LoadedModel, build_model, tensor_files
from lanekv.model.config import ModelConfig
from lanekv.model.parallel.ep import local_expert_name, shard_experts, shared_expert
from lanekv.model.parallel.weights_digest import WeightsSource, stamp_files
from lanekv.model.quant.linear import SCALE_SUFFIX, use_fp8_linears
from lanekv.model.tokenizer import load_tokenizer
from safetensors import safe_open
from torch import nn

# rows of the weight split (MLA: q_proj or q_b_proj, and kv_b_proj, are head-major)
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
_ROW = ("o_proj", "down_proj")  # columns of the weight split, output all-reduced


@dataclass(frozen=True)
class TPRank:
    """One rank of a tensor-parallel group."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tp_size={self.size!r} must be a positive integer")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank={self.rank!r} must be in [0, {self.size})")

    def span(self, total: int) -> slice:
        """This rank's part of ``total`` items split evenly."""
        part = total // self.size
        return slice(self.rank * part, (self.rank + 1) * part)


def check_tp(config: ModelConfig, tp_size: int) -> None:
    """Refuse a model ``tp_size`` ranks cannot split, in one line naming both values."""
    TPRank(0, tp_size)
    if tp_size == 1:
        return
    if config.moe is not None and config.moe.num_experts % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide num_experts={config.moe.num_experts}")
    # MLA: one latent row shared by every head, whole on every rank: only the q heads split.
    for name in ("num_heads", "intermediate_size") if kind_of(config).heads_share_rows else (
            "num_kv_heads", "num_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide {name}={value}")


def check_fp8_cuts(path: str | Path, tp_size: int) -> None:
    """Refuse, before any rank starts, a block-FP8 checkpoint a cut of ``tp_size`` ranks
    would split inside a block, in one line naming the layer, the tp size and the block
    size (only the files' headers are read)."""
    if tp_size == 1:
        return
    config = ModelConfig.from_dir(path)
    if config.weight_quant is None:
        return
    shapes = _tensor_shapes(tensor_files(path))
    tp = TPRank(0, tp_size)
    for name in sorted(shapes):
        weight = name[: -len(SCALE_SUFFIX)] + ".weight"
        if name.endswith(SCALE_SUFFIX) and weight in shapes:
            index = shard_index(weight, shapes[weight], tp)
            if index is not None:
                _check_blocks(weight, shapes[weight], index, tp, config.weight_quant.block)


def _tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's whole shape, from the files' headers (no tensor is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            shapes.update((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())
    return shapes


def shard_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The config of one rank's shard: heads and MLP columns divided by ``tp_size``."""
    check_tp(config, tp_size)
    if tp_size == 1:
        return config
    kv_heads = config.num_kv_heads if kind_of(config).heads_share_rows else config.num_kv_heads // tp_size
    return replace(config, num_heads=config.num_heads // tp_size, num_kv_heads=kv_heads,
                   intermediate_size=config.intermediate_size // tp_size)


def shard_index(name: str, shape: tuple[int, ...], tp: TPRank) -> tuple[Any, ...] | None:
    """The index of ``tp``'s part of checkpoint tensor ``name`` (of full ``shape``),
    or None when every rank holds it whole."""
    parts = name.split(".")
    if len(parts) < 2 or tp.size == 1:
        return None
    module, kind = parts[-2], parts[-1]
    if "experts" in parts or "shared_experts" in parts:
        return None  # routed experts are sharded whole (model.parallel.ep), shared ones replicated
    if module in _COLUMN:
        return (tp.span(shape[0]),)
    if module in _ROW and kind == "weight":
        return (slice(None), tp.span(shape[1]))
    return None


class ShardLoad(NamedTuple):
    loaded: LoadedModel  # its config is the whole model's; its model the shard
    bytes_read: int  # bytes materialized from the checkpoint's tensors by this rank


def load_shard(path: str | Path, tp: TPRank, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", *, weights: WeightsSource | None = None,
               ep: TPRank | None = None) -> ShardLoad:
    """Rank ``tp``'s shard of the checkpoint at ``path``: a model of ``shard_config``
    with its rows and columns read by ``get_slice`` (nothing else of a sharded tensor
    is read), eval mode, projections fused. ``weights``: gives the weights digest the daemon
    computed once (``model.checkpoint.checkpoint_digest``), asked after the read, checked
    against the files' stamps before and after it and carried by the shard; None: the
    shard carries none (ranks that do not handshake need none; a shard never hashes). ``ep``: the rank
    among the ranks sharing routed experts when it is not ``tp`` (prefill EP: the
    attention whole, ``tp`` of size 1, the experts over the CP ranks).

    A block-FP8 checkpoint's e4m3 weights are cut like any others and each
    ``weight_scale_inv`` by the same rule in blocks (``shard_scale_index``): a rank
    reads its rows or columns of the weight and the matching rows or columns of its
    block scales, so a cut must fall on block boundaries (else one line naming the
    layer, the tp size and the block size)."""
    experts = tp if ep is None else ep
    path = Path(path)
    config = ModelConfig.from_dir(path)
    local = shard_config(config, tp.size)
    model = build_model(local, dtype=dtype, device="meta")
    if config.moe is not None and experts.size > 1:
        shard_experts(model, experts.rank, experts.size, shared_everywhere=tp.size == 1)
    expected = model.state_dict()
    files = tensor_files(path)
    before = stamp_files(files)  # the weights digest's files, if one was handed down
    shapes = _tensor_shapes(files)  # a weight's and its scale's may be in different files
    block = None if config.weight_quant is None else config.weight_quant.block
    state: dict[str, torch.Tensor] = {}
    nbytes = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():
                name = stored if config.moe is None or experts.size == 1 else local_expert_name(
                    stored, experts.rank, experts.size, config.moe.num_experts)
                if name is None or tp.rank > 0 and shared_expert(stored) or (
                        model.ignores_extra_layers and _extra_layer(stored, config.num_layers)):
                    continue  # another rank's expert (or shared expert), a DeepSeek MTP layer: never read
                if name not in expected and not name.endswith(SCALE_SUFFIX):
                    if config.tie_word_embeddings and name == "lm_head.weight":
                        continue
                    if name.endswith(".rotary_emb.inv_freq"):
                        continue
                    raise ValueError(f"checkpoint {path} does not match {config.architecture}: "
                                     f"unexpected tensor {name!r}")
                if name.endswith(SCALE_SUFFIX):
                    weight = stored[: -len(SCALE_SUFFIX)] + ".weight"
                    index = shard_scale_index(name, shapes.get(weight), shapes[stored], tp, block)
                else:
                    index = shard_index(name, shapes[stored], tp)
                    scaled = stored[: -len(".weight")] + SCALE_SUFFIX
                    if index is not None and block is not None and scaled in shapes:
                        _check_blocks(name, shapes[stored], index, tp, block)
                if name.endswith("o_proj.bias") and tp.rank > 0:
                    part = torch.zeros(expected[name].shape)  # the all-reduce adds rank 0's once
                else:
                    tensor_slice = f.get_slice(stored)
                    part = tensor_slice[:] if index is None else tensor_slice[index]
                    nbytes += part.numel() * part.element_size()
                state[name] = part
    use_fp8_linears(model, state, config.weight_quant, dtype)  # block-FP8 layers, their local shapes checked
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint {path} does not match {config.architecture}: missing tensors {missing}")
    for name, part in state.items():
        if name not in expected:
            raise ValueError(f"checkpoint {path} does not match {config.architecture}: "
                             f"unexpected tensor {name!r}")
        if part.shape != expected[name].shape:
            raise ValueError(f"tensor {name!r}: rank {tp.rank} of {tp.size} got shape "
                             f"{tuple(part.shape)}, expected {tuple(expected[name].shape)}")
        stored_as = part.dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIX)  # e4m3 weights, their scales
        state[name] = part.to(device=device, dtype=part.dtype if stored_as else expected[name].dtype).contiguous()
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    model.fuse_projections()
    digest = ""
    if weights is not None:  # the files this rank read are those the digest describes
        given = weights()
        given.check(before)
        given.check(stamp_files(files))
        digest = given.digest
    loaded = LoadedModel(config=config, model=model, weights_digest=digest,
                         tokenizer=load_tokenizer(path, config.eos_token_ids))
    return ShardLoad(loaded, nbytes)


def shard_scale_index(name: str, weight_shape: tuple[int, ...] | None, shape: tuple[int, ...], tp: TPRank,
                      block: tuple[int, int] | None) -> tuple[Any, ...] | None:
    """The index of ``tp``'s part of block-scale tensor ``name`` (``X.weight_scale_inv``,
    of full ``shape``) for its weight of full ``weight_shape``: the blocks of the rows
    (column-parallel) or columns (row-parallel) ``shard_index`` gives the weight, or
    None when the weight is whole on every rank."""
    weight = name[: -len(SCALE_SUFFIX)] + ".weight"
    if block is None or weight_shape is None:
        raise ValueError(f"tensor {name!r} scales {weight!r}, but the checkpoint has no block-FP8 "
                         f"{'quantization_config' if block is None else 'weight beside it'}")
    index = shard_index(weight, weight_shape, tp)
    if index is None:
        return None
    _check_blocks(weight, weight_shape, index, tp, block)
    dim = len(index) - 1  # 0: the weight's rows are cut, 1: its columns
    return (slice(None),) * dim + (tp.span(shape[dim]),)


def _check_blocks(name: str, shape: tuple[int, ...], index: tuple[Any, ...], tp: TPRank,
                  block: tuple[int, int]) -> None:
    """Refuse a cut of a block-FP8 weight that does not fall on its blocks' boundaries."""
    dim = len(index) - 1
    part = shape[dim] // tp.size
    if part % block[dim]:
        what = ("output rows", "input columns")[dim]
        layer = name.removesuffix(".weight")
        raise ValueError(f"layer {layer!r}: tp_size={tp.size} cuts its {shape[dim]} {what} into parts of "
                         f"{part}, not whole blocks of weight_block_size={list(block)}")


def _extra_layer(name: str, num_layers: int) -> bool:
    """A layer past the decoder's (DeepSeek-V3's multi-token-prediction layers)."""
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


def attach_all_reduce(model: nn.Module, group: Any) -> int:
    """Sum the outputs of every row-parallel projection (o_proj, and down_proj as the
    MLP block's output) over ``group``, in place, by a forward hook; the number of
    hooks attached."""

    def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)
        return output

    count = 0
    for layer in model.model.layers:
        # The MLP block's output, down_proj's: a block-FP8 down_proj runs through its
        # ``silu_mul``, not its forward; EP: the block's sum of the experts' shares.
        for projection in (layer.self_attn.o_proj, layer.mlp):
            projection.register_forward_hook(hook)
            count += 1
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (fused views counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
