"""The simulated kernel timeline (native/sim/cuda_launch.c, state_timeline.c,
nvml_util.c) as real clients see it: cuda-python launching kernels, several
processes time-slicing one simulated device, and nvidia-ml-py reading device
and per-process utilization.  Each test has its own state file, so the
device is idle when it starts.  Timing tolerances are wide (+-10 points) for
loaded 2-core CI machines."""

from __future__ import annotations

import itertools
import json
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import CU_CHK
from tests.simhelp import (
    REPO,
    has_cuda_bindings,
    ok,
    ready_then_go,
    run_c_test,
    run_py,
    sim_env,
    spawn_py,
)

needs_cuda_python = pytest.mark.skipif(not has_cuda_bindings(), reason="cuda-python missing")

T_SIM_TIMELINE = REPO / "build" / "tests" / "t_sim_timeline"

# cuda-python child prelude: a context, a module and the kernels
CUDA_PRELUDE = (
    CU_CHK
    + """
import json, sys, time
chk(cu.cuInit(0))
ctx = chk(cu.cuDevicePrimaryCtxRetain(0))
chk(cu.cuCtxSetCurrent(ctx))
mod = chk(cu.cuModuleLoadData(b"not really a cubin"))
spin = chk(cu.cuModuleGetFunction(mod, b"spin"))
blocks = chk(cu.cuModuleGetFunction(mod, b"vector_add"))
def spin_args(us):
    return ((us,), (ctypes.c_uint32,))
def launch_spin(stream, us):
    chk(cu.cuLaunchKernel(spin, 1, 1, 1, 128, 1, 1, 0, stream, spin_args(us), 0))
"""
)


def with_prelude(body: str) -> str:
    return CUDA_PRELUDE + textwrap.dedent(body)


def test_c_timeline(tmp_path: Path) -> None:
    run_c_test(T_SIM_TIMELINE, tmp_path)
    assert not list(tmp_path.glob("gv-t-sim-timeline-*")), "t_sim_timeline left its state file"


@needs_cuda_python
def test_cuda_python_launch_paths(tmp_path: Path) -> None:
    """cuLaunchKernel (kernelParams as (values, types)), cuLaunchKernelEx,
    cooperative launch, explicit and captured graphs, events and queries."""
    out = ok(
        run_py(
            with_prelude(
                """
            s = chk(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
            e0, e1 = chk(cu.cuEventCreate(0)), chk(cu.cuEventCreate(0))
            def timed(fn):
                chk(cu.cuEventRecord(e0, s)); fn(); chk(cu.cuEventRecord(e1, s))
                chk(cu.cuEventSynchronize(e1))
                return chk(cu.cuEventElapsedTime(e0, e1))
            res = {}
            t0 = time.monotonic()
            launch_spin(s, 100000)
            res["launch_s"] = time.monotonic() - t0
            res["query"] = int(cu.cuStreamQuery(s)[0])
            chk(cu.cuStreamSynchronize(s))
            res["sync_s"] = time.monotonic() - t0
            res["query_after"] = int(cu.cuStreamQuery(s)[0])
            res["spin"] = timed(lambda: launch_spin(s, 20000))
            res["blocks"] = timed(lambda: chk(cu.cuLaunchKernel(
                blocks, 100, 10, 10, 256, 1, 1, 0, s, 0, 0)))
            cfg = cu.CUlaunchConfig()
            cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1
            cfg.blockDimX = cfg.blockDimY = cfg.blockDimZ = 1
            cfg.hStream = s
            res["ex"] = timed(lambda: chk(cu.cuLaunchKernelEx(cfg, spin, spin_args(15000), 0)))
            res["coop"] = timed(lambda: chk(cu.cuLaunchCooperativeKernel(
                spin, 1, 1, 1, 32, 1, 1, 0, s, spin_args(5000))))
            # captured graph: nothing runs during capture
            chk(cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
            for _ in range(3):
                launch_spin(s, 10000)
            res["capturing"] = int(chk(cu.cuStreamIsCapturing(s)))
            g = chk(cu.cuStreamEndCapture(s))
            res["query_captured"] = int(cu.cuStreamQuery(s)[0])
            ge = chk(cu.cuGraphInstantiate(g, 0))
            res["captured"] = timed(lambda: chk(cu.cuGraphLaunch(ge, s)))
            # explicit graph: two dependent kernel nodes
            g2 = chk(cu.cuGraphCreate(0))
            p = cu.CUDA_KERNEL_NODE_PARAMS()
            p.func = spin
            p.gridDimX = p.gridDimY = p.gridDimZ = 1
            p.blockDimX = p.blockDimY = p.blockDimZ = 1
            p.kernelParams = spin_args(7000)
            n1 = chk(cu.cuGraphAddKernelNode(g2, None, 0, p))
            chk(cu.cuGraphAddKernelNode(g2, [n1], 1, p))
            ge2 = chk(cu.cuGraphInstantiate(g2, 0))
            res["explicit"] = timed(lambda: chk(cu.cuGraphLaunch(ge2, s)))
            for x in (ge, ge2):
                chk(cu.cuGraphExecDestroy(x))
            for x in (g, g2):
                chk(cu.cuGraphDestroy(x))
            chk(cu.cuCtxSynchronize())
            chk(cu.cuModuleUnload(mod))
            print(json.dumps(res))
            """
            ),
            sim_env(tmp_path, "1x8g"),
        )
    )
    r = json.loads(out.splitlines()[-1])
    assert r["launch_s"] < 0.05, r  # asynchronous
    assert r["query"] == 600, r  # NOT_READY
    assert r["query_after"] == 0, r  # then SUCCESS
    assert 0.095 < r["sync_s"] < 0.5, r
    assert 19.9 < r["spin"] < 30, r
    assert 9.9 < r["blocks"] < 15, r  # 10000 blocks x 1 us
    assert 14.9 < r["ex"] < 25, r
    assert 4.9 < r["coop"] < 10, r
    assert r["capturing"] == 1, r
    assert r["query_captured"] == 0, r
    assert 29.9 < r["captured"] < 45, r
    assert 13.9 < r["explicit"] < 25, r


