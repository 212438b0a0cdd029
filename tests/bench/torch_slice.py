"""How a real GPU shares itself between two contexts (issue 35; needs an NVIDIA GPU).

No interposer anywhere: this measures the device that the SM gate's turn
(docs/interposer.md) is built for, and that the simulator's time-slicing
mode (docs/simulator.md, GPUVISOR_SIM_TIMESLICE_US) models.

1. Matrix-product workers (PyTorch, bf16, square; by default 16384 and
   8192, about 13 ms and 1.65 ms per product on an H200), each alone and
   then both at once: each one's throughput together as a share of its
   own alone, and each product's CUDA-event time (an event before and one
   after every product, three products in flight), alone and together.
   A product that is preempted for the other context's slice measures
   that slice too.
2. A probe (CuPy, one thread): a kernel that reads %globaltimer in a loop
   and notes every gap longer than --gap-us, alone and then beside each
   worker.  While another context has work, the probe's runs are its
   timeslices and its gaps the other context's slices plus two switches.
3. Sporadic small products (--sporadic-size, 2048 by default: about 26 us
   on an H200), one at a time every --every-ms, each timed from its launch
   to its end on the host clock, alone and beside the second worker: does
   a context that gets work preempt the busy one at once (its products
   take a switch longer) or wait for the end of the busy one's slice (up to
   a slice longer)?

Run as `python3 -m tests.bench.torch_slice [--out DIR]` with a Python that
has PyTorch, nvidia-ml-py (and CuPy for the probe).  It prints Markdown
tables and writes them, with the figures as JSON, to DIR.  Without an NVIDIA
GPU it says so in one line and exits 0 (nothing measured).

On an H200 (docs/benchmarks.md, "Third sitting"): slices of 2086 us, gaps of
2430 us (a switch costs about 170 us), each worker 45-46 % of its alone
throughput, an 8192 product measuring 4.15 ms beside another context.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pynvml

from tests.bench.torch_sm import MATRICES, release, wait_ready, write_report

# Both workers' start: n x n bf16 matrices, three products to warm up, READY,
# then a line on stdin to begin (torch_sm's MATRICES).
SETUP = (
    r"""
import json, sys, time
import torch
n, warm, seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
"""
    + MATRICES
)

WORKER = (
    SETUP
    + r"""
pending = []
ms = []
done = 0
first = last = None
t0 = time.monotonic()
while True:
    e0 = torch.cuda.Event(enable_timing=True)
    e1 = torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.matmul(a, b, out=c)
    e1.record()
    pending.append((e0, e1))
    if len(pending) > 3:
        x0, x1 = pending.pop(0)
        x1.synchronize()
        done += 1
        now = time.monotonic() - t0
        if now >= warm:
            if first is None:
                first = (now, done)
            else:
                ms.append(x0.elapsed_time(x1))
            last = (now, done)
        if now >= warm + seconds:
            break
torch.cuda.synchronize()
rate = (last[1] - first[1]) / (last[0] - first[0])
print(json.dumps({"rate": rate, "ms": ms}), flush=True)
"""
)

PROBE = r'''
import json, sys, time
import cupy as cp
warm, seconds, gap_ns = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
SRC = r"""
extern "C" __global__ void probe(unsigned long long span, unsigned long long gap,
                                 unsigned long long *out, unsigned int cap,
                                 unsigned int *count) {
    unsigned long long t0, last, now;
    unsigned int n = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    last = t0;
    for (;;) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - last > gap) {
            if (n < cap) {
                out[2 * n] = last - t0;
                out[2 * n + 1] = now - t0;
            }
            n++;
        }
        last = now;
        if (now - t0 > span)
            break;
    }
    *count = n;
}
"""
kern = cp.RawKernel(SRC, "probe")
cap = 1 << 16
out = cp.zeros(2 * cap, dtype=cp.uint64)
count = cp.zeros(1, dtype=cp.uint32)
kern((1,), (1,), (cp.uint64(10_000_000), cp.uint64(gap_ns), out, cp.uint32(cap), count))
cp.cuda.Device().synchronize()
print("READY", flush=True)
sys.stdin.readline()
time.sleep(warm)
span = int(seconds * 1e9)
kern((1,), (1,), (cp.uint64(span), cp.uint64(gap_ns), out, cp.uint32(cap), count))
cp.cuda.Device().synchronize()
n = int(count.get()[0])
gaps = out.get()[: 2 * min(n, cap)].reshape(-1, 2).tolist()
print(json.dumps({"span_ns": span, "gaps": gaps, "lost": max(0, n - cap)}), flush=True)
'''

# One small product at a time, now and then: how long from its launch to its
# end (host clock), alone and while another context keeps the GPU busy.
SPORADIC = (
    SETUP
    + r"""
