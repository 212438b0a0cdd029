"""Containers sharing one GPU get their split on a time-sliced device
(issue 35, part 2): the simulator's time-slicing mode
(GPUVISOR_SIM_TIMESLICE_US, docs/simulator.md) preempts a context's kernel
for another's slice, as the H100/H200 did, so the events around a kernel
measure the other context's time too unless the gate gives one process at a
time the device (sm_arbiter.c, the turn).

A container's share is what its workers really got: the GPU time of the
kernels they completed over their wall time (NVML's per-process figure,
which counts a preempted kernel as busy, reads the limit either way).
Workers are real cuda-python clients through libgpuvisor.so; 3 s runs and
bounds of +-4 points (the benchmark, make bench-sm, holds 2), for a loaded
2-core CI machine.  Before the turn these pairs came out 38.9 / 37.8 at
50:50 and 23.2 / 59.1 at 30:70 (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.helpers import CU_SPIN_PRELUDE, SimNode, hung_report, start_ready
from tests.test_sm_quota import LONG_RUN, finish, go, start

TS = {"GPUVISOR_SIM_TIMESLICE_US": "2048"}
RUN_S = 3.0
BOUND = 4.0  # points


def container(node: SimNode, name: str, limit: int) -> dict[str, str]:
    """The env of a container of its own (its own region file) with an SM
    limit, on the node's time-sliced device."""
    return node.shimmed(
        **TS,
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(node.dir / f"{name}.shr"),
        CUDA_DEVICE_SM_LIMIT=str(limit),
    )


def run_together(node: SimNode, limits: list[int], procs: list[int]) -> list[float]:
    """Containers of the given limits and process counts, run together for
    RUN_S; each one's share of the unlimited device (%)."""
    workers: list[tuple[int, subprocess.Popen[str]]] = []
    try:
        for i, (limit, n) in enumerate(zip(limits, procs, strict=True)):
            env = container(node, f"c{i}", limit)
            workers += [(i, start(env, "kernel", RUN_S, 10 * i + k)) for k in range(n)]
        go(*(w for _, w in workers))
        shares = [0.0] * len(limits)
        for i, w in workers:
            shares[i] += finish(w)
        return shares
    finally:
        for _, w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()


TRIES = 3


def reports(procs: list[subprocess.Popen[str]]) -> list[dict[str, float]]:
    """Starts ready workers together and returns the JSON object each
    prints last; a worker still running when this fails is killed."""
    try:
        go(*procs)
        got = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, out + err
            got.append(json.loads(out.strip().splitlines()[-1]))
        return got
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)


def holds_split(node: SimNode, limits: list[int], procs: list[int]) -> None:
    """Some run of up to TRIES gives every container its limit within
    BOUND.  A CPU-heavy test on CI's other core can starve the workers'
    launch threads for part of a 3 s run (a CI run read 25.9 / 64.4 at 30:70
    and 19.3 / 26.8 / 44.6 at 20:30:50, where alone these pass every time):
    each run is independent, and all of them are shown when none holds."""
    runs = []
    for _ in range(TRIES):
        shares = run_together(node, limits, procs)
        runs.append([round(x, 1) for x in shares])
        if all(abs(got - limit) <= BOUND for limit, got in zip(limits, shares, strict=True)):
            return
    pytest.fail(f"{limits}: no run of {TRIES} within {BOUND} points: {runs}")


@pytest.mark.parametrize(("split", "procs"), [((50, 50), (1, 1)), ((30, 70), (1, 2))])
def test_a_pair_gets_its_split(
    node: SimNode, split: tuple[int, int], procs: tuple[int, int]
) -> None:
    holds_split(node, list(split), list(procs))


def test_three_containers_get_their_split(node: SimNode) -> None:
    holds_split(node, [20, 30, 50], [1, 1, 1])


# Back-to-back 1 ms kernels; after "go" it runs RUN_S seconds, then prints
# its share of the device and the longest a launch call took from 1.2 s on
# (after the neighbour is stopped or killed at 1.0 s).
PROBE = (
    CU_SPIN_PRELUDE
    + """
import json, sys, time
run = float(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
gpu, worst = 0, 0.0
while (t := time.monotonic()) - t0 < run:
    launch(1000)
    took = time.monotonic() - t
    gpu += 1000
    if t - t0 >= 1.2:
        worst = max(worst, took)
chk(cu.cuStreamSynchronize(s))
wall = time.monotonic() - t0
print(json.dumps({"share": gpu / 1e6 / wall * 100, "worst_ms": worst * 1e3}), flush=True)
"""
)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_neighbour_killed_or_stopped_holding_the_device_costs_little(
    node: SimNode, how: signal.Signals
) -> None:
    """B (90 %) holds the device most of the time; it is killed or stopped
    at 1 s, whenever that falls.  A (10 %) keeps its share, and none of its
    launches waits long: the turn of a process that stopped giving signs of
    life lapses after 20 ms (the 150 ms bound on any wait for the turn is
    the last resort)."""
    b = start(container(node, "b", 90), "kernel", LONG_RUN, 7)
    a = start_ready(PROBE, container(node, "a", 10), str(RUN_S))
    try:
        go(b, a)
        time.sleep(1.0)
        b.send_signal(how)
        try:
            out, err = a.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # (About one run in fifty hung here once, cause not found; if
            # it comes back, this says where each process was.)
            pytest.fail(f"A did not finish its {RUN_S} s:\n" + hung_report({"A": a, "B": b}))
        assert a.returncode == 0, out + err
        got = json.loads(out.strip().splitlines()[-1])
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    assert abs(got["share"] - 10) <= BOUND, got
    assert got["worst_ms"] < 100, got


