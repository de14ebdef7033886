"""FP8 KV pages end to end (``kv_cache_dtype="fp8_e4m3"``), for Llama (GQA), DeepSeek-V3
(MLA) and V3.2 (DSA) on tiny float32 checkpoints:

- greedy tokens through CP prefill (cp 1-3, rank threads) -> the pages in the wire's
  order -> paged decode equal the single-process run with the same FP8 KV
  (``generate_colocated``), and real daemons over gRPC and over the fast path generate
  the same tokens;
- the pages the CP prefill stores (cp 1-3) are the single-process run's byte for byte,
  page by page, for Llama (GQA) and DeepSeek-V3 (MLA): on the CPU the model's linears and
  attention are batch-invariant (``kernels/invariant``), so the K/V a rank quantizes are
  the bits the single process quantizes, and every path stores through the same fused
  RoPE + quantize + store op. V3.2 (DSA) rows stay within one e4m3 step: its sparse
  attention is not batch-invariant yet. The bytes the decode reads are the bytes the
  prefill stored (the transfer tests: digests checked per chunk and page);
- a decode step's logits over FP8 KV stay within ``LOGITS_TOL`` of the float32-KV ones;
- a decode daemon with another KV cache dtype refuses the prefill daemon at the
  handshake in one line naming ``kv_cache_dtype`` and both values.
"""

from __future__ import annotations

import math

import pytest
import torch
from lanekv.decode.colocated import generate_colocated, prefill_into_pool
from lanekv.decode.pool import PagePool
from lanekv.model.attention import DecodeStep, kind_of, pool_rows
from lanekv.model.attention.rows import DSARows, FP8MLARows, FP8Rows, RowLayout
from lanekv.model.checkpoint import load_model
from lanekv.model.sampling import SamplingParams
from lanekv.prefill.cp.launcher import PrefillInput
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.engine_config import EngineConfig
from lanekv.transfer.errors import ContractMismatch
from lanekv.transfer.protocol.fielddiff import format_diff

from tests.checkpoints import VOCAB_SIZE, write_deepseek_v3, write_deepseek_v32, write_llama
from tests.daemons import generate_concurrently, running_pair, start_pair
from tests.markers import requires_gpu
from tests.threaded_e2e import threaded_generate

FP8 = "fp8_e4m3"
PROMPT_LENS = (3, 9, 22)
NEW_TOKENS = 6
WRITERS = {"llama": write_llama, "deepseek_v3": write_deepseek_v3, "deepseek_v32": write_deepseek_v32}
# A decode step's logits over FP8 KV against float32 KV, relative to the logits' largest
# magnitude. e4m3 keeps 3 mantissa bits (each value within 1/16 of itself); these random
# 2-3 layer checkpoints have no outlier structure for the scales to absorb, and the error
# grows with the context: measured 3.4% to 12.5% (3 to 22 tokens, all three models). A
# misapplied scale or a misread row is off by 100% or more.
LOGITS_TOL = 0.2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-kv")
    return {name: write(root / name) for name, write in WRITERS.items()}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _pool(config, pages: int = 64, page_size: int = 4, kv: str = FP8) -> PagePool:
    return PagePool.for_model(config, pages, page_size, torch.float32, kv_cache_dtype=kv)


@pytest.fixture(scope="module")
def single(checkpoints) -> dict[str, list[list[int]]]:
    """Each model's greedy tokens in one process with FP8 KV (prompt, then paged decode)."""
    out = {}
    for name, path in checkpoints.items():
        loaded = load_model(path)
        out[name] = generate_colocated(loaded.model, _pool(loaded.config), _prompts(),
                                       SamplingParams(), NEW_TOKENS, ignore_eos=True)
    return out


