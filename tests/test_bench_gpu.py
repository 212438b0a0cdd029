"""The real-GPU benchmarks' arithmetic (tests/bench/torch_sm.py,
torch_oversub.py and torch_slice.py, make bench-gpu): throughput from the
completion curve, the NVML samples and the interposer's meter taken inside
the measured window only, steadiness of the 100 ms windows, the time-slice
probe's runs and gaps, and a one-line refusal where there is no GPU.  The
benchmarks need PyTorch and an NVIDIA GPU; these checks need neither."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gpuvisor.shim.hardware import real_gpu_present

from tests.bench.torch_oversub import CHUNK, case_env, row, tensor_total
from tests.bench.torch_slice import quantiles, slices
from tests.bench.torch_sm import (
    NvmlPoller,
    QueryLog,
    parse_mixed,
    rate_between,
    summarise,
    together_windows,
    worker_env,
)
from tests.helpers import LIBRARY, clean_env, run_cmd


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cmd([sys.executable, "-m", "tests.bench.torch_sm", *args], clean_env())


def test_rate_between_interpolates_the_completion_curve() -> None:
    marks: list[list[float]] = [[0.1, 10], [0.2, 20], [0.4, 20], [0.5, 40]]
    assert rate_between(marks, 0.1, 0.2) == pytest.approx(100)
    assert rate_between(marks, 0.2, 0.4) == pytest.approx(0)  # nothing finished
    assert rate_between(marks, 0.15, 0.25) == pytest.approx(50)  # half of each side
    assert rate_between(marks, 0.0, 0.1) == pytest.approx(100)  # from (0, 0)


def test_summary_uses_the_measured_window_only() -> None:
    # 1000 products/s, steady, for 3 s; 1 s of warm-up.  The worker started at
    # wall-clock 1000.0 s, so the window is [1001, 1003] s.
    marks = [[i / 100, i * 10] for i in range(1, 301)]
    r: dict[str, object] = {
        "marks": marks,
        "wall0": 1000.0,
        "pid": 42,
        # the interposer's meter at 1.0 s and 3.0 s: 0.6 s of GPU time between
        "metered": [[1.0, 5_000_000_000], [3.0, 5_600_000_000]],
    }
    poller = NvmlPoller(handle=None)
    us = 1_000_000
    poller.proc = {
        42: [(1000 * us + us // 2, 99), (1002 * us, 30), (1003 * us, 32)],
        7: [(1002 * us, 5)],
    }
    poller.device = [(1000 * us, 100), (1002 * us, 40), (1002 * us + us // 2, 42)]
    poller.clocks = [(1000 * us, 1500, 690.0), (1002 * us, 1980, 300.0)]
    summarise(r, poller, warm=1.0)
    assert r["rate"] == pytest.approx(1000)
    assert r["nvml_sm"] == pytest.approx(31)  # not the warm-up's 99, not PID 7's
    assert r["nvml_sm_samples"] == 2
    assert r["nvml_gpu"] == pytest.approx(41)
    assert r["metered"] == pytest.approx(30)  # 0.6 s of 2 s
    assert r["sm_mhz"] == pytest.approx(1980)
    assert r["win_sd"] == pytest.approx(0, abs=1e-6)  # steady
    assert "marks" not in r


def test_uneven_windows_show_in_the_spread() -> None:
    # 2 s measured: the first second at 1500/s, the second at 500/s.
    marks = [[0.01 * i, 15 * i] for i in range(1, 101)]
    marks += [[1 + 0.01 * i, 1500 + 5 * i] for i in range(1, 101)]
    r: dict[str, object] = {"marks": marks, "wall0": 0.0, "pid": 1, "metered": []}
    summarise(r, NvmlPoller(handle=None), warm=0.0)
    assert r["rate"] == pytest.approx(1000)
    assert r["win_sd"] == pytest.approx(50, abs=3)  # windows at 150 % and 50 % of the mean
    assert abs(r["win_worst"]) == pytest.approx(50, abs=3)  # type: ignore[arg-type]
    assert r["metered"] is None  # no interposer: no meter


def test_without_a_gpu_it_says_so_in_one_line() -> None:
    if real_gpu_present():
        pytest.skip("a real GPU is present")
    proc = bench("--lib", str(LIBRARY))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("torch_sm: NVML:")
    assert "needs an NVIDIA GPU" in lines[0]


def test_a_missing_library_is_named() -> None:
    proc = bench("--lib", "/nonexistent/libgpuvisor.so")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "torch_sm: --lib /nonexistent/libgpuvisor.so: no such file (run make first)"
    )


class _Sample:
    def __init__(self, pid: int, ts: int) -> None:
        self.pid, self.timeStamp, self.smUtil = pid, ts, 50


def test_the_nvml_query_log_tells_the_answers_form_and_pace() -> None:
    """What a future GPU run must tell the simulator's knobs: the query's
    time, one entry per process or per process and sample, and the step
    between a process's samples."""
    log = QueryLog()
    assert log.summary() == "NVML per-process query: never called"
    log.record(0.002, [_Sample(1, 1_000_000), _Sample(2, 1_000_000)])
    assert log.most_entries == 1  # one entry over all samples
    per_sample = [_Sample(1, t) for t in (1_200_000, 1_400_000, 1_600_000)]
    log.record(0.004, [*per_sample, _Sample(2, 1_600_000)])
    assert log.most_entries == 3
    assert log.steps_us == [200_000, 200_000]
    line = log.summary()
    assert "2 calls" in line
    assert "median 3.00 ms, max 4.00 ms" in line
    assert "at most 3 entries for one process" in line
    assert line.endswith("median step between a process's samples 200 ms")


