"""Smoke test of the per-call benchmarks (make bench): they build, run with
tiny iteration counts, print well-formed tables (instructions counted under
callgrind where asked), measure a peer library named by LIBRARY beside ours,
and rewrite only their own sections of the results file.  No timing
assertions."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import BUILD_DIR, LIBRARY, clean_env, make_benches, run_cmd

MEMORY = BUILD_DIR / "bench" / "bench_memory"
LAUNCH = BUILD_DIR / "bench" / "bench_launch"
SECTION = "## Memory quota: per-call cost (make bench)"
LAUNCH_SECTION = "## Launch: per-call cost (make bench)"
HEADER = [
    "processes",
    "operation",
    "direct ns",
    "direct instructions",
    "libgpuvisor ns",
    "libgpuvisor instructions",
]
OPS = [
    "cuMemAlloc_v2 + cuMemFree_v2 (1 MiB), limit 8g",
    "cuMemGetInfo_v2, limit 8g",
    "refused cuMemAlloc_v2 (64 MiB), limit 8g full",
    "cuMemAlloc_v2 + cuMemFree_v2 (1 MiB), no limit",
    "cuMemGetInfo_v2, no limit",
]
OVERSUBSCRIBED = [
    "cuMemAlloc_v2 + cuMemFree_v2 (1 MiB), oversubscribed, within the guarantee",
    "cuMemAlloc_v2 + cuMemFree_v2 (1 MiB), oversubscribed, spilled",
]
FIGURE = r"\d+"
ADDED = r"(\d+) \(([+-]\d+)\)"


@pytest.fixture(scope="module")
def built(build_dir: Path) -> Path:
    make_benches(MEMORY.name, LAUNCH.name)
    assert MEMORY.is_file()
    assert LAUNCH.is_file()
    return MEMORY


def run_bench(
    tmp_path: Path, *args: str, bench: Path = MEMORY, procs: str = "1,3"
) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env["TMPDIR"] = str(tmp_path)
    return run_cmd(
        [str(bench), "--batches", "3", "--iters", "50", "--procs", procs, "--no-pin", *args],
        env,
        120,
    )


def table_rows(text: str, header: list[str] = HEADER) -> list[list[str]]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert len(lines) >= 2, text
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == header
    assert re.fullmatch(r"\|(-*:?-+:?\|)+", lines[1].replace(" ", ""))
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert all(len(r) == len(header) for r in rows)
    return rows


def added(cell: str, base: str) -> float:
    """The figure of an "N (+M)" cell, checking that M is N - base."""
    m = re.fullmatch(ADDED, cell)
    assert m, cell
    assert abs(float(m.group(1)) - float(base) - float(m.group(2))) <= 1.0
    return float(m.group(1))


def test_prints_a_well_formed_table(built: Path, tmp_path: Path) -> None:
    proc = run_bench(tmp_path, "--callgrind", "0")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(SECTION + "\n")
    assert re.search(r"Machine: \d+ CPUs, .+; \d{4}-\d\d-\d\d \d\d:\d\d UTC", out)
    rows = table_rows(out)
    assert [(r[0], r[1]) for r in rows] == [
        (n, op) for n in ("1", "3") for op in OPS + OVERSUBSCRIBED
    ]
    for _, op, direct, direct_in, ours, ours_in in rows:
        assert float(direct) > 0
        assert (direct_in, ours_in) == ("-", "-")  # not counted: --callgrind 0
        if op.startswith("refused"):
            assert re.fullmatch(FIGURE, ours)  # answered without the driver
        else:
            added(ours, direct)
    assert "Goals (libgpuvisor):" in out
    assert "refused cuMemAlloc_v2 (64 MiB), limit 8g full: at most 2000 ns added" in out
    # The helpers registered in the region (checked with gv_process_list)
    # and were stopped; the scratch directory is gone.
    assert "bench_memory: 3 processes" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_counts_instructions_under_callgrind(built: Path, tmp_path: Path) -> None:
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    proc = run_bench(tmp_path, "--ops", "info,refused", "--callgrind", "20", procs="1")
    assert proc.returncode == 0, proc.stderr
    info, refused = table_rows(proc.stdout)
    assert float(info[3]) > 0
    added(info[5], info[3])
    # A refusal with the quota full: libgpuvisor answers alone, in far fewer
    # instructions than the simulated driver's own refusal.
    assert 0 < float(refused[5]) < float(refused[3])
    assert list(tmp_path.iterdir()) == []


def test_a_peer_library_is_measured_beside_ours(built: Path, tmp_path: Path) -> None:
    # Any interposer will do as the peer: here a copy of ours, under its own name.
    peer = tmp_path / "peer" / "libpeer.so"
    peer.parent.mkdir()
    shutil.copy(LIBRARY, peer)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = run_bench(
        scratch,
        "--ops",
        "refused",
        "--callgrind",
        "0",
        "--library",
        str(peer),
        "--library-env",
        "LIBCUDA_LOG_LEVEL=1",
        "--library-name",
        "peer",
    )
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout, [*HEADER, "peer ns", "peer instructions"])
    assert [r[0] for r in rows] == ["1", "3"]
    for row in rows:
        assert re.fullmatch(FIGURE, row[6])
    assert f"`LIBRARY={peer}`" in proc.stdout
    assert "with `LIBCUDA_LOG_LEVEL=1`" in proc.stdout
    assert "bench_memory: 3 processes" in proc.stderr


def test_bad_peer_settings_fail_with_one_clear_line(built: Path, tmp_path: Path) -> None:
    proc = run_bench(tmp_path, "--library", str(tmp_path / "nope.so"), "--callgrind", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(f"LIBRARY={tmp_path / 'nope.so'}: no such file")
    proc = run_bench(
        tmp_path, "--library", str(LIBRARY), "--library-env", "NOEQUALS", "--callgrind", "0"
    )
    assert proc.returncode == 2
    assert 'LIBRARY_ENV: "NOEQUALS" is not NAME=VALUE' in proc.stderr
    proc = run_bench(tmp_path, "--ops", "nope", "--callgrind", "0")
    assert proc.returncode == 2
    assert '--ops: no operation "nope"' in proc.stderr


def test_launch_table(built: Path, tmp_path: Path) -> None:
    proc = run_bench(tmp_path, "--callgrind", "0", bench=LAUNCH, procs="1,2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(LAUNCH_SECTION + "\n")
    rows = table_rows(proc.stdout, [*HEADER, "other threads' CPU ns"])
    assert [(r[0], r[1]) for r in rows] == [
        (n, op)
        for n in ("1", "2")
        for op in ("cuLaunchKernel, no SM limit", "cuLaunchKernel, SM limit 50")
    ]
    for row in rows:
        added(row[4], row[2])
        assert re.fullmatch(r"libgpuvisor -?\d+", row[6])


def test_write_replaces_only_its_section(built: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    doc = tmp_path / "benchmarks.md"
    other = "## SM sharing (make bench-sm)\n\nkeep me\n"
    doc.write_text(f"# Benchmarks\n\nIntro.\n\n{SECTION}\n\nold table\n\n{other}")
    for _ in range(2):
        proc = run_bench(scratch, "--ops", "info", "--callgrind", "0", "--write", str(doc))
        assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nIntro.\n\n" + SECTION + "\n")
    assert text.count(SECTION) == 1
    assert "old table" not in text
    assert text.endswith("\n\n" + other)
    assert len(table_rows(text.split(other)[0])) == 2

    fresh = tmp_path / "new.md"
    proc = run_bench(scratch, "--ops", "info", "--callgrind", "0", "--write", str(fresh))
    assert proc.returncode == 0, proc.stderr
    assert fresh.read_text().startswith("# Benchmarks\n\n" + SECTION + "\n")