@pytest.mark.parametrize("name", list(WRITERS))
@pytest.mark.parametrize("cp_size,page_size", [(1, 4), (2, 1), (3, 16)])
def test_cp_prefill_transfer_decode_equals_a_single_process_run(checkpoints, single, name,
                                                                cp_size, page_size):
    got = threaded_generate(checkpoints[name], cp_size, page_size, _prompts(), NEW_TOKENS,
                            kv_cache_dtype=FP8)
    # threaded_generate stops at EOS; the single-process run ran past it
    assert got == [want[: len(g)] for g, want in zip(got, single[name])]
    assert all(len(g) == NEW_TOKENS or g[-1] in (0, 1, 2) for g in got)


def _fp8_tolerance(rows, values_a, values_b) -> None:
    """``values_*`` (dequantized rows) agree within one e4m3 step of their magnitude."""
    step = values_a.abs().amax(dim=-1, keepdim=True) / 448 * 2.0 ** -9  # the subnormal step
    assert bool(((values_a - values_b).abs() <= values_a.abs() / 8 + 2 * step + 1e-6).all())


def _cp_and_single_process_rows(checkpoint, kv: str, page_size: int = 4):
    """Per cp size 1-3: (prompt, the single-process run's rows, the CP prefill's rows), each
    ``[layers, planes, prompt tokens, heads, row]`` in the prompt's order (the wire's)."""
    loaded = load_model(checkpoint)
    pool = _pool(loaded.config, page_size=page_size, kv=kv)
    prompts = _prompts()
    want = []
    for ids in prompts:
        table, _ = prefill_into_pool(loaded.model, pool, ids, SamplingParams())
        want.append(pool.tensor[:, :, table.locs_for(range(len(ids)))].clone())
    for cp_size in (1, 2, 3):
        eng = ThreadedPrefillEngine(EngineConfig(
            str(checkpoint), cp_size=cp_size, page_size=page_size, pages_per_lane=16,
            pool_fill=math.nan, kv_cache_dtype=kv))
        for ids, res, ours in zip(prompts, eng.prefill([PrefillInput(p) for p in prompts]), want):
            yield cp_size, ids, ours, eng.read_pages([p.page for p in res.pages])[:, :, : len(ids)]