def test_mixed_runs_name_each_containers_policy_and_limit(tmp_path: Path) -> None:
    assert parse_mixed("burst-share:30+fixed-share:50") == [
        ("burst-share", 30),
        ("fixed-share", 50),
    ]
    with pytest.raises(ValueError, match="'burst-share' is not POLICY:LIMIT"):
        parse_mixed("burst-share")
    env = worker_env(LIBRARY, 30, tmp_path / "r.shr", tmp_path, "burst-share")
    assert env["GPUVISOR_SM_POLICY"] == "burst-share"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert "GPUVISOR_SM_POLICY" not in worker_env(LIBRARY, 30, tmp_path / "r.shr", tmp_path)


def curve(
    rate: float, seconds: float, pause: tuple[float, float] | None = None
) -> list[list[float]]:
    """A completion curve marked every 10 ms: rate products/s, none while paused."""
    marks, done = [], 0.0
    for i in range(1, round(seconds * 100) + 1):
        t = i / 100
        if pause is None or not pause[0] < t <= pause[1]:
            done += rate / 100
        marks.append([t, done])
    return marks


def test_two_workers_windows_are_taken_on_one_wall_clock() -> None:
    """A at 1000 products/s, B at 3000/s, B started 0.5 s later (its own
    clock starts at its wall0): over the time both ran after the warm-up,
    A did 25 % of the work in every window, and both together were steady.
    Then B stalls from its 1.5 s to 1.7 s: the split and the total show it."""
    a: dict[str, Any] = {"wall0": 100.0, "marks": curve(1000, 4.0)}
    b: dict[str, Any] = {"wall0": 100.5, "marks": curve(3000, 3.0)}
    t = together_windows([a, b], warm=0.5)
    assert t is not None
    assert t["split"] == pytest.approx(25)
    assert t["split_sd"] == pytest.approx(0, abs=1e-6)
    assert t["total_sd"] == pytest.approx(0, abs=1e-6)
    stalled: dict[str, Any] = {"wall0": 100.5, "marks": curve(3000, 3.0, pause=(1.5, 1.7))}
    t = together_windows([a, stalled], warm=0.5)
    assert t is not None
    assert t["split_worst"] > 50  # A alone in those windows: 100 % against about 27
    assert t["total_worst"] < -50
    assert together_windows([a], warm=0.5) is None


# ---- memory oversubscription with PyTorch (tests/bench/torch_oversub.py) ----


def oversub_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cmd([sys.executable, "-m", "tests.bench.torch_oversub", *args], clean_env())


def test_oversub_without_a_gpu_it_skips_in_one_line() -> None:
    if real_gpu_present():
        pytest.skip("a real GPU is present")
    proc = oversub_bench("--lib", str(LIBRARY), "--out", "/nonexistent/never-written")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("torch_oversub: skipped: NVML:")
    assert lines[0].endswith("(needs an NVIDIA GPU)")


def test_oversub_a_missing_library_is_named() -> None:
    proc = oversub_bench("--lib", "/nonexistent/libgpuvisor.so")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "torch_oversub: --lib /nonexistent/libgpuvisor.so: no such file (run make first)"
    )


def test_oversub_tensors_are_one_and_a_half_guarantees_within_the_quota() -> None:
    g = 8 << 30
    assert tensor_total(g) == 12 << 30
    assert tensor_total(g) % CHUNK == 0
    # a guarantee that is no whole number of tensors rounds down
    assert tensor_total((1 << 30) + (100 << 20)) == 1536 << 20


