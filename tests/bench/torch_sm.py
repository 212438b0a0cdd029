"""SM quota on a real GPU with PyTorch (make bench-gpu; needs an NVIDIA GPU).

Each run starts worker processes: a PyTorch loop of square bf16 matrix
products (`torch.matmul(a, b, out=c)`) that records a CUDA event after every
batch (about --batch-ms of GPU work) and waits for the batch before last, so
at most two batches are queued, as a training loop that reads its loss two
steps late.  The worker notes when each batch finished (host clock).

Runs, for each size:
- no interposer (the reference throughput);
- the interposer preloaded with no limit (its overhead);
- the interposer with CUDA_DEVICE_SM_LIMIT = 25, 50, 75 (fixed-share);
then, at the first size:
- two containers at once (a region file each, one node directory):
  10:90, 30:70, 50:50;
- one container of two processes (one region file) at 50;
- containers with SM policies (--mixed): burst-share 30 alone (lends the
  idle GPU), beside fixed-share 50 (the lender takes the other 50 while
  the fixed-share one uses all of its share: docs/interposer.md, the
  split), best-effort 10 beside fixed-share 50 (the same), two
  burst-share 30 (50 each).

Columns:
- TFLOP/s and "% of unlimited": throughput over the measured window (after
  --warm), against the no-interposer run of the same size;
- NVML smUtil: nvmlDeviceGetProcessUtilization's samples of the worker's
  PID inside the window (mean, and sd across samples); NVML GPU util:
  nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES); SM MHz / W: the SM
  clock and power draw, read every 0.5 s.  NVML is read by this process,
  which does not load the interposer;
- metered %: the container's GPU time as its interposer measured it
  (gv_device_get_sm_usage), over the window;
- 100 ms windows: each 100 ms of the worker's completion curve
  (interpolated between batches) as a percentage of the run's mean rate,
  so they show steadiness, not the level.

Under the tables, a line for each run of two workers (together_windows):
the first worker's part of both's work, mean and 100 ms windows (the
real-GPU analogue of bench-sm's window shares), and how steady both
together were (for one container of two processes, the container).

A closing line says how NVML's per-process query behaved (QueryLog): its
time per call, whether an answer holds one entry per process or one per
process and sample, and the step between a process's samples; the
simulator models each (GPUVISOR_SIM_NVML_UTIL_MS, _PER_SAMPLE, _SAMPLE_MS).

The quota is one of GPU time (docs/interposer.md), so NVML's figures are the
ones to hold against the limit.  Throughput can differ: a GPU kept below its
power limit runs its clocks higher (docs/benchmarks.md, "SM quota on a real
GPU").

Run as `python3 -m tests.bench.torch_sm [--lib build/libgpuvisor.so]
[--out DIR]` with a Python that has PyTorch and nvidia-ml-py.  It prints
Markdown tables and writes them, with every figure as JSON, to DIR.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

# A PyTorch worker's start, given n: n x n bf16 matrices a, b, c, three
# products to warm up, READY, then a line on stdin to begin (the parent
# starts every worker of a run at once).  tests/bench/torch_slice.py's
# workers start the same way.
MATRICES = r"""
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    torch.matmul(a, b, out=c)
torch.cuda.synchronize()
print("READY", flush=True)
sys.stdin.readline()
"""

WORKER = (
    r"""
import ctypes, json, os, sys, time
import torch
n, batch, warm, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
"""
    + MATRICES
    + r"""def meter():  # the container's GPU time as the interposer measured it (ns), or None
    try:
        f = ctypes.CDLL(None).gv_device_get_sm_usage
    except AttributeError:
        return None
    busy, waited, launches = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
    if f(0, ctypes.byref(busy), ctypes.byref(waited), ctypes.byref(launches)) != 0:
        return None
    return busy.value
queued = []
marks = []
metered = []
done = 0
t0 = time.monotonic()
w0 = time.time()
end = t0 + warm + seconds
while True:
    for _ in range(batch):
        torch.matmul(a, b, out=c)
    ev = torch.cuda.Event()
    ev.record()
    queued.append(ev)
    if len(queued) > 2:
        queued.pop(0).synchronize()
        done += batch
        now = time.monotonic()
        marks.append((now - t0, done))
        if len(metered) == 0 and now >= t0 + warm or len(metered) == 1 and now >= end:
            metered.append((now - t0, meter()))
        if now >= end:
            break
