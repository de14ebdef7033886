"""Layout contract: construction, canonical encoding, fingerprint, diff, topology, source digest."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lanekv.transfer.protocol import source_digest as source_digest_module
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.contract import LayoutContract, Topology, agreement_of
from lanekv.transfer.protocol.fielddiff import FieldDiff, diff, format_diff
from lanekv.transfer.protocol.source_digest import source_digest
from lanekv.transfer.protocol.wire import WIRE_VERSION

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[3]

MODEL_FIELDS = {
    "architecture": "LlamaForCausalLM",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_layers": 32,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "rope": {"theta": 500000.0, "scaling": {"type": "llama3", "factor": 8.0}},
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "tie_word_embeddings": False,
}


def make_agreement(**changes) -> Agreement:
    base = Agreement.from_model(MODEL_FIELDS, "w" * 64, "bfloat16", 64, source_digest="s" * 64)
    return dataclasses.replace(base, **changes)


def make_topology(cp_size: int = 2) -> Topology:
    return Topology(
        cp_size, "in_seq", "page_mod_cp", tuple(f"10.0.0.{r}:5000" for r in range(cp_size))
    )


# One changed value per agreement field.
CHANGES = {
    "architecture": "Qwen2ForCausalLM",
    "model_config": {**MODEL_FIELDS, "hidden_size": 2048},
    "rope": {"theta": 10000.0},
    "num_layers": 16,
    "num_kv_heads": 4,
    "head_dim": 64,
    "weights_digest": "v" * 64,
    "kv_dtype": "float16",
    "page_size": 16,
    "pool_layout": "layer,page,kv,row,head,dim",
    "wire_version": WIRE_VERSION + 1,
    "source_digest": "t" * 64,
}


def test_from_model_splits_fields():
    agreement = make_agreement()
    assert agreement.architecture == "LlamaForCausalLM"
    assert (agreement.num_layers, agreement.num_kv_heads, agreement.head_dim) == (32, 8, 128)
    assert agreement.rope["scaling"]["factor"] == 8.0
    assert sorted(agreement.model_config) == sorted(
        set(MODEL_FIELDS) - {"architecture", "num_layers", "num_kv_heads", "head_dim", "rope"}
    )
    assert agreement.wire_version == WIRE_VERSION
    assert agreement.pool_layout == "layer,kv,page*row,head,dim"
    with pytest.raises(ValueError, match="rope"):
        Agreement.from_model(
            {k: v for k, v in MODEL_FIELDS.items() if k != "rope"}, "w", "bfloat16", 64
        )


def test_frozen_and_hashable():
    agreement = make_agreement()
    with pytest.raises(dataclasses.FrozenInstanceError):
        agreement.page_size = 8
    with pytest.raises(TypeError):
        agreement.rope["theta"] = 1.0
    assert len({agreement, make_agreement(), make_agreement(page_size=16)}) == 2
    assert hash(LayoutContract(agreement, make_topology())) == hash(
        LayoutContract(make_agreement(), make_topology())
    )


def test_round_trip():
    agreement = make_agreement()
    assert Agreement.decode(agreement.encode()) == agreement
    assert Agreement.decode(agreement.encode()).encode() == agreement.encode()
    contract = LayoutContract(agreement, make_topology(3))
    back = LayoutContract.decode(contract.encode())
    assert back == contract and back.topology.endpoints == contract.topology.endpoints
    assert agreement_of(contract.encode()) == agreement_of(agreement.encode()) == agreement


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_fingerprint_changes_with_each_field(field):
    base = make_agreement()
    changed = make_agreement(**{field: CHANGES[field]})
    assert changed.fingerprint != base.fingerprint
    assert [d.name.split(".")[0] for d in diff(base, changed)] == [field] * len(diff(base, changed))


def test_fingerprint_ignores_topology_and_key_order():
    reordered = dict(reversed(list(MODEL_FIELDS.items())))
    a = Agreement.from_model(MODEL_FIELDS, "w" * 64, "bfloat16", 64, source_digest="s" * 64)
    b = Agreement.from_model(reordered, "w" * 64, "bfloat16", 64, source_digest="s" * 64)
    assert a.encode() == b.encode()
    assert (
        LayoutContract(a, make_topology(1)).fingerprint
        == LayoutContract(b, make_topology(4)).fingerprint
    )


def test_int_and_float_differ():
    a = make_agreement(rope={"theta": 10000})
    b = make_agreement(rope={"theta": 10000.0})
    assert a != b and a.fingerprint != b.fingerprint
    assert diff(a, b) == [FieldDiff("rope.theta", 10000, 10000.0)]


def test_diff_lists_exactly_the_differing_fields():
    ours = make_agreement()
    theirs = make_agreement(
        page_size=16,
        kv_dtype="float16",
        rope={"theta": 10000.0, "scaling": {"type": "llama3", "factor": 8.0}},
        model_config={**ours.model_config, "hidden_size": 2048, "extra": 1},
    )
    diffs = diff(ours, theirs)
    assert [d.name for d in diffs] == [
        "kv_dtype",
        "model_config.extra",
        "model_config.hidden_size",
        "page_size",
        "rope.theta",
    ]
    assert diffs[3] == FieldDiff("page_size", 64, 16)
    assert repr(diffs[1].ours) == "<absent>" and diffs[1].theirs == 1
    text = format_diff(diffs, ours="server", theirs="caller")
    assert text.splitlines()[3] == "page_size: server=64 caller=16"
    assert len(text.splitlines()) == 5
    assert diff(ours, make_agreement()) == []


@pytest.mark.parametrize(
    "change, error, field",
    [
        ({"page_size": 0}, ValueError, "page_size"),
        ({"page_size": True}, TypeError, "page_size"),
        ({"num_layers": -1}, ValueError, "num_layers"),
        ({"head_dim": 2.0}, TypeError, "head_dim"),
        ({"kv_dtype": "int4"}, ValueError, "kv_dtype"),
        ({"weights_digest": ""}, ValueError, "weights_digest"),
        ({"rope": {"theta": float("nan")}}, ValueError, "rope.theta"),
        ({"rope": {1: 2}}, TypeError, "rope"),
        ({"model_config": {"x": object()}}, TypeError, "model_config.x"),
        ({"wire_version": 0}, ValueError, "wire_version"),
    ],
)
def test_agreement_validation_names_field(change, error, field):
    with pytest.raises(error, match=field):
        make_agreement(**change)


def test_topology_checks():
    topology = make_topology(3)
    assert [topology.owner_of(p) for p in range(6)] == [0, 1, 2, 0, 1, 2]
    topology.check([(0, 0), (4, 1), (5, 2)])
    with pytest.raises(ValueError, match="owner"):
        topology.check([(4, 0)])
    with pytest.raises(ValueError, match="owner"):
        topology.check([(3, 3)])
    with pytest.raises(ValueError, match="cp_size is 3"):
        Topology(3, "in_seq", "page_mod_cp", ("a:1", "b:2"))
    with pytest.raises(ValueError, match="owner_rule"):
        Topology(1, "in_seq", "round_robin", ("a:1",))
    with pytest.raises(ValueError, match="split_mode"):
        Topology(1, "zigzag", "page_mod_cp", ("a:1",))
    with pytest.raises(ValueError, match="endpoints"):
        Topology(1, "in_seq", "page_mod_cp", ("nohost",))
    with pytest.raises(ValueError, match="cp_size"):
        Topology(0, "in_seq", "page_mod_cp", ())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x93\x01\x02\x03",  # an array, not a map
        b"\x81\xa1x\x01",  # a map with the wrong keys
        b"\xd4\x01\x00",  # an ext type
    ],
)
def test_decode_rejects_malformed(data):
    with pytest.raises(ValueError):
        Agreement.decode(data)
    with pytest.raises(ValueError):
        LayoutContract.decode(data)


def test_decode_rejects_wrong_types():
    import msgpack

    fields = make_agreement().to_dict()
    for key, bad in [("page_size", "64"), ("rope", [1, 2]), ("kv_dtype", 3)]:
        with pytest.raises(ValueError, match=key):
            Agreement.decode(msgpack.packb({**fields, key: bad}))


def write_sources(root: Path, content: dict[str, bytes]) -> list[str]:
    for name, data in content.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return list(content)


def test_source_digest(tmp_path, monkeypatch):
    files = {"prefill/plan.py": b"a = 1\n", "transfer/protocol/wire.py": b"b = 2\n"}
    modules = ["lanekv.prefill.plan", "lanekv.transfer.protocol.wire"]
    one, two = tmp_path / "one", tmp_path / "two"
    write_sources(one, files)
    write_sources(two, files)
    digest = source_digest(modules, one)
    assert digest == source_digest(list(reversed(modules)), two)  # location and order do not matter
    write_sources(two, {"transfer/protocol/wire.py": b"b = 3\n"})
    assert source_digest(modules, two) != digest
    write_sources(two, {"prefill/planner.py": b"a = 1\n", "transfer/protocol/wire.py": b"b = 2\n"})
    assert source_digest(["lanekv.prefill.planner", "lanekv.transfer.protocol.wire"], two) != digest
    with pytest.raises(FileNotFoundError, match="lanekv.prefill.layout"):
        source_digest(["lanekv.prefill.layout"], one)
    with pytest.raises(ValueError, match="not a module of lanekv"):
        source_digest(["prefill.plan"], one)
    monkeypatch.setattr(source_digest_module, "CONTRACT_SOURCES", tuple(modules))
    monkeypatch.setattr(source_digest_module, "PACKAGE_ROOT", one)
    assert Agreement.from_model(MODEL_FIELDS, "w", "bfloat16", 64).source_digest == digest


FINGERPRINT_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from tests.transfer.protocol.test_contract import make_agreement
from lanekv.transfer.protocol.source_digest import source_digest
digest = source_digest(["lanekv.transfer.protocol.wire", "lanekv.transfer.protocol.contract"])
print(make_agreement(source_digest=digest, model_config={{str(i): i for i in range(50)}}).fingerprint)
"""


def test_fingerprint_identical_across_processes():
    script = FINGERPRINT_SCRIPT.format(root=str(REPO_ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in ("0", "12345")
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outputs.append(out.strip())
    assert len(outputs[0]) == 64 and outputs[0] == outputs[1]
