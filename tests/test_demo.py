"""`gpuvisor demo` (make demo) on the simulated 2-GPU node.

The demo's own verdicts use the issue's bounds (±2 points); these tests
re-check its summary.json with looser ones (±5 points), so a loaded CI
machine does not fail them, and check the parts that are exact: memory
never passes a quota, the over-allocating container is refused, the
agent saw the refusals, the plot is a PNG.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from gpuvisor.supervisor.demo.report import stops, verdicts
from gpuvisor.supervisor.demo.sampler import Point, Series
from gpuvisor.supervisor.demo.scenario import Workload, scenario

from tests.helpers import REPO_ROOT, clean_env

GiB = 1 << 30
DEMO = [sys.executable, "-m", "gpuvisor.supervisor", "demo"]
NO_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None\n"
    "from gpuvisor.supervisor.cli import main\n"
    "main(prog_name='gpuvisor')"
)


def run_demo(
    out: Path, *args: str, argv: list[str] | None = None, mode: str = "--simulate"
) -> subprocess.CompletedProcess[str]:
    cmd = [*(argv or DEMO), mode, "--out", str(out), *args]
    return subprocess.run(
        cmd, env=clean_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def verdict(summary: dict[str, Any], name: str, phase: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [
        v for v in summary["verdicts"] if v["name"] == name and v["phase"] == phase
    ]
    assert len(found) == 1, summary["verdicts"]
    return found[0]


@pytest.mark.slow
def test_demo_three_containers_on_two_simulated_gpus(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = run_demo(out, "--seconds", "12")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "target against achieved" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    print(json.dumps(summary["verdicts"], indent=1))
    assert summary["exit_codes"] == {"notebook": 0, "trainer": 0, "batch": 0}
    quotas = {w["name"]: w for w in summary["workloads"]}
    assert {w["gpu"] for w in quotas.values()} == {0, 1}
    assert len({(w["memory"], w["sm"], w["policy"]) for w in quotas.values()}) == 3

    # Fixed shares hold on both GPUs; the batch container is capped although
    # its GPU is otherwise idle.
    for name in ("trainer", "batch"):
        v = verdict(summary, name, "whole run")
        assert abs(v["achieved"] - quotas[name]["sm"]) <= 5, v
    # burst-share: lent the idle GPU, gives it back when the trainer starts.
    alone = verdict(summary, "notebook", "alone")
    shared = verdict(summary, "notebook", "with neighbour")
    assert alone["achieved"] >= 50, alone
    room = 100 - quotas["trainer"]["sm"]
    assert quotas["notebook"]["sm"] - 5 <= shared["achieved"] <= room + 5, shared
    assert shared["settled"] is not None, shared
    assert shared["settled"] <= 2.0, shared

    # Memory: the notebook asks past its 4 GiB and is refused; nobody passes a quota.
    work = summary["workload_summaries"]
    for name, size in (("notebook", 4 * GiB), ("trainer", 8 * GiB), ("batch", 2 * GiB)):
        assert quotas[name]["memory"] == f"{size // GiB}g"
        assert work[name]["total"] == size  # cuMemGetInfo inside shows the quota
    assert work["notebook"]["refused"] >= 1
    assert work["notebook"]["held"] <= 4 * GiB
    for name, points in summary["series"].items():
        limit = quotas[name]["memory"]
        assert points, name
        assert all(p["memory_limit"] is not None for p in points)
        assert max(p["memory_used"] for p in points) <= points[0]["memory_limit"], (name, limit)
    seen = max(p["refusals"] for p in summary["series"]["notebook"])
    assert 1 <= seen <= work["notebook"]["refused"]
    assert max(p["refusals"] for p in summary["series"]["trainer"]) == 0

    png = out / "sm-share.png"
    assert summary["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "logs" / "node-agent.log").is_file()


@pytest.mark.slow
def test_demo_without_matplotlib_says_how_to_get_the_plot(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = run_demo(out, "--seconds", "9", argv=[sys.executable, "-c", NO_MATPLOTLIB, "demo"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())
    assert "matplotlib is not installed" in text
    assert "pip install 'gpuvisor[plot]'" in text
    assert not (out / "sm-share.png").exists()
    assert json.loads((out / "summary.json").read_text())["plot"] is None


@pytest.mark.parametrize("seconds", ["5", "abc", "601"])
def test_demo_rejects_a_bad_duration(tmp_path: Path, seconds: str) -> None:
    proc = run_demo(tmp_path, "--seconds", seconds)
    assert proc.returncode == 2
    assert "--seconds" in proc.stderr
    assert seconds in proc.stderr
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("seconds", ["nan", "NaN"])
def test_demo_rejects_a_duration_that_is_not_a_number(tmp_path: Path, seconds: str) -> None:
    """nan passes click's FloatRange (every comparison with it is false):
    the demo then ran for ever, its containers "starting nan s"."""
    proc = run_demo(tmp_path, "--seconds", seconds)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--seconds" in proc.stderr
    assert seconds in proc.stderr
    assert not (tmp_path / "logs").exists()


def test_demo_names_an_out_directory_it_cannot_create(tmp_path: Path) -> None:
    """--out below a regular file: a traceback (NotADirectoryError) before."""
    afile = tmp_path / "afile"
    afile.write_text("")
    proc = run_demo(afile / "demo", "--seconds", "9")
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, proc.stderr
    assert "'--out'" in errors[0]
    assert str(afile / "demo") in errors[0]


def test_demo_without_the_library_says_so_in_one_line(tmp_path: Path) -> None:
    """environment.md: a GPUVISOR_NATIVE_DIR without libgpuvisor.so is one
    line and exit status 1 for every command that needs the library; the
    demo ended in a traceback (NativeLibraryNotFound)."""
    env = {**clean_env(), "GPUVISOR_NATIVE_DIR": str(tmp_path / "nothing")}
    proc = subprocess.run(
        [*DEMO, "--simulate", "--out", str(tmp_path / "demo"), "--seconds", "9"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"Error: GPUVISOR_NATIVE_DIR={str(tmp_path / 'nothing')!r} has no libgpuvisor.so"
    ]


NOTEBOOK_AND_TRAINER = [
    Workload("notebook", 0, "burst-share", 20, "4g", 0.0, "1g"),
    Workload("trainer", 0, "fixed-share", 60, "8g", 4.0, "6g"),
]


def sampled(sm: Callable[[str, float], float], seconds: float) -> dict[str, Series]:
    """The notebook's and the trainer's series, sampled every 0.1 s from 0
    to `seconds`, their SM use given by sm(name, t)."""
    out = {n: Series(n) for n in ("notebook", "trainer")}
    for n, series in out.items():
        series.points.extend(
            Point(k / 10, sm(n, k / 10), None, None, 0, None, 0)
            for k in range(round(seconds * 10) + 1)
        )
    return out


def test_give_back_is_timed_from_the_neighbours_first_gpu_use() -> None:
    """A neighbour that takes 1.5 s to start its processes (a loaded machine)
    does not need the GPU yet: the burst-share container's give-back, and
    the neighbour's own settling, count from the neighbour's first use."""

    def sm(name: str, t: float) -> float:
        if name == "trainer":
            return 0.0 if t < 5.5 else (30.0 if t < 6.2 else 60.0)
        return 90.0 if t < 6.0 else 40.0

    # Spawned at 4.0 s, the trainer first runs at 5.5 s; the notebook is
    # down to 40 % at 6.0 s and the trainer at 60 % at 6.2 s.
    got = {
        (v.name, v.phase): v
        for v in verdicts(
            NOTEBOOK_AND_TRAINER,
            sampled(sm, 12.0),
            end=12.0,
        )
    }
    assert got["notebook", "alone"].window == (1.5, 5.5)
    assert got["notebook", "with neighbour"].settled == 0.5
    assert got["notebook", "with neighbour"].window == (7.0, 11.5)
    assert got["trainer", "whole run"].settled == 0.7
    assert all(v.ok for v in got.values()), got


def test_phases_end_when_their_containers_stop() -> None:
    """On a loaded machine the containers started 20 s late and ran their
    time from then: a phase ends when its containers stop, not at the
    schedule's end (before, the windows ended before they began and nothing
    was measured); a fixed share is measured over its whole run, a phase
    with neighbours until the first of them stops."""

    def sm(name: str, t: float) -> float:
        if name == "trainer":
            return 60.0 if t >= 28.0 else 0.0
        return 0.0 if t < 20.0 else (90.0 if t < 28.0 else 40.0)

    s, work = sampled(sm, 39.9), NOTEBOOK_AND_TRAINER
    stopped = {"notebook": 36.0, "trainer": 39.0}
    got = {(v.name, v.phase): v for v in verdicts(work, s, end=12.0, stopped=stopped)}
    assert got["notebook", "alone"].window == (21.5, 28.0)
    assert got["notebook", "with neighbour"].window == (29.5, 35.5)
    assert got["trainer", "whole run"].window == (29.5, 38.5)
    assert got["trainer", "whole run"].achieved == pytest.approx(60.0)
    assert all(v.ok for v in got.values()), got


def test_containers_compute_their_time_from_their_first_gpu_use() -> None:
    """CI at load 19: the notebook's process started at 0 s but first used
    the GPU at 8.4 s, and the trainer, due once the notebook had used it
    for 3 s, first used it at 15.0 s.  Each computes its time from its first
    use, so the notebook stops at 20.4 s and the trainer at 23.0 s (before,
    the GPU's phases ended 12 s after the notebook's process started, and
    the trainer's window was (16.5, 11.5): nothing was measured)."""

    def sm(name: str, t: float) -> float:
        if name == "trainer":
            return 60.0 if 15.0 <= t < 23.0 else 0.0
        return 0.0 if t < 8.4 or t >= 20.4 else (90.0 if t < 15.0 else 40.0)

    s, work = sampled(sm, 29.9), NOTEBOOK_AND_TRAINER
    stopped = stops(work, s, {"notebook": 0.0, "trainer": 11.5}, seconds=12.0)
    assert stopped == pytest.approx({"notebook": 20.4, "trainer": 23.0})
    got = {(v.name, v.phase): v for v in verdicts(work, s, end=12.0, stopped=stopped)}
    assert got["notebook", "alone"].window == pytest.approx((9.9, 15.0))
    assert got["notebook", "with neighbour"].window == pytest.approx((16.5, 19.9))
    assert got["trainer", "whole run"].window == pytest.approx((16.5, 22.5))
    assert all(v.ok for v in got.values()), got


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_scenario_promises_fit_on_the_gpus(gpus: int) -> None:
    """Every GPU can honour what its containers are promised: fixed shares
    plus burst-share guarantees at most 100 %, on one GPU too."""
    work = scenario(24.0, gpus)
    assert len(work) == 3
    assert {w.policy for w in work} == {"fixed-share", "burst-share"}
    assert [w for w in work if w.grow_to]  # one container asks past its quota
    assert all(0 <= w.gpu < gpus for w in work)
    for gpu in {w.gpu for w in work}:
        assert sum(w.sm for w in work if w.gpu == gpu) <= 100
    late = [w for w in work if w.start > 0]
    assert late  # someone arrives later, so burst-share has something to give back
    assert all(w.start < 24.0 / 2 for w in late)


@pytest.mark.gpu
def test_demo_on_a_real_gpu(tmp_path: Path) -> None:
    """The same demo with PyTorch workloads on the real GPU(s)."""
    pytest.importorskip("torch")
    out = tmp_path / "demo"
    proc = run_demo(out, "--seconds", "15", mode="--real")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    print(json.dumps(summary["verdicts"], indent=1))
    assert "real GPU" in summary["where"]
    assert set(summary["exit_codes"].values()) == {0}
    work = summary["workload_summaries"]
    assert work["notebook"]["refused"] >= 1
    for w in summary["workloads"]:
        size = {"4g": 4, "8g": 8, "2g": 2}[w["memory"]] * GiB
        assert work[w["name"]]["total"] == size
        assert work[w["name"]]["held"] <= size
    for v in summary["verdicts"]:
        if v["policy"] == "fixed-share":
            assert abs(v["achieved"] - int(v["target"].split()[0])) <= 5, v


def test_the_sampler_loses_no_sample_that_nvml_publishes_late() -> None:
    """NVML may publish the processes' samples of one period at different
    times (an H200 did).  Each known PID is asked for from its own newest
    sample, and new PIDs are looked for up to a second back, so a sample
    published after another PID's newer one still counts: asked from the
    newest of anyone's, PID 2's samples were all lost."""
    from gpuvisor.supervisor.demo.sampler import ProcessUtilization

    class Sample:
        def __init__(self, pid: int, ts: int, util: int) -> None:
            self.pid, self.timeStamp, self.smUtil = pid, ts, util

    class FakeNvml:
        class NVMLError(Exception):
            pass

        now = 0  # the newest sample period published for PID 1; PID 2 lags one

        @classmethod
        def nvmlDeviceGetProcessUtilization(cls, h: int, since: int) -> list[Sample]:
            published = [Sample(1, t, 60) for t in range(1, cls.now + 1)]
            published += [Sample(2, t, 30) for t in range(1, cls.now)]
            out = [s for s in published if s.timeStamp > since]
            if not out:
                raise cls.NVMLError("Not Found")
            return out

    pu = ProcessUtilization.__new__(ProcessUtilization)  # without loading NVML
    pu.nvml = FakeNvml
    pu.handles = [0]
    pu.last_seen = [0]
    pu.pid_seen = [{}]
    pu.start_us = 0
    seen: dict[int, int] = {1: 0, 2: 0}
    for period in range(1, 8):
        FakeNvml.now = period
        for pid in pu.poll():
            seen[pid] += 1
    assert seen[1] == 7
    assert seen[2] == 6  # every poll after PID 2's first sample (period 1, seen at poll 2)
    assert pu.pid_seen[0] == {1: 7, 2: 6}


def _cmdline(p: psutil.Process) -> str:
    """Its command line; "" for one that has exited meanwhile (a zombie too)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def test_a_demo_killed_leaves_no_agent_or_container_running(tmp_path: Path) -> None:
    """SIGKILL gives the demo no chance to stop its children: the node agent
    used to run on (its socket and port held) until someone found it."""
    demo = subprocess.Popen(
        [*DEMO, "--simulate", "--out", str(tmp_path / "demo"), "--seconds", "60"],
        env=clean_env(),
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kids: list[psutil.Process] = []
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            kids = psutil.Process(demo.pid).children(recursive=True)
            lines = [_cmdline(k) for k in kids]
            if any("node-agent" in ln for ln in lines) and any(" run " in ln for ln in lines):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the demo did not start its agent and a container: {lines}")
        demo.kill()
        demo.wait()
        _, alive = psutil.wait_procs(kids, timeout=20)
        assert not alive, [_cmdline(p) for p in alive]
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for k in kids:  # what a failure left behind
            with contextlib.suppress(psutil.NoSuchProcess):
                k.kill()


def test_demo_with_real_gpus_but_no_pytorch_falls_back_to_the_simulated_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner
    from gpuvisor.supervisor.demo import cli as demo_cli

    ran: list[bool] = []
    monkeypatch.setattr(demo_cli, "real_gpu_present", lambda: True)
    real_find_spec = demo_cli.importlib.util.find_spec
    monkeypatch.setattr(
        demo_cli.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch" else real_find_spec(name, *a),
    )

    def fake_run(seconds: float, simulate: bool, out: Path, console: object) -> int:
        ran.append(simulate)
        return 0

    monkeypatch.setattr(demo_cli, "run_demo", fake_run)
    res = CliRunner().invoke(demo_cli.demo, ["--out", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    assert ran == [True]
    assert "PyTorch is not installed: running the demo on the simulated node" in res.output


def test_make_demo_installs_only_what_the_demo_needs(tmp_path: Path) -> None:
    plan = subprocess.run(
        ["make", "-n", "demo", f"DEMO_VENV={tmp_path / 'venv'}"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    installs = [line for line in plan.splitlines() if "pip install" in line and " -e " in line]
    assert installs, plan
    assert all("'.[plot]'" in line for line in installs), installs
