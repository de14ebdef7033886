"""A decode layout the model or the transports cannot serve is refused at start-up, in one
line naming the field and both values (``DecodeConfig``, before any rank process starts);
and through ``lanekv decode``, one line on stderr and exit status 2."""

from __future__ import annotations

import json
import shutil

import pytest
from lanekv.decode.config import DecodeConfig

from lanekv.cli import main
from tests.checkpoints import write_deepseek_v3, write_deepseek_v32, write_llama_4kv


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-refusals")
    llama = write_llama_4kv(root / "llama")  # 8 query / 4 KV heads, intermediate 128
    odd = root / "llama-odd-mlp"  # the same with an MLP of 130 columns (only config.json is read)
    odd.mkdir()
    config = json.loads((llama / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "intermediate_size": 130}))
    shutil.copy(llama / "generation_config.json", odd / "generation_config.json")
    return {"llama": llama, "llama-odd-mlp": odd,
            "deepseek_v3": write_deepseek_v3(root / "v3", num_layers=2),  # MLA, 4 heads, 8 experts
            "deepseek_v32": write_deepseek_v32(root / "v32")}


CASES = [
    ("llama", {"tp_size": 3}, r"^tp_size=3 does not divide num_kv_heads=4$"),
    ("llama", {"tp_size": 8}, r"^tp_size=8 does not divide num_kv_heads=4$"),
    ("llama-odd-mlp", {"tp_size": 4}, r"^tp_size=4 does not divide intermediate_size=130$"),
    ("deepseek_v3", {"tp_size": 3}, r"^tp_size=3 does not divide num_experts=8$"),
    ("deepseek_v3", {"tp_size": 8}, r"^tp_size=8 does not divide num_heads=4$"),
    ("llama", {"tp_size": 0}, r"^tp_size=0 must be a positive integer$"),
    ("llama", {"tp_size": 2, "load_format": "dummy"}, r"^load_format='dummy' is not supported with tp_size=2 "),
]


@pytest.mark.parametrize(("model", "fields", "message"), CASES, ids=[f"{m}-{'-'.join(map(str, f.values()))}"
                                                                     for m, f, _ in CASES])
def test_an_unservable_decode_layout_is_refused_naming_both_values(models, model, fields, message) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        DecodeConfig(str(models[model]), "127.0.0.1:1", device="cpu", **fields)
    assert "\n" not in str(caught.value)


def test_every_layout_the_heads_allow_is_accepted(models) -> None:
    for tp_size in (1, 2, 4):
        for model in ("llama", "deepseek_v3"):  # GQA: 4 KV heads; MLA: 4 query heads share the latent row
            for transport in ("auto", "grpc", "nixl"):
                config = DecodeConfig(str(models[model]), "127.0.0.1:1", device="cpu", tp_size=tp_size,
                                      transport=transport)
                # With tp_size > 1 too, auto tries the same-host fast path first (each rank its heads), and
                # nixl reads each rank's heads staged by the prefill rank (GQA) or whole latent rows (MLA).
                assert config.transports == {"auto": ("fastpath", "grpc"), "grpc": ("grpc",),
                                             "nixl": ("nixl", "grpc")}[transport]
    # DSA (the indexer replicated on every rank) and FP8 KV rows (each rank its heads' bytes)
    assert DecodeConfig(str(models["deepseek_v32"]), "127.0.0.1:1", device="cpu", tp_size=2).tp_size == 2
    assert DecodeConfig(str(models["llama"]), "127.0.0.1:1", device="cpu", tp_size=2,
                        kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"


def test_lanekv_decode_refuses_in_one_line(models, capsys) -> None:
    assert main(["decode", "--model", str(models["llama"]), "--prefill", "127.0.0.1:1", "--device", "cpu",
                 "--tp-size", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tp_size=3 does not divide num_kv_heads=4" in err, err