torch.cuda.synchronize()
print(json.dumps({"marks": marks, "wall0": w0, "pid": os.getpid(), "metered": metered}), flush=True)
"""
)


READY_TIMEOUT_S = 60.0
LABELS: dict[int | None, str] = {None: "no interposer", 0: "interposer, no limit"}


def nvml_handle() -> object:
    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetHandleByIndex(0)


@dataclass
class QueryLog:
    """How NVML's per-process query behaves on this GPU, which the
    interposer's policies depend on and the simulator can only be told
    (GPUVISOR_SIM_NVML_UTIL_MS, _PER_SAMPLE, _SAMPLE_MS): how long a call
    takes, whether an answer has one entry per process or one per process
    and sample, and the step between a process's sample timestamps."""

    ms: list[float] = field(default_factory=list)
    most_entries: int = 0  # the most entries one process had in one answer
    steps_us: list[int] = field(default_factory=list)

    def record(self, seconds: float, samples: Sequence[Any]) -> None:
        self.ms.append(seconds * 1e3)
        stamps: dict[int, list[int]] = {}
        for s in samples:
            stamps.setdefault(int(s.pid), []).append(int(s.timeStamp))
        for ts in stamps.values():
            self.most_entries = max(self.most_entries, len(ts))
            ts.sort()
            self.steps_us += [b - a for a, b in itertools.pairwise(ts) if b > a]

    def summary(self) -> str:
        if not self.ms:
            return "NVML per-process query: never called"
        ms = sorted(self.ms)
        step = f"{statistics.median(self.steps_us) / 1e3:.0f} ms" if self.steps_us else "-"
        return (
            f"NVML per-process query (1 s asked for, {len(ms)} calls): "
            f"median {statistics.median(ms):.2f} ms, max {ms[-1]:.2f} ms; "
            f"at most {self.most_entries} entries for one process in one answer "
            f"(1: one entry over all samples; more: one per sample); "
            f"median step between a process's samples {step}"
        )


QUERIES = QueryLog()


class NvmlPoller:
    """Reads the device's per-process and device utilisation samples every 0.5 s.

    Per-process samples are asked for over the last second each time, and
    kept once per (PID, timestamp): the driver does not publish every
    process's sample of a period at once, so asking from the newest
    timestamp seen would lose the samples that other processes publish
    later (on an H200, about half of each process's, with two processes).
    """

    PROC_LOOKBACK_US = 1_000_000

    def __init__(self, handle: object) -> None:
        self.handle = handle
        self.proc: dict[int, list[tuple[int, int]]] = {}
        self._proc_seen: set[tuple[int, int]] = set()
        self.device: list[tuple[int, int]] = []
        self.clocks: list[tuple[int, int, float]] = []  # (time us, SM MHz, watts)
        self._last_proc = 0
        self._last_dev = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        now_us = int(time.time() * 1e6)
        self._last_proc = self._last_dev = now_us
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self._poll()

    def _poll(self) -> None:
        since = max(self._last_proc, int(time.time() * 1e6) - self.PROC_LOOKBACK_US)
        t0 = time.perf_counter()
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(self.handle, since)
        except pynvml.NVMLError:
            samples = []
        QUERIES.record(time.perf_counter() - t0, samples)
        for s in samples:
            key = (int(s.pid), int(s.timeStamp))
            if key not in self._proc_seen:
                self._proc_seen.add(key)
                self.proc.setdefault(key[0], []).append((key[1], int(s.smUtil)))
        try:
            _, dev = pynvml.nvmlDeviceGetSamples(
                self.handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, self._last_dev
            )
        except pynvml.NVMLError:
            dev = []
        for s in dev:
            value = s.sampleValue.uiVal
            self.device.append((int(s.timeStamp), int(value)))
            self._last_dev = max(self._last_dev, int(s.timeStamp))
        try:
            mhz = pynvml.nvmlDeviceGetClockInfo(self.handle, pynvml.NVML_CLOCK_SM)
            watts = pynvml.nvmlDeviceGetPowerUsage(self.handle) / 1000
        except pynvml.NVMLError:
            return
        self.clocks.append((int(time.time() * 1e6), int(mhz), float(watts)))


