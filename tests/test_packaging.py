"""`pip wheel .` builds the native libraries and ships them in the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import repo_files

NATIVE = "gpuvisor/shim/_native/"
MODULES = ["__init__", "loader", "capi", "region", "limits", "cli", "driver", "hardware"]
DEMO_MODULES = ["demo", "demo_workload", "demo_sampler", "demo_report"]


def _source_copy(repo_root: Path, dest: Path) -> Path:
    """The checkout's tracked and untracked-but-not-ignored files (no build outputs)."""
    for name in repo_files(repo_root):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo_root / name, target)
    return dest


@pytest.fixture(scope="module")
def wheel(repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(repo_root, tmp / "src")
    out = tmp / "dist"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("gpuvisor-*.whl")
    return built


def test_wheel_contents(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for lib in ("libgpuvisor.so", "libcuda.so.1", "libnvidia-ml.so.1"):
        assert NATIVE + lib in names
    for mod in MODULES:
        assert f"gpuvisor/shim/{mod}.py" in names
    for mod in DEMO_MODULES:
        assert f"gpuvisor/supervisor/{mod}.py" in names
    assert "gpuvisor/shim/py.typed" in names
    # One namespace: no gpuvisor/__init__.py, no top-level shim package.
    assert "gpuvisor/__init__.py" not in names
    assert not [n for n in names if n.startswith(("shim/", "tests/", "native/"))]
    # ELF inside: platform-specific, any Python 3.
    assert wheel.name.endswith(".whl")
    assert "-py3-none-linux_" in wheel.name
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "gpuvisor = gpuvisor.supervisor.cli:main" in text


def test_wheel_finds_its_own_libraries(wheel: Path, tmp_path: Path) -> None:
    root = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(root)
    # -S: no site-packages, so only the unpacked wheel provides gpuvisor.
    code = (
        "import gpuvisor.shim as s, gpuvisor.shim.capi as c\n"
        "print(s.library_path()); print(s.simulator_dir()); print(c.lib().gv_api_version())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lib, sim, version = proc.stdout.split()
    assert lib == str(root / NATIVE / "libgpuvisor.so")
    assert sim == str(root / NATIVE.rstrip("/"))
    assert version == "1"