def test_oversub_cases_environments(tmp_path: Path) -> None:
    base = {
        "PATH": "/usr/bin",
        "LD_PRELOAD": "/other.so",
        "CUDA_OVERSUBSCRIBE": "true",
        "GPUVISOR_MEMORY_SCALING": "4",
        "CUDA_DEVICE_MEMORY_LIMIT": "1g",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    region = tmp_path / "r.shr"
    g = 8 << 30
    over = case_env(base, LIBRARY, region, g, True, True, "backend:cudaMallocAsync")
    assert over["LD_PRELOAD"] == str(LIBRARY)
    assert over["CUDA_DEVICE_MEMORY_LIMIT"] == "16384m"
    assert over["CUDA_OVERSUBSCRIBE"] == "true"
    assert over["GPUVISOR_MEMORY_SCALING"] == "2"
    assert over["GPUVISOR_NODE_LOCK"] == ""  # never borrows beyond the guarantee
    assert over["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert over["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == str(region)
    on_device = case_env(base, LIBRARY, region, g, True, False, None)
    assert on_device["CUDA_DEVICE_MEMORY_LIMIT"] == "16384m"
    assert "CUDA_OVERSUBSCRIBE" not in on_device
    assert "GPUVISOR_MEMORY_SCALING" not in on_device
    assert "PYTORCH_CUDA_ALLOC_CONF" not in on_device
    plain = case_env(base, LIBRARY, region, g, False, False, None)
    assert "LD_PRELOAD" not in plain
    assert "CUDA_DEVICE_MEMORY_LIMIT" not in plain
    assert plain["PATH"] == "/usr/bin"


def test_oversub_rows() -> None:
    r = {
        "rate": 2.0,
        "tensor_bytes": 12 << 30,
        "mem_get_info": [3 << 30, 16 << 30],
        "spilled": 5 << 29,
        "correct": True,
    }
    assert row("native", "oversubscribed", r, 8.0) == (
        "| native | oversubscribed | yes | 2.00 | 52 | 25.0 | 3.00 / 16.00 | 2.50 |"
    )
    assert row("native", "no interposer", dict(r, spilled=None), None).endswith(
        "| 2.00 | 52 | - | 3.00 / 16.00 | - |"
    )
    err = {"error": "OutOfMemoryError: CUDA out of memory."}
    assert row("cudaMallocAsync", "oversubscribed", err, 8.0) == (
        "| cudaMallocAsync | oversubscribed | no: OutOfMemoryError: CUDA out of memory. "
        "| - | - | - | - | - |"
    )
    assert row("native", "x", dict(r, correct=False), 8.0).startswith(
        "| native | x | yes, but wrong sums |"
    )


# ---- how the GPU time-slices between contexts (tests/bench/torch_slice.py) ----


def test_slice_probe_runs_and_gaps() -> None:
    # A probe that ran 2 ms, was switched out 2.4 ms, and so on, over 10 ms;
    # gaps are [last timer read before, first after] in ns from the start.
    gaps = [[2_000_000, 4_400_000], [6_400_000, 8_800_000]]
    s = slices(gaps, 10_000_000)
    assert s["gaps"] == 2
    assert s["run_us_median"] == pytest.approx(2000)  # 4.4 -> 6.4 ms: one whole run
    assert s["gap_us_median"] == pytest.approx(2400)
    assert s["probe_share"] == pytest.approx(52)  # 4.8 ms of 10 switched out
    alone = slices([], 10_000_000)
    assert alone["gaps"] == 0
    assert alone["probe_share"] == pytest.approx(100)


def test_slice_quantiles() -> None:
    assert quantiles([]) == (0.0, 0.0, 0.0)
    assert quantiles([float(i) for i in range(1, 11)]) == (2.0, 5.5, 10.0)


def test_slice_without_a_gpu_it_skips_in_one_line() -> None:
    if real_gpu_present():
        pytest.skip("a real GPU is present")
    proc = run_cmd(
        [sys.executable, "-m", "tests.bench.torch_slice", "--out", "/nonexistent/never"],
        clean_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("torch_slice: skipped: NVML:")
    assert lines[0].endswith("(needs an NVIDIA GPU)")


def test_slice_unknown_parts_are_named() -> None:
    proc = run_cmd(
        [sys.executable, "-m", "tests.bench.torch_slice", "--parts", "probe,x"], clean_env()
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "torch_slice: --parts 'probe,x': name some of probe, sporadic, workers"
    )