every = float(sys.argv[4])
time.sleep(warm)
us = []
end = time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.perf_counter()
    torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    us.append((time.perf_counter() - t0) * 1e6)
    time.sleep(every)
print(json.dumps({"us": us}), flush=True)
"""
)

PARTS = {"workers", "probe", "sporadic"}


def start(code: str, args: Sequence[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(jobs: Sequence[tuple[str, Sequence[str]]], timeout: float) -> list[dict[str, Any]]:
    """Start each job, wait until all are READY, release them at once, collect their JSON."""
    procs = [start(code, args) for code, args in jobs]
    try:
        wait_ready(procs)
        release(procs)
        out = []
        for p in procs:
            stdout, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"job exited {p.returncode}: {err[-2000:]}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def quantiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """(p10, median, p90) of xs; zeros when empty."""
    if not xs:
        return (0.0, 0.0, 0.0)
    s = sorted(xs)

    def at(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))]

    return (at(0.1), statistics.median(s), at(0.9))


def slices(gaps: Sequence[Sequence[int]], span_ns: int) -> dict[str, float]:
    """The probe's runs (between gaps, the first and last cut off by the
    span's ends left out) and gaps, in microseconds, and the share of the
    span the probe ran."""
    runs = [b[0] - a[1] for a, b in itertools.pairwise(gaps)]
    off = [g[1] - g[0] for g in gaps]
    on_share = 100.0 * (1 - sum(off) / span_ns) if span_ns else 0.0
    r10, r50, r90 = quantiles([r / 1e3 for r in runs])
    g10, g50, g90 = quantiles([g / 1e3 for g in off])
    return {
        "gaps": len(off),
        "run_us_p10": r10,
        "run_us_median": r50,
        "run_us_p90": r90,
        "gap_us_p10": g10,
        "gap_us_median": g50,
        "gap_us_p90": g90,
        "probe_share": on_share,
    }


Emit = Callable[[str], None]


def measure_workers(
    a: argparse.Namespace, sizes: list[int], emit: Emit, report: dict[str, Any]
) -> None:
    """1. The two workers alone, then together."""
    wargs = [str(a.warm), str(a.seconds)]
    timeout = a.warm + a.seconds + 60
    alone = {n: run([(WORKER, [str(n), *wargs])], timeout)[0] for n in sizes}
    both = run([(WORKER, [str(n), *wargs]) for n in sizes], timeout)
    report["alone"] = {str(n): alone[n] for n in sizes}
    report["together"] = {str(n): r for n, r in zip(sizes, both, strict=True)}
    emit(
        "| worker | products/s alone | together | share of alone "
        "| product ms alone: p10 / median / p90 | together |"
    )
    emit("|---:|---:|---:|---:|---|---|")
    shares = []
    for n, r in zip(sizes, both, strict=True):
        share = 100 * r["rate"] / alone[n]["rate"]
        shares.append(share)
        qa = quantiles(alone[n]["ms"])
        qt = quantiles(r["ms"])
        emit(
            f"| {n} | {alone[n]['rate']:.1f} | {r['rate']:.1f} | {share:.1f} "
            f"| {qa[0]:.2f} / {qa[1]:.2f} / {qa[2]:.2f} | {qt[0]:.2f} / {qt[1]:.2f} / {qt[2]:.2f} |"
        )
    emit(f"\ntogether: {shares[0]:.1f} + {shares[1]:.1f} = {sum(shares):.1f} % of the device")


def measure_probe(
    a: argparse.Namespace, sizes: list[int], emit: Emit, report: dict[str, Any]
) -> None:
    """2. The probe alone and beside each worker."""
    timeout = a.warm + a.seconds + 60
    gap_ns = str(int(a.gap_us * 1e3))
    pargs = [str(a.warm), str(a.seconds - 0.5), gap_ns]
    probes: dict[str, Any] = {}
    try:
        probes["alone"] = run([(PROBE, pargs)], timeout)[0]
        for n in sizes:
            probes[f"beside {n}"] = run(
                [(PROBE, pargs), (WORKER, [str(n), str(a.warm), str(a.seconds + 1)])], timeout
            )[0]
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        emit(f"\nprobe FAILED: {str(e).splitlines()[-1] if str(e) else repr(e)}")
        print(e, file=sys.stderr, flush=True)
    if probes:
        emit("")
        emit(
            f"| probe (gaps over {a.gap_us:g} us) | gaps "
            "| probe's runs, us: p10 / median / p90 "
            "| its gaps, us: p10 / median / p90 | probe ran, % |"
        )
        emit("|---|---:|---|---|---:|")
    report["probe"] = {}
    for label, p in probes.items():
        s = slices(p["gaps"], int(p["span_ns"]))
        s["lost"] = p["lost"]
        report["probe"][label] = s
        emit(
            f"| {label} | {s['gaps']} | {s['run_us_p10']:.0f} / {s['run_us_median']:.0f} / "
            f"{s['run_us_p90']:.0f} | {s['gap_us_p10']:.0f} / {s['gap_us_median']:.0f} / "
            f"{s['gap_us_p90']:.0f} | {s['probe_share']:.1f} |"
        )


def measure_sporadic(
    a: argparse.Namespace, sizes: list[int], emit: Emit, report: dict[str, Any]
) -> None:
    """3. Sporadic small products alone and beside the second worker."""
    timeout = a.warm + a.seconds + 60
    sargs = [str(a.sporadic_size), str(a.warm), str(a.seconds - 0.5), str(a.every_ms / 1e3)]
    busy = sizes[1]
    try:
        lone = run([(SPORADIC, sargs)], timeout)[0]
        beside = run(
            [(SPORADIC, sargs), (WORKER, [str(busy), str(a.warm), str(a.seconds + 1)])],
            timeout,
        )[0]
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        emit(f"\nsporadic FAILED: {str(e).splitlines()[-1] if str(e) else repr(e)}")
        print(e, file=sys.stderr, flush=True)
    else:
        emit("")
        emit(
            f"| one {a.sporadic_size} product every {a.every_ms:g} ms | products "
            "| launch to end, us: p10 / median / p90 | max |"
        )
        emit("|---|---:|---|---:|")
        report["sporadic"] = {}
        for label, r in (("alone", lone), (f"beside {busy}", beside)):
            q = quantiles(r["us"])
            report["sporadic"][label] = {"us": r["us"]}
            emit(
                f"| {label} | {len(r['us'])} | {q[0]:.0f} / {q[1]:.0f} / {q[2]:.0f} "
                f"| {max(r['us'], default=0):.0f} |"
            )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write torch_slice.json and .md here")
    ap.add_argument("--sizes", default="16384,8192", help="the two workers' matrix sizes")
    ap.add_argument("--warm", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--gap-us", type=float, default=4.0, help="the probe's shortest gap")
    ap.add_argument(
        "--parts",
        default="workers,probe,sporadic",
        help="which measurements, comma-separated (the probe needs CuPy)",
    )
    ap.add_argument("--sporadic-size", type=int, default=2048)
    ap.add_argument("--every-ms", type=float, default=7.0, help="between sporadic products")
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",") if s]
    if len(sizes) != 2:
        print(f"torch_slice: --sizes {a.sizes!r}: give two sizes", file=sys.stderr)
        return 2
    parts = {p for p in a.parts.split(",") if p}
    if not parts or parts - PARTS:
        print(
            f"torch_slice: --parts {a.parts!r}: name some of {', '.join(sorted(PARTS))}",
            file=sys.stderr,
        )
        return 2
    try:
        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    except pynvml.NVMLError as e:
        print(f"torch_slice: skipped: NVML: {e} (needs an NVIDIA GPU)", file=sys.stderr)
        return 0
    lines: list[str] = []
    report: dict[str, Any] = {"gpu": name, "sizes": sizes}

    def emit(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    emit(f"GPU: {name}; {a.seconds:g} s measured after {a.warm:g} s warm-up per run")
    emit("")
    for part, measure in (
        ("workers", measure_workers),
        ("probe", measure_probe),
        ("sporadic", measure_sporadic),
    ):
        if part in parts:
            measure(a, sizes, emit, report)
    if a.out:
        write_report(a.out, "torch_slice", report, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