@pytest.mark.parametrize("kv", [FP8, "auto"])
@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_cp_prefill_stores_the_single_process_bytes_page_by_page(checkpoints, name, kv):
    """FP8 rows reach what the model dtype's rows reach: the same bytes as one process."""
    page_size = 4
    for cp_size, ids, ours, theirs in _cp_and_single_process_rows(checkpoints[name], kv, page_size):
        assert theirs.dtype == ours.dtype and theirs.shape == ours.shape
        if kv == FP8:
            assert theirs.dtype == torch.uint8
        for layer in range(ours.shape[0]):
            for page in range(-(-len(ids) // page_size)):
                rows = slice(page * page_size, (page + 1) * page_size)
                # bytes, so that NaN payloads or -0.0 could not hide behind a float compare
                assert torch.equal(theirs[layer, :, rows].view(torch.uint8),
                                   ours[layer, :, rows].view(torch.uint8)), (
                    f"cp_size={cp_size} prompt of {len(ids)}: layer {layer} page {page} differs")


def test_dsa_cp_prefill_stores_the_single_process_rows_within_one_e4m3_step(checkpoints):
    """V3.2's latent and index rows: its sparse attention is not batch-invariant yet, so
    layers past the first hold the single-process values within one e4m3 step."""
    rows = _pool(load_model(checkpoints["deepseek_v32"]).config).rows
    for _, _, ours, theirs in _cp_and_single_process_rows(checkpoints["deepseek_v32"], FP8):
        assert theirs.dtype == torch.uint8 and theirs.shape == ours.shape
        assert torch.equal(rows.index_rows(theirs[0, 0, :, 0]), rows.index_rows(ours[0, 0, :, 0]))
        assert torch.equal(rows.latent(theirs[0, 0, :, 0]), rows.latent(ours[0, 0, :, 0]))
        for layer in range(ours.shape[0]):
            _fp8_tolerance(rows, _values(rows, ours[layer]), _values(rows, theirs[layer]))


def _values(rows, stored: torch.Tensor) -> torch.Tensor:
    """One layer's stored rows ``[kv, n, heads, row]`` -> float values (latent part for DSA)."""
    if hasattr(rows, "decode_latent"):
        return rows.decode_latent(rows.latent(stored[0, :, 0])).float()
    return rows.decode(stored.transpose(0, 1)).float()


def _decode_step_logits(loaded, kv: str, prompt: list[int]) -> torch.Tensor:
    """The last prompt token's logits as a decode step computes them over the others' KV."""
    model, pool = loaded.model, _pool(loaded.config, kv=kv)
    table, _ = prefill_into_pool(model, pool, prompt[:-1], SamplingParams())
    loc = table.append_slot()
    step = DecodeStep(torch.tensor([loc]), torch.tensor([list(table.pages)], dtype=torch.int32),
                      torch.tensor([table.seq_len], dtype=torch.int32))
    kind = kind_of(loaded.config)
    with torch.inference_mode():
        hidden = kind.forward(model, torch.tensor(prompt[-1:]), torch.tensor([len(prompt) - 1]),
                              kind.paged_decode(model, pool, step))
        return model.compute_logits(hidden)[0]


@pytest.mark.parametrize("name", list(WRITERS))
def test_fp8_decode_logits_stay_within_the_stated_tolerance_of_float32_kv(checkpoints, name):
    loaded = load_model(checkpoints[name])
    for prompt in _prompts()[1:]:
        exact = _decode_step_logits(loaded, "auto", prompt)
        fp8 = _decode_step_logits(loaded, FP8, prompt)
        assert not torch.equal(exact, fp8)  # the KV was quantized
        assert float((fp8 - exact).abs().max()) <= LOGITS_TOL * float(exact.abs().max())


def test_fp8_rows_are_the_stated_bytes():
    """Per token and layer, bf16 against FP8: Llama-3-8B's 8 KV heads of 128, DeepSeek's
    512 + 64 latent (FlashMLA's 656-byte row), and V3.2's row with its index key."""
    bf16 = torch.bfloat16
    assert FP8Rows.build(8, 128, bf16).row_bytes == 2 * 8 * 132
    assert RowLayout(2, 8, 128, bf16).row_bytes == 2 * 8 * 256
    assert FP8MLARows.build(512, 64, bf16).row_bytes == 656
    assert RowLayout(1, 1, 576, bf16).row_bytes == 1152
    assert DSARows.build(576, 128, bf16, fp8_rank=512).row_bytes == 800  # 656 + 132, padded
    assert DSARows.build(576, 128, bf16).row_bytes == 1296


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,transport,cp_size", [
    ("llama", "grpc", 2), ("llama", "fastpath", 2), ("deepseek_v3", "grpc", 2),
    ("deepseek_v32", "fastpath", 2)])
def test_daemons_with_fp8_kv_generate_the_single_process_tokens(checkpoints, single, name,
                                                                transport, cp_size):
    engine = EngineConfig(str(checkpoints[name]), cp_size=cp_size, page_size=4,
                          pages_per_lane=32, start_timeout_s=120, kv_cache_dtype=FP8)
    extra = {"transport": "grpc"} if transport == "grpc" else {}
    with running_pair(engine, pool_pages=96, **extra) as (pre, dec):
        a = dec.agreement
        rows = pool_rows(dec.loaded.config, torch.float32, kv_cache_dtype=FP8)
        assert (a.kv_cache_dtype, a.kv_dtype, a.head_dim, a.kv_row_format) == (
            FP8, "uint8", rows.head_dim, rows.row_format)
        got = generate_concurrently(dec.endpoint, _prompts(), NEW_TOKENS, id_prefix="fp8")
        assert got == [want[: len(g or [])] for g, want in zip(got, single[name])]
        if transport == "fastpath":
            assert {dec.fastpath.transport(e) for e in pre.topology.endpoints} == {"shm"}


