"""The attention kinds are told apart in one package, ``lanekv.model.attention``.

The source scan: outside that package no module tests which kind a model is.
A *kind test* is, anywhere in a module's ``ast`` (type hints and all):

- a comparison (``is``, ``is not``, ``==``, ``!=``, ...) with an attribute named
  ``mla`` or ``dsa`` on either side (``config.mla is None``, ``pool.dsa is not None``);
- such an attribute used as a truth value (the test of ``if``/``while``/a
  conditional expression/``assert``, an operand of ``and``/``or``/``not``);
- a comparison with the string ``"gqa"``, ``"mla"`` or ``"dsa"``;
- any use of an attribute ``attention_kind``;
- ``isinstance``/``issubclass`` against a model class, an attention layer class,
  a kind class or a kind's row layout;

except in the test of an ``if`` whose body only raises (a class refusing a
config that is not its own, a config checking its fields against its
architecture). Two modules are allowed by name: ``lanekv.model.config``, which
declares the fields a kind is read from and checks them, and
``lanekv.transfer.protocol.agreement``, which checks a peer's ``Agreement`` (the
wire contract names its ``attention``; it is not a model).
"""

from __future__ import annotations

import ast

import pytest
import torch
from lanekv.decode.pool import PagePool
from lanekv.model.attention import (
    KINDS,
    DSARows,
    RowLayout,
    kind_of,
    pool_contract_fields,
    pool_rows,
)
from lanekv.model.attention.dsa import DSA
from lanekv.model.attention.gqa import GQA
from lanekv.model.attention.mla import MLA
from lanekv.model.checkpoint import model_class
from lanekv.model.config import ModelConfig
from lanekv.model.deepseek import DeepseekCausalLM
from lanekv.model.deepseek_v32 import DeepseekV32CausalLM
from lanekv.model.llama import CausalLM
from lanekv.model.qwen3_moe import Qwen3MoeCausalLM

from tests.checkpoints import write_deepseek_v3, write_deepseek_v32, write_llama, write_qwen3_moe
from tests.test_layers import project_modules

KIND_PACKAGE = "lanekv.model.attention"
ALLOWED = {
    "lanekv.model.config": "declares mla/dsa/moe and checks them against the architecture",
    "lanekv.transfer.protocol.agreement": "checks a peer's Agreement (attention is a wire field)",
}
KIND_ATTRS = frozenset({"mla", "dsa"})
KIND_NAMES = frozenset({"gqa", "mla", "dsa"})
KIND_CLASSES = frozenset({
    "CausalLM", "Qwen3MoeCausalLM", "DeepseekCausalLM", "DeepseekV32CausalLM",
    "LlamaAttention", "MLAAttention", "DSAAttention",
    "AttentionKind", "GQA", "MLA", "DSA", "DSARows", "DSARowLayout",
})


def _names(node: ast.AST) -> set[str]:
    """The names an ``isinstance`` class argument mentions (``a.B``, ``(A, B)``, ``A | B``)."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
    return found


def _kind_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in KIND_ATTRS


def kind_tests(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every kind test in ``source`` (see the module doc)."""
    tree = ast.parse(source)
    refusals = set()  # nodes inside the test of an ``if`` whose body only raises
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and not node.orelse and all(
                isinstance(s, ast.Raise) for s in node.body):
            refusals |= {id(sub) for sub in ast.walk(node.test)}
    found = []
    for node in ast.walk(tree):
        if id(node) in refusals:
            continue
        hit = False
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            hit = any(_kind_attr(s) for s in sides) or any(
                isinstance(s, ast.Constant) and s.value in KIND_NAMES for s in sides)
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            hit = _kind_attr(node.test)
        elif isinstance(node, ast.BoolOp):
            hit = any(_kind_attr(v) for v in node.values)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            hit = _kind_attr(node.operand)
        elif isinstance(node, ast.Attribute):
            hit = node.attr == "attention_kind"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
                node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            hit = bool(_names(node.args[1]) & KIND_CLASSES)
        if hit:
            found.append((node.lineno, ast.get_source_segment(source, node) or ""))
    return sorted(set(found))


