"""Where the import packages come from; everything else is in pyproject.toml.

The installed distribution has one import package, ``lanekv``. Its subpackages
keep the repository's folders of the design (kernels/, model/, runtime/,
transfer/, prefill/, decode/, proto/ at the top, beside lanekv/ which holds the
command line and the HTTP front): ``package_dir`` maps ``lanekv.kernels`` to
``kernels/`` and so on, so a wheel holds ``lanekv/kernels/...`` and an editable
install (``make install``) resolves ``lanekv.kernels`` to the folder here.
"""

from setuptools import find_packages, setup

# The folders at the top of the repository that install as subpackages of lanekv.
SUBPACKAGES = ("kernels", "model", "runtime", "transfer", "prefill", "decode", "proto")

package_dir = {"lanekv": "lanekv"}
packages = find_packages(include=["lanekv", "lanekv.*"])
for folder in SUBPACKAGES:
    package_dir[f"lanekv.{folder}"] = folder
    packages += [f"lanekv.{name}" for name in find_packages(include=[folder, f"{folder}.*"])]

setup(packages=packages, package_dir=package_dir)
