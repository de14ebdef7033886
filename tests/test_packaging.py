"""The distribution installs one import package, ``lanekv`` (setup.py maps the design's folders into it)."""

from __future__ import annotations

import os
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



@pytest.mark.timeout(120)
@pytest.mark.parametrize("root_as", ["cwd", "PYTHONPATH"])
def test_the_checkouts_folders_do_not_shadow_a_distribution_of_the_same_name(tmp_path, root_as):
    """transformers 5.25 imports the ``kernels`` distribution by name. With the checkout's
    root on sys.path before it (as the current directory of ``python -c``/``-m``, or in
    PYTHONPATH), importing lanekv leaves the name to the distribution."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHOSE = 'distribution'\n")
    (site / "kernels-0.19.1.dist-info").mkdir()
    (site / "kernels-0.19.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    probe = "import lanekv, kernels, lanekv.kernels; print(kernels.WHOSE, lanekv.kernels.__name__)"
    path = [str(site)] if root_as == "cwd" else [str(ROOT), str(site)]
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT if root_as == "cwd" else tmp_path,
                         env={"PYTHONPATH": os.pathsep.join(path), "PATH": os.environ.get("PATH", "")},
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["distribution", "lanekv.kernels"]
    # Without lanekv's import first, the checkout's folder wins: what transformers met.
    shadowed = subprocess.run([sys.executable, "-c", "import kernels; print(getattr(kernels, 'WHOSE', 'ours'))"],
                              cwd=ROOT if root_as == "cwd" else tmp_path,
                              env={"PYTHONPATH": os.pathsep.join(path), "PATH": os.environ.get("PATH", "")},
                              capture_output=True, text=True, timeout=100)
    assert shadowed.stdout.split() == ["ours"], shadowed.stderr[-2000:]
