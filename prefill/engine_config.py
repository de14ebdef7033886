"""Configuration of a CP prefill engine (frozen; the CLI takes its defaults from it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from lanekv.model.attention.rows import (
    DEFAULT_INDEX_CACHE_DTYPE,
    DEFAULT_KV_CACHE_DTYPE,
    check_index_cache_dtype,
    check_kv_cache_dtype,
)
from lanekv.model.config import ModelConfig
from lanekv.model.dtypes import DTYPES
from lanekv.transfer.rank.relay import check_relays

if TYPE_CHECKING:
    from lanekv.model.checkpoint import LoadedModel
    from lanekv.model.parallel.weights_digest import WeightsSource


EP_DISPATCHES = ("sized", "capturable")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    cp_size: int = 1
    page_size: int = 16
    pages_per_lane: int = 1024  # physical pages in each rank's pool
    dtype: str = "float32"  # model weights and KV pool
    device: str = "auto"  # "cpu", "cuda" (rank r on cuda:r) or "auto"
    dist_port: int = 0  # the ranks' rendezvous port, held by the launcher; 0: one the OS gives
    start_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    pool_fill: float = 0.0  # initial pool value; tests poison it with NaN
    cpu_threads: int = 0  # torch threads per rank on CPU; 0 = cores / cp_size
    load_format: str = "safetensors"  # or "dummy": config.json's shapes, seeded random weights
    # DeepSeek-V3.2 (DSA) index-K rows: "fp8_e4m3" (e4m3 + a float32 scale per 128
    # values) or "model" (the model dtype, bit-comparable with transformers)
    index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE
    # KV rows: "auto" (the model dtype) or "fp8_e4m3" (model/attention/rows.py: e4m3 values
    # with float32 scales, the pool in bytes); the decode daemon must hold the same
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE
    # CUDA: prefills of up to this many rows per rank replay piecewise CUDA graphs
    # (``prefill.cp.graphs``, captured at warm-up); 0 = always eager. Past it the GPU's
    # work outweighs the host's launches (8B shapes).
    graph_max_rows: int = 2048
    # Expert parallelism: the routed experts sharded over the CP ranks (each reads only
    # its experts; every MoE layer exchanges rows: model.parallel.ep, docs/parallelism.md).
    ep: bool = False
    # How an EP MoE layer exchanges rows (EP_DISPATCHES): "sized" sends exactly the rows
    # each rank needs, split sizes read on the host once a layer; "capturable" sends a
    # fixed [cp_size, max rows per rank] padded buffer with no host sync, so a layer can
    # be captured in a CUDA graph, for up to cp_size / D times the bytes
    # (model.parallel.dispatch_capturable, docs/parallelism.md).
    ep_dispatch: str = "sized"
    # Sender relays per rank (``transfer.rank.relay``): processes that send the rank's
    # FetchKV bytes outside its GIL. 0 (CPU and GPU): each relay on a GPU holds a CUDA
    # context and runs its reads on the rank's GPU, and what it buys is measured by
    # bench/ttft.py's grpc_relay_s<n> rows before it becomes a default.
    fetch_relays: int = 0

    def __post_init__(self) -> None:
        for name in ("cp_size", "page_size", "pages_per_lane"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")
        if isinstance(self.graph_max_rows, bool) or not isinstance(self.graph_max_rows, int) or (
            self.graph_max_rows < 0
        ):
            raise ValueError(f"graph_max_rows must be an integer >= 0, got graph_max_rows={self.graph_max_rows!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got dtype={self.dtype!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be safetensors or dummy, got load_format={self.load_format!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got device={self.device!r}")
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"model_path={self.model_path!r} has no config.json")
        check_index_cache_dtype(self.index_cache_dtype)
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_relays(self.fetch_relays)
        if self.ep_dispatch not in EP_DISPATCHES:
            raise ValueError(f"ep_dispatch must be one of {', '.join(EP_DISPATCHES)}, got "
                             f"ep_dispatch={self.ep_dispatch!r}")
        if self.ep_dispatch != "sized" and not self.ep:
            raise ValueError(f"ep_dispatch={self.ep_dispatch!r} needs ep=True")
        # An architecture or a config field the model code cannot run is one line
        # naming it, here at start-up (not a traceback from a rank or a loader).
        model = ModelConfig.from_dir(self.model_path)
        if self.ep:
            if model.moe is None:
                raise ValueError(f"ep=True needs a MoE model, architecture={model.architecture!r} has no experts")
            if model.moe.num_experts < self.cp_size:  # every rank owns an expert (an uneven split is fine)
                raise ValueError(f"ep=True: cp_size={self.cp_size} is more ranks than "
                                 f"num_experts={model.moe.num_experts}")
            if self.load_format != "safetensors":
                raise ValueError(f"ep=True reads each rank's experts from the safetensors files, "
                                 f"got load_format={self.load_format!r}")
        if self.resolved_device == "cuda":
            visible = torch.cuda.device_count()
            if self.cp_size > visible:
                raise ValueError(
                    f"cp_size={self.cp_size} needs one GPU per rank but {visible} are visible"
                )

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def load_for(config: EngineConfig, device: torch.device | str, rank: int = 0,
             weights: WeightsSource | None = None) -> LoadedModel:
    """The model of ``config`` on ``device`` (weights read, or dummy ones made there);
    with ``ep``, rank ``rank``'s routed experts only (``model.parallel.tp.load_shard``).
    ``weights``: gives the weights digest the launcher computed once for every rank,
    asked after the read (the load checks the files are those it describes and never
    hashes them); None: the load finds or computes its own (an EP shard carries none)."""
    from lanekv.model.checkpoint import load_checkpoint

    if config.ep and config.cp_size > 1:
        from lanekv.model.parallel.tp import TPRank, load_shard

        return load_shard(config.model_path, TPRank(0, 1), config.torch_dtype, device,
                          ep=TPRank(rank, config.cp_size), weights=weights).loaded
    return load_checkpoint(config.model_path, config.torch_dtype, device, config.load_format, weights)