def test_no_module_outside_the_kind_package_tests_the_kind():
    offenders = [
        f"{name}:{line}: {code}"
        for name, path in project_modules().items()
        if not (name == KIND_PACKAGE or name.startswith(KIND_PACKAGE + ".")) and name not in ALLOWED
        for line, code in kind_tests(path.read_text())
    ]
    assert not offenders, ("modules outside lanekv.model.attention test a model's attention "
                           "kind; ask kind_of(config) instead:\n" + "\n".join(offenders))


# Kind tests the house held before the kinds had a package of their own, one per
# form, and code that is no kind test.
OLD_KIND_TESTS = [
    "if pool.dsa is not None:\n    x = 1\n",  # decode/cuda/step.py
    "if model.config.mla is not None:\n    rank = model.config.mla.kv_lora_rank\n",
    "cb = attention if model.config.mla is None else latent_attention\n",  # decode/colocated.py
    "ok = isinstance(model, CausalLM) and cfg.mla is None and cfg.dsa is None\n",  # prefill graphs
    "row_dim = config.head_dim if pool.dsa is None else pool.dsa.head_dim\n",  # decode/engine.py
    "if self.dsa:\n    pass\n",
    "planes = 2 if not config.mla else 1\n",
    "x = config.attention_kind\n",
    "if kind.name == 'dsa':\n    pass\n",
    "ok = isinstance(model, (DeepseekCausalLM, object))\n",
    "if (dsa is None) != (model.config.dsa is None):\n    raise ValueError('x')\nelse:\n    y = 1\n",
]
NOT_KIND_TESTS = [
    "if config.mla is None:\n    raise ValueError('not an MLA model')\n",  # a class refusing
    "if mla.q_lora_rank is None:\n    q = 1\n",  # a field of the MLA config, not the kind
    "dims = config.mla.latent_dim\n",
    "ok = isinstance(x, torch.Tensor)\n",
    "if name == 'v32':\n    pass\n",
]


@pytest.mark.parametrize("source", OLD_KIND_TESTS)
def test_the_scan_finds_each_form_of_kind_test(source):
    assert kind_tests(source), source


@pytest.mark.parametrize("source", NOT_KIND_TESTS)
def test_the_scan_leaves_what_is_no_kind_test(source):
    assert kind_tests(source) == [], source


# ---- the registry ----


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    return {
        "llama": ModelConfig.from_dir(write_llama(root / "llama")),
        "qwen3_moe": ModelConfig.from_dir(write_qwen3_moe(root / "qwen3_moe")),
        "v3": ModelConfig.from_dir(write_deepseek_v3(root / "v3")),
        "v32": ModelConfig.from_dir(write_deepseek_v32(root / "v32")),
    }


def test_each_config_has_its_kind_and_model_class(configs):
    assert [type(k) for k in KINDS] == [DSA, MLA, GQA]  # asked in order: most specific first
    want = {"llama": ("gqa", CausalLM), "qwen3_moe": ("gqa", Qwen3MoeCausalLM),
            "v3": ("mla", DeepseekCausalLM), "v32": ("dsa", DeepseekV32CausalLM)}
    for name, (kind, cls) in want.items():
        assert kind_of(configs[name]).name == kind, name
        assert model_class(configs[name]) is cls, name
    assert [k.rope_in_attention for k in KINDS] == [False, False, True]
    assert [k.prefill_graphs for k in KINDS] == [False, False, True]