@pytest.mark.timeout(120)
def test_a_model_dtype_decode_refuses_an_fp8_prefill_by_field(checkpoints):
    engine = EngineConfig(str(checkpoints["llama"]), cp_size=1, page_size=4, pages_per_lane=8,
                          start_timeout_s=60, kv_cache_dtype=FP8)
    with pytest.raises(ContractMismatch) as refused:
        start_pair(engine, pool_pages=16, kv_cache_dtype="auto")
    assert format_diff(refused.value.diffs, ours="decode", theirs="prefill") == (
        "kv_cache_dtype: decode='auto' prefill='fp8_e4m3'")


@pytest.mark.parametrize("name", list(WRITERS))
def test_the_interpreted_fp8_kernels_generate_the_single_process_tokens(checkpoints, single, name,
                                                                        monkeypatch):
    """The same run with the FP8 kernels interpreted (the rest on the references): RoPE,
    packing and store fused (GQA, MLA; MLA's decode step with the kv_a norm too), the packing
    of DSA's latent, the decode kernels dequantizing the rows as they load them, and MLA's
    split partials merged in the output's expansion."""
    from lanekv.kernels import decode_attention
    from lanekv.kernels.backend import interpreter_enabled
    from lanekv.kernels.dsa import sparse_mla
    from lanekv.kernels.fp8 import kv_rows, rope_store
    from lanekv.kernels.mla import expand_merge, latent_store, paged_decode
    from lanekv.model import deepseek
    from lanekv.model.attention import dsa, gqa, mla, rows

    if not interpreter_enabled():
        pytest.skip("runs Triton on CPU tensors, which needs TRITON_INTERPRET=1 (set by "
                    "tests/conftest.py without a GPU); the gpu-marked kernel tests cover CUDA")
    for module, name_, kernel in (
            (rows, "pack_kv_fp8_rows", kv_rows.pack_kv_fp8_rows_triton),
            (rows, "pack_mla_fp8_rows", kv_rows.pack_mla_fp8_rows_triton),
            (gqa, "rope_store_kv_fp8", rope_store.rope_store_kv_fp8_triton),
            (mla, "mla_rope_store_fp8", rope_store.mla_rope_store_fp8_triton),
            (gqa, "paged_decode_attention", decode_attention.paged_decode_attention_triton),
            (mla, "mla_rope_norm_store", latent_store.mla_rope_norm_store_triton),
            (mla, "paged_mla_decode_partials", paged_decode.paged_mla_decode_stage1),
            (deepseek, "mla_expand_partials", expand_merge.mla_expand_partials_triton),
            (dsa, "sparse_mla_decode", sparse_mla.sparse_mla_decode_triton)):
        monkeypatch.setattr(module, name_, kernel)
    # one rank: the interpreter is not thread-safe (rank threads would interpret at once)
    got = threaded_generate(checkpoints[name], 1, 4, _prompts()[:2], NEW_TOKENS,
                            kv_cache_dtype=FP8)
    assert got == [want[: len(g)] for g, want in zip(got, single[name][:2])]


@requires_gpu
@pytest.mark.parametrize("name", list(WRITERS))
def test_gpu_cp_prefill_transfer_decode_equals_a_single_process_run(checkpoints, name):
    """On the GPU (compiled kernels, float32 models, CUDA graphs in the decode engine's
    default batch ladder): the same equality as on the CPU, cp 1."""
    loaded = load_model(checkpoints[name], device="cuda")
    pool = PagePool.for_model(loaded.config, 64, 16, torch.float32, "cuda", kv_cache_dtype=FP8)
    want = generate_colocated(loaded.model, pool, _prompts(), SamplingParams(), NEW_TOKENS,
                              ignore_eos=True)
    got = threaded_generate(checkpoints[name], 1, 16, _prompts(), NEW_TOKENS, device="cuda",
                            kv_cache_dtype=FP8)
    assert got == [w[: len(g)] for g, w in zip(got, want)]