def worker_env(
    lib: Path,
    limit: int | None,
    region: Path,
    node_dir: Path,
    policy: str | None = None,
    order: bool = True,
) -> dict[str, str]:
    """A worker's environment: no interposer (limit None), or the interposer
    with its limit (0: none), region, node directory (order False: none, so
    no launch order between containers) and policy."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CUDA_DEVICE_", "GPUVISOR_", "GPU_CORE_"))
        and k not in {"LD_PRELOAD", "CUDA_TASK_PRIORITY"}
    }
    env["CUDA_VISIBLE_DEVICES"] = "0"
    if limit is None:
        return env
    env["LD_PRELOAD"] = str(lib)
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(region)
    env["GPUVISOR_NODE_LOCK"] = str(node_dir / "vgpu.lock") if order else ""
    if limit:
        env["CUDA_DEVICE_SM_LIMIT"] = str(limit)
    if policy:
        env["GPUVISOR_SM_POLICY"] = policy
    return env


def parse_mixed(spec: str) -> list[tuple[str, int]]:
    """'burst-share:30+fixed-share:50' -> [('burst-share', 30), ('fixed-share', 50)]:
    one container per term, each with its policy and SM limit."""
    out = []
    for term in spec.split("+"):
        policy, sep, limit = term.partition(":")
        if not sep or not limit.isdigit() or not 0 <= int(limit) <= 100:
            raise ValueError(f"--mixed {spec!r}: {term!r} is not POLICY:LIMIT (0-100)")
        out.append((policy, int(limit)))
    return out


def run_together(
    lib: Path,
    limits: Sequence[int | None],
    size: int,
    batch: int,
    warm: float,
    seconds: float,
    handle: object,
    one_container: bool = False,
    policies: Sequence[str | None] | None = None,
    order: bool = True,
) -> list[dict[str, object]]:
    """Start one worker per limit, release them at once, return what each measured.

    Each worker is a container of its own, or with one_container all share one region.
    policies, if given, sets each worker's GPUVISOR_SM_POLICY; order False
    gives them no node directory (no launch order between containers).
    """
    with tempfile.TemporaryDirectory(prefix="gv-torch-sm-") as tmp:
        root = Path(tmp)
        procs = []
        for i, limit in enumerate(limits):
            region = root / f"region{0 if one_container else i}.shr"
            env = worker_env(lib, limit, region, root, policies[i] if policies else None, order)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", WORKER, str(size), str(batch), str(warm), str(seconds)],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        out: list[dict[str, object]] = []
        try:
            wait_ready(procs)
            poller = NvmlPoller(handle)
            poller.start()
            release(procs)
            for p, limit in zip(procs, limits, strict=True):
                stdout, err = p.communicate(timeout=warm + seconds + 30)
                if p.returncode != 0:
                    raise RuntimeError(f"worker exited {p.returncode}: {err[-3000:]}")
                r = json.loads(stdout.strip().splitlines()[-1])
                r["limit"] = limit
                r["stderr_tail"] = err[-500:]
                out.append(r)
            poller.stop()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        together = together_windows(out, warm)
        for r in out:
            summarise(r, poller, warm)
        if together is not None:
            out[0]["together"] = together
        return out


def write_report(out: Path, name: str, report: object, lines: Sequence[str]) -> None:
    """NAME.json (every figure) and NAME.md (the tables as printed) in out."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def wait_ready(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Wait until each worker says READY; a worker that says otherwise, or
    nothing for READY_TIMEOUT_S, is killed and its stderr raised."""
    for p in procs:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], READY_TIMEOUT_S)
        line = p.stdout.readline().strip() if ready else "(no answer)"
        if line != "READY":
            p.kill()
            _, err = p.communicate(timeout=30)
            raise RuntimeError(f"worker did not start ({line!r}): {err[-3000:]}")


def release(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Let every worker start at once (each waits for a line on stdin)."""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()