# A worker: back-to-back 5 ms spin kernels, eight in flight (40 ms of queued
# work, so a loaded CI machine descheduling the worker does not leave the
# device idle), for RUN_S seconds after "go" on stdin.
WORKER = with_prelude(
    """
    RUN_S = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    s = chk(cu.cuStreamCreate(0))
    ev = [chk(cu.cuEventCreate(0)) for _ in range(8)]
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < RUN_S:
        chk(cu.cuEventSynchronize(ev[i % 8]))   # launch i-8 has completed
        launch_spin(s, 5000)
        chk(cu.cuEventRecord(ev[i % 8], s))
        i += 1
    chk(cu.cuCtxSynchronize())
    print("launched", i, flush=True)
    """
)

NVML_QUERY = """
import json, sys, time
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
since = int(sys.argv[1])
u = n.nvmlDeviceGetUtilizationRates(h)
a = {s.pid: [s.smUtil, s.timeStamp] for s in n.nvmlDeviceGetProcessUtilization(h, since)}
b = {s.pid: [s.smUtil, s.timeStamp] for s in n.nvmlDeviceGetProcessesUtilizationInfo(h, since)}
print(json.dumps({"gpu": u.gpu, "mem": u.memory, "a": a, "b": b, "now": time.time()}))
"""