def test_rows_say_layout_and_bytes(configs):
    llama, v3, v32 = configs["llama"], configs["v3"], configs["v32"]
    gqa = pool_rows(llama, torch.bfloat16)
    assert (gqa.kv, gqa.kv_heads, gqa.head_dim, gqa.row_bytes) == (2, 2, 16, 2 * 2 * 16 * 2)
    mla = pool_rows(v3, torch.float32)
    assert (mla.kv, mla.kv_heads, mla.head_dim, mla.row_bytes) == (1, 1, 40, 160)
    dsa = pool_rows(v32, torch.float32, "fp8_e4m3")
    assert isinstance(dsa, DSARows) and (dsa.kv, dsa.kv_heads) == (1, 1)
    assert dsa.head_dim * 4 == dsa.row_bytes >= 40 * 4 + dsa.index.row_bytes
    assert pool_rows(v32, torch.float32, "model").index.cache_dtype == "model"
    spec = dsa.spec(v32.num_layers, 4)
    assert spec.pool_shape(3) == dsa.pool_shape(v32.num_layers, 12)
    with pytest.raises(ValueError, match="index_cache_dtype must be one of"):
        pool_rows(llama, torch.float32, "int4")
    # Each kind takes its own rows only.
    for config, rows in ((llama, gqa), (v3, mla), (v32, dsa)):
        fitting = [k.name for k in KINDS if k.fits(config, rows)]
        assert fitting == [kind_of(config).name]
    assert not kind_of(v3).fits(v3, dsa) and not kind_of(v32).fits(v32, mla)
    assert not kind_of(llama).fits(llama, RowLayout(2, 2, 8, torch.float32))
    with pytest.raises(ValueError, match="a latent view needs an MLA pool"):
        gqa.latent(torch.zeros(4, 16))
    with pytest.raises(ValueError, match="index-K view needs a DSA pool"):
        mla.index_rows(torch.zeros(4, 40))


def test_contract_fields_are_the_kinds(configs):
    llama, v3, v32 = configs["llama"], configs["v3"], configs["v32"]
    plain = {"kv_cache_dtype": "auto", "kv_row_format": ""}
    assert pool_contract_fields(llama, torch.float32) == {**llama.contract_fields(), **plain}
    mla = pool_contract_fields(v3, torch.float32)
    assert mla["attention"] == "mla" and mla["mla"] == v3.mla.contract_fields()
    assert list(mla) == list(v3.contract_fields({"attention": "mla", "mla": {}, **plain}))  # key order
    # FP8 rows: the row's bytes are the contract's head_dim, its format named
    fp8 = pool_contract_fields(llama, torch.float32, kv_cache_dtype="fp8_e4m3")
    assert (fp8["kv_cache_dtype"], fp8["head_dim"]) == ("fp8_e4m3", llama.head_dim + 4)
    assert fp8["kv_row_format"].startswith("gqa_fp8_e4m3:")
    fp8 = pool_contract_fields(v3, torch.float32, kv_cache_dtype="fp8_e4m3")
    assert fp8["head_dim"] == pool_rows(v3, torch.float32, kv_cache_dtype="fp8_e4m3").row_bytes
    dsa = pool_contract_fields(v32, torch.float32, "model")
    rows = pool_rows(v32, torch.float32, "model")
    assert dsa["head_dim"] == rows.head_dim and dsa["dsa"]["index_row_bytes"] == rows.index.row_bytes
    assert dsa["dsa"]["index_cache_dtype"] == "model" and dsa["attention"] == "mla"


def test_warm_up_and_prefill_tiles_are_the_kinds(configs):
    assert kind_of(configs["llama"]).prefill_qk_dim(configs["llama"]) == 16
    assert kind_of(configs["v3"]).prefill_qk_dim(configs["v3"]) == configs["v3"].mla.qk_head_dim


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("index_cache_dtype", ["fp8_e4m3", "model"])
@pytest.mark.parametrize("name", ["v3", "v32"])
def test_the_latent_kinds_warm_up_on_every_row_format(configs, name, kv_cache_dtype, index_cache_dtype):
    """``warm_up_decode`` of MLA and DSA (the GQA one asks CUDA for its SM count) runs the
    kernels' launch checks on the CPU: an FP8 latent pool holds uint8 rows, and the query
    the warm-up builds is still ``[1, H, R + P]`` in the model dtype (a decode rank of a
    DSA model over FP8 KV once died in its warm-up on a uint8 query)."""
    config = configs[name]
    pool = PagePool.for_model(config, 8, 4, torch.float32, index_cache_dtype=index_cache_dtype,
                              kv_cache_dtype=kv_cache_dtype)
    assert (pool.tensor.dtype == torch.uint8) == (kv_cache_dtype == "fp8_e4m3")
    before = pool.tensor.clone()
    kind_of(config).warm_up_decode(config, pool)
    assert torch.equal(pool.tensor, before)  # nothing selected, nothing written