def done_by(marks: Sequence[Sequence[float]], t: float) -> float:
    """Products done by t on the completion curve [(time, done), ...] from
    (0, 0), linear between marks."""
    prev_t, prev_n = 0.0, 0.0
    for mt, mn in marks:
        if mt >= t:
            span = mt - prev_t
            return prev_n + (mn - prev_n) * ((t - prev_t) / span if span > 0 else 1.0)
        prev_t, prev_n = mt, mn
    return prev_n


def rate_between(marks: list[list[float]], t0: float, t1: float) -> float:
    """Products per second between t0 and t1 on the completion curve (linear between marks)."""
    return (done_by(marks, t1) - done_by(marks, t0)) / (t1 - t0)


def summarise(r: dict[str, object], poller: NvmlPoller, warm: float) -> None:
    marks = r["marks"]
    assert isinstance(marks, list)
    end = float(marks[-1][0])
    r["rate"] = rate_between(marks, warm, end)
    r["windows"] = [rate_between(marks, t, t + 0.1) for t in _steps(warm, end - 0.1, 0.1)]
    wall0 = r["wall0"]
    assert isinstance(wall0, float)
    lo, hi = int((wall0 + warm) * 1e6), int((wall0 + end) * 1e6)
    pid = r["pid"]
    assert isinstance(pid, int)
    proc = [v for ts, v in poller.proc.get(pid, []) if lo <= ts <= hi]
    dev = [v for ts, v in poller.device if lo <= ts <= hi]
    r["nvml_sm"] = statistics.fmean(proc) if proc else None
    r["nvml_sm_samples"] = len(proc)
    r["nvml_sm_sd"] = statistics.pstdev(proc) if len(proc) > 1 else None
    r["nvml_gpu"] = statistics.fmean(dev) if dev else None
    metered = r.pop("metered")
    assert isinstance(metered, list)
    # The container's GPU time as its interposer measured it, % of the window.
    if len(metered) == 2 and None not in (metered[0][1], metered[1][1]):
        r["metered"] = 100 * (metered[1][1] - metered[0][1]) / 1e9 / (metered[1][0] - metered[0][0])
    else:
        r["metered"] = None
    clocks = [(mhz, w) for ts, mhz, w in poller.clocks if lo <= ts <= hi]
    r["sm_mhz"] = statistics.fmean(c for c, _ in clocks) if clocks else None
    r["watts"] = statistics.fmean(w for _, w in clocks) if clocks else None
    wins = r["windows"]
    assert isinstance(wins, list)
    mean = statistics.fmean(wins) if wins else 0.0
    # Steadiness: each 100 ms window's throughput as a percentage of the run's own mean.
    rel = [100 * w / mean for w in wins] if mean > 0 else []
    r["win_sd"] = statistics.pstdev(rel) if len(rel) > 1 else None
    r["win_worst"] = max(rel, key=lambda w: abs(w - 100)) - 100 if rel else None
    del r["windows"]
    del r["marks"]


def together_windows(rs: Sequence[dict[str, Any]], warm: float) -> dict[str, float] | None:
    """Two workers run together, on one wall clock (their completion curves
    start at their own wall0): each 100 ms window's split, the first
    worker's part of both's work in percent (the real-GPU analogue of
    bench-sm's window shares), and the sum of both's work as a percentage
    of its own mean (a container of two processes: how steady the
    container is, whatever its processes do between them).  None unless
    exactly two workers."""
    if len(rs) != 2:
        return None
    starts = [float(r["wall0"]) for r in rs]
    ends = [s + float(r["marks"][-1][0]) for s, r in zip(starts, rs, strict=True)]
    lo, hi = max(starts) + warm, min(ends)
    split: list[float] = []
    total: list[float] = []
    for t in _steps(lo, hi - 0.1, 0.1):
        a, b = (
            rate_between(r["marks"], t - s, t + 0.1 - s) for r, s in zip(rs, starts, strict=True)
        )
        if a + b > 0:
            split.append(100 * a / (a + b))
            total.append(a + b)
    if len(split) < 2:
        return None
    mean_split = statistics.fmean(split)
    mean_total = statistics.fmean(total)
    rel = [100 * t / mean_total for t in total]
    return {
        "split": mean_split,
        "split_sd": statistics.pstdev(split),
        "split_worst": max(split, key=lambda x: abs(x - mean_split)) - mean_split,
        "total_sd": statistics.pstdev(rel),
        "total_worst": max(rel, key=lambda x: abs(x - 100)) - 100,
    }


