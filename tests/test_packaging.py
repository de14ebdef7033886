"""The distribution installs one import package, ``lanekv`` (setup.py maps the design's folders into it)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("kernels", "model", "runtime", "transfer", "prefill", "decode", "proto")


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(out)],
                   check=True, timeout=240, capture_output=True)
    (wheel,) = out.glob("lanekv-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


@pytest.mark.timeout(300)
def test_the_wheel_has_one_top_level_package(wheel_names):
    tops = {name.split("/")[0] for name in wheel_names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"lanekv"}


@pytest.mark.timeout(300)
def test_every_package_folder_is_in_the_wheel(wheel_names):
    expected = {f"lanekv/{init.relative_to(ROOT).as_posix()}"
                for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")}
    expected |= {f"{init.relative_to(ROOT).as_posix()}" for init in (ROOT / "lanekv").rglob("__init__.py")}
    assert expected <= set(wheel_names), sorted(expected - set(wheel_names))
    assert "lanekv/proto/lanekv.proto" in wheel_names
    tops = [line for line in wheel_names if line.endswith("top_level.txt")]
    assert tops, "the wheel names its top-level packages"
