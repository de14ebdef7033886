"""The decode daemon's configuration (``lanekv decode`` takes its defaults from it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from lanekv.decode.cuda.graphs import check_ladder
from lanekv.model.attention.rows import (
    DEFAULT_INDEX_CACHE_DTYPE,
    DEFAULT_KV_CACHE_DTYPE,
    check_index_cache_dtype,
    check_kv_cache_dtype,
)
from lanekv.model.config import ModelConfig
from lanekv.model.dtypes import DTYPES
from lanekv.model.parallel.tp import check_fp8_cuts, check_tp
from lanekv.model.pool_sizing import check_max_model_len
from lanekv.runtime.advertise import check_advertise_host
from lanekv.runtime.security import SecurityConfig
from lanekv.transfer.connector.registry import TRANSPORTS
from lanekv.transfer.grpcfetch.client import RetryPolicy
from lanekv.transfer.grpcfetch.layerwise import MAX_STREAMS_PER_RANK

# The most receiver processes the default sizes (each imports torch and grpc, and maps
# its slots of /dev/shm); --fetch-processes sets more.
AUTO_FETCH_PROCESSES = 16

@dataclass(frozen=True)
class DecodeConfig:
    model_path: str
    prefill_endpoint: str  # "host:port" of the (first) prefill daemon (Prefill + Handshake)
    page_size: int = 16  # must equal the prefill daemon's (the contract checks it)
    dtype: str = "float32"  # model weights and KV pool
    device: str = "auto"  # "cpu", "cuda" or "auto"
    pool_pages: int = 4096  # physical pages in the decode pool
    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port
    load_format: str = "safetensors"  # or "dummy" (seeded random weights, as the prefill daemon's)
    max_batch_size: int = 256
    # Batch sizes whose decode step is captured as a CUDA graph at start (decode.cuda.graphs);
    # None: 1, 2, 4, 8, steps of 8 to 64, then of 16, up to max_batch_size; (): none, all eager.
    graph_batch_sizes: tuple[int, ...] | None = None
    max_workers: int = 64  # calls at once: 8 per worker (CallLimits.for_workers), each holding a thread
    page_wait_s: float = 30.0  # how long a request waits for pages while the pool is full
    connect_timeout_s: float = 30.0  # how long start-up waits for the prefill daemon to answer
    request_timeout_s: float = 600.0  # prefill + transfer of one request, without a client deadline
    max_inflight_bytes: int = 256 << 20  # received but not yet placed, per request
    fetch_chunk_bytes: int = 0  # largest chunk asked of a rank; 0: the rank's default
    # Processes that receive ranks' gRPC streams outside this process's GIL
    # (transfer.grpcfetch.receivers); None: with the pool on a GPU, 4 while the model
    # loads, then one per stream of a fetch (fetch_streams x the largest CP among the
    # prefill daemons, at most AUTO_FETCH_PROCESSES); else 0 (threads here).
    fetch_processes: int | None = None
    # gRPC streams from each owner rank, each a run of its pages, every layer as it is
    # written (transfer.grpcfetch.layerwise); None: 2 when the pool is on a GPU, else 1.
    fetch_streams: int | None = None
    fetch_attempts: int = 4  # tries of a rank's stream in a row that bring nothing new
    stall_timeout_s: float = 10.0  # a rank's stream silent this long is cut and retried
    release_timeout_s: float = 10.0  # deadline of each Release at a prefill rank
    metrics_port: int | None = None  # GET /metrics on host; None: off, 0: a free port
    security: SecurityConfig = SecurityConfig()  # our port, and our channels to prefill and its ranks
    # "auto": ranks on this host that share their pool are read in place
    # (transfer.protocol.descriptors), the others over gRPC; "grpc": every rank over gRPC;
    # "nixl": every rank NIXL reaches read through NIXL (transfer/connector/nixl.py), the rest over gRPC.
    transport: str = "auto"
    # xPyD: more prefill daemons beside prefill_endpoint; each request goes to one of them.
    extra_prefill_endpoints: tuple[str, ...] = ()
    # How often each prefill daemon's health is asked (one out of the pick rejoins at SERVING).
    prefill_health_interval_s: float = 1.0
    # DeepSeek-V3.2 (DSA) index-K rows, as the prefill daemon's (the contract checks it)
    index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE  # "auto" or "fp8_e4m3": the prefill's must match
    advertise_host: str | None = None  # the host the ready file and banner name (runtime.advertise)
    # Longest prompt + output a request may have; None: the model's max_position_embeddings.
    max_model_len: int | None = None
    prefix_cache: bool = True  # keep verified prompt pages for later requests (decode.prefix.cache)
    prefix_cache_share: float = 1.0  # at most this share of the pool's pages cached
    # Tensor parallelism: rank processes of one decode group, rank 0 this daemon's
    # (decode.tp, docs/parallelism.md); must divide the model's KV heads. 1: one process.
    tp_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.prefix_cache_share, bool) or not isinstance(self.prefix_cache_share, (int, float)) \
                or not 0 <= self.prefix_cache_share <= 1:
            raise ValueError(f"prefix_cache_share must be in [0, 1], got prefix_cache_share={self.prefix_cache_share!r}")
        check_advertise_host(self.advertise_host)
        if self.transport not in ("auto", "grpc", "nixl"):
            raise ValueError(f"transport must be auto, grpc or nixl, got transport={self.transport!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got dtype={self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got device={self.device!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be safetensors or dummy, got load_format={self.load_format!r}")
        for name in ("page_size", "pool_pages", "max_batch_size", "max_workers", "max_inflight_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")
        if self.graph_batch_sizes is not None:
            if not isinstance(self.graph_batch_sizes, tuple):
                raise ValueError(f"graph_batch_sizes must be None or a tuple of ints, "
                                 f"got graph_batch_sizes={self.graph_batch_sizes!r}")
            check_ladder(self.graph_batch_sizes, self.max_batch_size)
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got port={self.port!r}")
        if self.metrics_port is not None and (
            isinstance(self.metrics_port, bool) or not isinstance(self.metrics_port, int)
            or not 0 <= self.metrics_port <= 65535
        ):
            raise ValueError(f"metrics_port must be None or in [0, 65535], got metrics_port={self.metrics_port!r}")
        if not isinstance(self.security, SecurityConfig):
            raise TypeError(f"security must be a SecurityConfig, got security={self.security!r}")
        if isinstance(self.fetch_chunk_bytes, bool) or not isinstance(self.fetch_chunk_bytes, int) \
                or self.fetch_chunk_bytes < 0:
            raise ValueError(f"fetch_chunk_bytes must be an integer >= 0, got fetch_chunk_bytes={self.fetch_chunk_bytes!r}")
        if self.fetch_processes is not None and (
            isinstance(self.fetch_processes, bool) or not isinstance(self.fetch_processes, int)
            or not 0 <= self.fetch_processes <= 64
        ):
            raise ValueError(f"fetch_processes must be None or an integer in [0, 64], "
                             f"got fetch_processes={self.fetch_processes!r}")
        if self.fetch_streams is not None and (
            isinstance(self.fetch_streams, bool) or not isinstance(self.fetch_streams, int)
            or not 1 <= self.fetch_streams <= MAX_STREAMS_PER_RANK
        ):
            raise ValueError(f"fetch_streams must be None or an integer in [1, {MAX_STREAMS_PER_RANK}], "
                             f"got fetch_streams={self.fetch_streams!r}")
        if isinstance(self.fetch_attempts, bool) or not isinstance(self.fetch_attempts, int) or self.fetch_attempts < 1:
            raise ValueError(f"fetch_attempts must be an integer >= 1, got fetch_attempts={self.fetch_attempts!r}")
        for name in ("page_wait_s", "connect_timeout_s", "request_timeout_s", "release_timeout_s", "stall_timeout_s",
                     "prefill_health_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {name}={getattr(self, name)!r}")
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"model_path={self.model_path!r} has no config.json")
        # An architecture or a config field the model code cannot run is one line
        # naming it, here at start-up (not a traceback from a rank or a loader).
        check_index_cache_dtype(self.index_cache_dtype)
        check_kv_cache_dtype(self.kv_cache_dtype)
        model = ModelConfig.from_dir(self.model_path)
        check_tp(model, self.tp_size)  # one line naming tp_size and the value it does not divide
        check_fp8_cuts(self.model_path, self.tp_size)  # block-FP8: each cut on a block boundary
        if self.tp_size > 1:
            if self.load_format != "safetensors":
                raise ValueError(f"load_format={self.load_format!r} is not supported with tp_size={self.tp_size} "
                                 "(each rank reads its shard of the safetensors files)")
            if self.resolved_device == "cuda" and self.tp_size > torch.cuda.device_count():
                raise ValueError(f"tp_size={self.tp_size} needs one GPU per rank, "
                                 f"{torch.cuda.device_count()} are visible")
        check_max_model_len(self.max_model_len, model.max_position_embeddings, self.pool_pages * self.page_size)
        if not _is_endpoint(self.prefill_endpoint):
            raise ValueError(f"prefill_endpoint must be 'host:port', got {self.prefill_endpoint!r}")
        if not isinstance(self.extra_prefill_endpoints, tuple):
            raise TypeError(f"extra_prefill_endpoints must be a tuple, got {self.extra_prefill_endpoints!r}")
        for endpoint in self.extra_prefill_endpoints:
            if not _is_endpoint(endpoint):
                raise ValueError(f"extra_prefill_endpoints: {endpoint!r} is not 'host:port'")
        if len(set(self.prefill_endpoints)) != len(self.prefill_endpoints):
            raise ValueError(f"prefill endpoints {list(self.prefill_endpoints)!r} name a daemon twice")

    @property
    def prefill_endpoints(self) -> tuple[str, ...]:
        """Every prefill daemon, in the order given."""
        return (self.prefill_endpoint, *self.extra_prefill_endpoints)

    @property
    def resolved_fetch_processes(self) -> int:
        if self.fetch_processes is not None:
            return self.fetch_processes
        return 4 if self.resolved_device == "cuda" else 0

    def fetch_processes_for(self, cp_sizes: Sequence[int]) -> int:
        """Receiver processes once the prefill daemons' CP sizes are known: the setting,
        else (on a GPU) enough that no stream of one fetch is received in a thread of
        the daemon, where it would share the GIL with the placement of every stream."""
        if self.fetch_processes is not None or not self.resolved_fetch_processes:
            return self.resolved_fetch_processes
        streams = self.resolved_fetch_streams * max(cp_sizes, default=1)
        return max(self.resolved_fetch_processes, min(streams, AUTO_FETCH_PROCESSES))

    @property
    def resolved_fetch_streams(self) -> int:
        if self.fetch_streams is not None:
            return self.fetch_streams
        return 2 if self.resolved_device == "cuda" else 1

    @property
    def fetch_retry(self) -> RetryPolicy:
        """How a KV fetch retries a rank's stream (``transfer.grpcfetch.fetch``)."""
        return RetryPolicy(attempts=self.fetch_attempts, stall_s=self.stall_timeout_s)

    @property
    def transports(self) -> tuple[str, ...]:
        """The KV fetcher's transports, most preferred first (``transfer.connector.registry``):
        every one registered but NIXL for "auto" (NIXL is chosen, never assumed), NIXL then
        gRPC for "nixl", gRPC alone for "grpc"."""
        if self.transport == "auto":  # with tp_size > 1 each rank's KV heads too (decode.tp.fetch)
            return tuple(name for name in TRANSPORTS if name != "nixl")
        return ("nixl", "grpc") if self.transport == "nixl" else ("grpc",)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


def _is_endpoint(endpoint: object) -> bool:
    if not isinstance(endpoint, str):
        return False
    host, _, port = endpoint.rpartition(":")
    return bool(host) and port.isdigit() and 1 <= int(port) <= 65535
