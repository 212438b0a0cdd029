"""SM-quota benchmark (make bench-sm): how closely CUDA_DEVICE_SM_LIMIT holds.

Everything runs on the simulated driver, whose kernel timeline runs one
kernel at a time per device across every process of the node and reports
per-process utilisation through NVML.  Each scenario gets a fresh directory
(simulator state, one region file per container).  The workload is
build/bench/bench_sm_worker (native/tests/bench_sm_worker.c): saturating
launches of `spin` kernels of 20 us to 5 ms, log-uniform, random grid sizes,
~10 % cuLaunchKernelEx and ~10 % graph launches.  A sampler process reads
nvmlDeviceGetProcessUtilization once per 100 ms sample of the simulator's
grid (lastSeenTimeStamp = the end of the previous sample), so every
container gets a series of 100 ms windows: the sum of its processes' smUtil.

Run as `python -m tests.bench.sm_bench [--write docs/benchmarks.md]`; the
per-launch cost table comes from `build/bench/bench_launch --sm-cost`
(native/tests/bench_launch.c), given --launch-args (make bench-sm passes
LIBRARY there: docs/benchmarks.md).  `--quick` is the smoke test's tiny
configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

from tests.bench.machine import cpu_model
from tests.bench.sm_floor import (
    ALLOWANCE,
    PAIR_PROCS,
    PROCS,
    QUOTAS,
    SECONDS,
    SPLITS,
    Floor,
    floor,
    runs_within,
    same_launches,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD = REPO_ROOT / "build"
LIBRARY = BUILD / "libgpuvisor.so"
SIM_DIR = BUILD / "sim"
WORKER = BUILD / "bench" / "bench_sm_worker"
LAUNCH_BENCH = BUILD / "bench" / "bench_launch"
STALL_PROBE = BUILD / "bench" / "bench_stall_probe"

ACCURACY = "## SM quota: accuracy (make bench-sm)"
COST = "## SM quota: per-launch cost (make bench-sm)"

SAMPLE_NS = 100_000_000
GOAL_ERROR = 2.0  # points, achieved share
GOAL_SETTLE = 1.0  # seconds
GOAL_WINDOW = 5.0  # points, every 100 ms window
ROLLING = 5  # windows: the 500 ms rolling mean of the settling rule
STALL_NS = 2_000_000  # a machine stall this long can be what a window misses
STALL_BEFORE_NS = 10_000_000  # ... also when it ended this soon before the window

_SCRUBBED_PREFIXES = ("CUDA_", "GPUVISOR_", "LIBCUDA_", "NVIDIA_")


# --- the sampler (a child process: it needs the simulator's NVML) ----------

SAMPLER = r"""
import json, sys, time
import pynvml as n
from gpuvisor.supervisor.agent.metrics import process_samples
S = 100_000_000
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
windows = int(sys.argv[1])
print("ready", flush=True)
t_go = int(sys.stdin.readline())
prev = t_go                                  # end of the last sample read (monotonic ns)
last_ts = 0                                  # NVML's newest sample timestamp read (us)
end = t_go + windows * S
out = []
while prev < end:
    wake = prev + S + 30_000_000             # 30 ms after the next sample completes
    d = wake - time.monotonic_ns()
    if d > 0:
        time.sleep(d / 1e9)
    off = time.time_ns() - time.monotonic_ns()
    before = time.monotonic_ns()
    # From NVML's own timestamp of the last sample read, as NVML means
    # lastSeenTimeStamp: the end of the previous sample by this process's
    # clock may lie a few us before that stamp, and then the previous
    # sample is read again, averaged into this window.
    seen = last_ts or (prev + off) // 1000
    try:
        got = process_samples(n, h, seen)        # asked again if samples grew meanwhile
    except n.NVMLError:
        got = []
    if got:
        newest = max(s.timeStamp for s in got)
        hi = (newest * 1000 - off + S // 2) // S * S
    else:
        hi = before // S * S
    if hi <= prev:
        continue
    out.append([prev - t_go, hi - t_go, {str(s.pid): s.smUtil for s in got}])
    prev = hi
    last_ts = newest if got else (hi + off) // 1000
print(json.dumps(out), flush=True)
"""


def clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_SCRUBBED_PREFIXES) and k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Container:
    name: str
    limit: int
    procs: int
    policy: str = "fixed-share"
    phase_ms: int = 0  # > 0: idle/busy phases of this length, idle first
    # > 0: the PyTorch worker's shape instead (fixed kernels of this many us,
    # batches of 3, an event each, waiting on the batch before last;
    # bench_sm_worker.c); its report then has the completion marks
    kernel_us: int = 0
    jitter: int = 0  # with kernel_us: each kernel uniform within +-jitter % of it
    batch: int = 3  # with kernel_us: kernels per batch
    pids: list[int] = field(default_factory=list)
    series: list[float] = field(default_factory=list)
    # each process's report (JSON); a batch worker's has its "marks" too
    reports: list[dict[str, Any]] = field(default_factory=list)
    # the scenario's machine stalls: (start, length) in ns from the common start
    stalls: list[tuple[int, int]] = field(default_factory=list)


# GPUVISOR_SIM_TIMESLICE_US for every scenario (--timeslice-us; 0: the
# launch-order timeline)
TIMESLICE_US = 0
# More simulator settings for every scenario (sm_shared.py --sim-env), e.g.
# GPUVISOR_SIM_NVML_SAMPLE_MS=200 as an H200 samples
SIM_ENV: dict[str, str] = {}


def node_env(tmp: Path) -> dict[str, str]:
    env = clean_env()
    if TIMESLICE_US:
        env["GPUVISOR_SIM_TIMESLICE_US"] = str(TIMESLICE_US)
    env.update(SIM_ENV)
    env.update(
        {
            "LD_LIBRARY_PATH": str(SIM_DIR),
            "GPUVISOR_SIM_STATE": str(tmp / "sim.state"),
            "GPUVISOR_SIM_DEVICES": "1x80g",
            # The node directory every container shares (HAMi mounts the
            # host's /tmp/vgpulock): the node lock and the launch order.
            "GPUVISOR_NODE_LOCK": str(tmp / "gpuvisor.lock"),
        }
    )
    return env


# (scenario, share of all CPU time the hypervisor took while it ran), in
# the order the scenarios ran: on a virtual machine whose host is busy, the
# launching processes stall for tens of milliseconds and windows show it.
STEAL: list[tuple[str, float]] = []


@dataclass
class Stalls:
    """What bench_stall_probe saw while one scenario ran."""

    label: str
    fifo: bool  # the probe threads ran SCHED_FIFO (else their lateness counts our load)
    spans: list[tuple[int, int]]  # (start, length) ns from the scenario's start


# Per scenario, in the order they ran.
STALLS: list[Stalls] = []


def start_probe(end_ns: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(STALL_PROBE), str(end_ns)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def probe_result(label: str, probe: subprocess.Popen[str], t_go: int) -> Stalls:
    out, err = probe.communicate(timeout=60)
    if probe.returncode != 0:
        raise RuntimeError(f"{STALL_PROBE} failed ({probe.returncode}): {err}")
    raw = json.loads(out.strip().splitlines()[-1])
    spans = sorted((int(at) - t_go, int(late)) for _, at, late in raw["stalls"])
    return Stalls(label, bool(raw["fifo"]), spans)


def longest_stall(spans: Sequence[tuple[int, int]], k: int) -> int:
    """The longest machine stall (ns) overlapping window k or ending less
    than STALL_BEFORE_NS before it (the device drains while the launchers
    cannot run, and the container makes the time up only at its share)."""
    lo, hi = k * SAMPLE_NS - STALL_BEFORE_NS, (k + 1) * SAMPLE_NS
    return max((n for at, n in spans if at < hi and at + n > lo), default=0)


def cpu_steal(before: Sequence[float], after: Sequence[float]) -> float:
    """The share of all CPU time between two psutil.cpu_times() readings
    that was stolen (Linux's `steal`: time the hypervisor ran something else)."""
    total = sum(after) - sum(before)
    stolen = getattr(after, "steal", 0.0) - getattr(before, "steal", 0.0)
    return stolen / total if total > 0 else 0.0


def run_scenario(containers: Sequence[Container], seconds: float, seed: int) -> int:
    """Run the containers together for `seconds` from a common start on a
    100 ms sample boundary; fill each container's 100 ms series.  Returns
    how many sampler reads covered more than one 100 ms sample; notes the
    CPU time stolen meanwhile in STEAL."""
    label = ":".join(f"{c.limit}x{c.procs}" for c in containers)
    times0 = psutil.cpu_times()
    with tempfile.TemporaryDirectory(prefix="gvbench-sm.") as d:
        tmp = Path(d)
        env = node_env(tmp)
        workers: list[tuple[Container, subprocess.Popen[str]]] = []
        try:
            for c in containers:
                cenv = dict(env)
                cenv.update(
                    {
                        "LD_PRELOAD": str(LIBRARY),
                        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp / f"{c.name}.shr"),
                        "CUDA_DEVICE_SM_LIMIT": str(c.limit),
                        "GPUVISOR_SM_POLICY": c.policy,
                    }
                )
                for i in range(c.procs):
                    args = [str(WORKER), f"{seconds + 0.3:.3f}", str(seed * 100 + len(workers))]
                    if c.phase_ms or c.kernel_us:
                        args.append(str(c.phase_ms))
                    if c.kernel_us:
                        args.append(f"{c.kernel_us}:{c.jitter}x{c.batch}")
                    p = subprocess.Popen(
                        args,
                        env=cenv,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                    workers.append((c, p))
                    del i
            windows = round(seconds * 1e9 / SAMPLE_NS)
            sampler = subprocess.Popen(
                [sys.executable, "-c", SAMPLER, str(windows)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _, p in [*workers, (None, sampler)]:
                assert p.stdout is not None
                line = p.stdout.readline()
                if line.strip() != "ready":
                    err = p.stderr.read() if p.stderr else ""
                    raise RuntimeError(f"a benchmark process failed to start: {line}{err}")
            # Start on a sample boundary, at least 50 ms from now.
            t_go = (time.monotonic_ns() + 50_000_000) // SAMPLE_NS * SAMPLE_NS + SAMPLE_NS
            probe = start_probe(t_go + int((seconds + 0.3) * 1e9))
            assert sampler.stdin is not None
            sampler.stdin.write(f"{t_go}\n")
            sampler.stdin.flush()
            time.sleep(max(0.0, (t_go - time.monotonic_ns()) / 1e9))
            for _, p in workers:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            reports = []
            for c, p in workers:
                out, err = p.communicate(timeout=seconds + 60)
                if p.returncode != 0:
                    raise RuntimeError(f"worker of {c.name} failed ({p.returncode}): {out}{err}")
                rep = json.loads(out.strip().splitlines()[-1])
                c.pids.append(int(rep["pid"]))
                c.reports.append(rep)
                reports.append(rep)
            out, err = sampler.communicate(timeout=60)
            if sampler.returncode != 0:
                raise RuntimeError(f"sampler failed: {err}")
            stalls = probe_result(label, probe, t_go)
        finally:
            for _, p in workers:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        raw = json.loads(out.strip().splitlines()[-1])
        late = max(abs(r["t0_ns"] - t_go) for r in reports)
        if late > 20_000_000:
            print(f"sm_bench: a worker started {late / 1e6:.1f} ms late", file=sys.stderr)
        merged = 0
        for c in containers:
            c.series = [0.0] * windows
        for lo, hi, util in raw:
            k0, k1 = lo // SAMPLE_NS, hi // SAMPLE_NS
            if k1 - k0 > 1:
                merged += 1
            for c in containers:
                v = float(sum(util.get(str(pid), 0) for pid in c.pids))
                for k in range(k0, min(k1, windows)):
                    c.series[k] = v
        STEAL.append((label, cpu_steal(times0, psutil.cpu_times())))
        STALLS.append(stalls)
        for c in containers:
            c.stalls = stalls.spans
        return merged


# --- analysis ----------------------------------------------------------------


def settling(series: Sequence[float], target: float) -> float | None:
    """Seconds from the start until the 500 ms rolling mean stays within
    +-GOAL_ERROR points of target to the end of the run (None: never)."""
    last_bad = -1
    for k in range(len(series)):
        win = series[max(0, k + 1 - ROLLING) : k + 1]
        if abs(sum(win) / len(win) - target) > GOAL_ERROR:
            last_bad = k
    if last_bad == len(series) - 1:
        return None
    return (last_bad + 2) * SAMPLE_NS / 1e9  # end of the first good window


@dataclass
class Accuracy:
    target: float
    achieved: float
    settle: float | None
    measured_s: float
    worst: float  # signed: the window furthest from target, minus target
    sd: float  # standard deviation of the windows from target, points
    label: str = ""
    # windows beyond +-GOAL_WINDOW: (window, points from target, longest
    # machine stall in or just before it, ns)
    misses: list[tuple[int, float, int]] = field(default_factory=list)

    @property
    def error(self) -> float:
        return self.achieved - self.target


def accuracy(
    series: Sequence[float],
    target: float,
    allowance: float,
    stalls: Sequence[tuple[int, int]] = (),
) -> Accuracy:
    settle = settling(series, target)
    # A fixed window: starting it at the settling time instead would pick,
    # by the settling rule's own definition, the tail that looks good.
    k0 = round(allowance * 1e9 / SAMPLE_NS)
    if k0 >= len(series):
        k0 = 0
    part = list(series[k0:])
    misses = [
        (k, series[k] - target, longest_stall(stalls, k))
        for k in range(k0, len(series))
        if abs(series[k] - target) > GOAL_WINDOW
    ]
    worst = max(part, key=lambda v: abs(v - target)) - target
    sd = (sum((v - target) ** 2 for v in part) / len(part)) ** 0.5
    return Accuracy(
        target=target,
        achieved=sum(part) / len(part),
        settle=settle,
        measured_s=len(part) * SAMPLE_NS / 1e9,
        worst=worst,
        sd=sd,
        misses=misses,
    )


def fmt_settle(s: float | None) -> str:
    return "never" if s is None else f"{s:.1f} s"


def ideal(same: Floor, fl: Floor) -> str:
    """A table cell: the ideal scheduler's window sd / worst on the run's own
    launches; then over the model runs: sd / worst (mean, largest)."""
    return f"{same.sd:.1f} / {same.worst:.1f}; {fl.sd:.1f} / {fl.worst:.1f} ({fl.worst_max:.1f})"


def short_graph_floors(
    quotas: Sequence[int],
    procs: Sequence[int],
    splits: Sequence[tuple[int, int]],
    seconds: float,
    allowance: float,
) -> list[Floor]:
    """The ideal scheduler on every fixed-share scenario of this run, with
    graphs as long as one kernel (sm_floor's short_graphs)."""
    out: list[Floor] = []
    for q, n in zip(quotas, procs, strict=True):
        out += floor([q], [n], seconds, allowance, short_graphs=True)
    for qa, qb in splits:
        out += floor([qa, qb], [*PAIR_PROCS], seconds, allowance, short_graphs=True)
    return out


def single_container(
    quotas: Sequence[int], procs: Sequence[int], seconds: float, allowance: float
) -> tuple[list[str], list[Accuracy], int, list[Floor], list[Floor]]:
    rows, results, merged, floors, sames = [], [], 0, [], []
    for i, (q, n) in enumerate(zip(quotas, procs, strict=True)):
        c = Container("c", q, n)
        merged += run_scenario([c], seconds, seed=i + 1)
        same = same_launches([q], [n], seconds, allowance, seed=i + 1)
        sames += same
        a = accuracy(c.series, q, allowance, c.stalls)
        a.label = f"one container {q} %"
        results.append(a)
        launches = sum(r["launch_kernel"] + r["launch_ex"] + r["graph_launch"] for r in c.reports)
        graphs = sum(r["graph_launch"] for r in c.reports)
        ok = (
            abs(a.error) <= GOAL_ERROR
            and abs(a.worst) <= GOAL_WINDOW
            and (a.settle is not None and a.settle <= GOAL_SETTLE)
        )
        fl = floor([q], [n], seconds, allowance)
        floors += fl
        rows.append(
            f"| {q} % | {n} | {launches} ({graphs} graph) | {a.achieved:.2f} % | "
            f"{a.error:+.2f} | {fmt_settle(a.settle)} | {a.measured_s:.1f} s | "
            f"{a.worst:+.0f} | {a.sd:.1f} | {ideal(same[0], fl[0])} | {'yes' if ok else 'no'} |"
        )
        print(rows[-1], file=sys.stderr)
    return rows, results, merged, floors, sames


def two_fixed(
    splits: Sequence[tuple[int, int]], seconds: float, allowance: float
) -> tuple[list[str], list[Accuracy], int, list[Floor], list[Floor]]:
    rows, results, merged, floors, sames = [], [], 0, [], []
    for i, (qa, qb) in enumerate(splits):
        a, b = Container("a", qa, PAIR_PROCS[0]), Container("b", qb, PAIR_PROCS[1])
        merged += run_scenario([a, b], seconds, seed=50 + i)
        fl = floor([qa, qb], [*PAIR_PROCS], seconds, allowance)
        floors += fl
        same = same_launches([qa, qb], [*PAIR_PROCS], seconds, allowance, seed=50 + i)
        sames += same
        cells = []
        for c, f, sf in zip((a, b), fl, same, strict=True):
            r = accuracy(c.series, c.limit, allowance, c.stalls)
            r.label = f"{qa}:{qb} {c.name.upper()}"
            results.append(r)
            cells.append(
                f"{r.achieved:.2f} % ({r.error:+.2f}) | {fmt_settle(r.settle)} | {r.worst:+.0f} "
                f"| {r.sd:.1f} | {ideal(sf, f)}"
            )
        rows.append(f"| {qa}:{qb} | {cells[0]} | {cells[1]} |")
        print(rows[-1], file=sys.stderr)
        print(
            f"{qa}:{qb} throughput (share of the unlimited device) "
            f"A {throughput(a):.1f} % B {throughput(b):.1f} %",
            file=sys.stderr,
        )
    return rows, results, merged, floors, sames


def throughput(c: Container) -> float:
    """The container's share of the unlimited device, in %: the GPU time of
    the kernels its processes completed over their wall time (the worker
    synchronizes before it reports), whatever NVML or the meters say."""
    return 100 * sum(float(r["gpu_us"]) / 1e6 / float(r["wall_s"]) for r in c.reports)


def mean(v: Sequence[float]) -> float:
    return sum(v) / len(v) if v else float("nan")


def two_burst(
    splits: Sequence[tuple[int, int]], seconds: float, phase_ms: int
) -> tuple[list[str], list[float], int]:
    """A saturates; B is idle and busy in turn (phase_ms each, idle first).
    Per B-busy phase: A's and B's mean share, and how long until A is back
    within its quota + 5 points (first window at or under it, measured at the
    window's end) and B at its quota - 5.  Per B-idle phase (not the first,
    when A starts too): A's mean share."""
    rows, backs, merged = [], [], 0
    per = phase_ms * 1_000_000 // SAMPLE_NS
    for i, (qa, qb) in enumerate(splits):
        a = Container("a", qa, 1, policy="burst-share")
        b = Container("b", qb, 1, policy="burst-share", phase_ms=phase_ms)
        merged += run_scenario([a, b], seconds, seed=80 + i)
        n = len(a.series)
        busy_a, busy_b, idle_a, back_a, back_b = [], [], [], [], []
        for p0 in range(per, n - per + 1, per):
            phase = range(p0, p0 + per)
            if (p0 // per) % 2 == 1:  # B busy
                busy_a += [a.series[k] for k in phase]
                busy_b += [b.series[k] for k in phase]
                ka = next((k for k in phase if a.series[k] <= qa + GOAL_WINDOW), None)
                kb = next((k for k in phase if b.series[k] >= qb - GOAL_WINDOW), None)
                back_a.append(float("inf") if ka is None else (ka - p0 + 1) * SAMPLE_NS / 1e9)
                back_b.append(float("inf") if kb is None else (kb - p0 + 1) * SAMPLE_NS / 1e9)
            else:
                idle_a += [a.series[k] for k in phase]
        backs += back_a

        def span(v: Sequence[float]) -> str:
            def one(x: float) -> str:
                return f"> {phase_ms / 1000:.1f} s" if x == float("inf") else f"{x:.1f} s"

            return f"{one(mean(v))} / {one(max(v))}" if v else "-"

        rows.append(
            f"| {qa}:{qb} | {mean(busy_a):.1f} % | {mean(busy_b):.1f} % | {mean(idle_a):.1f} % "
            f"| {span(back_a)} | {span(back_b)} | {len(back_a)} |"
        )
        print(rows[-1], file=sys.stderr)
    return rows, backs, merged


def two_lenders(
    splits: Sequence[tuple[int, int]], seconds: float, allowance: float
) -> tuple[list[str], list[tuple[str, float]], int]:
    """A and B, both burst-share, both saturating: each should get its
    quota plus the spare capacity's part in proportion to the quotas, i.e.
    100 x quota / (sum of the quotas).  Per split: the expected and the
    achieved shares (mean of the windows after the allowance), the device's
    idle time and the windows' standard deviations; with (label, error)
    for the goal line."""
    rows, errors, merged = [], [], 0
    skip = round(allowance * 1e9 / SAMPLE_NS)
    for i, (qa, qb) in enumerate(splits):
        a = Container("a", qa, 1, policy="burst-share")
        b = Container("b", qb, 1, policy="burst-share")
        merged += run_scenario([a, b], seconds, seed=90 + i)
        cells = []
        for c in (a, b):
            want = 100 * c.limit / (qa + qb)
            v = c.series[skip:]
            got = mean(v)
            sd = (sum((x - got) ** 2 for x in v) / len(v)) ** 0.5 if v else 0.0
            errors.append((f"{qa}:{qb} {c.name.upper()}", got - want))
            cells.append(f"{want:.1f} % | {got:.2f} % ({got - want:+.2f}) | {sd:.1f}")
        idle = 100 - mean(a.series[skip:]) - mean(b.series[skip:])
        rows.append(f"| {qa}:{qb} | {cells[0]} | {cells[1]} | {idle:.1f} % |")
        print(rows[-1], file=sys.stderr)
    return rows, errors, merged


# --- the document ------------------------------------------------------------


def machine() -> str:
    model = cpu_model("unknown CPU")
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"Machine: {os.cpu_count()} CPUs, {model}; Linux {platform.release()}; {date}."


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def render_accuracy(args: argparse.Namespace) -> str:
    quotas = [int(q) for q in args.quotas.split(",")]
    procs = [int(p) for p in args.procs.split(",")]
    procs = (procs * len(quotas))[: len(quotas)]
    splits = [tuple(int(x) for x in s.split(":")) for s in args.splits.split(",")]
    splits2 = [(s[0], s[1]) for s in splits]
    t0 = time.monotonic()
    STEAL.clear()
    STALLS.clear()
    single_rows, single, m1, floors1, same1 = single_container(
        quotas, procs, args.seconds, args.allowance
    )
    fixed_rows, fixed, m2, floors2, same2 = two_fixed(splits2, args.seconds, args.allowance)
    burst_rows, backs, m3 = two_burst(splits2, args.burst_seconds, args.phase_ms)
    lender_splits = [tuple(int(x) for x in s.split(":")) for s in args.lender_splits.split(",")]
    lender_rows, lender_errors, m4 = two_lenders(
        [(s[0], s[1]) for s in lender_splits], args.seconds, args.allowance
    )
    took = time.monotonic() - t0
    merged = m1 + m2 + m3 + m4

    out = [ACCURACY, ""]
    out.append(
        "How closely `CUDA_DEVICE_SM_LIMIT` holds, measured on the simulated device's kernel "
        "timeline (one kernel at a time per device, in launch order across all processes; see "
        "docs/simulator.md). Each scenario runs in a fresh directory (simulator state, one "
        "region file per container). Workload: `build/bench/bench_sm_worker` "
        "(`native/tests/bench_sm_worker.c`, linked with `-lcuda`, `libgpuvisor.so` preloaded), "
        "which always has work queued: `spin` kernels of 20 us to 5 ms (log-uniform), grid "
        "sizes random and independent of the duration, three modules' `spin` picked at random, "
        "about 80 % `cuLaunchKernel`, 10 % `cuLaunchKernelEx` and 10 % `cuGraphLaunch` of eight "
        "graphs of 1-4 such kernels, back to back on one stream. All processes start together "
        "on a 100 ms boundary of the simulator's sample grid. A sampler reads "
        "`nvmlDeviceGetProcessUtilization` once per 100 ms sample, with `lastSeenTimeStamp` = "
        "the end of the previous sample, so a container's share in each 100 ms window is the "
        "sum of its processes' `smUtil` (whole percents, per process)."
    )
    out.append("")
    out.append(
        f"Definitions. *Settling time*: from the start until the 500 ms rolling mean of the "
        f"100 ms windows (fewer windows before 0.5 s) is within +-{GOAL_ERROR:.0f} points of "
        f"the target and stays there to the end of the run; reported at the end of the first "
        f"window from which that holds. *Achieved*: the mean of the 100 ms windows from "
        f"{args.allowance:g} s (the settling allowance) to the end of the {args.seconds:g} s "
        f"run (the *measured* column), whatever the settling time: starting it at the settling "
        f"time instead would keep, by that rule's own definition, only a tail that looks good. "
        f"*Worst window*: the 100 ms window of that interval furthest from the target, in "
        f"points; *window sd*: the standard deviation of those windows from the target. "
        f"*Ideal scheduler*: the same figures for a model of a perfect scheduler on the same "
        f"workload (`tests/bench/sm_floor.py`: it knows the exact length of every kernel and "
        f"graph that has run and reacts at once, starts the next one of the container "
        f"furthest behind its quota, never preempts, and, like any real scheduler, does not "
        f"know a kernel's length before running it). The model draws the launches with the "
        f"worker's own generator and seeds, so it is given first on the very launches of "
        f"the run (window sd / worst window; each process's launches in their order, a "
        f"container's processes taking turns), then over 20 model runs of the same length "
        f"with other seeds (window sd / worst window as the mean, the largest of the 20 in "
        f"brackets); NVML's rounding to whole percents is not modelled. It is a reference "
        f"for what the workload allows, not a measurement. Runs were {args.seconds:.0f} s "
        f"per scenario ({args.burst_seconds:.0f} s for burst-share); the whole benchmark took "
        f"{took:.0f} s. Sampler reads that covered more than one 100 ms sample (a late read: "
        f"the windows it covers get its average): {merged}."
    )
    out.append("")
    out.append(machine() + "  ")
    out.append(
        f"Command: `make bench-sm` (`python -m tests.bench.sm_bench --quotas {args.quotas} "
        f"--procs {args.procs} --splits {args.splits} --seconds {args.seconds:g} "
        f"--burst-seconds {args.burst_seconds:g} --phase-ms {args.phase_ms}`)."
    )
    out.append("")
    out.append("### One container, fixed-share")
    out.append("")
    out.append(
        "| quota | processes | launches (graph launches) | achieved | error (points) "
        "| settling | measured | worst 100 ms window (points) | window sd (points) "
        "| ideal scheduler: same launches; 20 other runs | all goals |"
    )
    out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    out += single_rows
    out.append("")
    out.append("### Two containers, fixed-share")
    out.append("")
    out.append(
        f"Containers A ({PAIR_PROCS[0]} process) and B ({PAIR_PROCS[1]} processes), own region "
        "files, both saturating. "
        "Cells: achieved (error), settling, worst 100 ms window (points from quota), the "
        "windows' standard deviation from the quota, and the ideal scheduler's figures "
        "(same launches; 20 other runs)."
    )
    out.append("")
    out.append(
        "| A:B quota | A achieved (error) | A settling | A worst | A sd | A ideal "
        "| B achieved (error) | B settling | B worst | B sd | B ideal |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    out += fixed_rows
    out.append("")
    out.append("### Two containers, burst-share, B idle half the time")
    out.append("")
    out.append(
        f"Both containers burst-share with the given quotas. A (1 process) always has work; "
        f"B (1 process) alternates idle and busy phases of {args.phase_ms} ms, idle first "
        f"(A starts alone). The first idle phase is left out. *Back*: from the start of "
        f"each B-busy phase to the end of the first 100 ms window with A at most its quota "
        f"+ 5 points (B at least its quota - 5), mean / worst over the busy phases; "
        f'"> {args.phase_ms / 1000:.1f} s" if not within the phase.'
    )
    out.append("")
    out.append(
        "| A:B quota | A while B busy | B while busy | A while B idles | A back to quota+5 "
        "| B up to quota-5 | busy phases |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|")
    out += burst_rows
    out.append("")
    out.append("### Two containers, burst-share, both busy")
    out.append("")
    out.append(
        "Both containers burst-share and saturating (1 process each), so each wants more than "
        "its quota: each should get its quota plus a part of the spare capacity in proportion "
        "to the quotas, 100 x quota / (sum of the quotas) in all (docs/interposer.md, "
        "Policies). Cells: expected, achieved (difference in points) over the windows from "
        f"{args.allowance:.0f} s to the end, the windows' standard deviation from their mean; "
        "and the time the device idled."
    )
    out.append("")
    out.append(
        "| A:B quota | A expected | A achieved | A sd | B expected | B achieved | B sd "
        "| device idle |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    out += lender_rows
    out.append("")

    every = single + fixed
    err_max = max(abs(a.error) for a in every)
    settles = [a.settle for a in every]
    settle_ok = all(s is not None and s <= GOAL_SETTLE for s in settles)
    settle_max = max((s if s is not None else float("inf")) for s in settles)
    win_max = max(abs(a.worst) for a in every)
    bad_err = [f"{a.label} ({a.error:+.2f})" for a in every if abs(a.error) > GOAL_ERROR]
    bad_win = [f"{a.label} ({a.worst:+.0f})" for a in every if abs(a.worst) > GOAL_WINDOW]
    out.append("Goals (one container and fixed-share pairs):")
    out.append("")
    out.append(
        f"- |error| <= {GOAL_ERROR:.0f} points at every quota: {verdict(not bad_err)} "
        f"(largest {err_max:.2f}{'; missed at ' + ', '.join(bad_err) if bad_err else ''})."
    )
    out.append(
        f"- Settling <= {GOAL_SETTLE:.0f} s: {verdict(settle_ok)} (slowest "
        f"{'never settled' if settle_max == float('inf') else f'{settle_max:.1f} s'})."
    )
    out.append(
        f"- Every 100 ms window within +-{GOAL_WINDOW:.0f} points: {verdict(not bad_win)} "
        f"(worst {win_max:.0f}{'; missed at ' + ', '.join(bad_win) if bad_win else ''})."
    )
    model_ok = runs_within([*floors1, *floors2], GOAL_WINDOW)
    model_runs = min(len(f.worsts) for f in [*floors1, *floors2])
    short_ok = runs_within(
        short_graph_floors(quotas, procs, splits2, args.seconds, args.allowance), GOAL_WINDOW
    )
    sames = [*same1, *same2]
    same_bad = [
        f"{a.label} ({f.worst:.1f})"
        for a, f in zip(every, sames, strict=True)
        if f.worst > GOAL_WINDOW
    ]
    out.append(
        f"  For reference, the ideal scheduler on this run's own launches: worst window "
        f"{max(f.worst for f in sames):.1f} points"
        + (f" (beyond +-{GOAL_WINDOW:.0f} at {', '.join(same_bad)})" if same_bad else "")
        + f". Over {model_runs} model runs with other seeds it kept every window of all these "
        f"scenarios within +-{GOAL_WINDOW:.0f} points in {model_ok}; with graphs as long as "
        f"one kernel (no launch over 5 ms) in {short_ok}."
    )
    misses = [(a.label, k, dev, st) for a in every for k, dev, st in a.misses]
    if misses:
        calm = [f"{label} ({dev:+.0f})" for label, _, dev, st in misses if st < STALL_NS]
        out.append(
            f"  Windows beyond +-{GOAL_WINDOW:.0f} points: {len(misses)}; in "
            f"{len(misses) - len(calm)} of them a CPU of this machine stalled for "
            f"{STALL_NS / 1e6:.0f} ms or more (next item) within the window or the "
            f"{STALL_BEFORE_NS / 1e6:.0f} ms before it"
            + (f"; with no such stall: {', '.join(calm)}." if calm else ".")
            + " Each miss, window (s from the start): points, longest stall: "
            + ", ".join(
                f"{label} {k * SAMPLE_NS / 1e9:.1f} s: {dev:+.0f}, {st / 1e6:.1f} ms"
                for label, k, dev, st in misses
            )
            + "."
        )
    if STALLS:
        fifo = all(x.fifo for x in STALLS)
        out.append(
            "- Machine stalls while each scenario ran, quota x processes: wake-ups of "
            f"`build/bench/bench_stall_probe` (`native/tests/bench_stall_probe.c`: one "
            f"{'SCHED_FIFO' if fifo else 'SCHED_OTHER (SCHED_FIFO was refused)'} thread pinned to "
            "each CPU, woken every 250 us) 1 ms or more late, count (longest): "
            + ", ".join(
                f"{x.label} {len(x.spans)} ({max((n for _, n in x.spans), default=0) / 1e6:.1f} ms)"
                for x in STALLS
            )
            + ". "
            + (
                "A thread the kernel may run at once is that late only when its CPU was "
                "taken (the hypervisor, or kernel work that is not preempted); the launching "
                "processes and their meter threads wait at least as long, and the device "
                "drains meanwhile. A miss with no such stall near it is not the machine's "
                "doing (the launchers, being SCHED_OTHER, can still be held up by other "
                "threads, which these do not count)."
                if fifo
                else "These threads also waited for the benchmark's own processes."
            )
        )
    if STEAL:
        out.append(
            "- CPU time the hypervisor took (Linux `steal`) while each scenario ran, "
            "quota x processes: "
            + ", ".join(f"{label} {100 * share:.0f} %" for label, share in STEAL)
            + " (time in which the launching processes of a virtual machine cannot run)."
        )
    if lender_errors:
        worst_label, worst_err = max(lender_errors, key=lambda e: abs(e[1]))
        out.append(
            f"- Burst-share containers that both want more split the GPU in proportion to "
            f"their quotas, each within 2 points: {verdict(abs(worst_err) <= GOAL_ERROR)} "
            f"(furthest {worst_label}, {worst_err:+.2f})."
        )
    if backs:
        worst_back = max(backs)
        out.append(
            f"- Burst-share gives lent capacity back within 1 s (A at most quota + 5): "
            f"{verdict(worst_back <= 1.0)} (worst "
            f"{'not within the phase' if worst_back == float('inf') else f'{worst_back:.1f} s'})."
        )
    return "\n".join(out) + "\n"


def render_cost(args: argparse.Namespace) -> str:
    cmd = [str(LAUNCH_BENCH), "--sm-cost", *shlex.split(args.launch_args)]
    proc = subprocess.run(
        cmd, env=clean_env(), capture_output=True, text=True, timeout=600, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr}")
    text = proc.stdout
    if not text.startswith(COST + "\n"):
        raise RuntimeError(f"unexpected output of bench_launch: {text[:200]}")
    return text


def replace_section(doc: str, title: str, text: str) -> str:
    """doc with section `title` (up to the next "## " heading) replaced by text,
    or text appended."""
    lines = doc.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip("\n") == title), None)
    body = text if text.endswith("\n") else text + "\n"
    if start is None:
        head = doc if doc.endswith("\n") or not doc else doc + "\n"
        if head and not head.endswith("\n\n"):
            head += "\n"
        return head + body
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), None)
    tail = "".join(lines[end:]) if end is not None else ""
    return "".join(lines[:start]) + body + ("\n" + tail if tail else "")


def write_sections(path: Path, sections: Sequence[tuple[str, str]]) -> None:
    doc = path.read_text() if path.exists() else "# Benchmarks\n\n"
    for title, text in sections:
        doc = replace_section(doc, title, text)
    tmp = path.with_name(path.name + f".tmp.{os.getpid()}")
    tmp.write_text(doc)
    tmp.replace(path)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quotas", default=QUOTAS)
    p.add_argument("--procs", default=PROCS, help="processes per quota, in order")
    p.add_argument("--splits", default=SPLITS)
    p.add_argument("--seconds", type=float, default=SECONDS, help="run per scenario")
    p.add_argument("--allowance", type=float, default=ALLOWANCE, help="settling allowance (s)")
    p.add_argument("--burst-seconds", type=float, default=9.0)
    p.add_argument("--phase-ms", type=int, default=1000)
    p.add_argument("--lender-splits", default="30:30,20:40,10:50", help="burst-share pairs")
    p.add_argument(
        "--launch-args", default="", help="arguments for bench_launch --sm-cost (shell words)"
    )
    p.add_argument(
        "--timeslice-us",
        type=int,
        default=0,
        help="run every scenario in the simulator's time-slicing mode with this slice (us)",
    )
    p.add_argument("--quick", action="store_true", help="a tiny configuration (smoke test)")
    p.add_argument("--no-cost", action="store_true", help="skip the per-launch cost table")
    p.add_argument("--write", type=Path, help="replace this benchmark's sections of FILE")
    args = p.parse_args(argv)
    if args.quick:
        args.quotas, args.procs, args.splits = "50", "2", "30:70"
        args.seconds, args.allowance = 1.5, 0.5
        args.burst_seconds, args.phase_ms = 1.6, 400
        args.lender_splits = "20:40"
        args.launch_args = args.launch_args or "--batches 3 --iters 200 --callgrind 20"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    global TIMESLICE_US
    TIMESLICE_US = args.timeslice_us
    for f in (LIBRARY, WORKER, *(() if args.no_cost else (LAUNCH_BENCH,))):
        if not f.is_file():
            print(f"sm_bench: {f} is missing (run make bench-sm)", file=sys.stderr)
            return 2
    sections = [(ACCURACY, render_accuracy(args))]
    if not args.no_cost:
        sections.append((COST, render_cost(args)))
    for _, text in sections:
        sys.stdout.write(text + "\n")
    sys.stdout.flush()
    if args.write:
        write_sections(args.write, sections)
        print(f"sm_bench: wrote {len(sections)} section(s) of {args.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
