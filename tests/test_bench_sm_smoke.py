"""Smoke test of the SM-quota benchmark (make bench-sm): it builds, runs a tiny
configuration (--quick: one quota, one split, short runs, few launches for
the cost table), prints well-formed tables and rewrites only its own
sections of the results file.  No timing assertions."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, clean_env, make_benches
from tests.test_bench_smoke import HEADER as BENCH_HEADER

ACCURACY = "## SM quota: accuracy (make bench-sm)"
COST = "## SM quota: per-launch cost (make bench-sm)"
NUM = r"[+-]?\d+(\.\d+)?"
# An ideal-scheduler cell: sd / worst on the run's own launches; sd / worst
# (largest) over the model runs with other seeds.
IDEAL = NUM + " / " + NUM + "; " + NUM + " / " + NUM + r" \(" + NUM + r"\)"


@pytest.fixture(scope="module")
def built(build_dir: Path) -> Path:
    return make_benches("bench_sm_worker", "bench_launch", "bench_stall_probe")


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
        timeout=180,
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
    assert stolen.group(1).count("%") == 4  # one container, a fixed pair, two burst pairs
    # What the stall probe saw while each scenario ran: one figure per scenario.
    stalls = re.search(r"1 ms or more late, count \(longest\): (.+?)\. ", out)
    assert stalls, out
    assert re.fullmatch(r"(\d+x\d+(:\d+x\d+)* \d+ \(\d+\.\d ms\)(, )?){4}", stalls.group(1))

    acc, cost = out.split(COST)
    single, fixed, burst, lenders = tables(acc)
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
    assert len(lenders) == 2
    row = lenders[1]
    assert row[0] == "20:40"
    assert (row[1], row[4]) == ("33.3 %", "66.7 %")
    for c in (row[2], row[5]):
        assert re.fullmatch(NUM + r" % \(" + NUM + r"\)", c), c
    assert re.fullmatch(NUM + " %", row[7])
    assert "split the GPU in proportion to their quotas" in acc
    assert "Goals" in acc
    assert "|error| <= 2 points" in acc

    (cost_table,) = tables(cost)
    assert cost_table[0] == [*BENCH_HEADER, "other threads' CPU ns"]
    assert [r[1] for r in cost_table[1:]] == [
        "cuLaunchKernel, no SM limit",
        "cuLaunchKernel, SM limit 100 (fixed-share)",
        "cuLaunchKernel, limit lifted (0) after 100",
    ]
    for procs, _, direct, direct_in, ours, ours_in, threads in cost_table[1:]:
        assert procs == "1"
        assert float(direct) > 0
        assert float(direct_in) > 0
        for cell, base in ((ours, direct), (ours_in, direct_in)):
            m = re.fullmatch(r"(\d+) \(([+-]\d+)\)", cell)
            assert m, cell
            assert abs(float(m.group(1)) - float(base) - float(m.group(2))) <= 1.0
        assert re.fullmatch(r"libgpuvisor " + NUM, threads)
    assert "instructions added" in cost

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


def test_the_stall_probe_reports_a_stopped_cpu(built: Path) -> None:
    """bench_stall_probe notes the wake-ups its threads could not get: the
    process stopped for 60 ms, the thread of every CPU reports a stall of
    40 ms or more, due when the stop began."""
    import os
    import signal
    import time

    end = time.monotonic_ns() + 800_000_000
    proc = subprocess.Popen(
        [str(built / "bench_stall_probe"), str(end)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.3)
    stop_at = time.monotonic_ns()
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(0.06)
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    got = json.loads(out)
    assert got["period_us"] == 250
    assert got["cpus"] >= 1
    assert isinstance(got["fifo"], bool)
    cpus = {cpu for cpu, _, _ in got["stalls"]}
    assert len(cpus) == got["cpus"], got  # every CPU's thread saw the stop
    for cpu in cpus:
        # Its wake-up due when the stop began came 40 ms or more late (a
        # thread already held up by other load may have been due earlier;
        # the stop itself may take hold a few ms after kill() returns on a
        # loaded machine: CI saw a wake-up due 1.26 ms after it 63 ms late).
        assert any(
            c == cpu and stop_at - 50_000_000 <= at <= stop_at + 5_000_000 and late >= 40_000_000
            for c, at, late in got["stalls"]
        ), (cpu, stop_at, got["stalls"])
    for _, at, late in got["stalls"]:
        assert 1_000_000 <= late < 1_000_000_000
        assert at < end


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["x"], "END_NS: not a CLOCK_MONOTONIC time: 'x'"),
        (["1", "0"], "PERIOD_US: expected 1..100000, got '0'"),
        (["1", "7us"], "PERIOD_US: expected 1..100000, got '7us'"),
        ([], "usage: bench_stall_probe END_NS [PERIOD_US]"),
    ],
)
def test_the_stall_probe_refuses_bad_arguments(built: Path, args: list[str], message: str) -> None:
    proc = subprocess.run(
        [str(built / "bench_stall_probe"), *args], capture_output=True, text=True, timeout=10
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert message in proc.stderr.strip().splitlines()[0]


def test_misses_name_the_longest_stall_near_them() -> None:
    """accuracy() lists every window beyond the goal with the longest machine
    stall in it or in the 10 ms before it; stalls elsewhere do not count."""
    from tests.bench.sm_bench import SAMPLE_NS, accuracy, longest_stall

    ms = 1_000_000
    series = [50.0] * 10 + [50.0, 43.0, 50.0, 58.0, 50.0, 40.0, 50.0]
    stalls = [
        (11 * SAMPLE_NS + 30 * ms, 4 * ms),  # in window 11
        (13 * SAMPLE_NS - 8 * ms, 3 * ms),  # ends 5 ms before window 13
        (15 * SAMPLE_NS - 30 * ms, 9 * ms),  # ends 21 ms before window 15: not its
        (16 * SAMPLE_NS + 1 * ms, 7 * ms),  # in window 16, which is within the goal
    ]
    a = accuracy(series, 50, 1.0, stalls)
    assert a.misses == [(11, -7.0, 4 * ms), (13, 8.0, 3 * ms), (15, -10.0, 0)]
    assert a.worst == -10.0
    assert longest_stall(stalls, 16) == 7 * ms
    assert longest_stall(stalls, 12) == 3 * ms  # the stall is in window 12 itself
    assert longest_stall(stalls, 10) == 0
    assert accuracy(series, 50, 1.0).misses == [(11, -7.0, 0), (13, 8.0, 0), (15, -10.0, 0)]


def test_batch_workers_table(built: Path, tmp_path: Path) -> None:
    """sm_shared --kernel-us (the shape of make bench-gpu's PyTorch worker on
    the simulator): one short 50:50 run in the time-sliced mode prints one
    row per run, both containers' cells with their throughput, window and
    split figures.  No timing assertions beyond the throughput being some."""
    env = clean_env()
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.bench.sm_shared",
            "--kernel-us",
            "1650",
            "--jitter",
            "5",
            "--mode",
            "time-sliced",
            "--only",
            "50:50",
            "--seconds",
            "1",
            "--allowance",
            "0.3",
        ],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Batch workers (1650 us kernels, +-5 %, 3 per batch,")
    (table,) = tables(proc.stdout)
    assert table[0][:3] == ["sitting", "scenario", "device"]
    (row,) = table[1:]
    assert row[:3] == ["1", "50:50", "time-sliced 2048 us"]
    cell = NUM + r" \(" + NUM + r"\) / " + NUM + " / " + NUM + " / " + NUM + " / " + NUM
    sides = row[3].split(" ; ")
    assert len(sides) == 2
    for side in sides:
        assert re.fullmatch("50: " + cell, side), side
        assert float(side.split()[1]) > 5  # each side got some of the device
    assert float(row[4]) > 10


@pytest.mark.parametrize(
    "spec",
    ["1650:100", "1650x0", "1650:5y", "1650x200000"],
    ids=["jitter", "batch0", "junk", "big"],
)
def test_the_batch_worker_refuses_bad_kernel_specs(built: Path, tmp_path: Path, spec: str) -> None:
    from tests.bench.sm_bench import node_env

    proc = subprocess.run(
        [str(built / "bench_sm_worker"), "1", "1", "0", spec],
        env=node_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"KERNEL_US {spec}: not US[:J][xN]" in proc.stderr
