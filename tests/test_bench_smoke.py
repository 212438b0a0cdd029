"""Smoke test of the memory benchmark (make bench): it builds, runs with tiny
iteration counts, prints a well-formed table and rewrites only its own
section of the results file.  No timing assertions."""

from __future__ import annotations

import fcntl
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import BUILD_DIR, REPO_ROOT, clean_env

BENCH = BUILD_DIR / "bench" / "bench_memory"
SECTION = "## Memory quota: per-call cost (make bench)"
HEADER = (
    "processes registered",
    "quota",
    "operation",
    "direct ns/op",
    "with shim ns/op",
    "added ns/op",
    "ratio",
)
OPS = {"cuMemAlloc_v2 + cuMemFree_v2 (1 MiB)", "cuMemGetInfo_v2"}


@pytest.fixture(scope="module")
def bench(build_dir: Path) -> Path:
    # pytest-xdist workers may get here together: one make at a time.
    BENCH.parent.mkdir(parents=True, exist_ok=True)
    with open(BENCH.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(
            ["make", "-s", "-C", str(REPO_ROOT), "build/bench/bench_memory"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert BENCH.is_file()
    return BENCH


def run_bench(bench: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env["TMPDIR"] = str(tmp_path)
    return subprocess.run(
        [str(bench), "--batches", "3", "--iters", "50", "--procs", "1,3", "--no-pin", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def table_rows(text: str) -> list[list[str]]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert len(lines) >= 2, text
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert tuple(head) == HEADER
    assert re.fullmatch(r"\|(-*:?-+:?\|)+", lines[1].replace(" ", ""))
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def test_prints_a_well_formed_table(bench: Path, tmp_path: Path) -> None:
    proc = run_bench(bench, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(SECTION + "\n")
    assert re.search(r"Machine: \d+ CPUs, .+; \d{4}-\d\d-\d\d \d\d:\d\d UTC", out)
    rows = table_rows(out)
    # 2 process counts x 2 quota modes x 2 operations.
    assert len(rows) == 8
    seen = set()
    for procs, quota, op, direct, shim, added, ratio in rows:
        assert procs in {"1", "3"}
        assert quota in {"8g", "no limit"}
        assert op in OPS
        d, s, a = float(direct), float(shim), float(added)
        assert d > 0
        assert s > 0
        assert abs((s - d) - a) <= 1.0
        assert re.fullmatch(r"\d+\.\d\dx", ratio)
        seen.add((procs, quota, op))
    assert len(seen) == 8
    assert "Goals:" in out
    assert "per alloc+free pair" in out
    # The helpers registered in the region and were stopped; the scratch
    # directory (sim state, region file) is gone.
    assert "3 processes registered" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_write_replaces_only_its_section(bench: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    doc = tmp_path / "benchmarks.md"
    other = "## SM sharing (make bench-sm)\n\nkeep me\n"
    doc.write_text(f"# Benchmarks\n\nIntro.\n\n{SECTION}\n\nold table\n\n{other}")
    for _ in range(2):
        proc = run_bench(bench, scratch, "--write", str(doc))
        assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nIntro.\n\n" + SECTION + "\n")
    assert text.count(SECTION) == 1
    assert "old table" not in text
    assert text.endswith("\n\n" + other)
    assert len(table_rows(text.split(other)[0])) == 8

    fresh = tmp_path / "new.md"
    proc = run_bench(bench, scratch, "--write", str(fresh))
    assert proc.returncode == 0, proc.stderr
    assert fresh.read_text().startswith("# Benchmarks\n\n" + SECTION + "\n")


def test_rejects_runs_the_simulator_cannot_hold(bench: Path, tmp_path: Path) -> None:
    proc = run_bench(bench, tmp_path, "--batches", "10000", "--iters", "1000")
    assert proc.returncode == 2
    assert "address range" in proc.stderr
