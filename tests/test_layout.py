"""The package layout (docs/architecture.md, "Packages"): no import circles
between gpuvisor's modules, and the supervisor's subpackages import only
what the map allows.

Imports are read from the source with ast, all of them: those at the top,
those inside functions and those under `if TYPE_CHECKING:` (a circle that
only the type checker sees is still one that a reader has to untangle).
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

# Source folder -> the package it is installed as (pyproject.toml).
PACKAGES = {
    "shim": "gpuvisor.shim",
    "supervisor": "gpuvisor.supervisor",
    "cluster": "gpuvisor.cluster",
}
SUPERVISOR = "gpuvisor.supervisor"
PROGRAMS = ("entrypoint", "agent", "demo")


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the packages under root, by its dotted name."""
    found: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The gpuvisor modules that the module name (at path) imports."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from package import module` imports the module; any other
            # name comes from the package (or the module) itself.
            submodules = {f"{target}.{alias.name}" for alias in node.names}
            out.update(submodules & modules or {target})
    return {m for m in out if m in modules and m != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    files = module_files(root)
    names = set(files)
    return {name: imports_of(name, path, names) for name, path in files.items()}


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports in graph (its modules, the first one repeated
    at the end), or None when there is none."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def area(module: str) -> str:
    """Which part of the map module belongs to: 'shim', 'cluster', 'cli'
    (the CLI group and `python -m`), 'shared' (the supervisor's modules
    beside its subpackages) or a program (entrypoint, agent, demo)."""
    if not module.startswith(SUPERVISOR):
        return module.split(".")[1]
    rest = module[len(SUPERVISOR) + 1 :].split(".")
    if rest[0] in PROGRAMS:
        return rest[0]
    return "cli" if rest[0] in ("cli", "__main__") else "shared"


# What each part may import besides itself (docs/architecture.md,
# "Packages"); the CLI group may import everything.
ALLOWED = {
    "shared": {"shim", "shared"},
    "entrypoint": {"shim", "shared"},
    "agent": {"shim", "shared", "entrypoint.config"},
    "demo": {"shim", "shared", "entrypoint", "agent"},
    "cluster": {"shim", "shared"},
}


def allowed(src: str, dst: str) -> bool:
    have, want = area(src), area(dst)
    if have == want:
        return True
    if have == "shim":
        return want == "shim"
    if have not in ALLOWED:  # the CLI group assembles everything
        return True
    rules = ALLOWED[have]
    return want in rules or dst.removeprefix(f"{SUPERVISOR}.") in rules


def test_no_import_cycles() -> None:
    graph = import_graph(REPO_ROOT)
    # The reader sees the whole tree: every program and a relative import.
    assert "gpuvisor.supervisor.protocol" in graph["gpuvisor.supervisor.agent.connection"]
    assert "gpuvisor.supervisor.agent.cli" in graph["gpuvisor.supervisor.cli"]
    cycle = import_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_imports_follow_the_map() -> None:
    graph = import_graph(REPO_ROOT)
    wrong = sorted(
        f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts if not allowed(src, dst)
    )
    assert not wrong, "imports the map (docs/architecture.md) does not allow:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # a circle only the type checker sees, through a relative import
        (
            {
                "supervisor/agent/__init__.py": "",
                "supervisor/agent/server.py": "from .connection import Connection\n",
                "supervisor/agent/connection.py": (
                    "from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from .server import Agent\n"
                ),
            },
            {"gpuvisor.supervisor.agent.server", "gpuvisor.supervisor.agent.connection"},
        ),
        # across packages, `from package import module` inside a function
        (
            {
                "shim/a.py": "def f():\n    from gpuvisor.supervisor import b\n",
                "supervisor/b.py": "from gpuvisor.shim.a import f\n",
            },
            {"gpuvisor.shim.a", "gpuvisor.supervisor.b"},
        ),
        # no circle: a diamond
        (
            {
                "shim/top.py": "from . import left, right\n",
                "shim/left.py": "from .bottom import x\n",
                "shim/right.py": "from gpuvisor.shim.bottom import x\n",
                "shim/bottom.py": "x = 1\n",
            },
            None,
        ),
    ],
)
def test_the_cycle_check_finds_circles(
    tmp_path: Path, files: dict[str, str], expected: set[str] | None
) -> None:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    cycle = import_cycle(import_graph(tmp_path))
    if expected is None:
        assert cycle is None
    else:
        assert cycle is not None
        assert set(cycle) == expected
        assert cycle[0] == cycle[-1]


def test_the_map_check_refuses_a_wrong_way_import() -> None:
    assert not allowed("gpuvisor.supervisor.entrypoint.config", "gpuvisor.supervisor.agent.config")
    assert not allowed("gpuvisor.supervisor.agent.cli", "gpuvisor.supervisor.entrypoint.run")
    assert not allowed("gpuvisor.supervisor.protocol", "gpuvisor.supervisor.agent.state")
    assert not allowed("gpuvisor.shim.region", "gpuvisor.supervisor.protocol")
    assert not allowed("gpuvisor.supervisor.agent.server", "gpuvisor.cluster.inventory")
    assert not allowed("gpuvisor.cluster.plugin", "gpuvisor.supervisor.agent.config")
    assert allowed("gpuvisor.cluster.plugin", "gpuvisor.supervisor.paths")
    assert allowed("gpuvisor.supervisor.cli", "gpuvisor.cluster.inventory")
    assert allowed("gpuvisor.supervisor.agent.cli", "gpuvisor.supervisor.entrypoint.config")
    assert allowed("gpuvisor.supervisor.cli", "gpuvisor.supervisor.demo.cli")
