"""What a perfect scheduler would achieve on the SM benchmark's workload.

A reference for the tables of `make bench-sm` (tests/bench/sm_bench.py): how
far from their quota the 100 ms windows of a container would be if the
scheduling were perfect, so that a figure like "worst window 7 points" can
be read against what the workload itself allows.

The model: one device runs one unit at a time and never preempts it, as the
simulated device does.  A unit is what bench_sm_worker launches (see
native/tests/bench_sm_worker.c): a kernel of 20 us to 5 ms (log-uniform), or,
one launch in ten, one of eight graphs (per process) of 1-4 such kernels in
a chain, which run back to back.  The model draws them with the worker's own
generator and seeds (WorkerProcess), so a model run with a benchmark
scenario's seed runs the very launches of that scenario's workers, each
process's in its order (a container's processes take turns).  The
scheduler knows the exact length of every unit that has run and reacts at
once, but, like any real one, does not know a unit's length before it has
run it.  Whenever the device is free it
starts the next unit of the container that is furthest behind its quota
(least GPU time per unit of quota), among those not ahead of it; when every
container is ahead, the device idles until one is not.  With one container
that is pacing with no tolerance at all; with quotas adding up to 100 % it is
weighted fair queueing and the device never idles.

Run as `python -m tests.bench.sm_floor` for a table over the benchmark's
scenarios.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

WINDOW_S = 0.1
# The benchmark's scenarios (tests/bench/sm_bench.py takes its defaults from
# here): quotas of one container and processes for each, the fixed-share
# splits, whose containers A and B have PAIR_PROCS processes, and the run.
QUOTAS = "10,25,50,75,90"
PROCS = "1,2,3,4,2"
SPLITS = "10:90,30:70,50:50"
PAIR_PROCS = (1, 2)
SECONDS = 7.0
ALLOWANCE = 1.0
GRAPHS = 8  # per process
MAX_NODES = 4
FUNCS = 3
GRAPH_CHANCE = 0.10  # one launch in ten is a graph launch
_M64 = (1 << 64) - 1


def worker_seed(scenario_seed: int, process: int) -> int:
    """The seed sm_bench.run_scenario gives the process-th worker (all
    containers' processes numbered in order) of a scenario run with
    scenario_seed."""
    return scenario_seed * 100 + process


class WorkerProcess:
    """The launches of one bench_sm_worker process, in order, exactly: the
    same generator (xorshift64*), seeded the same way, drawn in the same
    order as native/tests/bench_sm_worker.c, so that the model runs the
    very kernels and graphs a benchmark run with that seed launches.

    short_graphs: each graph runs as long as its first node alone (20 us ..
    5 ms), so that no launch is longer than 5 ms; by default a graph chains
    its 1-4 kernels (up to 20 ms), as the worker's do."""

    def __init__(self, seed: int, short_graphs: bool = False) -> None:
        self.state = (seed * 0x9E3779B97F4A7C15 + 88172645463325252) & _M64
        self.graph = False  # whether the last unit drawn was a graph
        self.graphs: list[float] = []
        for _ in range(GRAPHS):
            nodes = [self._node() for _ in range(1 + self._next() % MAX_NODES)]
            self.graphs.append(nodes[0] if short_graphs else sum(nodes))

    def _next(self) -> int:
        x = self.state
        x ^= x >> 12
        x ^= (x << 25) & _M64
        x ^= x >> 27
        self.state = x
        return (x * 0x2545F4914F6CDD1D) & _M64

    def _unit(self) -> float:
        return (self._next() >> 11) / 9007199254740992.0

    def _duration_s(self) -> float:
        """log-uniform 20 us .. 5 ms, rounded to whole microseconds"""
        return int(20.0 * math.exp(self._unit() * math.log(5000 / 20)) + 0.5) * 1e-6

    def _node(self) -> float:
        d = self._duration_s()
        self._next()  # which module's spin
        self._next()  # grid size
        return d

    def next_unit(self) -> float:
        """The length of the next launch (a kernel or a whole graph), s."""
        self.graph = self._unit() < GRAPH_CHANCE
        if self.graph:
            return self.graphs[self._next() % GRAPHS]
        return self._node()


def kernel_s(rng: random.Random) -> float:
    """One kernel's length: log-uniform 20 us .. 5 ms, as bench_sm_worker."""
    return 20e-6 * math.exp(rng.random() * math.log(5000 / 20))


class Workload:
    """The launches of one container: its processes' (WorkerProcess), taken
    in turn."""

    def __init__(self, seeds: Sequence[int], short_graphs: bool = False) -> None:
        self.procs = [WorkerProcess(s, short_graphs) for s in seeds]
        self.turn = 0
        self.graph = False  # whether the last unit drawn was a graph

    def next_unit(self) -> float:
        p = self.procs[self.turn % len(self.procs)]
        self.turn += 1
        d = p.next_unit()
        self.graph = p.graph
        return d


def windows(
    quotas: Sequence[int],
    processes: Sequence[int],
    seconds: float,
    seed: int,
    short_graphs: bool = False,
) -> list[list[float]]:
    """Each container's share (percent) in each whole 100 ms window of a
    `seconds` run under the perfect scheduler, on the launches of a
    benchmark run with this seed (its workers' seeds: worker_seed)."""
    shares = [q / 100 for q in quotas]
    first = [sum(processes[:i]) for i in range(len(processes))]
    loads = [
        Workload([worker_seed(seed, f + k) for k in range(n)], short_graphs)
        for f, n in zip(first, processes, strict=True)
    ]
    used = [0.0] * len(shares)
    n_win = int(seconds / WINDOW_S + 1e-9)
    busy = [[0.0] * n_win for _ in shares]
    t = 0.0
    while t < seconds:
        # How far each container is behind its quota, in seconds of wall time.
        lead = [u / s - t for u, s in zip(used, shares, strict=True)]
        c = min(range(len(shares)), key=lambda i: lead[i])
        if lead[c] > 0:  # everybody is ahead: idle until one is not
            t += lead[c]
            continue
        d = loads[c].next_unit()
        _count_busy(busy[c], t, t + d)
        used[c] += d
        t += d
    return [[100 * b / WINDOW_S for b in row] for row in busy]


def _count_busy(row: list[float], start: float, end: float) -> None:
    """Add the busy interval [start, end) to the windows of `row` it
    covers (WINDOW_S each; the part past the last window is dropped)."""
    k = int(start / WINDOW_S)
    while start < end and k < len(row):
        stop = min(end, (k + 1) * WINDOW_S)
        row[k] += stop - start
        start, k = stop, k + 1


def turn_windows(
    quotas: Sequence[int],
    processes: Sequence[int],
    seconds: float,
    seed: int,
    turn_s: float = 0.0,
    cycle_s: float = 0.0,
) -> list[list[float]]:
    """windows() for a perfect scheduler that gives the device in turns, as
    the turn of sm_arbiter.c does: the container furthest behind its quota
    takes the device and runs whole units until it has run `turn_s`, or
    its quota's part of `cycle_s` when `turn_s` is 0, then the next.  It
    knows each unit's length once it has run, and handovers cost nothing:
    what is left of the windows' spread is the turns' own."""
    if turn_s <= 0 and cycle_s <= 0:
        raise ValueError("turn_windows: turn_s or cycle_s must be > 0")
    shares = [q / 100 for q in quotas]
    first = [sum(processes[:i]) for i in range(len(processes))]
    loads = [
        Workload([worker_seed(seed, f + k) for k in range(n)])
        for f, n in zip(first, processes, strict=True)
    ]
    used = [0.0] * len(shares)
    n_win = int(seconds / WINDOW_S + 1e-9)
    busy = [[0.0] * n_win for _ in shares]
    t = 0.0
    while t < seconds:
        lead = [u / s - t for u, s in zip(used, shares, strict=True)]
        c = min(range(len(shares)), key=lambda i: lead[i])
        if lead[c] > 0:
            t += lead[c]
            continue
        length = turn_s if turn_s > 0 else cycle_s * shares[c]
        ran = 0.0
        while ran < length and t < seconds:
            d = loads[c].next_unit()
            _count_busy(busy[c], t, t + d)
            used[c] += d
            ran += d
            t += d
    return [[100 * b / WINDOW_S for b in row] for row in busy]


def queued_windows(
    quotas: Sequence[int],
    processes: Sequence[int],
    seconds: float,
    seed: int,
    depth: int,
    latency: float,
) -> tuple[list[list[float]], float]:
    """windows() for a scheduler that must commit launches to the device's
    queue ahead of time, as a real one does to keep the device busy: at most
    `depth` launches committed and not yet known to have ended, and a
    launch's end known only `latency` seconds after it.  Its accounting is
    the gate's: known lengths exactly, a launch still in flight at its
    estimate (a graph's exact length, which a per-graph average learns; for
    a kernel the mean of all launches so far) or the time it has run, if
    longer.  Returns the windows and the share of time the device idled
    (percent)."""
    shares = [q / 100 for q in quotas]
    first = [sum(processes[:i]) for i in range(len(processes))]
    loads = [
        Workload([worker_seed(seed, f + k) for k in range(n)])
        for f, n in zip(first, processes, strict=True)
    ]
    n_win = int(seconds / WINDOW_S + 1e-9)
    busy = [[0.0] * n_win for _ in shares]
    known = [0.0] * len(shares)
    flying: list[tuple[int, float, float, float, float]] = []  # c, len, est, start, end
    total = count = 0.0
    t = dev_free = idle = 0.0
    step = 50e-6
    while t < seconds:
        for u in [u for u in flying if u[4] + latency <= t]:
            known[u[0]] += u[1]
            flying.remove(u)
        charge = list(known)
        for c, _, est, start, _ in flying:
            charge[c] += max(est, t - start) if start <= t else est
        lead = [u / s - t for u, s in zip(charge, shares, strict=True)]
        c = min(range(len(shares)), key=lambda i: lead[i])
        if len(flying) < depth and lead[c] <= 0:
            d = loads[c].next_unit()
            est = d if loads[c].graph else (total / count if count else d)
            total, count = total + d, count + 1
            start = max(t, dev_free)
            idle += start - dev_free
            end = dev_free = start + d
            flying.append((c, d, est, start, end))
            _count_busy(busy[c], start, end)
            continue
        ends = [u[4] + latency for u in flying]
        t = min([t + step, *ends]) if ends else t + step
    return [[100 * b / WINDOW_S for b in row] for row in busy], 100 * idle / seconds


@dataclass
class Floor:
    quota: int
    sd: float  # standard deviation of the windows from the quota, points
    worsts: list[float]  # per run: the window furthest from the quota, points

    @property
    def worst(self) -> float:
        """The worst window, mean over the runs."""
        return statistics.mean(self.worsts)

    @property
    def worst_max(self) -> float:
        """The worst window, the largest over the runs."""
        return max(self.worsts)


def floor(
    quotas: Sequence[int],
    processes: Sequence[int],
    seconds: float,
    allowance: float,
    runs: int = 20,
    seed: int = 1,
    short_graphs: bool = False,
) -> list[Floor]:
    """Per container: the perfect scheduler's window figures over the
    windows from `allowance` to `seconds` (the benchmark's measured
    interval), over `runs` runs of different seeds."""
    k0 = round(allowance / WINDOW_S)
    devs: list[list[float]] = [[] for _ in quotas]
    worsts: list[list[float]] = [[] for _ in quotas]
    for r in range(runs):
        series = windows(quotas, processes, seconds, seed * 1000 + r, short_graphs)
        for i, (q, row) in enumerate(zip(quotas, series, strict=True)):
            d = [v - q for v in row[k0:]]
            devs[i] += d
            worsts[i].append(max(abs(x) for x in d))
    return [Floor(q, statistics.pstdev(d), w) for q, d, w in zip(quotas, devs, worsts, strict=True)]


def same_launches(
    quotas: Sequence[int],
    processes: Sequence[int],
    seconds: float,
    allowance: float,
    seed: int,
    short_graphs: bool = False,
) -> list[Floor]:
    """Per container: the perfect scheduler's window figures on the launches
    of the benchmark run with this seed (one run)."""
    k0 = round(allowance / WINDOW_S)
    out = []
    for q, row in zip(quotas, windows(quotas, processes, seconds, seed, short_graphs), strict=True):
        d = [v - q for v in row[k0:]]
        out.append(Floor(q, statistics.pstdev(d), [max(abs(x) for x in d)]))
    return out


def runs_within(floors: Sequence[Floor], goal: float) -> int:
    """In how many runs every window of every container given was within
    +-goal points (run i of each Floor is run i of the whole benchmark)."""
    n = min(len(f.worsts) for f in floors)
    return sum(all(f.worsts[r] <= goal for f in floors) for r in range(n))


def queue_table(args: argparse.Namespace) -> int:
    """The --queue table: per pair (the benchmark's seeds, 50 + i) and per
    depth:latency, each side's window sd / worst and the device's idle."""
    k0 = round(args.allowance / WINDOW_S)
    print("| pair | depth | latency | A sd / worst | B sd / worst | device idle |")
    print("|---|---:|---:|---:|---:|---:|")
    for i, split in enumerate(args.splits.split(",")):
        qs = [int(x) for x in split.split(":")]
        for spec in args.queue.split(","):
            depth, lat = spec.split(":")
            rows, idle = queued_windows(
                qs, [*PAIR_PROCS], args.seconds, 50 + i, int(depth), float(lat) * 1e-6
            )
            cells = []
            for q, row in zip(qs, rows, strict=True):
                d = [v - q for v in row[k0:]]
                cells.append(f"{statistics.pstdev(d):.2f} / {max(abs(x) for x in d):.1f}")
            print(f"| {split} | {depth} | {lat} us | {cells[0]} | {cells[1]} | {idle:.2f} % |")
    return 0


# The containers-sharing-a-device scenarios of make bench-sm
# (tests/bench/sm_shared.py): per container (quota, processes).
SHARED_SCENARIOS: list[tuple[str, list[tuple[int, int]]]] = [
    ("10:90", [(10, 1), (90, 1)]),
    ("30:70", [(30, 1), (70, 1)]),
    ("50:50", [(50, 1), (50, 1)]),
    ("20:30:50", [(20, 1), (30, 1), (50, 1)]),
    ("50 x 2 processes : 50", [(50, 2), (50, 1)]),
]


def turns_table(args: argparse.Namespace) -> int:
    """The --turns table: per shared-device scenario and turn rule, each
    container's window sd (points) under turn_windows, over --runs runs."""
    rules = args.turns.split(",")
    head = " | ".join(f"turns {r}" for r in rules)
    print(f"| scenario | {head} |")
    print("|---|" + "---:|" * len(rules))
    k0 = round(args.allowance / WINDOW_S)
    for label, sides in SHARED_SCENARIOS:
        qs = [q for q, _ in sides]
        ns = [n for _, n in sides]
        cells = []
        for rule in rules:
            cycle = rule.startswith("c")
            try:
                ms = float(rule[1:] if cycle else rule)
            except ValueError:
                print(f"sm_floor: --turns {rule!r}: not MS or cMS", file=sys.stderr)
                return 2
            devs: list[list[float]] = [[] for _ in qs]
            for r in range(args.runs):
                rows = turn_windows(
                    qs,
                    ns,
                    args.seconds,
                    1000 + r,
                    turn_s=0.0 if cycle else ms / 1000,
                    cycle_s=ms / 1000 if cycle else 0.0,
                )
                for i, (q, row) in enumerate(zip(qs, rows, strict=True)):
                    devs[i] += [v - q for v in row[k0:]]
            cells.append(" / ".join(f"{statistics.pstdev(d):.1f}" for d in devs))
        print(f"| {label} | {' | '.join(cells)} |")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quotas", default=QUOTAS)
    p.add_argument("--procs", default=PROCS, help="processes per quota, in order")
    p.add_argument("--splits", default=SPLITS)
    p.add_argument("--seconds", type=float, default=SECONDS)
    p.add_argument("--allowance", type=float, default=ALLOWANCE)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--goal", type=float, default=5.0, help="points, every window")
    p.add_argument(
        "--short-graphs",
        action="store_true",
        help="graphs as long as one kernel (no launch over 5 ms) instead of 1-4 kernels",
    )
    p.add_argument(
        "--queue",
        default="",
        help="DEPTH:LATENCY_US,...: instead, the pairs on the benchmark's own launches "
        "under a scheduler that commits up to DEPTH launches ahead and hears of a "
        "launch's end LATENCY_US after it (queued_windows), e.g. 1:0,3:100,2:50",
    )
    p.add_argument(
        "--turns",
        default="",
        help="MS or cMS,...: instead, the shared-device scenarios under a perfect "
        "turn-taker (turn_windows) with turns of MS for every container, or of each "
        "container's quota's part of a cycle of MS (cMS), e.g. 10,c20,c10",
    )
    args = p.parse_args(argv)
    if args.turns:
        return turns_table(args)
    if args.queue:
        return queue_table(args)
    quotas = [int(q) for q in args.quotas.split(",")]
    procs = [int(n) for n in args.procs.split(",")]
    procs = (procs * len(quotas))[: len(quotas)]
    scenarios = [(f"one container {q} %", [q], [n]) for q, n in zip(quotas, procs, strict=True)]
    for split in args.splits.split(","):
        a, b = (int(x) for x in split.split(":"))
        scenarios.append(
            (f"{a}:{b} (A {PAIR_PROCS[0]} process, B {PAIR_PROCS[1]})", [a, b], [*PAIR_PROCS])
        )
    print(
        f"| scenario | window sd (points) | worst window, mean over runs | largest "
        f"| runs within +-{args.goal:g} |"
    )
    print("|---|---:|---:|---:|---:|")
    every: list[Floor] = []
    for name, qs, ns in scenarios:
        fl = floor(qs, ns, args.seconds, args.allowance, args.runs, short_graphs=args.short_graphs)
        every += fl
        cells = [
            " / ".join(f"{getattr(f, a):.1f}" for f in fl) for a in ("sd", "worst", "worst_max")
        ]
        print(f"| {name} | {' | '.join(cells)} | {runs_within(fl, args.goal)} of {args.runs} |")
    ok = runs_within(every, args.goal)
    print(
        f"\nRuns with every window of every scenario within +-{args.goal:g}: {ok} of {args.runs}."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
