"""Build hook: `pip install .` / `pip wheel .` run `make lib sim` and ship
the native libraries inside the package at gpuvisor/shim/_native/.

Editable installs (`pip install -e .`) skip this; the package then finds
the libraries in the repository's build/ directory (see shim/loader.py).
All metadata lives in pyproject.toml.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# What the wheel ships, relative to the make build directory -> file name
# inside gpuvisor/shim/_native/.
NATIVE_FILES = {
    "libgpuvisor.so": "libgpuvisor.so",
    "sim/libcuda.so.1": "libcuda.so.1",
    "sim/libnvidia-ml.so.1": "libnvidia-ml.so.1",
}


class BuildPyWithNative(build_py):
    """build_py that also builds and copies the native libraries."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        build_temp = Path(self.get_finalized_command("build").build_temp)
        native_build = (build_temp / "native").resolve()
        make = os.environ.get("MAKE", "make")
        subprocess.run(
            [make, "-C", str(ROOT), "lib", "sim", f"BUILD={native_build}"],
            check=True,
        )
        dest = Path(self.build_lib) / "gpuvisor" / "shim" / "_native"
        dest.mkdir(parents=True, exist_ok=True)
        for src, name in NATIVE_FILES.items():
            shutil.copyfile(native_build / src, dest / name)
            os.chmod(dest / name, 0o755)


class NativeDistribution(Distribution):
    """Ships ELF libraries: install into platlib, build a platform wheel."""

    def has_ext_modules(self) -> bool:
        return True


# The native libraries bind only GLIBC_2.17 symbol versions
# (native/include/gv_glibc.h), which is what manylinux2014 allows.
MANYLINUX = {"linux_x86_64": "manylinux2014_x86_64", "linux_aarch64": "manylinux2014_aarch64"}


class PlatformWheel(bdist_wheel):
    """Tag the wheel manylinux2014 (GLIBC_2.17) and any Python 3 (no CPython ABI used)."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", MANYLINUX.get(plat, plat)


setup(
    distclass=NativeDistribution,
    cmdclass={"build_py": BuildPyWithNative, "bdist_wheel": PlatformWheel},
)
