"""Launch configurations of the block-FP8 GEMM: the families, a default
heuristic, the sweep's candidate lists and the tuned tables.

A ``GemmConfig`` names a tile (``block_m x block_n``, k step ``block_k``), the
order tiles are handed out in (``group_m`` row tiles share each column sweep, so
a wave of programs reuses the same weight columns from L2), how many programs
split the k range (``split_k``: partial sums in float32, then one reduction),
the warps and pipeline stages, and four switches:

- ``tma``: the fp8 tiles of ``a`` and ``w`` come through TMA tensor descriptors
  (Hopper's bulk copies; no masks, out-of-range rows read as zero) instead of
  pointer loads; the launcher falls back to pointer loads when a tensor breaks
  TMA's 16-byte alignment rules;
- ``persistent``: one program per SM walks the tiles (``tile += programs``), so
  one tile's epilogue overlaps the next one's first loads and the last wave is
  not a partial one;
- ``lag``: the float32 scaling of one k step's product is applied in the next
  step, after that step's ``tl.dot`` is issued, so the tensor cores are not idle
  while the CUDA cores scale (it needs the whole tile inside one weight scale
  block: ``block_n`` of the scales divisible by ``block_n`` of the tile; Triton
  3.9, compiling offline for sm_90, still places the wait right after the dot,
  so the sweep is what shows whether it gains anything);
- ``w8a16``: weight-only dequantization (``gemm_w8a16.py``): the kernel reads the
  activations unquantized in their own dtype and converts each e4m3 weight tile to
  it for a 16-bit tensor-core dot (swap AB, the weight the register operand), the
  weight scale applied to each step's product; no ``a_scale``, no quantization
  anywhere. Only ``fp8_linear`` runs it (``block_fp8_matmul`` takes pre-quantized
  activations); it takes pointer loads (``tma``, ``persistent`` and ``lag`` are
  w8a8 switches and refused with it); its dot needs no fp8 padding (``dot_k`` is
  ``block_k``).

Every family's dot starts each k step from zero and its product is added to the
float32 sum: Hopper's fp8 tensor cores add at reduced precision, so at most one
step (one scale group) of products passes through their accumulator. A former
``fold`` family handed the running sum to the dot as its accumulator (one float32
tile live instead of two) and so summed all of K at that precision: its error
against the float32 reference grew with K (BENCHMARKS.md). It was removed, and
its table entries replaced by the same sweep's fastest other config; tables that
still name ``fold`` load when it is false. (Promoted per step with
``max_num_imprecise_acc``, it compiles for sm_90 with a float32 partial per
tensor-core instruction beside the sum, no longer one tile; whether that is
still faster than the other families is for a sweep on the device to show.)

The dot tile is at least ``MIN_DOT`` (16 x 16 x 32, Triton's fp8 dot on sm_90
needs K >= 32): a scale group narrower than 32 (tiny test checkpoints) keeps its
k step, and ``dot_k`` pads the step's dot with zero columns (masked loads, no TMA).

Where the down projection's config is w8a16 or gemv, ``silu_mul_fp8_linear`` reads the
gate/up GEMM's output itself and computes ``silu(gate) * up`` in registers, rounded to
its dtype as ``silu_mul`` rounds it (bit for bit the unfused result; one launch fewer
per layer); a w8a8 config still quantizes the product with ``silu_mul_quant_fp8``.

At <= 16 rows (decode) the default is w8a16 (16-row tile, 64 columns, k step one
scale group, split-K to about fill the SMs): the activations stay unquantized, which
is the reference's own operation, and the k loop has no per-step quantization of
the activation tile, which sits on the critical path of the fused w8a8 decode GEMM
(issue 33, BENCHMARKS.md). A tuned table entry still wins. The heuristic never picks
gemv: it runs where ``bench/fp8.py --sweep`` timed it fastest for a shape, as the step
runs it (the down projection with its SiLU fused), and a table entry names it.

At >= 256 rows (prefill) the default is the standard Hopper block-FP8 tile,
64x128x128 on 4 warps with 3 stages and pointer loads (two programs per SM: one
scales its k step's product while the other's dot runs), and the sweep tries
six configs (``prefill_candidates``), that one first.

The family of a config (``config_family``) is what the tests run each of under
the interpreter: ``tiles``, ``tma``, ``persistent``, ``splitk``, ``lag``, ``w8a16``, ``gemv``.

Tuned tables come from ``bench/fp8.py --sweep``: a JSON file of entries
``{"rows", "n", "k", "block", "config"}``. ``select_config`` looks one up for a
``(rows, N, K, block)``: the file named by ``LANEKV_FP8_GEMM_CONFIGS`` if set,
else ``gemm_tables/<device name>.json`` beside this module if present; among the
entries of that ``(N, K, block)`` the one whose row count is nearest in log
scale wins; entries without ``w8a16`` or ``gemv`` load as w8a8; a gemv entry is not used for more
than ``GEMV_MAX_ROWS`` rows (the heuristic decides there). Shapes no table covers take ``default_config``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path
from typing import NamedTuple

import torch

TABLE_ENV = "LANEKV_FP8_GEMM_CONFIGS"
TABLE_DIR = Path(__file__).resolve().parent / "gemm_tables"
# A tuned entry serves row counts within this many octaves (factors of 2) of its own.
MAX_ROW_OCTAVES = 2
FAMILIES = ("tiles", "tma", "persistent", "splitk", "lag", "w8a16", "gemv")
# The gemv family holds every row of x in one program (a [block_n] float32 sum per row).
GEMV_MAX_ROWS = 4
# The smallest fp8 dot tile (M, N, K): Triton on sm_90 refuses K < 32 ("Input shapes
# should have ... K >= 32"); rows and columns below 16 are not tiles this module makes.
MIN_DOT = (16, 16, 32)


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int = 128
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False
    persistent: bool = False
    lag: bool = False
    w8a16: bool = False
    # The linear quantizes x with the quantization kernel first (a w8a8 config at decode
    # rows where the sweep timed that faster than quantizing inside the GEMM); the GEMM
    # itself does not read it.
    quant_first: bool = False
    # The CUDA-core split-K GEMV of 1 to GEMV_MAX_ROWS rows (gemm_gemv.py): x unquantized,
    # no tensor cores; block_m is unused by it (its w8a8 twin's row tile).
    gemv: bool = False

    @property
    def dot_k(self) -> int:
        """Depth of each step's ``tl.dot``: ``block_k``, padded with zero columns to
        the fp8 dot's minimum (w8a16's 16-bit dot takes any ``block_k`` >= 16)."""
        return self.block_k if self.w8a16 or self.gemv else max(self.block_k, MIN_DOT[2])

    def name(self) -> str:
        flags = "".join(f for f, on in (("T", self.tma), ("P", self.persistent), ("L", self.lag),
                                        ("W", self.w8a16), ("Q", self.quant_first), ("V", self.gemv))
                        if on)
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}g{self.group_m}s{self.split_k}"
                f"w{self.num_warps}st{self.num_stages}{flags}")

    def to_dict(self) -> dict:
        return self._asdict()

    @classmethod
    def from_dict(cls, data: dict) -> GemmConfig:
        if not isinstance(data, dict):
            raise ValueError(f"a GEMM config must be an object, got {data!r}")
        if data.get("fold", False) is not False:  # the removed family (module docstring)
            raise ValueError(f"fold={data['fold']!r}: the fold family was removed (its sum "
                             "went through the fp8 tensor core's reduced-precision accumulator)")
        data = {key: value for key, value in data.items() if key != "fold"}
        unknown = set(data) - set(cls._fields)
        if unknown:
            raise ValueError(f"unknown GEMM config field(s) {sorted(unknown)} in {data!r}")
        return check_config(cls(**data))


def _pow2(value, name: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or value > high or (
            value & (value - 1)):
        raise ValueError(f"{name} must be a power of two in [{low}, {high}], got {value!r}")


def check_config(cfg: GemmConfig) -> GemmConfig:
    """Raise ValueError naming the field of a config Triton cannot run."""
    _pow2(cfg.block_m, "block_m", 16, 256)
    _pow2(cfg.block_n, "block_n", 16, 256)
    _pow2(cfg.block_k, "block_k", 16, 256)
    _pow2(cfg.num_warps, "num_warps", 1, 16)
    for field in ("group_m", "split_k", "num_stages"):
        value = getattr(cfg, field)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
            raise ValueError(f"{field} must be an int in [1, 64], got {value!r}")
    for field in ("tma", "persistent", "lag", "w8a16", "quant_first", "gemv"):
        if not isinstance(getattr(cfg, field), bool):
            raise ValueError(f"{field} must be a bool, got {getattr(cfg, field)!r}")
    if cfg.w8a16:
        for field in ("tma", "persistent", "lag", "quant_first"):
            if getattr(cfg, field):
                raise ValueError(f"{field}=True is a w8a8 switch; a w8a16 config quantizes nothing and takes "
                                 f"pointer loads, one program per tile (got {cfg.name()})")
    if cfg.gemv:
        for field in ("tma", "persistent", "lag", "quant_first", "w8a16"):
            if getattr(cfg, field):
                raise ValueError(f"{field}=True cannot go with gemv=True: a gemv config reads x "
                                 f"unquantized with pointer loads on the CUDA cores (got {cfg.name()})")
    return cfg


def config_family(cfg: GemmConfig) -> str:
    """The one feature a config exercises beyond plain tiles (tests cover each)."""
    if cfg.gemv:
        return "gemv"
    if cfg.w8a16:
        return "w8a16"
    if cfg.lag:
        return "lag"
    if cfg.split_k > 1:
        return "splitk"
    if cfg.persistent:
        return "persistent"
    return "tma" if cfg.tma else "tiles"


def _split_for(tiles: int, k_steps: int, sms: int) -> int:
    """Split the k range until the programs about fill the SMs, keeping >= 4 steps each."""
    split = 1
    while tiles * split * 2 <= sms and k_steps // (split * 2) >= 4 and split < 16:
        split *= 2
    return split


def default_config(rows: int, n: int, k: int, block: tuple[int, int], sms: int = 132,
                   ) -> GemmConfig:
    """The heuristic for shapes no tuned table covers (Hopper-sized defaults); at
    <= 16 rows the w8a16 family (module docstring: unquantized activations, the
    reference's op, and no per-step quantization in the k loop)."""
    block_k = min(block[1], 128)
    k_steps = -(-k // block_k)
    if rows <= 64:  # decode: stream the weight through thin row tiles
        block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
        block_n = 64
        tiles = -(-n // block_n) * -(-rows // block_m)
        return GemmConfig(block_m, block_n, block_k, 8, _split_for(tiles, k_steps, sms), 4, 4,
                          w8a16=rows <= 16)
    if rows < 256:
        return GemmConfig(64, 128, block_k, 8, 1, 4, 4)
    # prefill: the standard Hopper block-FP8 tile (the first of ``prefill_candidates``):
    # 64x128, one warpgroup, three stages, pointer loads; small enough that two programs
    # share an SM, so one scales its k step's product while the other's dot runs
    return prefill_candidates(block_k)[0]


def interpreter_config(block: tuple[int, int]) -> GemmConfig:
    """Small tiles for the Triton interpreter (several blocks on a test's shapes)."""
    return GemmConfig(16, 32, min(block[1], 32), 4, 1, 4, 1)


def candidate_configs(rows: int, block: tuple[int, int]) -> list[GemmConfig]:
    """What ``bench/fp8.py --sweep`` tries for a row count (each family included)."""
    bk = min(block[1], 128)
    out: list[GemmConfig] = []
    if rows <= 16:
        for bn in (32, 64, 128):
            for split in (1, 2, 4, 8):
                for stages in (4, 5):
                    out.append(GemmConfig(16, bn, bk, 8, split, 4, stages))
                out.append(GemmConfig(16, bn, bk, 8, split, 4, 4, tma=True))
        out += [GemmConfig(16, 64, bk, 8, 1, 4, 4, lag=True),
                GemmConfig(16, 128, bk, 8, 1, 4, 4, lag=True)]
        # w8a16 (timed as the linear, beside the w8a8 configs quantizing x themselves):
        # k step one scale group; 32 columns take mma.sync, 64 and 128 wgmma
        for bn in (32, 64, 128):
            for split in (1, 2, 4, 8):
                for stages in (3, 4, 5):
                    out.append(GemmConfig(16, bn, bk, 8, split, 4, stages, w8a16=True))
        if rows <= GEMV_MAX_ROWS:
            out += gemv_candidates(bk)
    elif rows < 256:
        bms = (32, 64) if rows <= 64 else (64, 128)
        for bm in bms:
            for bn in (64, 128):
                for split in (1, 2, 4):
                    out.append(GemmConfig(bm, bn, bk, 8, split, 4, 4))
                    out.append(GemmConfig(bm, bn, bk, 8, split, 4, 4, tma=True))
                out.append(GemmConfig(bm, bn, bk, 8, 1, 4, 3))
                out.append(GemmConfig(bm, bn, bk, 8, 1, 4, 5))
                out.append(GemmConfig(bm, bn, bk, 8, 1, 4, 4, lag=True))
    else:
        out += prefill_candidates(bk)
    return [c for c in out if not c.lag or block[0] % c.block_n == 0]


def gemv_candidates(bk: int = 128) -> list[GemmConfig]:
    """The gemv family's sweep candidates (1 to ``GEMV_MAX_ROWS`` rows): 16 to 128 columns
    per program (the widest first: the most bytes in flight a thread), split-K 1 to 16,
    2 to 8 warps, one stage or two (the next scale group's tile prefetched into registers:
    Triton does not pipeline a k loop without a dot), a k step of the scale group (and
    half of it for two configs, which cannot prefetch)."""
    out = []
    for bn in (64, 128, 32, 16):
        for split in (1, 2, 4, 8, 16):
            for warps in (2, 4, 8):
                for stages in (1, 2):
                    out.append(GemmConfig(16, bn, bk, 1, split, warps, stages, gemv=True))
    if bk >= 64:
        for bn in (64, 128):
            out.append(GemmConfig(16, bn, bk // 2, 1, 4, 4, 1, gemv=True))
    return out


def prefill_candidates(bk: int = 128) -> list[GemmConfig]:
    """Six configs for prefill's many rows, the likeliest winners on Hopper first
    (a sweep under a time limit tries them in this order): the standard block-FP8
    tile, 64x128 on one warpgroup with three stages (small enough that several
    programs share an SM, so one scales its partial product while another's
    tensor-core work runs), then 128x128 on two warpgroups, pointer loads or TMA,
    and one config of each further family (persistent, lag)."""
    return [
        GemmConfig(64, 128, bk, 8, 1, 4, 3),
        GemmConfig(128, 128, bk, 8, 1, 8, 3),
        GemmConfig(64, 128, bk, 8, 1, 4, 4, tma=True),
        GemmConfig(128, 128, bk, 8, 1, 8, 4, tma=True),
        GemmConfig(128, 128, bk, 8, 1, 8, 4, tma=True, persistent=True),
        GemmConfig(128, 128, bk, 8, 1, 8, 3, tma=True, lag=True),
    ]


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def table_entry(rows: int, n: int, k: int, block: tuple[int, int], cfg: GemmConfig,
                **extra) -> dict:
    return dict(rows=rows, n=n, k=k, block=list(block), config=cfg.to_dict(), **extra)


@functools.lru_cache(maxsize=8)
def load_table(path: str) -> dict[tuple[int, int, int, int], tuple[tuple[int, GemmConfig], ...]]:
    """``{(n, k, block_n, block_k): ((rows, config), ...)}`` from a sweep's JSON
    (read once per path: a memo of the file, never written to)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"GEMM config table {path!r} cannot be read: {err}") from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"GEMM config table {path!r} has no 'entries' list")
    table: dict[tuple[int, int, int, int], list[tuple[int, GemmConfig]]] = {}
    for i, entry in enumerate(entries):
        try:
            key = (int(entry["n"]), int(entry["k"]), int(entry["block"][0]), int(entry["block"][1]))
            rows = int(entry["rows"])
            cfg = GemmConfig.from_dict(entry["config"])
        except (KeyError, TypeError, IndexError, ValueError) as err:
            raise ValueError(f"GEMM config table {path!r} entry {i} is malformed: {err}") from None
        if key[3] % cfg.block_k:
            raise ValueError(f"GEMM config table {path!r} entry {i}: block_k={cfg.block_k} "
                             f"does not divide the scale block {key[3]}")
        table.setdefault(key, []).append((rows, cfg))
    return {key: tuple(sorted(rows)) for key, rows in table.items()}


@functools.lru_cache(maxsize=8)
def _committed_table(device_name: str) -> str | None:
    """The committed table of a device, if any (looked up once per device name)."""
    path = TABLE_DIR / f"{device_slug(device_name)}.json"
    return str(path) if path.is_file() else None


def lookup(table, rows: int, n: int, k: int, block: tuple[int, int]) -> GemmConfig | None:
    tuned = table.get((n, k, block[0], block[1]))
    if not tuned:
        return None
    target = math.log2(max(rows, 1))
    # nearest row count in log scale; on a tie the larger (its tiles cover these rows)
    if rows > GEMV_MAX_ROWS:  # a gemv entry takes no more rows than its kernel holds
        tuned = tuple(rc for rc in tuned if not rc[1].gemv)
        if not tuned:
            return None
    near_rows, cfg = min(tuned, key=lambda rc: (abs(math.log2(max(rc[0], 1)) - target), -rc[0]))
    # A config tuned for decode's few rows says nothing about a prefill's thousands (and
    # the reverse): beyond a factor of 4 the default's heuristics decide.
    if abs(math.log2(max(near_rows, 1)) - target) > MAX_ROW_OCTAVES:
        return None
    return cfg


# The split-K GEMV on unscaled 16-bit weights (``gemm_gemv.dense_linear``), by device name
# then (N, K, SiLU fused into the activation load): the bf16 shapes at one row where the
# fastest candidate beat cuBLAS (``bench/dense_gemv.py``, H200, 2026-12-03: 0.77-0.98x
# cuBLAS's time; Llama-3-8B's gate/up, 1.02x, is left to cuBLAS). Llama's o and down were
# then tuned in the captured step (``bench/gemv_in_step.py``, H200, 2026-12-04: split-K
# halved, each 1.1-1.3% off the step in two A/B pairs; the step 4.391 -> 4.283 ms), and
# V2-Lite's o (split-K doubled; its step 2.248 -> 2.222 ms). A shape or row count not
# here runs ``F.linear``.
DENSE_GEMV_TABLE: dict[str, dict[tuple[int, int, bool], GemmConfig]] = {
    "NVIDIA H200": {
        (6144, 4096, False): GemmConfig(16, 16, 128, 1, 4, 4, 1, gemv=True),  # Llama qkv
        (4096, 4096, False): GemmConfig(16, 32, 128, 1, 4, 8, 1, gemv=True),  # Llama o
        (4096, 14336, True): GemmConfig(16, 32, 128, 1, 8, 4, 1, gemv=True),  # Llama down
        (128256, 4096, False): GemmConfig(16, 32, 128, 1, 1, 8, 1, gemv=True),  # Llama lm_head
        (3648, 2048, False): GemmConfig(16, 32, 128, 1, 4, 8, 1, gemv=True),  # V2-Lite q/kv_a
        (2048, 2048, False): GemmConfig(16, 32, 128, 1, 16, 8, 1, gemv=True),  # V2-Lite o
        (102400, 2048, False): GemmConfig(16, 16, 128, 1, 1, 2, 1, gemv=True),  # V2-Lite lm_head
    },
}
DENSE_GEMV_ROWS = 1  # the row count the table was measured at
DENSE_GEMV_DTYPE = torch.bfloat16


def dense_gemv_config(rows: int, n: int, k: int, silu: bool, dtype: torch.dtype,
                      device: torch.device) -> GemmConfig | None:
    """The GEMV config for a 16-bit linear of this shape on this device, or None
    (``F.linear``)."""
    if device.type != "cuda" or rows != DENSE_GEMV_ROWS or dtype != DENSE_GEMV_DTYPE:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    table = DENSE_GEMV_TABLE.get(_device_name(index))
    return None if table is None else table.get((n, k, silu))


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)  # fixed per device: asked once, not per linear


def config_for_device(rows: int, n: int, k: int, block: tuple[int, int], device_name: str,
                      sms: int) -> GemmConfig:
    """What ``select_config`` picks on a CUDA device of this name and SM count: the
    table ``LANEKV_FP8_GEMM_CONFIGS`` names, else the device's committed one, else the
    heuristic (offline tools ask it for a device they do not have)."""
    path = os.environ.get(TABLE_ENV) or _committed_table(device_name)
    if path is not None:
        cfg = lookup(load_table(path), rows, n, k, block)
        if cfg is not None:
            return cfg
    return default_config(rows, n, k, block, sms)


def select_config(rows: int, n: int, k: int, block: tuple[int, int],
                  device: torch.device) -> GemmConfig:
    """``config_for_device`` of a CUDA device; on the CPU (the interpreter) the table
    ``LANEKV_FP8_GEMM_CONFIGS`` names, else small tiles."""
    if device.type == "cuda":
        return config_for_device(rows, n, k, block, torch.cuda.get_device_name(device),
                                 torch.cuda.get_device_properties(device).multi_processor_count)
    path = os.environ.get(TABLE_ENV)
    cfg = lookup(load_table(path), rows, n, k, block) if path else None
    return cfg if cfg is not None else interpreter_config(block)
