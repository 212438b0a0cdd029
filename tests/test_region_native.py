"""Runs the C tests of the shared accounting region (native/tests/t_region_*),
of the SM meter's calibration (native/tests/t_sm_calib.c) and of the launch
order between containers (native/tests/t_sm_arbiter.c).

Each binary runs in its own temporary directory with its own region file, so
the module is safe under ``pytest -n auto``.  The plain build must exist
(``make``); the sanitizer variants are skipped, with the reason, when their
build directory is missing (``make asan`` / ``make tsan``).  Rounds and
durations are chosen to keep the whole module well under a minute on two
cores.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# build dir -> how it is made
BUILDS = {"build": "make", "build-asan": "make asan", "build-tsan": "make tsan"}

# t_region_race's and t_region_kill's arguments per build (fewer rounds under sanitizers)
RACE_ARGS = {
    "build": ["--ms", "1500", "--hot-ms", "1000", "--duel-rounds", "200"],
    "build-asan": ["--ms", "800", "--hot-ms", "600", "--duel-rounds", "100"],
    # ThreadSanitizer does not follow forked children: threads only.
    "build-tsan": ["--threads-only", "--ms", "500", "--hot-ms", "400", "--duel-rounds", "60"],
}
KILL_ARGS = {
    "build": ["--rounds", "12", "--workers", "6", "--round-ms", "120"],
    "build-asan": ["--rounds", "6", "--workers", "6", "--round-ms", "100"],
    "build-tsan": ["--rounds", "4", "--workers", "4", "--round-ms", "100"],
}
# The stress programs: program -> (its region file, its arguments per build, timeout seconds)
STRESS = {
    "t_region_race": ("race.shr", RACE_ARGS, 60),
    "t_region_kill": ("kill.shr", KILL_ARGS, 90),
}

SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:exitcode=23",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66:second_deadlock_stack=1",
    "LIBCUDA_LOG_LEVEL": "1",
}
SANITIZER_MARKERS = (
    "ERROR: AddressSanitizer",
    "ERROR: LeakSanitizer",
    "runtime error:",
    "WARNING: ThreadSanitizer",
)


def binary(build: str, name: str) -> Path:
    path = REPO / build / "tests" / name
    if not path.exists():
        if build == "build":
            pytest.fail(f"run make first: missing {path}", pytrace=False)
        if not (REPO / build).is_dir():
            pytest.skip(f"{build}/ is missing: run `{BUILDS[build]}` to test this variant")
        pytest.fail(
            f"{path} is missing although {build}/ exists: run `{BUILDS[build]}`", pytrace=False
        )
    return path


def run(build: str, name: str, args: list[str], tmp_path: Path, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_DEVICE_MEMORY")}
    env.update(SANITIZER_ENV)
    proc = subprocess.run(
        [str(binary(build, name)), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{build}/tests/{name} exited {proc.returncode}:\n{out[-4000:]}"
    for marker in SANITIZER_MARKERS:
        assert marker not in out, f"{build}/tests/{name}: sanitizer report:\n{out[-4000:]}"
    return out


def stress(build: str, name: str, tmp_path: Path, *extra: str) -> str:
    """A stress program of STRESS on its region file in tmp_path, with extra
    arguments before its own for this build."""
    file, args, timeout = STRESS[name]
    return run(build, name, [str(tmp_path / file), *extra, *args[build]], tmp_path, timeout)


def overshoots(out: str) -> list[int]:
    return [int(v) for v in re.findall(r"^overshoot=(\d+) bytes$", out, re.MULTILINE)]


@pytest.mark.parametrize("build", list(BUILDS))
def test_region_unit(build: str, tmp_path: Path) -> None:
    out = run(build, "t_region_unit", [str(tmp_path / "scratch")], tmp_path, timeout=60)
    assert "t_region_unit: OK" in out
    # The corrupt-file messages are one line each and name the file.
    m = re.search(r"version (\d+), this library speaks (\d+)", out)
    assert m, out
    assert int(m.group(1)) == int(m.group(2)) + 1, out
    assert "region outliving a reboot: ok" in out
    assert re.search(r"bad magic 0x[0-9a-f]{16}, not a gpuvisor region", out)


@pytest.mark.parametrize("build", list(BUILDS))
def test_region_race(build: str, tmp_path: Path) -> None:
    out = stress(build, "t_region_race", tmp_path)
    figures = overshoots(out)
    assert len(figures) == 2, out  # wide phase and hot phase
    assert figures == [0, 0], out
    duel = re.search(r"several_winners=(\d+)", out)
    assert duel is not None, out
    assert duel.group(1) == "0", out
    assert "t_region_race: OK" in out
    assert not (tmp_path / "race.shr").exists()


@pytest.mark.parametrize("build", list(BUILDS))
def test_region_kill(build: str, tmp_path: Path) -> None:
    out = stress(build, "t_region_kill", tmp_path)
    m = re.search(r"kill: rounds=(\d+) .*kills=(\d+) .*hung=(\d+) .*final_used=(\d+)", out)
    assert m is not None, out
    assert int(m.group(2)) > 0, out  # kills happened
    assert m.group(3) == "0", out  # nobody hung
    assert m.group(4) == "0", out  # everything reclaimed
    # Two reclaimers at once over processes killed inside the gate.
    c = re.search(r"concurrent reclaims: rounds=(\d+) hung=(\d+) used=(\d+) inside=(\d+)", out)
    assert c is not None, out
    assert c.group(2) == "0", out  # nobody hung
    assert c.group(3) == "0", out  # everything reclaimed
    assert c.group(4) == "0", out  # nobody left inside the gate
    assert "t_region_kill: OK" in out


def test_region_race_and_kill_oversubscribed(tmp_path: Path) -> None:
    """The oversubscribed variants: reservations spill part of themselves
    to host memory (at once or later) and releases give both parts back;
    the quota is never passed, the spilled count never exceeds the usage,
    and it comes back to exactly 0, SIGKILLs included."""
    out = stress("build", "t_region_race", tmp_path, "--spill")
    assert overshoots(out) == [0, 0], out
    assert out.count("spill: final_spilled=0 slot_spill_sum=0 spill_over_used=0") == 2, out
    assert "t_region_race: OK" in out
    out = stress("build", "t_region_kill", tmp_path, "--spill")
    m = re.search(r"kills=(\d+) .*hung=(\d+) .*final_used=(\d+) final_spilled=(\d+)", out)
    assert m is not None, out
    assert int(m.group(1)) > 0, out
    assert m.group(2) == "0", out
    assert (m.group(3), m.group(4)) == ("0", "0"), out
    assert "t_region_kill: OK" in out


@pytest.mark.parametrize("build", list(BUILDS))
def test_region_exec_from_a_thread(build: str, tmp_path: Path) -> None:
    """A process whose other thread exec()s a program without the region
    while its main thread holds a device's gate, a slot being reclaimed or
    a device entry being initialised: exec() keeps the pid and start time
    that name the holder, so it looked alive for good and every other
    process of the container waited for it (20 s alarm in the test)."""
    out = run(build, "t_region_exec", [str(tmp_path / "exec.shr")], tmp_path, timeout=60)
    assert "gate and slot of an exec'd closer taken over: ok" in out
    assert "device entry of an exec'd initialiser taken over: ok" in out
    # The program exec()ed uses the region itself, first from another thread
    # than its main one (which has the old main thread's identity).
    assert "old main thread's holdings taken over by the new image: ok" in out
    assert "t_region_exec: OK" in out


@pytest.mark.parametrize("build", ["build", "build-asan"])
def test_sm_calibration_unit(build: str, tmp_path: Path) -> None:
    """The SM meter's calibration against NVML (native/shim/sm_calib.c)
    on a synthetic process: exact events keep a ratio of 1 within 1 %,
    events that overcount by 25 % are scaled back to within 1 %, NVML's
    answers per process or per sample and late answers agree, and a PID
    that NVML does not list leaves the measured times as they are."""
    out = run(build, "t_sm_calib", [], tmp_path, timeout=60)
    assert "t_sm_calib: OK" in out


@pytest.mark.parametrize("build", ["build", "build-asan"])
def test_sm_launch_order_unit(build: str, tmp_path: Path) -> None:
    """The launch order between containers (native/shim/sm_arbiter.c), with
    containers in forked processes sharing one node directory: a container
    alone is not held; the container furthest behind its share goes first
    (0.5 ms margin); at most 3 launches in flight over all containers; a
    process SIGKILLed or SIGSTOPped while waiting, or killed with launches
    in flight (also a forked child, which has its own slot), holds the
    others for less than 20 and 60 ms; turns average their length (a
    turn's overshoot opens the holder's next: 30:70 with 1.65 ms kernels
    charges 30 % to the first, within 0.75 points); a file of another
    layout, or no node directory, leaves the launch order out of play."""
    out = run(build, "t_sm_arbiter", [str(tmp_path)], tmp_path, timeout=60)
    assert "t_sm_arbiter: OK" in out
