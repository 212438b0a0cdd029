"""The simulator's time-slicing mode (native/sim/state_timeslice.c,
GPUVISOR_SIM_TIMESLICE_US): contexts of different processes take turns of
one timeslice, a running kernel is preempted at the end of its turn, events
are reached when their context is resident, and NVML counts a process busy
while it has a kernel started and not finished.  Real clients (cuda-python,
nvidia-ml-py) against the simulated driver; bounds are wide for loaded
2-core CI machines."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

from tests.simhelp import has_cuda_bindings, ok, ready_then_go, run_py, sim_env, spawn_py
from tests.test_sim_timeline import NVML_QUERY, with_prelude

needs_cuda_python = pytest.mark.skipif(not has_cuda_bindings(), reason="cuda-python missing")

TS = {"GPUVISOR_SIM_TIMESLICE_US": "2048"}

# A worker in the style of `make bench-gpu`: batches of 3 kernels of KERNEL_US,
# an event pair around each kernel, at most 2 batches queued ahead; after
# "go" on stdin it runs RUN_S seconds and prints the kernels it completed
# and its event times (ms).
WORKER = with_prelude(
    """
    import os
    KERNEL_US, RUN_S = int(os.environ["W_KERNEL_US"]), float(os.environ["W_RUN_S"])
    WARM = 0.3
    s = chk(cu.cuStreamCreate(0))
    batches = []
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    t1 = None
    done, times = 0, []
    while time.monotonic() - t0 < RUN_S:
        evs = []
        for _ in range(3):
            a, b = chk(cu.cuEventCreate(0)), chk(cu.cuEventCreate(0))
            chk(cu.cuEventRecord(a, s))
            launch_spin(s, KERNEL_US)
            chk(cu.cuEventRecord(b, s))
            evs.append((a, b))
        batches.append(evs)
        if len(batches) > 2:
            old = batches.pop(0)
            chk(cu.cuEventSynchronize(old[-1][1]))
            if t1 is None and time.monotonic() - t0 > WARM:
                t1 = time.monotonic()       # count batches done from here
            elif t1 is not None:
                done += len(old)
                times += [chk(cu.cuEventElapsedTime(a, b)) for a, b in old]
            for a, b in old:
                chk(cu.cuEventDestroy(a))
                chk(cu.cuEventDestroy(b))
    wall = time.monotonic() - t1
    chk(cu.cuCtxSynchronize())
    print(json.dumps({"share": done * KERNEL_US / 1e6 / wall, "times": times}), flush=True)
    """
)


def run_workers(
    tmp_path: Path, kernels_us: list[int], run_s: float, **extra: str
) -> list[dict[str, object]]:
    """Workers of the given kernel lengths on one time-sliced device."""
    ws = []
    for k in kernels_us:
        env = sim_env(tmp_path, "1x8g", **{**TS, **extra}, W_KERNEL_US=str(k), W_RUN_S=str(run_s))
        ws.append(spawn_py(WORKER, env))
    try:
        ready_then_go(ws)
        outs = [w.communicate(timeout=60) for w in ws]
    finally:
        for w in ws:
            if w.poll() is None:
                w.kill()
    res = []
    for w, (o, e) in zip(ws, outs, strict=True):
        assert w.returncode == 0, o + e
        res.append(json.loads(o.splitlines()[-1]))
    return res


def share(r: dict[str, object]) -> float:
    v = r["share"]
    assert isinstance(v, float)
    return 100 * v


def times_ms(r: dict[str, object]) -> list[float]:
    v = r["times"]
    assert isinstance(v, list)
    assert v
    return [float(x) for x in v]


def median_ms(r: dict[str, object]) -> float:
    return float(statistics.median(times_ms(r)))


@needs_cuda_python
def test_pair_of_busy_processes(tmp_path: Path) -> None:
    """Two processes of back-to-back 1.65 ms kernels: about 46 % each (8 % of
    the device goes to switches), and an event pair around one kernel
    measures about 4 ms, as on an H200 (docs/simulator.md)."""
    a, b = run_workers(tmp_path, [1650, 1650], 2.0)
    for r in (a, b):
        assert 38 <= share(r) <= 50, (share(a), share(b))
        assert 3.2 <= median_ms(r) <= 5.0, (median_ms(a), median_ms(b))
    assert share(a) + share(b) <= 96, (share(a), share(b))  # switches cost


@needs_cuda_python
def test_long_kernels_are_preempted(tmp_path: Path) -> None:
    """A 13 ms kernel worker next to a 1.65 ms one: both about 46 %, because
    the long kernel is preempted at the end of each turn."""
    a, b = run_workers(tmp_path, [13000, 1650], 2.0)
    for r in (a, b):
        assert 36 <= share(r) <= 54, (share(a), share(b))
    assert median_ms(a) > 20, median_ms(a)  # the other's turns are inside


@needs_cuda_python
def test_alone_runs_at_full_speed(tmp_path: Path) -> None:
    """One process alone has no switches: its events measure its kernels."""
    (a,) = run_workers(tmp_path, [1650], 1.5)
    assert share(a) >= 85, share(a)
    assert 1.6 <= median_ms(a) <= 2.0, median_ms(a)


@needs_cuda_python
def test_timeslice_knob_sets_the_turn(tmp_path: Path) -> None:
    """Longer slices mean fewer switches: with 20 ms slices a pair loses
    little to switching and events span a whole turn of the other."""
    a, b = run_workers(tmp_path, [1650, 1650], 2.0, GPUVISOR_SIM_TIMESLICE_US="20000")
    assert share(a) + share(b) >= 90, (share(a), share(b))
    assert max(times_ms(a) + times_ms(b)) >= 15


@needs_cuda_python
def test_nvml_counts_started_kernels(tmp_path: Path) -> None:
    """Per-process utilisation counts a started, unfinished kernel (preempted
    or not): two busy processes each read about 100 %, the device about 100 %."""
    env = sim_env(tmp_path, "1x8g", **TS, W_KERNEL_US="1650", W_RUN_S="4.0")
    ws = [spawn_py(WORKER, env) for _ in range(2)]
    try:
        ready_then_go(ws)
        time.sleep(0.6)
        since_us = int(time.time() * 1e6)
        time.sleep(1.0)
        q = json.loads(ok(run_py(NVML_QUERY, env, args=[str(since_us)])).splitlines()[-1])
        for w in ws:
            w.communicate(timeout=60)
    finally:
        for w in ws:
            if w.poll() is None:
                w.kill()
    pids = {str(w.pid) for w in ws}
    assert q["gpu"] >= 90, q
    for key in ("a", "b"):
        assert set(q[key]) == pids, q
        for util, _ in q[key].values():
            assert util >= 80, q


@needs_cuda_python
def test_stream_and_context_sync(tmp_path: Path) -> None:
    """Queries, stream/context/event synchronisation and elapsed times in the
    mode, alone and while another process keeps the device busy."""
    body = with_prelude(
        """
        s = chk(cu.cuStreamCreate(1))
        e0, e1 = chk(cu.cuEventCreate(0)), chk(cu.cuEventCreate(0))
        res = {}
        t0 = time.monotonic()
        chk(cu.cuEventRecord(e0, s))
        launch_spin(s, 100000)
        chk(cu.cuEventRecord(e1, s))
        res["launch_s"] = time.monotonic() - t0
        res["query"] = int(cu.cuStreamQuery(s)[0])
        res["equery"] = int(cu.cuEventQuery(e1)[0])
        res["elapsed_early"] = int(cu.cuEventElapsedTime(e0, e1)[0])
        chk(cu.cuStreamSynchronize(s))
        res["sync_s"] = time.monotonic() - t0
        res["query_after"] = int(cu.cuStreamQuery(s)[0])
        res["ms"] = chk(cu.cuEventElapsedTime(e0, e1))
        launch_spin(s, 30000)
        t1 = time.monotonic()
        chk(cu.cuCtxSynchronize())
        res["ctx_s"] = time.monotonic() - t1
        print(json.dumps(res))
        """
    )
    env = sim_env(tmp_path, "1x8g", **TS)
    r = json.loads(ok(run_py(body, env)).splitlines()[-1])
    assert r["launch_s"] < 0.05, r
    assert (r["query"], r["equery"], r["elapsed_early"]) == (600, 600, 600), r
    assert r["query_after"] == 0, r
    assert 0.099 < r["sync_s"] < 0.5, r
    assert 99.9 < r["ms"] < 150, r  # plus the launch call after e0
    assert 0.029 < r["ctx_s"] < 0.3, r
    # beside a busy process the same kernel takes about twice as long
    busy = spawn_py(WORKER, {**env, "W_KERNEL_US": "5000", "W_RUN_S": "3"})
    try:
        assert busy.stdout is not None
        assert busy.stdin is not None
        assert busy.stdout.readline().strip() == "ready"
        busy.stdin.write("go\n")
        busy.stdin.flush()
        time.sleep(0.2)
        r2 = json.loads(ok(run_py(body, env)).splitlines()[-1])
    finally:
        busy.kill()
        busy.wait()
    assert 170 < r2["ms"] < 320, r2
    assert r2["query_after"] == 0, r2


@needs_cuda_python
def test_killed_process_work_drains(tmp_path: Path) -> None:
    """Work queued by a process killed mid-run still runs (as on a GPU), then
    its queue is free; a survivor never hangs."""
    env = sim_env(tmp_path, "1x8g", **TS)
    hog = spawn_py(
        with_prelude(
            """
            s = chk(cu.cuStreamCreate(0))
            for _ in range(20):
                launch_spin(s, 10000)       # 200 ms queued
            print("ready", flush=True)
            time.sleep(60)
            """
        ),
        env,
    )
    assert hog.stdout is not None
    assert hog.stdout.readline().strip() == "ready"
    hog.kill()
    hog.wait()
    r = json.loads(
        ok(
            run_py(
                with_prelude(
                    """
                    s = chk(cu.cuStreamCreate(0))
                    e0, e1 = chk(cu.cuEventCreate(0)), chk(cu.cuEventCreate(0))
                    t0 = time.monotonic()
                    chk(cu.cuEventRecord(e0, s)); launch_spin(s, 50000)
                    chk(cu.cuEventRecord(e1, s)); chk(cu.cuEventSynchronize(e1))
                    print(json.dumps({"s": time.monotonic() - t0,
                                      "ms": chk(cu.cuEventElapsedTime(e0, e1))}))
                    """
                ),
                env,
            )
        ).splitlines()[-1]
    )
    # shares the device with the dead process's leftover work, then alone
    assert 0.05 < r["s"] < 1.0, r
    assert 50 <= r["ms"] < 300, r


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("GPUVISOR_SIM_TIMESLICE_US", "2ms"),
        ("GPUVISOR_SIM_TIMESLICE_US", "-1"),
        ("GPUVISOR_SIM_CTXSW_US", "1e3"),
        ("GPUVISOR_SIM_CTXSW_IDLE_US", "99999999999"),
    ],
)
@needs_cuda_python
def test_bad_values_fail(tmp_path: Path, var: str, value: str) -> None:
    """A bad value fails cuInit and nvmlInit with one line naming it."""
    env = sim_env(tmp_path, "1x8g", **{**TS, var: value})
    cp = run_py(
        """
        from cuda.bindings import driver as cu
        import pynvml
        print(int(cu.cuInit(0)[0]))
        try:
            pynvml.nvmlInit()
            print("nvml ok")
        except pynvml.NVMLError as e:
            print("nvml", e)
        """,
        env,
    )
    assert cp.returncode == 0, cp.stdout + cp.stderr
    lines = cp.stdout.split()
    assert lines[0] == "1", cp.stdout  # CUDA_ERROR_INVALID_VALUE
    assert "nvml ok" not in cp.stdout, cp.stdout
    errs = [ln for ln in cp.stderr.splitlines() if var in ln]
    assert errs, cp.stderr
    assert f"{var}={value}" in errs[0], cp.stderr


@needs_cuda_python
def test_events_past_the_launch_bound(tmp_path: Path) -> None:
    """Kernels and event markers share the process's queue: 1500 kernels
    with an event after each (3000 items, past the 1024 a queue holds)
    all run, the launching thread waiting while the queue is full."""
    body = with_prelude(
        """
        s = chk(cu.cuStreamCreate(0))
        evs = [chk(cu.cuEventCreate(0)) for _ in range(2)]
        t0 = time.monotonic()
        for i in range(1500):
            launch_spin(s, 200)
            chk(cu.cuEventRecord(evs[i % 2], s))
        chk(cu.cuStreamSynchronize(s))
        print(json.dumps({"s": time.monotonic() - t0}))
        """
    )
    r = json.loads(ok(run_py(body, sim_env(tmp_path, "1x8g", **TS))).splitlines()[-1])
    assert r["s"] >= 0.3, r  # 1500 x 200 us all ran
