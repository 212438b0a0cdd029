"""The map of native/shim (docs/architecture.md, "native/"): the memory path
and the SM path are two paths, not one knot.

Which file defines which exported function is read from the source (a
definition starts at the line's first column and is not `static`); a file
uses a function when it names it followed by `(`.  The SM path (the sm_*.c
files) may call the region and the shared core, never a file of the memory
path; the memory path may call the SM path (a
context's cost is kept in the node-wide file of sm_arbiter.c, and a
destroyed context's launches are settled by the SM meter), so the calls go
one way only.  The launch hooks (hooks_launch.c) are an entry into both: a
graph launch takes the graph's memory and GPU time.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import REPO_ROOT

SHIM = REPO_ROOT / "native" / "shim"
MEMORY_PATH = (
    "alloc_table.c",
    "charge.c",
    "graph_live.c",
    "graph_record.c",
    "hooks_array.c",
    "hooks_context.c",
    "hooks_graph.c",
    "hooks_memory.c",
    "hooks_pool.c",
    "hooks_vmm.c",
    "pending_free.c",
    "pool_account.c",
    "untracked.c",
)
DEFINITION = re.compile(r"^(?!static\b)[A-Za-z_][\w \*]*?\b(\w+)\([^;{]*?\)\s*\{", re.M)
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def sm_path() -> list[Path]:
    return sorted(SHIM.glob("sm_*.c"))


def source(path: Path) -> str:
    return COMMENT.sub(" ", path.read_text())


def defined(path: Path) -> set[str]:
    return set(DEFINITION.findall(source(path)))


def test_the_definitions_are_found() -> None:
    """The reader sees what the files export (else the next test proves nothing)."""
    assert {"gv_charge_begin", "gv_uncharge"} <= defined(SHIM / "charge.c")
    assert "gv_pending_frees_reap" in defined(SHIM / "pending_free.c")
    assert "gv_sm_ctx_destroying" in defined(SHIM / "sm_meter.c")
    assert "gv_nvml_self_pid" in defined(SHIM / "nvml_pid.c")


def test_the_sm_path_calls_nothing_of_the_memory_path() -> None:
    memory = {name: file for file in MEMORY_PATH for name in defined(SHIM / file)}
    calls = [
        f"{path.name} calls {name} ({memory[name]})"
        for path in sm_path()
        for name in sorted(set(re.findall(r"\b(\w+)\s*\(", source(path))))
        if name in memory
    ]
    assert calls == []


def test_the_memory_path_reaches_the_sm_path_only_through_the_named_calls() -> None:
    sm = {name for path in sm_path() for name in defined(path)}
    used = {
        name
        for file in MEMORY_PATH
        for name in re.findall(r"\b(\w+)\s*\(", source(SHIM / file))
        if name in sm
    }
    assert used == {
        "gv_arb_ctx_cost",
        "gv_arb_learn_ctx_cost",
        "gv_sm_ctx_destroying",
        "gv_sm_stream_destroying",
        "gv_sm_syncing",
    }


def test_the_map_in_the_docs_names_every_file_once() -> None:
    doc = (REPO_ROOT / "docs" / "architecture.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| ") and "`" in line]
    named = [name for row in rows for name in re.findall(r"`(\w+\.c)`", row.split(" | ")[1])]
    files = sorted(path.name for path in SHIM.glob("*.c"))
    assert sorted(named) == files
    memory_row = next(row for row in rows if row.startswith("| memory path"))
    assert all(f"`{file}`" in memory_row for file in MEMORY_PATH)
    sm_row = next(row for row in rows if row.startswith("| SM path"))
    assert all(f"`{path.name}`" in sm_row for path in sm_path())