def together_line(spec: str, r: dict[str, object]) -> str | None:
    """One line on how two workers shared the GPU (together_windows)."""
    t = r.get("together")
    if not isinstance(t, dict):
        return None
    return (
        f"{spec}: first worker's part of both's work {t['split']:.1f} % "
        f"(100 ms windows sd {t['split_sd']:.1f} points, worst {t['split_worst']:+.1f}); "
        f"both together, windows sd {t['total_sd']:.1f} % of their mean, "
        f"worst {t['total_worst']:+.1f}"
    )


def _steps(start: float, stop: float, step: float) -> list[float]:
    out = []
    t = start
    while t <= stop + 1e-9:
        out.append(t)
        t += step
    return out


COLUMNS = (
    "TFLOP/s | % of unlimited | NVML smUtil (sd) | NVML GPU util | metered % "
    "| SM MHz / W | 100 ms windows, % of mean: sd, worst"
)


def batch_for(size: int, batch_ms: float) -> int:
    """Products per batch: about batch_ms of GPU work at 600 TFLOP/s."""
    return max(1, round(batch_ms / (2 * size**3 / 600e12 * 1e3)))


def cells(r: dict[str, object], flop: int, base: float | None) -> str:
    """One run's figures, in COLUMNS' order (also records its share)."""
    rate = num(r["rate"])
    r["share"] = share = 100 * rate / base if base else None
    return (
        f"{rate * flop / 1e12:.0f} | {fmt(share)} "
        f"| {fmt(r['nvml_sm'])} ({fmt(r['nvml_sm_sd'])}) | {fmt(r['nvml_gpu'])} "
        f"| {fmt(r['metered'])} | {fmt(r['sm_mhz'], '.0f')} / {fmt(r['watts'], '.0f')} "
        f"| {fmt(r['win_sd'])}, {fmt(r['win_worst'], '+.1f')}"
    )


def num(v: object) -> float:
    assert isinstance(v, (int, float))
    return float(v)


