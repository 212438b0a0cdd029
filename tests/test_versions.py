"""What is installed: `gpuvisor --version`, the library's release and build id
in shim-info, status and the agent, and the warning when they differ."""

from __future__ import annotations

import json
import subprocess

import pytest
from gpuvisor.shim.version import LibraryVersion, library_version, mismatch, package_version

from tests.helpers import LIBRARY, run_cli, run_py
from tests.test_agent import AgentProc, sock_path  # noqa: F401 (fixture)


def elf_build_id() -> str:
    out = subprocess.run(
        ["readelf", "-n", str(LIBRARY)], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if "Build ID" in line)


def test_library_reports_its_release_and_its_own_build_id():
    found = library_version()
    assert found.version == package_version()
    assert found.build_id == elf_build_id()
    assert found.path == str(LIBRARY)


def test_version_option():
    out = run_cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"gpuvisor {package_version()}",
        f"library: {LIBRARY} {library_version().version} (build {elf_build_id()})",
    ]


def test_shim_info_and_status_name_the_build(node):
    info = json.loads(run_cli("shim-info", "--json", env=node.env).stdout)
    assert info["library_version"] == library_version().version
    assert info["library_build_id"] == elf_build_id()
    assert info["package_version"] == package_version()
    run_py("from gpuvisor.shim import Region; Region.attach()", node.env)
    status = json.loads(run_cli("status", "--json", "--sample", "0", env=node.env).stdout)
    assert status["build"] == {
        "version": package_version(),
        "library": {
            "path": str(LIBRARY),
            "version": library_version().version,
            "build_id": elf_build_id(),
        },
    }


def test_agent_shows_the_build_on_status_and_metrics(sock_path):  # noqa: F811
    with AgentProc(sock_path) as agent:
        build = agent.status()["agent"]["build"]
        samples = [m for m in agent.metrics() if m[0] == "gpuvisor_build_info"]
    assert build["version"] == package_version()
    assert build["library"]["build_id"] == elf_build_id()
    assert samples == [
        (
            "gpuvisor_build_info",
            {
                "version": package_version(),
                "library_version": library_version().version,
                "library_build_id": elf_build_id(),
            },
            1.0,
        )
    ]


def test_mismatch_is_one_line_naming_both_releases():
    lib = LibraryVersion("/x/libgpuvisor.so", "0.1.0", "ab")
    assert mismatch("0.1.0", lib) is None
    assert mismatch("unknown", lib) is None
    assert mismatch("0.2.0", lib) == (
        "gpuvisor: warning: the Python package is release 0.2.0 but /x/libgpuvisor.so "
        "is release 0.1.0; install matching releases"
    )


@pytest.mark.parametrize("release", ["0.1.0", "9.9.9"])
def test_a_command_warns_once_when_package_and_library_differ(node, release):
    code = f"""
        import importlib.metadata as md
        real = md.version
        md.version = lambda name: {release!r} if name == "gpuvisor" else real(name)
        from gpuvisor.supervisor.cli import main
        main(["shim-info"], prog_name="gpuvisor")
    """
    proc = run_py(code, node.env, 60)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    if release == "0.1.0":
        assert warnings == []
    else:
        assert warnings == [
            f"gpuvisor: warning: the Python package is release {release} but {LIBRARY} "
            "is release 0.1.0; install matching releases"
        ]
