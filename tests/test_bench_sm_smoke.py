"""Smoke test of the SM-quota benchmark (make bench-sm): it builds, runs a tiny
configuration (--quick: one quota, one split, short runs, few launches for
the cost table), prints well-formed tables and rewrites only its own
sections of the results file.  No timing assertions."""

from __future__ import annotations

import fcntl
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import BUILD_DIR, REPO_ROOT, clean_env

ACCURACY = "## SM quota: accuracy (make bench-sm)"
COST = "## SM quota: per-launch cost (make bench-sm)"
NUM = r"[+-]?\d+(\.\d+)?"
# An ideal-scheduler cell: sd / worst on the run's own launches; sd / worst
# (largest) over the model runs with other seeds.
IDEAL = NUM + " / " + NUM + "; " + NUM + " / " + NUM + r" \(" + NUM + r"\)"


@pytest.fixture(scope="module")
def built(build_dir: Path) -> Path:
    # pytest-xdist workers may get here together: one make at a time.
    bench = BUILD_DIR / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    with open(bench / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(
            [
                "make",
                "-s",
                "-C",
                str(REPO_ROOT),
                "build/bench/bench_sm_worker",
                "build/bench/bench_launch",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
    return bench


def tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table of text: rows of cells, the header first."""
    out: list[list[list[str]]] = []
    cur: list[list[str]] | None = None
    for ln in text.splitlines():
        if ln.startswith("|"):
            cells = [c.strip() for c in ln.strip("|").split("|")]
            if cur is None:
                cur = [cells]
                out.append(cur)
            elif len(cur) == 1:
                assert re.fullmatch(r"\|(-*:?-+:?\|)+", ln.replace(" ", "")), ln
                cur.append([])  # the separator row, dropped below
            else:
                assert len(cells) == len(cur[0]), ln
                cur.append(cells)
        else:
            cur = None
    return [[t[0], *t[2:]] for t in out]


def test_quick_run_writes_well_formed_sections(built: Path, tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    other = "## Memory quota: per-call cost (make bench)\n\nkeep me\n"
    doc.write_text(f"# Benchmarks\n\nIntro.\n\n{other}\n{ACCURACY}\n\nold table\n")
    env = clean_env()
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.bench.sm_bench", "--quick", "--write", str(doc)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(ACCURACY + "\n")
    assert COST in out
    assert re.search(r"Machine: \d+ CPUs, .+; \d{4}-\d\d-\d\d \d\d:\d\d UTC", out)
    # The CPU time stolen while each scenario ran: one figure per scenario.
    stolen = re.search(r"while each scenario ran, quota x processes: (.+?) \(time", out)
    assert stolen, out
    assert re.fullmatch(r"(\d+x\d+(:\d+x\d+)* \d+ %(, )?)+", stolen.group(1)), stolen.group(1)
    assert stolen.group(1).count("%") == 3  # one container, a fixed pair, a burst pair

    acc, cost = out.split(COST)
    single, fixed, burst = tables(acc)
    assert single[0][:5] == [
        "quota",
        "processes",
        "launches (graph launches)",
        "achieved",
        "error (points)",
    ]
    assert len(single) == 2
    q, procs, launches, achieved, error, settle, measured, worst, sd, ideal, ok = single[1]
    assert (q, procs) == ("50 %", "2")
    assert re.fullmatch(r"\d+ \(\d+ graph\)", launches)
    assert int(launches.split()[0]) > 0
    assert re.fullmatch(NUM + " %", achieved)
    assert abs(float(achieved.split()[0]) - 50 - float(error)) <= 0.011
    assert re.fullmatch(NUM + " s|never", settle)
    assert re.fullmatch(NUM + " s", measured)
    assert re.fullmatch(NUM, worst)
    assert re.fullmatch(NUM, sd)
    assert 0 <= float(sd) <= abs(float(worst)) + 0.05
    assert re.fullmatch(IDEAL, ideal), ideal
    assert ok in {"yes", "no"}
    assert len(fixed) == 2
    assert fixed[1][0] == "30:70"
    assert re.fullmatch(NUM + r" % \(" + NUM + r"\)", fixed[1][1])
    assert len(fixed[1]) == 11
    assert re.fullmatch(IDEAL, fixed[1][5])
    assert re.search(r"the ideal scheduler on this run's own launches: worst window " + NUM, acc)
    assert len(burst) == 2
    assert burst[1][0] == "30:70"
    assert all(re.fullmatch(NUM + " %", c) for c in burst[1][1:4])
    assert "Goals" in acc
    assert "|error| <= 2 points" in acc

    (cost_table,) = tables(cost)
    assert cost_table[0][0] == "SM limit"
    assert [r[0] for r in cost_table[1:]] == [
        "none",
        "100 % (fixed-share)",
        "lifted (0) after 100 %",
    ]
    for _, direct, shim, added, ratio, meter in cost_table[1:]:
        assert float(direct) > 0
        assert float(shim) > 0
        assert abs(float(shim) - float(direct) - float(added)) <= 1.0
        assert re.fullmatch(r"\d+\.\d\dx", ratio)
        assert re.fullmatch(NUM, meter)

    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nIntro.\n\n" + other + "\n" + ACCURACY + "\n")
    assert text.count(ACCURACY) == 1
    assert text.count(COST) == 1
    assert "old table" not in text
    assert "keep me" in text
    # Scratch directories (simulator state, region files) are gone.
    assert [p.name for p in tmp_path.iterdir()] == ["benchmarks.md"]


def test_the_model_replays_the_workers_launches(built: Path, tmp_path: Path) -> None:
    """The ideal-scheduler reference runs the very launches of a benchmark
    run: for a worker seed, the model's first n units (n = the launches the
    worker made) add up to the GPU time the worker says it launched, to the
    microsecond, for each of several seeds and lengths."""
    from tests.bench.sm_bench import WORKER, node_env
    from tests.bench.sm_floor import WorkerProcess, worker_seed

    env = node_env(tmp_path)
    for seed, seconds in ((worker_seed(50, 0), 0.05), (worker_seed(1, 2), 0.02), (7, 0.03)):
        proc = subprocess.Popen(
            [str(WORKER), str(seconds), str(seed)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        out, err = proc.communicate("go\n", timeout=60)
        assert proc.returncode == 0, err
        rep = json.loads(out.strip().splitlines()[-1])
        launches = rep["launch_kernel"] + rep["launch_ex"] + rep["graph_launch"]
        assert launches > 10, rep
        assert rep["graph_launch"] > 0, rep
        model = WorkerProcess(seed)
        total_us = sum(model.next_unit() for _ in range(launches)) * 1e6
        assert round(total_us) == rep["gpu_us"], (seed, launches)