def fmt(v: object, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", type=Path, default=Path("build/libgpuvisor.so"))
    ap.add_argument("--out", type=Path, default=None, help="write torch_sm.json and .md here")
    ap.add_argument("--sizes", default="8192,2048", help="matrix sizes, comma-separated")
    ap.add_argument("--batch-ms", type=float, default=5.0, help="GPU time per batch, about")
    ap.add_argument("--warm", type=float, default=1.5)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--limits", default="25,50,75")
    ap.add_argument("--no-overhead", action="store_true", help="skip the no-limit run")
    ap.add_argument(
        "--pairs",
        default="10:90,30:70,50:50",
        help="two containers (first size); '-' for a side without the interposer",
    )
    ap.add_argument(
        "--no-order",
        action="store_true",
        help="no node directory: no launch order between containers",
    )
    ap.add_argument("--mates", default="50", help="limits of one container of two processes")
    ap.add_argument(
        "--mixed",
        default="burst-share:30,burst-share:30+fixed-share:50,"
        "best-effort:10+fixed-share:50,burst-share:30+burst-share:30",
        help="containers with policies, run together (first size): POLICY:LIMIT+...,...",
    )
    a = ap.parse_args(argv)
    if not a.lib.is_file():
        print(f"torch_sm: --lib {a.lib}: no such file (run make first)", file=sys.stderr)
        return 2
    try:
        handle = nvml_handle()
    except pynvml.NVMLError as e:
        print(f"torch_sm: NVML: {e} (this benchmark needs an NVIDIA GPU)", file=sys.stderr)
        return 2
    name = pynvml.nvmlDeviceGetName(handle)
    lines = [f"GPU: {name}; {a.seconds:g} s measured after {a.warm:g} s warm-up per run", ""]
    report: dict[str, object] = {"gpu": name, "single": [], "pairs": []}
    sizes = [int(s) for s in a.sizes.split(",") if s]
    limits = [int(s) for s in a.limits.split(",") if s]
    single = report["single"]
    pairs = report["pairs"]
    assert isinstance(single, list)
    assert isinstance(pairs, list)

    def emit(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    emit(f"| size | run | {COLUMNS} |")
    emit("|---:|---|" + "---:|" * COLUMNS.count("|") + "---:|")
    base_rate: dict[int, float] = {}
    for size in sizes:
        flop = 2 * size**3
        batch = batch_for(size, a.batch_ms)
        for limit in [None, *([] if a.no_overhead else [0]), *limits]:
            label = LABELS.get(limit, f"limit {limit}")
            try:
                (r,) = run_together(a.lib, [limit], size, batch, a.warm, a.seconds, handle)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                last = str(e).splitlines()[-1] if str(e) else repr(e)
                emit(f"| {size} | {label} | FAILED: {last} |")
                print(e, file=sys.stderr, flush=True)
                single.append({"size": size, "limit": limit, "error": str(e)})
                continue
            if limit is None:
                base_rate[size] = num(r["rate"])
            r.update(size=size, batch=batch)
            single.append(r)
            emit(f"| {size} | {label} | {cells(r, flop, base_rate.get(size))} |")
    size = sizes[0]
    flop = 2 * size**3
    batch = batch_for(size, a.batch_ms)
    emit("")
    emit(f"| size {size} | container | {COLUMNS} |")
    emit("|---|---|" + "---:|" * COLUMNS.count("|") + "---:|")
    runs: list[tuple[str, list[int | None], bool]] = [
        (spec, [None if x == "-" else int(x) for x in spec.split(":")], False)
        for spec in a.pairs.split(",")
        if spec
    ]
    runs += [(f"{m}, one container", [int(m)] * 2, True) for m in a.mates.split(",") if m]
    order = not a.no_order
    together: list[str | None] = []
    for spec, lims, one in runs:
        try:
            rs = run_together(
                a.lib, list(lims), size, batch, a.warm, a.seconds, handle, one, order=order
            )
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            emit(f"| {spec} | FAILED |")
            print(e, file=sys.stderr, flush=True)
            pairs.append({"run": spec, "error": str(e)})
            continue
        for i, (limit, r) in enumerate(zip(lims, rs, strict=True)):
            said = "no interposer" if limit is None else limit
            tag = f"process {i + 1} ({said})" if one else f"{'AB'[i]} ({said})"
            r.update(run=spec)
            pairs.append(r)
            emit(f"| {spec} | {tag} | {cells(r, flop, base_rate.get(size))} |")
        together.append(together_line(spec, rs[0]))
    mixed = [(spec, parse_mixed(spec)) for spec in a.mixed.split(",") if spec]
    if mixed:
        emit("")
        emit(f"| size {size}, policies | container | {COLUMNS} |")
        emit("|---|---|" + "---:|" * COLUMNS.count("|") + "---:|")
    for spec, terms in mixed:
        try:
            rs = run_together(
                a.lib,
                [t[1] for t in terms],
                size,
                batch,
                a.warm,
                a.seconds,
                handle,
                policies=[t[0] for t in terms],
                order=order,
            )
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            emit(f"| {spec} | FAILED |")
            print(e, file=sys.stderr, flush=True)
            pairs.append({"run": spec, "error": str(e)})
            continue
        for i, ((policy, limit), r) in enumerate(zip(terms, rs, strict=True)):
            r.update(run=spec, policy=policy)
            pairs.append(r)
            tag = f"{'ABCD'[i]} ({policy} {limit})"
            emit(f"| {spec} | {tag} | {cells(r, flop, base_rate.get(size))} |")
        together.append(together_line(spec, rs[0]))
    emit("")
    for line in together:
        if line:
            emit(line + "  ")
    emit("")
    emit(QUERIES.summary())
    report["nvml_query"] = {
        "ms": QUERIES.ms,
        "most_entries": QUERIES.most_entries,
        "steps_us": QUERIES.steps_us,
    }
    if a.out:
        write_report(a.out, "torch_sm", report, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
