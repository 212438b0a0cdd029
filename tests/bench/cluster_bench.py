"""Scheduling throughput through the real kube-scheduler (make bench-cluster):
pods scheduled per second with 1,000 Node objects of 8 GPUs each, without
and with gpuvisor's extender.

The control plane is the real one (tests/k8s_cluster.py: etcd,
kube-apiserver, kube-scheduler, built by `make k8s`).  Every Node carries
8 GPUs twice over: as extended resources in its allocatable (what
kube-scheduler alone counts) and as an inventory annotation
(`gpuvisor.io/node-inventory`, 8 x A100 40 GB, what the extender reads).
The same pods (1 GPU, 1000 MiB, 10 % cores each) are scheduled in two runs:

- without: kube-scheduler alone, the resources counted by its own
  NodeResourcesFit against the Nodes' allocatable;
- with: kube-scheduler with `gpuvisor scheduler` as its extender
  (filter, prioritize, bind; the resources `ignoredByScheduler`), configured
  as docs/kubernetes.md shows.

The pods are created before the run's kube-scheduler starts (schedulerName
of that run's profile), so the time measured is the scheduler's alone: the
binds after the first over the time from the first bind to the last, seen
by a watch on the pods (kube-scheduler's start-up is shown apart).  Both
kube-schedulers get `clientConnection.qps/burst` 5000 (as Kubernetes' own
scheduler_perf does), so the client's rate limiter of 50/s does not cap the
run without the extender.

"No pod waits on a lock": the extender holds none across a decision or an
API call (docs/kubernetes.md); what is measured is what could make a pod
wait instead: binds that failed (a lost race for a node's room, a conflict)
and so sent the pod back to kube-scheduler's queue, from the extender's own
request counters.

With --rounds N the two runs alternate N times (without, with, without,
...), each against a fresh kube-scheduler (and a fresh extender), and the
goal is judged on the median of the rounds' ratios: one run's bind phase
lasts only seconds, so a single ratio moves by tens of percent from run to
run on the same machine.

With --write FILE, replaces the "## Scheduling through kube-scheduler
(make bench-cluster)" section.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.watch
from gpuvisor.cluster.deviceplugin.publish import NODE_INVENTORY

from tests.bench.agent_bench import replace_section
from tests.bench.machine import cpu_model
from tests.k8s_cluster import GPU, GPUCORES, GPUMEM, KubeTest, running_cluster
from tests.test_scheduler_e2e import Extender, scheduler_config

TITLE = "## Scheduling through kube-scheduler (make bench-cluster)"
GPUS_PER_NODE = 8
GPU_MIB = 40960
SPLIT = 10  # replicas per GPU (the device plugin's default --split-count)
POD_MIB = 1000
POD_CORES = 10
QPS = 5000
GOAL = 0.5  # with the extender, at least half the throughput without it


def inventory(name: str) -> str:
    doc = {
        "kind": "gpuvisor.io/node-inventory",
        "version": 1,
        "node": name,
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{name}-{i}",
                "model": "NVIDIA A100-SXM4-40GB",
                "memory_mib": GPU_MIB,
            }
            for i in range(GPUS_PER_NODE)
        ],
    }
    return json.dumps(doc, separators=(",", ":"))


def create_nodes(k8s: KubeTest, count: int, workers: int = 8) -> float:
    """`count` Nodes of 8 GPUs (allocatable and inventory); the seconds it took."""
    began = time.monotonic()

    def one(i: int) -> None:
        name = f"bench-{i:04d}"
        k8s.create_node(
            name,
            gpus=GPUS_PER_NODE * SPLIT,
            gpumem=GPUS_PER_NODE * GPU_MIB,
            gpucores=GPUS_PER_NODE * 100,
            annotations={NODE_INVENTORY: inventory(name)},
        )

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, range(count)))
    return time.monotonic() - began


def create_pods(k8s: KubeTest, count: int, scheduler: str, prefix: str, workers: int = 8) -> None:
    def one(i: int) -> None:
        k8s.create_pod(
            f"{prefix}-{i:05d}",
            gpus=1,
            gpumem=POD_MIB,
            gpucores=POD_CORES,
            scheduler_name=scheduler,
        )

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, range(count)))


WATCH_SECONDS = 3600  # each watch request's timeoutSeconds (the apiserver ends it then)


class BindWatch:
    """The moment each pod of `prefix` was first seen bound, from a watch.

    The apiserver's watch cache closes a watcher whose buffer stays full
    past its dispatch budget (`apiserver_terminated_watchers_total`), which
    under this bench's bursts of binds on a busy machine it does: the stream
    just ends (docs/benchmarks.md).  A stream that ends (that,
    timeoutSeconds, a dropped connection) is resumed from the last
    resourceVersion seen (bookmarks included), so no event is missed and no
    bind is timed late.  The watch reads the API's JSON itself: the
    client's models cost about 1 ms of the interpreter per event, which
    would time the binds late whenever they came faster.  Only when that version is gone (410)
    does it list again: the pods first seen bound in that list are counted
    in `late`, their times those of the list."""

    def __init__(
        self, k8s: KubeTest, prefix: str, count: int, watch_seconds: int = WATCH_SECONDS
    ) -> None:
        self.k8s = k8s
        self.prefix = prefix
        self.count = count
        self.watch_seconds = watch_seconds
        self.bound: dict[str, float] = {}
        self.meter: CpuMeter | None = None  # read at each pod's bind, once set
        self.done = threading.Event()
        self._stopped = threading.Event()
        self.ends: list[str] = []  # how each stream ended before every pod was seen bound
        self.relists = 0  # lists after a 410 (the watch's resourceVersion was gone)
        self.late = 0  # pods first seen bound in such a list (their times late)
        self._resp: Any = None
        self._version = self._list()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _list(self) -> str:
        listed = self.k8s.core.list_namespaced_pod(self.k8s.namespace)
        for p in listed.items:
            self._see(p.metadata.name, p.spec.node_name)
        return str(listed.metadata.resource_version)

    def _see(self, name: str, node_name: str | None) -> bool:
        """Records `name` bound now if it is one of ours, bound and not yet seen."""
        if not (name.startswith(self.prefix) and node_name and name not in self.bound):
            return False
        self.bound[name] = time.monotonic()
        if self.meter is not None:
            self.meter.bound()
        if len(self.bound) >= self.count:
            self.done.set()
        return True

    def _stream(self) -> str:
        """One watch request from the last resourceVersion seen; how it ended."""
        resp = self.k8s.core.list_namespaced_pod(
            self.k8s.namespace,
            watch=True,
            resource_version=self._version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_seconds,
            # no read outlives the request (bookmarks come about once a minute)
            _request_timeout=(30, self.watch_seconds + 60),
            _preload_content=False,
        )
        self._resp = resp
        events = 0
        try:
            if resp.status == 410:
                return "ERROR 410 Gone (at the request)"
            if not 200 <= resp.status < 300:
                raise RuntimeError(f"the watch answered HTTP {resp.status}: {resp.read()[:200]!r}")
            for line in kubernetes.watch.watch.iter_resp_lines(resp):
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    return f"ERROR {obj.get('code')} {obj.get('reason')}: {obj.get('message')}"
                events += 1
                meta = obj.get("metadata") or {}
                self._version = meta.get("resourceVersion") or self._version
                if event.get("type") in ("ADDED", "MODIFIED"):
                    self._see(meta.get("name", ""), (obj.get("spec") or {}).get("nodeName"))
                if self.done.is_set() or self._stopped.is_set():
                    return "done"
        finally:
            self._resp = None
            resp.release_conn()
        return f"closed by the apiserver after {events} events at resourceVersion {self._version}"

    def _run(self) -> None:
        while not self.done.is_set() and not self._stopped.is_set():
            try:
                end = self._stream()
            except Exception as e:  # a dropped connection, a read timeout: resume
                end = f"{type(e).__name__}: {e}"
                time.sleep(0.1)
            if end == "done" or self.done.is_set() or self._stopped.is_set():
                return
            self.ends.append(end)
            if end.startswith("ERROR 410"):
                # the version is gone from the watch cache: only a list tells
                # what happened meanwhile
                self.relists += 1
                before = len(self.bound)
                with contextlib.suppress(Exception):
                    self._version = self._list()
                self.late += len(self.bound) - before

    def stop(self) -> None:
        self._stopped.set()
        resp = self._resp
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()  # ends a blocked read (urllib3 2.3+)


@dataclass
class Run:
    name: str
    nodes: int
    pods: int
    bound: int
    seconds: float  # first pod bound -> last pod bound
    startup_s: float  # kube-scheduler started -> first pod bound
    bind_errors: int = 0  # failed binds (the pod went back to the queue)
    bind_failures: dict[str, int] | None = None  # why, from the extender's log
    verbs: dict[str, tuple[int, float]] | None = None  # verb -> (requests, mean seconds)
    cpu_ms: dict[str, float] | None = None  # process -> CPU ms per pod bound (CpuMeter)
    round: int = 1  # which round of --rounds

    @property
    def per_second(self) -> float:
        # the binds after the first, over the time they took
        return (self.bound - 1) / self.seconds if self.seconds > 0 else 0.0


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) process `pid` has used, from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # the fields after the command's name in brackets, which may hold spaces
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """The CPU time of named processes, read when each pod is first seen
    bound, so the run's figure spans its first bind to its last."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.first: dict[str, float] | None = None
        self.last: dict[str, float] = {}
        self.binds = 0  # pods seen bound since the first reading

    def read(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def bound(self) -> None:
        now = self.read()
        if self.first is None:
            self.first = now
        else:
            self.binds += 1
        self.last = now

    def per_pod_ms(self) -> dict[str, float]:
        """Each process's CPU per pod bound after the first reading (ms)."""
        first, n = self.first or {}, max(self.binds, 1)
        return {k: (self.last.get(k, 0.0) - first.get(k, 0.0)) * 1000 / n for k in self.pids}


def extender_counters(metrics: str) -> tuple[int, dict[str, tuple[int, float]]]:
    """Failed binds, and per verb (requests, mean seconds), from /metrics."""
    errors = 0
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    for line in metrics.splitlines():
        m = re.match(r"gpuvisor_scheduler_requests_total\{(.*)\} (\S+)", line)
        if m and 'verb="bind"' in m.group(1) and 'result="error"' in m.group(1):
            errors += int(float(m.group(2)))
        m = re.match(r'gpuvisor_scheduler_request_seconds_(count|sum)\{verb="(\w+)"\} (\S+)', line)
        if m:
            (counts if m.group(1) == "count" else sums)[m.group(2)] = float(m.group(3))
    verbs = {v: (int(n), sums.get(v, 0.0) / n if n else 0.0) for v, n in counts.items()}
    return errors, verbs


def scheduler_run(
    k8s: KubeTest,
    nodes: int,
    pods: int,
    extender: Extender | None,
    timeout: float,
    round_: int = 1,
) -> Run:
    """Creates `pods` pods for a fresh kube-scheduler, starts it and times it."""
    name = "with-extender" if extender is not None else "without"
    profile = f"bench-{name}"
    config: dict[str, Any] = scheduler_config(extender.port) if extender is not None else {}
    config["profiles"] = [{"schedulerName": profile}]
    config["clientConnection"] = {"qps": QPS, "burst": QPS}
    create_pods(k8s, pods, profile, name)
    watch = BindWatch(k8s, name, pods)
    try:
        pids = {c.name: c.proc.pid for c in k8s.cluster.components}
        if extender is not None and extender.proc is not None:
            pids["extender"] = extender.proc.pid
        began = time.monotonic()
        scheduler = k8s.start_scheduler(config)
        pids["kube-scheduler"] = scheduler.component.proc.pid
        watch.meter = CpuMeter(pids)
        watch.done.wait(timeout)
        cpu = watch.meter.per_pod_ms()
        times = sorted(watch.bound.values())
        scheduler.stop()
        for end in watch.ends:
            print(f"{name}: the pod watch ended early ({end}); resumed")
        if watch.relists:
            print(
                f"{name}: the pod watch's version was gone {watch.relists} times; listed again, "
                f"{watch.late} bind times late"
            )
    finally:
        watch.stop()
    if not times:
        raise RuntimeError(f"{name}: no pod bound in {timeout:.0f}s; see {scheduler.log}")
    run = Run(
        name,
        nodes,
        pods,
        len(times),
        times[-1] - times[0],
        times[0] - began,
        cpu_ms=cpu,
        round=round_,
    )
    if extender is not None:
        run.bind_errors, run.verbs = extender_counters(extender.metrics())
        run.bind_failures = bind_failures(extender.log.read_text(errors="replace"))
    return run


def bind_failures(log: str) -> dict[str, int]:
    """Why binds failed, from the extender's log (`bind ns/pod to node: why`)."""
    out: dict[str, int] = {}
    for m in re.finditer(r"gpuvisor\.scheduler: bind \S+ to \S+: (.*)", log):
        out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


def delete_pods(k8s: KubeTest, timeout: float = 300) -> None:
    k8s.core.delete_collection_namespaced_pod(k8s.namespace, grace_period_seconds=0)
    deadline = time.monotonic() + timeout
    while k8s.core.list_namespaced_pod(k8s.namespace, limit=1).items:
        if time.monotonic() > deadline:
            raise RuntimeError("pods not deleted")
        time.sleep(0.5)


def bench(
    k8s: KubeTest,
    nodes: int,
    pods: int,
    workdir: Path,
    timeout: float = 900,
    rounds: int = 1,
) -> list[Run]:
    """`rounds` rounds on `nodes` Nodes, each kube-scheduler alone and then
    with a fresh extender (the runs in that order, round after round)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    create_nodes(k8s, nodes)
    runs: list[Run] = []
    for n in range(1, rounds + 1):
        if n > 1:
            delete_pods(k8s)
        runs.append(scheduler_run(k8s, nodes, pods, None, timeout, n))
        delete_pods(k8s)
        extender = Extender(k8s.cluster.kubeconfig, workdir / f"extender-{n}.log")
        extender.start()
        try:
            runs.append(scheduler_run(k8s, nodes, pods, extender, timeout, n))
        finally:
            extender.stop()
    return runs


def pairs(runs: list[Run]) -> list[tuple[Run, Run]]:
    """Each round's (without, with-extender) runs."""
    without = {r.round: r for r in runs if r.verbs is None}
    with_ = {r.round: r for r in runs if r.verbs is not None}
    return [(without[n], with_[n]) for n in sorted(without) if n in with_]


def ratio(pair: tuple[Run, Run]) -> float:
    without, with_ = pair
    return with_.per_second / without.per_second if without.per_second else 0.0


def table(runs: list[Run]) -> list[str]:
    base = {r.round: r.per_second for r in runs if r.verbs is None}
    out = [
        "| round | kube-scheduler | nodes x GPUs | pods | bound | start to first bind "
        "| first to last bind | pods/s "
        "| vs without | failed binds (pod re-queued) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        b = base.get(r.round, 0.0)
        vs = f"{r.per_second / b:.0%}" if b else "-"
        errors = str(r.bind_errors) if r.verbs is not None else "-"
        out.append(
            f"| {r.round} | {r.name} | {r.nodes:,} x {GPUS_PER_NODE} | {r.pods:,} | {r.bound:,} "
            f"| {r.startup_s:.2f} s | {r.seconds:.2f} s | {r.per_second:.1f} | {vs} "
            f"| {errors} |"
        )
    return out


def verdict(runs: list[Run]) -> str:
    rounds = pairs(runs)
    ratios = [ratio(p) for p in rounds]
    median = statistics.median(ratios)
    errors = sum(w.bind_errors for _, w in rounds)
    all_bound = all(r.bound == r.pods for r in runs)
    met = all_bound and median > GOAL and errors == 0
    spread = (
        f" (the {len(ratios)} rounds: {min(ratios):.0%} to {max(ratios):.0%})"
        if len(ratios) > 1
        else ""
    )
    rates = "; ".join(f"{w.per_second:.1f} against {wo.per_second:.1f}" for wo, w in rounds)
    return (
        f"Goal: the extender costs kube-scheduler less than half its throughput (judged on "
        f"the median of the rounds' ratios), and no pod waits on a lock.  Measured: with "
        f"the extender {median:.0%} of the rate without, median{spread}, so it costs "
        f"{1.0 - median:.0%} ({rates} pods/s), {errors} failed binds: "
        f"{'met' if met else 'NOT met'}."
    )


def machine() -> str:
    model = cpu_model(platform.machine())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    python = platform.python_version()
    return f"{model}, {os.cpu_count()} CPUs (load average {load} at the end), Python {python}"


def cpu_line(runs: list[Run]) -> str:
    """Each process's CPU per pod, the median over `runs` (one configuration's)."""
    names = list(dict.fromkeys(k for r in runs for k in (r.cpu_ms or {})))
    cpu = {n: statistics.median((r.cpu_ms or {}).get(n, 0.0) for r in runs) for n in names}
    parts = ", ".join(f"{name} {ms:.1f} ms" for name, ms in cpu.items())
    return f"{parts} ({sum(cpu.values()):.1f} ms in all)"


def all_verbs(runs: list[Run]) -> dict[str, tuple[int, float]]:
    """Per verb (requests, mean seconds) over every run with the extender."""
    counts: dict[str, int] = {}
    sums: dict[str, float] = {}
    for r in runs:
        for v, (n, mean) in (r.verbs or {}).items():
            counts[v] = counts.get(v, 0) + n
            sums[v] = sums.get(v, 0.0) + n * mean
    return {v: (n, sums[v] / n if n else 0.0) for v, n in counts.items()}


def all_failures(runs: list[Run]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in runs:
        for why, n in (r.bind_failures or {}).items():
            out[why] = out.get(why, 0) + n
    return out


def section(runs: list[Run]) -> str:
    with_ = runs[-1]
    rounds = len(pairs(runs))
    verbs = all_verbs(runs)
    verb_line = ", ".join(
        f"{v} {n:,} requests, {mean * 1000:.1f} ms mean" for v, (n, mean) in sorted(verbs.items())
    )
    return "\n".join(
        [
            TITLE,
            "",
            f"`make bench-cluster` (tests/bench/cluster_bench.py), {time.strftime('%Y-%m-%d')}, "
            f"{machine()}.  Kubernetes {kubernetes_version()} (etcd, kube-apiserver and "
            "kube-scheduler from `make k8s`), all on this machine with the extender.",
            "",
            f"{with_.nodes:,} Node objects of {GPUS_PER_NODE} GPUs (allocatable "
            f"`{GPU}: {GPUS_PER_NODE * SPLIT}`, `{GPUMEM}`, `{GPUCORES}`, and the inventory "
            f"annotation the extender reads); {with_.pods:,} pods of 1 GPU, {POD_MIB} MiB and "
            f"{POD_CORES} % cores, created before each run's kube-scheduler starts, so it "
            "finds them all pending; pods/s: the binds after the first over the time from the "
            "first bind to the last (seen by a watch), so the scheduler's start-up is not "
            "counted.  kube-scheduler's defaults otherwise "
            f"(it scores a share of the feasible nodes), `clientConnection.qps/burst` {QPS} for "
            f"both.  {rounds} round{'s' if rounds > 1 else ''}, each kube-scheduler alone and "
            "then with a fresh extender, each against a fresh kube-scheduler; "
            "the goal is judged on the median of the rounds' ratios.",
            "",
            *table(runs),
            "",
            f"The extender's requests, all rounds: {verb_line}.  Failed binds: "
            + (
                "; ".join(f"{n} x `{why}`" for why, n in sorted(all_failures(runs).items()))
                or "none"
            )
            + ".",
            "",
            "CPU per pod bound (from /proc, over the binds after the first; the median "
            "of the rounds): "
            + "; ".join(
                f"{name}: {cpu_line([r for r in runs if r.name == name])}"
                for name in dict.fromkeys(r.name for r in runs)
            )
            + ".",
            "",
            verdict(runs),
            "",
        ]
    )


def kubernetes_version() -> str:
    from tests.k8s_cluster import kubernetes_version as version

    return version()


@contextlib.contextmanager
def test_cluster(workdir: Path) -> Iterator[KubeTest]:
    with running_cluster(workdir / "k8s") as cluster:
        k8s = KubeTest(cluster)
        try:
            yield k8s
        finally:
            k8s.teardown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pods", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of without/with, alternating; the goal is judged on the median ratio",
    )
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, not {args.rounds}")
    with tempfile.TemporaryDirectory(prefix="gv-bench-cluster-") as tmp:
        workdir = Path(tmp)
        with test_cluster(workdir) as k8s:
            began = time.monotonic()
            runs = bench(k8s, args.nodes, args.pods, workdir, args.timeout, args.rounds)
            print(f"({time.monotonic() - began:.0f} s with the nodes' creation)")
    text = section(runs)
    print(text)
    if args.write is not None:
        args.write.write_text(replace_section(args.write.read_text(), TITLE, text))


if __name__ == "__main__":
    main()
