"""The agreement names the KV cache dtype and the FP8 row format: FP8 agreements of
each attention kind round-trip, carry the rows' bytes as head_dim (uint8), refuse an
inconsistent field in one line, and two sides of different KV dtypes differ by the one
field ``kv_cache_dtype``."""

import pytest
import torch
from lanekv.model.attention import pool_contract_fields, pool_rows
from lanekv.model.attention.rows import FP8MLARows
from lanekv.model.config import ModelConfig
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.fielddiff import diff, format_diff

from tests.checkpoints import write_deepseek_v3, write_deepseek_v32, write_llama

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-kv-contract")
    return {name: ModelConfig.from_dir(write(root / name)) for name, write in (
        ("llama", write_llama), ("v3", write_deepseek_v3), ("v32", write_deepseek_v32))}


def _agreement(config: ModelConfig, kv: str) -> Agreement:
    rows = pool_rows(config, torch.float32, kv_cache_dtype=kv)
    return Agreement.from_model(pool_contract_fields(config, torch.float32, kv_cache_dtype=kv),
                                "w" * 64, rows.dtype, 4, source_digest="s" * 64)


@pytest.mark.parametrize("name", ["llama", "v3", "v32"])
def test_fp8_agreements_name_the_dtype_and_the_row(configs, name):
    a = _agreement(configs[name], "fp8_e4m3")
    rows = pool_rows(configs[name], torch.float32, kv_cache_dtype="fp8_e4m3")
    assert (a.kv_cache_dtype, a.kv_dtype, a.head_dim) == ("fp8_e4m3", "uint8", rows.head_dim)
    assert a.kv_row_format == rows.row_format != ""
    assert Agreement.decode(a.encode()) == a
    plain = _agreement(configs[name], "auto")
    assert (plain.kv_cache_dtype, plain.kv_row_format, plain.kv_dtype) == ("auto", "", "float32")


def test_the_mla_row_format_is_flashmla_s():
    rows = FP8MLARows.build(512, 64, torch.bfloat16)  # DeepSeek-V3's latent: 512 + 64
    assert rows.row_bytes == 656 and rows.row_format == "mla_fp8_e4m3:512xe4m3+4xf32_scale+64xbf16"


@pytest.mark.parametrize("name", ["llama", "v3", "v32"])
def test_sides_of_different_kv_dtypes_differ_by_that_one_field(configs, name):
    fp8, plain = _agreement(configs[name], "fp8_e4m3"), _agreement(configs[name], "auto")
    assert format_diff(diff(plain, fp8), ours="decode", theirs="prefill") == (
        "kv_cache_dtype: decode='auto' prefill='fp8_e4m3'")
    assert fp8.fingerprint != plain.fingerprint


@pytest.mark.parametrize("field,value,message", [
    ("kv_cache_dtype", "fp8_e5m2", "kv_cache_dtype must be one of"),
    ("kv_dtype", "float32", "kv_cache_dtype='fp8_e4m3' needs kv_dtype='uint8'"),
    ("kv_row_format", "", "needs kv_dtype='uint8' and a kv_row_format"),
])
def test_inconsistent_fp8_fields_are_refused_by_name(configs, field, value, message):
    fields = _agreement(configs["llama"], "fp8_e4m3").to_dict()
    fields[field] = value
    with pytest.raises(ValueError, match=message):
        Agreement.from_dict(fields)


def test_a_row_format_without_fp8_is_refused(configs):
    fields = _agreement(configs["llama"], "auto").to_dict()
    fields["kv_row_format"] = "gqa_fp8_e4m3:16xe4m3+f32_scale_per_head"
    with pytest.raises(ValueError, match="kv_row_format must be empty with kv_cache_dtype='auto'"):
        Agreement.from_dict(fields)


def test_an_fp8_mla_agreement_checks_its_row_bytes(configs):
    fields = _agreement(configs["v3"], "fp8_e4m3").to_dict()
    fields["head_dim"] = 40  # the latent's values, not the FP8 row's padded bytes
    with pytest.raises(ValueError, match="head_dim=64"):
        Agreement.from_dict(fields)


def test_an_fp8_mla_row_is_padded_to_16_bytes_and_says_so():
    """Compiled kernels misread rows that do not start on a 16-byte boundary: a tiny
    model's 52-byte row (32 e4m3 + one scale + 8 bf16) is kept in 64 bytes, zero padded."""
    rows = FP8MLARows.build(32, 8, torch.float32)
    assert (rows.row_bytes, rows.packed_bytes) == (64, 52)
    assert rows.row_format.endswith("+8xbf16+12xpad")
    values = torch.randn(5, 1, 40)
    encoded = rows.encode(values)
    assert encoded.shape == (5, 1, 64) and not encoded[..., 52:].any()
    torch.testing.assert_close(rows.decode(encoded), rows.decode(encoded[..., :52].contiguous()))


def test_the_contract_sizes_fp8_mla_rows_as_the_kernels_lay_them_out():
    """The protocol does not import the kernels: its copies of the row sizes must agree."""
    from lanekv.kernels.fp8 import kv_rows
    from lanekv.transfer.protocol import agreement

    for rank, rope in ((512, 64), (32, 8), (48, 16), (128, 64)):
        assert agreement.mla_fp8_row_bytes(rank, rope) == kv_rows.mla_fp8_row_bytes(rank, rope)
        assert agreement.mla_fp8_row_stride(rank, rope) == kv_rows.mla_fp8_row_stride(rank, rope)
