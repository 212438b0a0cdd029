"""`pip wheel .` builds the native libraries and ships them in the package."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from gpuvisor.shim.capi import API_VERSION

from tests.helpers import LIBRARY, SIM_LIBS, repo_files

NATIVE = "gpuvisor/shim/_native/"
MODULES = ["__init__", "loader", "capi", "region", "limits", "cli", "driver", "hardware", "version"]
# One module at least of each subpackage, and the demo whole.
SUPERVISOR_MODULES = [
    "cli",
    "paths",
    "entrypoint/run",
    "agent/server",
    "demo/cli",
    "demo/scenario",
    "demo/workload",
    "demo/sampler",
    "demo/report",
]


# Programs make builds besides `all` (make bench, make bench-sm).
BENCH_PROGRAMS = ["bench/bench_memory", "bench/bench_launch", "bench/bench_sm_worker"]


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
    # setuptools deprecates the TOML-table license with an end date after
    # which builds fail: the SPDX string form only.
    assert "`project.license` as a TOML table" not in proc.stdout + proc.stderr
    (built,) = out.glob("gpuvisor-*.whl")
    return built


def test_wheel_contents(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for lib in ("libgpuvisor.so", "libcuda.so.1", "libnvidia-ml.so.1"):
        assert NATIVE + lib in names
    for mod in MODULES:
        assert f"gpuvisor/shim/{mod}.py" in names
    for mod in SUPERVISOR_MODULES:
        assert f"gpuvisor/supervisor/{mod}.py" in names
    assert "gpuvisor/shim/py.typed" in names
    # the device plugin, with its generated gRPC modules and their sources
    api = "gpuvisor/cluster/deviceplugin/api/"
    for f in ("deviceplugin_v1beta1", "podresources_v1"):
        for suffix in (".proto", "_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert api + f + suffix in names
    assert "gpuvisor/cluster/deviceplugin/cli.py" in names
    # One namespace: no gpuvisor/__init__.py, no top-level shim package.
    assert "gpuvisor/__init__.py" not in names
    assert not [n for n in names if n.startswith(("shim/", "tests/", "native/"))]
    # ELF inside: platform-specific, any Python 3.
    assert wheel.name.endswith(".whl")
    assert "-py3-none-manylinux2014_" in wheel.name
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "gpuvisor = gpuvisor.supervisor.cli:main" in text
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    headers = zipfile.ZipFile(wheel).read(metadata).decode().split("\n\n", 1)[0]
    assert "License-Expression: Apache-2.0" in headers.splitlines()


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
    assert version == str(API_VERSION)


def test_make_rules_list_every_header_their_sources_include(
    repo_root: Path, tmp_path: Path
) -> None:
    """Each native target is rebuilt when a header its sources include changes.

    gcc -MM (with each compile command's own -I/-iquote/-D flags) gives the
    headers; make's database (make -p) the prerequisites, followed through
    prerequisites that are themselves targets."""
    build = str(tmp_path / "b")  # never created: -n
    proc = subprocess.run(
        ["make", "-p", "-n", "-B", f"BUILD={build}", "all"]
        + [f"{build}/{p}" for p in BENCH_PROGRAMS],
        cwd=repo_root,
        env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    prereqs: dict[str, list[str]] = {}
    commands: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith(build + "/") and ":" in line and "%" not in line:
            target, _, deps = line.partition(":")
            if deps.split():
                prereqs[target] = deps.split()
        elif line.startswith(("gcc ", "cc ")) and " -o " in line:
            words = shlex.split(line)
            commands[words[words.index("-o") + 1]] = words

    def closure(target: str) -> set[str]:
        seen: set[str] = set()
        todo = [target]
        while todo:
            for dep in prereqs.get(todo.pop(), []):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return {os.path.normpath(d) for d in seen}

    assert f"{build}/tests/t_sim_basic" in commands, proc.stdout[-2000:]
    missing = {}
    for out, words in commands.items():
        sources = [w for w in words if w.endswith(".c")]
        flags: list[str] = []
        for i, w in enumerate(words):
            if w.startswith(("-I", "-D", "-std=")):
                flags.append(w)
            elif w == "-iquote":
                flags += [w, words[i + 1]]
        deps = subprocess.run(
            ["gcc", "-MM", *flags, *sources],
            cwd=repo_root,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        headers = {os.path.normpath(w) for w in deps.split() if w.endswith(".h")}
        lacking = sorted(headers - closure(out))
        if lacking:
            missing[os.path.relpath(out, build)] = lacking
    assert not missing, f"make would not rebuild these after a header change: {missing}"


def test_sdist_rebuilds_the_native_libraries(repo_root: Path, tmp_path: Path) -> None:
    """The sdist carries what `make lib sim` needs, and a wheel builds from it alone."""
    src = _source_copy(repo_root, tmp_path / "src")
    code = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "sdist")],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sdist = tmp_path / "sdist" / proc.stdout.split()[-1]
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n.removeprefix(top + "/") for n in tar.getnames()}
        # filter= exists from 3.11.4 / 3.10.12 (and warns when left out from 3.12).
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path / "unpacked", **safe)  # type: ignore[arg-type]
    for need in ("Makefile", "README.md", "pyproject.toml", "setup.py", "shim/py.typed"):
        assert need in names, need
    native = {n for n in repo_files(repo_root) if n.startswith("native/")}
    assert native <= names, sorted(native - names)
    # No half test suite (tests/test_*.py without conftest.py and helpers.py).
    assert not [n for n in names if n.startswith("tests/")]
    out = tmp_path / "dist"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*pip_wheel, "-q", "-w", str(out), str(tmp_path / "unpacked" / top)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("gpuvisor-*.whl")
    names = set(zipfile.ZipFile(built).namelist())
    for lib in ("libgpuvisor.so", "libcuda.so.1", "libnvidia-ml.so.1"):
        assert NATIVE + lib in names


def _glibc_versions(path: Path) -> set[tuple[int, ...]]:
    """The GLIBC_x.y symbol versions that an ELF file needs (objdump -T)."""
    out = subprocess.run(
        ["objdump", "-T", str(path)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    found = set()
    for word in out.split():
        name = word.strip("()")
        if name.startswith("GLIBC_") and name[6:7].isdigit():
            found.add(tuple(int(part) for part in name[6:].split(".")))
    return found


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
@pytest.mark.parametrize("lib", [LIBRARY, *SIM_LIBS], ids=lambda p: p.name)
def test_native_libraries_need_only_glibc_2_17(lib: Path) -> None:
    """The library is preloaded into images we did not build: a build on any
    glibc binds no symbol version newer than GLIBC_2.17 (gv_glibc.h)."""
    versions = _glibc_versions(lib)
    assert versions, f"{lib} binds no GLIBC_ versions: is it linked against glibc?"
    assert max(versions) <= (2, 17), f"{lib} needs GLIBC_{'.'.join(map(str, max(versions)))}"


def test_wheel_passes_auditwheel_as_manylinux2014(wheel: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())
    assert 'consistent with the following platform tag: "manylinux_2_17_' in text, text


def test_wheel_ships_the_apache_license(wheel: Path, repo_root: Path) -> None:
    """pyproject.toml and the image labels say Apache-2.0: the text ships with the wheel."""
    text = (repo_root / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    names = zipfile.ZipFile(wheel).namelist()
    shipped = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert shipped, names
    assert zipfile.ZipFile(wheel).read(shipped[0]).decode() == text