@needs_cuda_python
def test_two_processes_time_slice(tmp_path: Path) -> None:
    """Two processes saturating one device each get about half of it; NVML
    sees the device 100% busy and each pid at about 50%."""
    env = sim_env(tmp_path, "1x8g")
    workers = [spawn_py(WORKER, env) for _ in range(2)]
    try:
        ready_then_go(workers)
        time.sleep(0.5)  # let both reach steady state
        since_us = int(time.time() * 1e6)
        time.sleep(1.0)
        q = json.loads(ok(run_py(NVML_QUERY, env, args=[str(since_us)])).splitlines()[-1])
        outs = [w.communicate(timeout=30) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    for w, (o, e) in zip(workers, outs, strict=True):
        assert w.returncode == 0, o + e
    pids = {str(w.pid) for w in workers}
    assert q["gpu"] >= 85, q
    assert q["mem"] == 0, q
    for key in ("a", "b"):
        assert set(q[key]) == pids, q
        for util, ts in q[key].values():
            assert 35 <= util <= 65, q
            assert since_us < ts <= q["now"] * 1e6, q


@needs_cuda_python
def test_duty_cycle_utilization(tmp_path: Path) -> None:
    """One process busy half the time: device and per-process utilization
    about 50%; the sample API's lastSeenTimeStamp and NOT_FOUND semantics."""
    out = ok(
        run_py(
            with_prelude(
                """
            import pynvml as n
            n.nvmlInit()
            h = n.nvmlDeviceGetHandleByIndex(0)
            res = {"idle": n.nvmlDeviceGetUtilizationRates(h).gpu}
            try:
                n.nvmlDeviceGetProcessUtilization(h, 0)
                res["idle_samples"] = "found"
            except n.NVMLError_NotFound:
                res["idle_samples"] = "not found"
            s = chk(cu.cuStreamCreate(0))
            period = 0.010
            t0 = time.monotonic()
            k = 0
            since = None
            while True:
                t = time.monotonic() - t0
                if t > 1.35:
                    break
                if since is None and t > 0.25:
                    since = int(time.time() * 1e6)
                launch_spin(s, 5000)        # 5 ms of every 10 ms
                k += 1
                time.sleep(max(0.0, t0 + k * period - time.monotonic()))
            res["gpu"] = n.nvmlDeviceGetUtilizationRates(h).gpu
            samples = n.nvmlDeviceGetProcessUtilization(h, since)
            res["samples"] = [[x.pid, x.smUtil, x.timeStamp] for x in samples]
            info = n.nvmlDeviceGetProcessesUtilizationInfo(h, since)
            res["info"] = [[x.pid, x.smUtil, x.timeStamp] for x in info]
            res["since"] = since
            res["now"] = int(time.time() * 1e6)
            last = max(x.timeStamp for x in samples)
            try:
                newer = n.nvmlDeviceGetProcessUtilization(h, last)
                res["newer_ok"] = all(x.timeStamp > last for x in newer)
            except n.NVMLError_NotFound:
                res["newer_ok"] = True
            try:
                n.nvmlDeviceGetProcessUtilization(h, res["now"] + 10**7)
                res["future"] = "found"
            except n.NVMLError_NotFound:
                res["future"] = "not found"
            res["pid"] = __import__("os").getpid()
            chk(cu.cuCtxSynchronize())
            print(json.dumps(res))
            """
            ),
            sim_env(tmp_path, "1x8g"),
        )
    )
    r = json.loads(out.splitlines()[-1])
    assert r["idle"] == 0, r
    assert r["idle_samples"] == "not found", r
    assert 40 <= r["gpu"] <= 60, r
    for key in ("samples", "info"):
        assert len(r[key]) == 1, r
        pid, util, ts = r[key][0]
        assert pid == r["pid"], r
        assert 40 <= util <= 60, r
        assert r["since"] < ts <= r["now"], r
    assert r["newer_ok"], r
    assert r["future"] == "not found", r


def after_one_kernel(us: int, body: str) -> str:
    """A program that runs one `us`-long kernel, waits for its samples to
    end (as long again, at most 250 ms), opens NVML (`n`, handle `h`) and
    then runs body."""
    return with_prelude(
        f"""
        import pynvml as n
        s = chk(cu.cuStreamCreate(0))
        launch_spin(s, {us})
        chk(cu.cuStreamSynchronize(s))
        time.sleep({min(us, 250_000) / 1e6})
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        """
    ) + textwrap.dedent(body)


PUBLISH_QUERY = after_one_kernel(
    300_000,
    """
    print(len(n.nvmlDeviceGetProcessUtilization(h, 0)), flush=True)
    """,
)


@needs_cuda_python
@pytest.mark.parametrize(
    ("var", "value"),
    [
        # * 1000 wraps to 0 in 64 bits: a modulo by zero (SIGFPE) in the
        # per-process sampler
        ("GPUVISOR_SIM_NVML_PUBLISH_MS", str(1 << 61)),
        ("GPUVISOR_SIM_NVML_PUBLISH_MS", "10001"),
        ("GPUVISOR_SIM_NVML_UTIL_MS", "10001"),
        ("GPUVISOR_SIM_NVML_SAMPLE_MS", "9"),
        ("GPUVISOR_SIM_NVML_PER_SAMPLE", "2"),
        ("GPUVISOR_SIM_NVML_NOISE", "101"),
        ("GPUVISOR_SIM_NVML_SAMPLE_MS", "1001"),
        ("GPUVISOR_SIM_MODULE_MIB", str((1 << 20) + 1)),
        ("GPUVISOR_SIM_LAUNCH_US", "1000001"),
        ("GPUVISOR_SIM_LAUNCH_EVERY", "1000001"),
    ],
)
def test_a_knob_out_of_range_is_named_and_ignored(tmp_path: Path, var: str, value: str) -> None:
    """A delay or size knob past its range is a bad value like a malformed
    one: one line naming the variable and the value, and the knob ignored
    (a 2**61 ms publication delay used to crash the sampler with a modulo
    by zero; a module size past 1 TiB was dropped without a word)."""
    cp = run_py(PUBLISH_QUERY, sim_env(tmp_path, "1x8g", **{var: value}))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert cp.stdout.split()[-1] == "1", cp.stdout  # this process, its kernel seen
    lines = [ln for ln in cp.stderr.splitlines() if ln.startswith("gpuvisor-sim:")]
    assert len(lines) == 1, cp.stderr
    assert f"{var}={value}" in lines[0], lines[0]


SAMPLE_GRID = with_prelude(
    """
    import pynvml as n
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    s = chk(cu.cuStreamCreate(0))
    launch_spin(s, 1_200_000)
    seen = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.1:
        try:
            ts = max(x.timeStamp for x in n.nvmlDeviceGetProcessUtilization(h, 0))
        except n.NVMLError_NotFound:    # no sample has ended yet
            ts = None
        if ts is not None and (not seen or ts != seen[-1]):
            seen.append(ts)
        time.sleep(0.01)
    print(json.dumps([b - a for a, b in zip(seen[1:], seen[2:])]))
    """
)


@needs_cuda_python
@pytest.mark.parametrize(("knob", "period_us"), [("", 100_000), ("200", 200_000)])
def test_the_nvml_sample_period_is_a_knob(tmp_path: Path, knob: str, period_us: int) -> None:
    """Per-process samples end every 100 ms, or every
    GPUVISOR_SIM_NVML_SAMPLE_MS (an H200 sampled every 200 ms): the newest
    sample's timestamp moves on in steps of the period."""
    env = sim_env(tmp_path, "1x8g", GPUVISOR_SIM_NVML_SAMPLE_MS=knob)
    steps = json.loads(ok(run_py(SAMPLE_GRID, env)))
    assert len(steps) >= 2, steps
    for step in steps:
        assert abs(step - period_us) <= 50, steps


PER_SAMPLE = after_one_kernel(
    250_000,
    """
    old = n.nvmlDeviceGetProcessUtilization(h, 0)
    new = n.nvmlDeviceGetProcessesUtilizationInfo(h, 0)
    print(json.dumps([[[x.pid, x.smUtil, x.timeStamp] for x in got] for got in (old, new)]))
    """,
)


@needs_cuda_python
@pytest.mark.parametrize("knob", ["", "1"])
def test_nvml_answers_per_sample_when_asked(tmp_path: Path, knob: str) -> None:
    """GPUVISOR_SIM_NVML_PER_SAMPLE=1: a 250 ms kernel shows as one entry
    per 100 ms sample it ran in (3 or 4), each sample's own share and
    timestamp, 100 ms apart, adding up to its 250 ms; without the knob, as
    one entry over all of them.  Both queries alike."""
    env = sim_env(tmp_path, "1x8g", GPUVISOR_SIM_NVML_PER_SAMPLE=knob)
    for entries in json.loads(ok(run_py(PER_SAMPLE, env))):
        assert len({pid for pid, _, _ in entries}) == 1, entries
        if not knob:
            assert len(entries) == 1, entries
            continue
        assert 3 <= len(entries) <= 4, entries
        stamps = [ts for _, _, ts in entries]
        assert all(b - a == 100_000 for a, b in itertools.pairwise(stamps)), entries
        assert abs(sum(util for _, util, _ in entries) - 250) <= 2, entries


SLOW_QUERY = after_one_kernel(
    150_000,
    """
    t0 = time.monotonic()
    old = n.nvmlDeviceGetProcessUtilization(h, 0)
    t1 = time.monotonic()
    new = n.nvmlDeviceGetProcessesUtilizationInfo(h, 0)
    t2 = time.monotonic()
    print(json.dumps({"util_ms": (t1 - t0) * 1e3, "info_ms": (t2 - t1) * 1e3,
                      "util_n": len(old), "info_n": len(new)}))
    """,
)


@needs_cuda_python
@pytest.mark.parametrize("knob", ["", "60"])
def test_a_slow_nvml_query_takes_its_time(tmp_path: Path, knob: str) -> None:
    """GPUVISOR_SIM_NVML_UTIL_MS=60: both per-process utilisation queries
    take 60 ms (pynvml calls each twice: for the size, then the samples),
    and still answer (this process, its kernel seen); without the knob
    each takes well under that."""
    env = sim_env(tmp_path, "1x8g", GPUVISOR_SIM_NVML_UTIL_MS=knob)
    r = json.loads(ok(run_py(SLOW_QUERY, env)))
    assert r["util_n"] == 1, r
    assert r["info_n"] == 1, r
    for query in ("util_ms", "info_ms"):
        if knob:
            assert r[query] >= 60, r
        else:
            assert r[query] < 30, r


SLOW_LAUNCH = with_prelude(
    """
    s = chk(cu.cuStreamCreate(0))
    g = chk(cu.cuGraphCreate(0))
    p = cu.CUDA_KERNEL_NODE_PARAMS()
    p.func = spin
    p.gridDimX = p.gridDimY = p.gridDimZ = p.blockDimY = p.blockDimZ = 1
    p.blockDimX = 128
    p.kernelParams = spin_args(0)
    chk(cu.cuGraphAddKernelNode(g, None, 0, p))
    ge = chk(cu.cuGraphInstantiate(g, 0))
    t0 = time.monotonic()
    for _ in range(5):
        launch_spin(s, 0)
    t1 = time.monotonic()
    for _ in range(5):
        chk(cu.cuGraphLaunch(ge, s))
    t2 = time.monotonic()
    chk(cu.cuStreamSynchronize(s))
    print(json.dumps({"kernel_ms": (t1 - t0) * 200, "graph_ms": (t2 - t1) * 200}))
    """
)


@needs_cuda_python
def test_a_slow_driver_launch_takes_its_time(tmp_path: Path) -> None:
    """GPUVISOR_SIM_LAUNCH_US=20000: each launch call, of a kernel or a
    graph, takes 20 ms before it returns (the 0 us kernels take nothing);
    without the knob it takes well under a millisecond."""
    env = sim_env(tmp_path, "1x8g", GPUVISOR_SIM_LAUNCH_US="20000")
    slow = json.loads(ok(run_py(SLOW_LAUNCH, env)))
    assert slow["kernel_ms"] >= 20, slow
    assert slow["graph_ms"] >= 20, slow
    fast = json.loads(ok(run_py(SLOW_LAUNCH, sim_env(tmp_path, "1x8g"))))
    assert fast["kernel_ms"] < 10, fast
    assert fast["graph_ms"] < 10, fast


@needs_cuda_python
def test_a_launch_held_up_now_and_then(tmp_path: Path) -> None:
    """GPUVISOR_SIM_LAUNCH_EVERY=5 with GPUVISOR_SIM_LAUNCH_US=20000: only
    the 5th and 10th of the process's ten launch calls (five kernels, then
    five graphs) take the 20 ms, so each group of five takes 20 ms in all,
    4 ms a launch on average, not 20."""
    env = sim_env(tmp_path, "1x8g", GPUVISOR_SIM_LAUNCH_US="20000", GPUVISOR_SIM_LAUNCH_EVERY="5")
    got = json.loads(ok(run_py(SLOW_LAUNCH, env)))
    for kind in ("kernel_ms", "graph_ms"):
        assert 4 <= got[kind] < 10, got


@needs_cuda_python
def test_an_event_is_recorded_only_in_its_own_context(tmp_path: Path) -> None:
    """cuEventRecord: "hEvent and hStream must be from the same context
    otherwise CUDA_ERROR_INVALID_HANDLE is returned" (CUDA driver API).  The
    simulator recorded an event of one context on another context's stream
    (an explicit stream, or the legacy stream of the other current context)
    and answered CUDA_SUCCESS, so an interposer that records its timing
    events in the wrong context was never told.  Waiting on an event from
    another context stays allowed (cuStreamWaitEvent documents it)."""
    out = ok(
        run_py(
            with_prelude(
                """
            ctx2 = chk(cu.cuCtxCreate(None, 0, 0))      # now current
            s2 = chk(cu.cuStreamCreate(0))
            chk(cu.cuCtxSetCurrent(ctx))
            s1 = chk(cu.cuStreamCreate(0))
            e = chk(cu.cuEventCreate(0))
            res = {}
            res["own"] = int(cu.cuEventRecord(e, s1)[0])
            res["other_stream"] = int(cu.cuEventRecord(e, s2)[0])
            res["other_stream_flags"] = int(cu.cuEventRecordWithFlags(e, s2, 0)[0])
            chk(cu.cuCtxSetCurrent(ctx2))
            res["other_legacy"] = int(cu.cuEventRecord(e, 0)[0])
            res["other_per_thread"] = int(cu.cuEventRecord(e, cu.CU_STREAM_PER_THREAD)[0])
            res["wait_other"] = int(cu.cuStreamWaitEvent(s2, e, 0)[0])
            chk(cu.cuCtxSetCurrent(ctx))
            res["own_legacy"] = int(cu.cuEventRecord(e, 0)[0])
            chk(cu.cuEventSynchronize(e))
            print(json.dumps(res))
            """
            ),
            sim_env(tmp_path, "1x8g"),
        )
    )
    r = json.loads(out.splitlines()[-1])
    bad = 400  # CUDA_ERROR_INVALID_HANDLE
    assert r == {
        "own": 0,
        "other_stream": bad,
        "other_stream_flags": bad,
        "other_legacy": bad,
        "other_per_thread": bad,
        "wait_other": 0,
        "own_legacy": 0,
    }, r


@needs_cuda_python
def test_last_seen_selects_every_sample_with_a_greater_timestamp(tmp_path: Path) -> None:
    """NVML returns "only samples with timestamp greater than
    lastSeenTimeStamp".  The simulator added 1 ms to lastSeenTimeStamp
    (against jitter in its clock offset), so a sample stamped less than
    1 ms after it was left out: asking from just before the newest
    sample's timestamp found nothing (NVML_ERROR_NOT_FOUND) while that
    sample was busy.  Handing back the timestamp itself must still leave
    its sample out."""
    out = ok(
        run_py(
            with_prelude(
                """
            import os
            import pynvml as n
            n.nvmlInit()
            h = n.nvmlDeviceGetHandleByIndex(0)
            me = os.getpid()
            s = chk(cu.cuStreamCreate(0))
            launch_spin(s, 3_000_000)           # busy for 3 s
            time.sleep(0.35)
            def mine(fn, since):
                try:
                    return [x.timeStamp for x in fn(h, since) if x.pid == me]
                except n.NVMLError_NotFound:
                    return []
            res = []
            for fn in (n.nvmlDeviceGetProcessUtilization, n.nvmlDeviceGetProcessesUtilizationInfo):
                for _ in range(5):
                    t = max(mine(fn, 0))
                    got = {d: mine(fn, t - d) for d in (0, 1, 500, 999)}
                    if max(mine(fn, 0)) == t:   # no sample completed meanwhile
                        break
                res.append({"t": t, "got": got})
            print(json.dumps(res))
            """
            ),
            sim_env(tmp_path, "1x8g"),
        )
    )
    for r in json.loads(out.splitlines()[-1]):
        t, got = r["t"], r["got"]
        assert got["0"] == [], r  # the sample handed back is not newer than itself
        for d in ("1", "500", "999"):
            assert got[d] == [t], r
