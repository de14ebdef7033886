"""The agreement's DSA fields: index dims, index_topk, the index cache dtype, its
quantization block and row bytes are agreement fields of their own, so two
sides that differ in any of them refuse each other naming it; the row's
head_dim follows them."""

import dataclasses
import json

import pytest
import torch
from lanekv.model.attention import pool_contract_fields, pool_rows
from lanekv.model.config import ModelConfig
from lanekv.transfer.protocol.agreement import DSA_INT_FIELDS, Agreement, dsa_row_elements
from lanekv.transfer.protocol.fielddiff import diff

from tests.checkpoints import write_deepseek_v3, write_deepseek_v32

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa-contract")
    v32 = write_deepseek_v32(root / "v32")
    wider = root / "v32-wider"
    wider.mkdir()
    for f in v32.iterdir():
        (wider / f.name).write_bytes(f.read_bytes())
    config = json.loads((wider / "config.json").read_text())
    config.update(index_head_dim=64, index_n_heads=8, index_topk=9)
    (wider / "config.json").write_text(json.dumps(config))
    return {"v32": ModelConfig.from_dir(v32), "wider": ModelConfig.from_dir(wider),
            "v3": ModelConfig.from_dir(write_deepseek_v3(root / "v3"))}


def _agreement(config, cache_dtype="fp8_e4m3", dtype=torch.float32) -> Agreement:
    return Agreement.from_model(pool_contract_fields(config, dtype, cache_dtype), "w" * 64,
                                dtype, 4, source_digest="s" * 64)


def test_dsa_agreement_names_the_index_fields_and_the_row(configs):
    a = _agreement(configs["v32"])
    assert (a.index_n_heads, a.index_head_dim, a.index_topk) == (4, 32, 5)
    # fp8: 32 e4m3 bytes + one float32 scale per block of 32 values
    assert (a.index_cache_dtype, a.index_block, a.index_row_bytes) == ("fp8_e4m3", 32, 36)
    assert a.head_dim == pool_rows(configs["v32"], torch.float32, "fp8_e4m3").head_dim == 52
    assert a.head_dim == dsa_row_elements(40, 4, 36)  # 40 * 4 + 36 = 196 bytes, to 208
    model = _agreement(configs["v32"], "model")
    assert (model.index_row_bytes, model.head_dim) == (128, 72)
    assert Agreement.decode(a.encode()) == a
    v3 = _agreement(configs["v3"])
    assert (v3.index_cache_dtype, v3.head_dim) == ("", 40)
    assert all(getattr(v3, name) == 0 for name in DSA_INT_FIELDS)


def test_other_index_dims_and_topk_differ_by_field(configs):
    names = {d.name for d in diff(_agreement(configs["v32"]), _agreement(configs["wider"]))}
    assert {"index_head_dim", "index_n_heads", "index_topk", "index_block",
            "index_row_bytes", "head_dim"} <= names


def test_another_cache_dtype_differs_by_field(configs):
    names = {d.name for d in diff(_agreement(configs["v32"]),
                                  _agreement(configs["v32"], "model"))}
    assert {"index_cache_dtype", "index_row_bytes", "head_dim"} <= names


def test_dsa_and_plain_mla_refuse_each_other_by_field(configs):
    names = {d.name for d in diff(_agreement(configs["v32"]), _agreement(configs["v3"]))}
    assert {"architecture", "index_cache_dtype", "index_topk", "head_dim"} <= names


@pytest.mark.parametrize("field", [*DSA_INT_FIELDS, "index_cache_dtype"])
def test_each_field_alone_changes_the_fingerprint(configs, field):
    base = _agreement(configs["v32"])
    if field == "index_cache_dtype":
        other = dataclasses.replace(base, index_cache_dtype="model", index_row_bytes=128,
                                    head_dim=72)
    elif field == "index_row_bytes":
        other = dataclasses.replace(base, index_row_bytes=60, head_dim=56)
    else:
        other = dataclasses.replace(base, **{field: getattr(base, field) * 2})
    assert other.fingerprint != base.fingerprint
    assert field in {d.name for d in diff(base, other)}


@pytest.mark.parametrize("changes,match", [
    ({"index_cache_dtype": "fp4"}, "index_cache_dtype must be one of"),
    ({"index_topk": 0}, "index_topk must be in"),
    ({"head_dim": 40}, "head_dim=52"),
])
def test_dsa_agreement_validation_names_the_field(configs, changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(_agreement(configs["v32"]), **changes)
    with pytest.raises(ValueError, match="index_topk must be in \\[0, 0\\]"):
        dataclasses.replace(_agreement(configs["v3"]), index_topk=5)


def test_bf16_rows_keep_the_latent_and_index_bytes_aligned(configs):
    layout = pool_rows(configs["v32"], torch.bfloat16, "fp8_e4m3")
    # 40 bf16 values = 80 bytes, then 36 index bytes: 116, padded to 128 (64 elements)
    assert (layout.index_offset, layout.head_dim) == (80, 64)
    assert _agreement(configs["v32"], dtype=torch.bfloat16).head_dim == 64