# Back-to-back kernels of argv[2] us from one Python thread; after "go" it
# runs argv[1] seconds and prints the share of the device its kernels took.
SMALL = (
    CU_SPIN_PRELUDE
    + """
import json, sys, time
run, us = float(sys.argv[1]), int(sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
n = 0
while time.monotonic() - t0 < run:
    launch(us)
    n += 1
chk(cu.cuStreamSynchronize(s))
print(json.dumps({"share": n * us / 1e4 / (time.monotonic() - t0)}), flush=True)
"""
)


def test_the_turns_holder_measures_small_kernels_in_segments(node: SimNode) -> None:
    """Every event record costs 150 us of CPU here (GPUVISOR_SIM_RECORD_US;
    a real driver's costs microseconds).  Under the turn the holder's
    device is its own, so its launches back to back share an event pair
    per 1 ms of estimates (a segment) instead of one pair each: with a
    pair each, a Python thread launching 200 us kernels spent over 300 us
    per launch, kept its turns about 60 % busy and got 30.4 / 31.1 at
    50:50 (an H200's 26 us products fell short the same way); with
    segments 46.9 / 46.6."""
    env = {"GPUVISOR_SIM_RECORD_US": "150"}
    runs = []
    for _ in range(TRIES):
        procs = [
            start_ready(SMALL, container(node, name, 50) | env, str(RUN_S), "200")
            for name in ("a", "b")
        ]
        shares = [r["share"] for r in reports(procs)]
        runs.append([round(x, 1) for x in shares])
        if all(x >= 50 - 2 * BOUND for x in shares):
            return
    pytest.fail(f"no run of {TRIES} gave both 50 % containers {50 - 2 * BOUND} or more: {runs}")


# Back-to-back 1.65 ms kernels (make bench-gpu's products); after "go" it
# runs RUN_S + 1 seconds and prints, from 1 s on, the GPU time its kernels
# took and the time its interposer's meter counted (gv_device_get_sm_usage),
# each as a share of the wall time.
METERED = (
    CU_SPIN_PRELUDE
    + """
import json, sys, time
run = float(sys.argv[1])
usage = ctypes.CDLL(None).gv_device_get_sm_usage
def meter():
    busy, waited, n = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
    assert usage(0, ctypes.byref(busy), ctypes.byref(waited), ctypes.byref(n)) == 0
    return busy.value / 1e3
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
gpu, mark = 0, None
while (t := time.monotonic()) - t0 < run:
    if mark is None and t - t0 >= 1.0:
        mark = (t, gpu, meter())
    launch(1650)
    gpu += 1650
chk(cu.cuStreamSynchronize(s))
t1 = time.monotonic()
m1 = meter()
span = (t1 - mark[0]) * 1e4
print(json.dumps({"ran": (gpu - mark[1]) / span, "metered": (m1 - mark[2]) / span}), flush=True)
"""
)


def test_the_meter_counts_what_ran_under_the_turn_whatever_nvml_says(node: SimNode) -> None:
    """Under the turn each process's events measure its own kernels only,
    so its measured times are settled as measured.  NVML's per-process
    samples are noisy while processes take turns (an H200's spread by 9-21
    points, sd): scaled by them, each container was charged 3-6 points
    less than it ran there, and a 30 % container's 100 ms windows swung by
    18-27 % of its mean.  Here every sample is off by up to 100 points
    (GPUVISOR_SIM_NVML_NOISE, 200 ms samples as on an H200), so that the
    scaling shows on a loaded machine: before, B's meter read 52 for 75
    run and the split went 23 / 75."""
    env = {"GPUVISOR_SIM_NVML_NOISE": "100", "GPUVISOR_SIM_NVML_SAMPLE_MS": "200"}
    procs = [
        start_ready(METERED, container(node, name, limit) | env, str(RUN_S + 1))
        for name, limit in (("a", 30), ("b", 70))
    ]
    got = reports(procs)
    for r in got:
        assert abs(r["metered"] - r["ran"]) <= 1.5, got
    assert abs(got[0]["ran"] - 30) <= BOUND, got
    assert abs(got[1]["ran"] - 70) <= BOUND, got
