"""The committed generated modules are current, reproducible and free of runtime version guards."""

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from lanekv.proto import generate

pytestmark = pytest.mark.timeout(120)

PROTO_DIR = Path(generate.__file__).resolve().parent


def committed(name: str) -> str:
    return (PROTO_DIR / name).read_text()


def test_committed_modules_match_a_fresh_generation(tmp_path):
    stamp = committed("lanekv_pb2.py").splitlines()[0]
    if stamp != generate.generator_stamp():
        pytest.skip(
            f"committed modules carry '{stamp}', this environment has grpcio-tools "
            f"{metadata.version('grpcio-tools')}: a fresh generation would differ by generator version"
        )
    # protoc runs in a child process, as `make proto` runs it: its extension carries a
    # protobuf of its own, and loading it into this process, after the suite has loaded
    # other native libraries, crashed the interpreter once (a segfault at import).
    first, second = (_generate_in_child(tmp_path / run) for run in ("a", "b"))
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes(), f"{a.name} differs between two runs"
        assert a.read_text() == committed(a.name), f"proto/{a.name} is stale: run `make proto`"


def _generate_in_child(out: Path) -> list[Path]:
    subprocess.run([sys.executable, generate.__file__, "--out", str(out)], check=True, timeout=100,
                   capture_output=True)
    return [out / "proto" / name for name in generate.OUTPUTS]


@pytest.mark.parametrize("name", generate.OUTPUTS)
def test_no_runtime_version_guards(name):
    text = committed(name)
    for guard in (
        "ValidateProtobufRuntimeVersion",
        "runtime_version",
        "GRPC_GENERATED_VERSION",
        "_registered_method=",
    ):
        assert guard not in text, f"{name} still contains {guard}"


def test_generated_modules_import_as_package():
    from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc

    assert "from lanekv.proto import lanekv_pb2" in committed("lanekv_pb2_grpc.py")
    assert lanekv_pb2.DESCRIPTOR.package == "lanekv.v1"
    services = set(lanekv_pb2.DESCRIPTOR.services_by_name)
    assert services == {"PrefillService", "KVTransfer", "DecodeService"}
    assert hasattr(lanekv_pb2_grpc, "KVTransferStub")
    request = lanekv_pb2.FetchRequest(request_id="r")
    assert not request.HasField("layer_end")
    request.layer_end = 0
    assert request.HasField("layer_end")
    prefill = lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=[1, 2]))
    assert prefill.WhichOneof("prompt") == "token_ids"
