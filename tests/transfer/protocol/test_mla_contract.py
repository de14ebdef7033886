"""The agreement's attention kind and MLA dims: an MLA and a GQA side, or two
MLA models with different dims, differ by named field; MLA chunks carry one
plane per layer."""

import dataclasses

import pytest
import torch
from lanekv.model.attention import pool_contract_fields
from lanekv.model.config import ModelConfig
from lanekv.transfer.protocol.agreement import MLA_FIELDS, Agreement
from lanekv.transfer.protocol.fielddiff import diff
from lanekv.transfer.protocol.wire import ChunkHeader, encode_chunk, payload_to_tensor

from tests.checkpoints import DEEPSEEK_WRITERS, write_llama

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-contract")
    return {
        "llama": ModelConfig.from_dir(write_llama(root / "llama")),
        "v2": ModelConfig.from_dir(DEEPSEEK_WRITERS["deepseek_v2"](root / "v2")),
        "v3": ModelConfig.from_dir(DEEPSEEK_WRITERS["deepseek_v3"](root / "v3")),
    }


def _agreement(config: ModelConfig) -> Agreement:
    return Agreement.from_model(pool_contract_fields(config, torch.float32), "w" * 64, "float32", 4,
                                source_digest="s" * 64)


def test_mla_agreement_names_its_kind_and_dims(configs):
    a = _agreement(configs["v3"])
    assert (a.attention, a.kv_planes, a.num_kv_heads, a.head_dim) == ("mla", 1, 1, 40)
    assert (a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim,
            a.q_lora_rank) == (32, 8, 16, 16, 48)
    assert _agreement(configs["v2"]).q_lora_rank == 0  # no q LoRA
    gqa = _agreement(configs["llama"])
    assert (gqa.attention, gqa.kv_planes) == ("gqa", 2)
    assert all(getattr(gqa, name) == 0 for name in MLA_FIELDS)
    assert Agreement.decode(a.encode()) == a


def test_mla_and_gqa_refuse_each_other_by_field(configs):
    names = {d.name for d in diff(_agreement(configs["v3"]), _agreement(configs["llama"]))}
    assert {"attention", "kv_lora_rank", "qk_rope_head_dim", "num_kv_heads", "head_dim"} <= names


@pytest.mark.parametrize("field", MLA_FIELDS)
def test_two_mla_models_with_other_dims_differ_by_that_field(configs, field):
    base = _agreement(configs["v3"])
    value = getattr(base, field) + 8
    changes = {field: value}
    if field in ("kv_lora_rank", "qk_rope_head_dim"):
        changes["head_dim"] = base.head_dim + 8  # the latent row widens with them
    other = dataclasses.replace(base, **changes)
    assert other.fingerprint != base.fingerprint
    assert field in {d.name for d in diff(base, other)}


@pytest.mark.parametrize("changes,match", [
    ({"attention": "mha"}, "attention must be one of"),
    ({"num_kv_heads": 2}, "an MLA agreement has num_kv_heads=1"),
    ({"kv_lora_rank": 0, "head_dim": 8}, "kv_lora_rank must be in"),
])
def test_mla_agreement_validation_names_the_field(configs, changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(_agreement(configs["v3"]), **changes)
    with pytest.raises(ValueError, match="kv_lora_rank must be in \\[0, 0\\]"):
        dataclasses.replace(_agreement(configs["llama"]), kv_lora_rank=32)


def test_latent_chunk_round_trip():
    payload = torch.randn(2, 1, 8, 1, 40)
    header, data = encode_chunk("r", 0, 0, 1, [3, 5], payload)
    assert header.planes == 1 and header.shape == (2, 1, 8, 1, 40)
    back = ChunkHeader.decode(header.encode())
    assert back == header
    assert torch.equal(payload_to_tensor(back, bytes(data)), payload)
    with pytest.raises(ValueError, match="planes"):
        dataclasses.replace(header, planes=3)
