"""`make demo-cluster`: the cluster half at work, live.

A real control plane (etcd, kube-apiserver, kube-scheduler from `make k8s`,
tests/k8s_cluster.py), `gpuvisor scheduler` as kube-scheduler's extender,
and two simulated GPU nodes (`GPUVISOR_SIM_TOPOLOGY`), each with a real
`gpuvisor device-plugin` process that publishes the node's inventory and
with kubelet's side played by tests/kubelet_harness.py
(tests/cluster_sim.py).  The demo's pods are submitted one after the other;
kube-scheduler places each through the extender; the harness admits it
(GetPreferredAllocation, Allocate, PreStartContainer) and runs each
container's workload under the library on the simulated driver with exactly
what the plugin returned.  The workload reports what it got:
`cuMemGetInfo`'s total per GPU, and the SM limit the library enforces
(read from the container's own region).

Why a pod went where it did comes from two places: the answers the extender
gave kube-scheduler (filter's reasons per node, prioritize's scores),
recorded by a pass-through proxy between the two; and the allocator's score
terms for its choice, computed by the demo with the extender's own state
code (`ClusterState`: the published inventories and the pods'
reservations, listed from the API server) just before the pod is submitted.

It ends with a summary: where each pod went and why, and what each
container got against what it asked.  Run as `python -m tests.demo_cluster`
(`--keep DIR` keeps the logs there).
"""

from __future__ import annotations

import argparse
import http.server
import json
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gpuvisor.cluster.request import pod_request
from gpuvisor.cluster.scheduler.state import ClusterState
from kubernetes.utils import parse_quantity

from tests.cluster_sim import SimTopologyNode, topology
from tests.k8s_cluster import (
    GPU,
    GPUCORES,
    GPUMEM,
    KubeTest,
    free_port,
    gpu_container,
    gpu_pod,
    running_cluster,
)
from tests.test_scheduler_e2e import Extender, scheduler_config

# What a container reports: per visible GPU, cuMemGetInfo's total and the SM
# limit the library enforces (its region, at the path Allocate gave).
WORKLOAD = """
import json, os
from cuda.bindings import driver as cu
from gpuvisor.shim import Region
from tests.cuclient import *
err = cu.cuInit(0)[0]
if err != 0:
    print(json.dumps({"init": int(err)}))
    raise SystemExit(0)
got = []
for d in range(ok(cu.cuDeviceGetCount)):
    init(d)
    got.append({"uuid": uuid(d), "total_mib": mem_info()[1] >> 20})
region = Region.attach(os.environ["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
sm = {u.uuid: region.sm(u.index).limit for u in region.devices()}
for g in got:
    g["sm_limit"] = sm.get(g["uuid"])
print(json.dumps({"init": 0, "gpus": got}))
"""

A100_40 = "NVIDIA A100-SXM4-40GB"
A6000 = "NVIDIA RTX A6000"  # not a model the simulator knows: memory given


def a6000_topology() -> dict[str, Any]:
    doc = topology([A6000] * 4, 1, nvlink=[[0, 1, 4], [2, 3, 4]])
    for g in doc["gpus"]:
        g["memory"] = "49140m"
    return doc


NODES = {
    # two A100 40GB on PCIe
    "node-a": (topology([A100_40, A100_40], 0), "2 x A100-SXM4-40GB, PCIe"),
    # four RTX A6000 (48 GB, no MIG), NVLink bridges in pairs (0-1, 2-3)
    "node-b": (
        a6000_topology(),
        "4 x RTX A6000, NVLink pairs 0-1 and 2-3",
    ),
}


@dataclass
class Workload:
    name: str
    what: str
    containers: list[dict[str, Any]]
    annotations: dict[str, str] = field(default_factory=dict)


WORKLOADS = [
    Workload(
        "notebook", "1 GPU, 3000 MiB, 30 % cores", [gpu_container(gpus=1, gpumem=3000, gpucores=30)]
    ),
    Workload(
        "trainer",
        "2 GPUs of 20000 MiB, 50 % each, topology-aware, node policy spread",
        [gpu_container(gpus=2, gpumem=20000, gpucores=50)],
        {
            "hami.io/gpu-scheduler-policy": "topology-aware",
            "hami.io/node-scheduler-policy": "spread",
        },
    ),
    Workload(
        "packed",
        "1 GPU, 4000 MiB, 20 %, node policy binpack",
        [gpu_container(gpus=1, gpumem=4000, gpucores=20)],
        {"hami.io/node-scheduler-policy": "binpack"},
    ),
    Workload(
        "on-40gb",
        "1 GPU, 8000 MiB, 25 %, only an A100 40GB",
        [gpu_container(gpus=1, gpumem=8000, gpucores=25)],
        {"nvidia.com/use-gputype": "A100-SXM4-40GB"},
    ),
    Workload(
        "pipeline",
        "two containers: 2000 MiB / 10 % and 6000 MiB / 40 %",
        [
            gpu_container("prep", gpus=1, gpumem=2000, gpucores=10),
            gpu_container("serve", gpus=1, gpumem=6000, gpucores=40),
        ],
    ),
    Workload(
        "too-big",
        "1 GPU of 100000 MiB: more than any GPU has",
        [gpu_container(gpus=1, gpumem=100000, gpucores=10)],
    ),
]


class Recorder:
    """A pass-through HTTP proxy between kube-scheduler and the extender
    that keeps the extender's answers per pod: filter's failed nodes and
    prioritize's scores (the last of each, kube-scheduler may retry)."""

    def __init__(self, upstream: int) -> None:
        self.port = free_port()
        self.answers: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = urllib.request.Request(
                    f"http://127.0.0.1:{upstream}{self.path}",
                    data=body,
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=60) as r:
                    answer = r.read()
                    status = r.status
                recorder.record(self.path.strip("/"), body, answer)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def record(self, verb: str, body: bytes, answer: bytes) -> None:
        try:
            args = json.loads(body)
            reply = json.loads(answer)
        except ValueError:
            return
        if verb == "bind":
            pod = str(args.get("PodName", ""))
        else:
            pod = str(((args.get("Pod") or {}).get("metadata") or {}).get("name", ""))
        with self.lock:
            self.answers.setdefault(pod, {})[verb] = reply

    def of(self, pod: str) -> dict[str, Any]:
        with self.lock:
            return dict(self.answers.get(pod, {}))

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Outcome:
    workload: Workload
    node: str | None = None
    why: list[str] = field(default_factory=list)
    got: list[str] = field(default_factory=list)
    ok: bool = True


def say(text: str = "") -> None:
    print(text, flush=True)


def asked(container: Mapping[str, Any]) -> tuple[int, int, int]:
    limits = container["resources"]["limits"]
    return (
        int(limits.get(GPU, 0)),
        int(parse_quantity(limits.get(GPUMEM, "0"))),
        int(limits.get(GPUCORES, 0)),
    )


def explain(
    k8s: KubeTest, manifest: Mapping[str, Any]
) -> tuple[str | None, dict[str, Any], dict[str, str]]:
    """The allocator's choice for the pod `manifest` (not created yet) from
    the cluster's state as the extender builds it (ClusterState, listed
    from the API server)."""
    state = ClusterState(k8s.core)
    state.sync()
    req = pod_request(manifest)
    d = state.allocator.decide(req, explain=True)
    return d.node, dict(d.score), {n: str(r) for n, r in d.reasons.items()}


def scores_line(answers: Mapping[str, Any]) -> str:
    scores = answers.get("prioritize")
    if not isinstance(scores, list):
        return "no prioritize call (one feasible node)"
    return ", ".join(f"{s['Host']} {s['Score']}" for s in sorted(scores, key=lambda s: -s["Score"]))


def terms_line(score: Mapping[str, Any]) -> str:
    parts = []
    for key, value in score.items():
        if key == "finalists":
            continue
        parts.append(f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}")
    return ", ".join(parts)


def place_and_run(
    k8s: KubeTest, nodes: Mapping[str, SimTopologyNode], recorder: Recorder, w: Workload
) -> Outcome:
    out = Outcome(w)
    say(f"\n--- {w.name}: {w.what}")
    manifest = gpu_pod(w.name, containers=w.containers, annotations=w.annotations)
    manifest["metadata"]["namespace"] = k8s.namespace
    choice, score, reasons = explain(k8s, manifest)
    k8s.create_pod(w.name, containers=w.containers, annotations=w.annotations)
    try:
        node = k8s.wait_bound(w.name, timeout=60) if choice else None
    except pytest.fail.Exception:
        node = None
    answers = recorder.of(w.name)
    failed = (answers.get("filter") or {}).get("FailedNodes") or {}
    if node is None:
        message = k8s.wait_unschedulable(w.name, timeout=60)
        say(f"    kube-scheduler: Unschedulable: {message}")
        out.why = [f"{n}: {r}" for n, r in sorted((failed or reasons).items())]
        for line in out.why:
            say(f"    extender filter: {line}")
        out.ok = choice is None
        return out
    out.node = node
    live = k8s.read_pod(w.name)
    placed = json.loads(live.metadata.annotations["gpuvisor.io/allocation"])
    out.why.append(f"extender scores: {scores_line(answers)}")
    for n, r in sorted(failed.items()):
        out.why.append(f"{n} filtered out: {r}")
    out.why.append(f"allocator's terms: {terms_line(score)}")
    if choice != node:
        out.why.append(f"(the demo's recomputed choice was {choice})")
    say(f"    kube-scheduler bound it to {node} (through the extender's bind)")
    for line in out.why:
        say(f"    {line}")
    sim = nodes[node]
    _, resps = sim.admit(live)
    say(f"    kubelet (harness) admitted it: Allocate + PreStartContainer on {node}")
    for c in w.containers:
        gpus, mib, cores = asked(c)
        gpus_placed = next(x["gpus"] for x in placed["containers"] if x["name"] == c["name"])
        report = sim.run(resps[c["name"]], WORKLOAD)
        if report.get("init") != 0:
            out.ok = False
            out.got.append(f"{c['name']}: cuInit failed ({report.get('init')})")
            continue
        got = report["gpus"]
        shown = ", ".join(
            f"GPU {next(g['index'] for g in gpus_placed if g['uuid'] == x['uuid'])}: "
            f"{x['total_mib']} MiB, SM limit {x['sm_limit']} %"
            for x in got
        )
        fine = len(got) == gpus and all(
            x["total_mib"] == mib and x["sm_limit"] == cores for x in got
        )
        out.ok = out.ok and fine
        line = (
            f"{c['name']}: asked {gpus} GPU x {mib} MiB, {cores} %; got {shown}"
            f"{'' if fine else '  <-- MISMATCH'}"
        )
        out.got.append(line)
        say(f"    workload {line}")
    return out


def summary(outcomes: Sequence[Outcome]) -> list[str]:
    lines = ["", "=== Summary: where each pod went and why, what it got against what it asked"]
    for o in outcomes:
        lines.append(f"{o.workload.name} ({o.workload.what}) -> {o.node or 'not placed'}")
        lines.extend(f"    why: {w}" for w in o.why)
        lines.extend(f"    got: {g}" for g in o.got)
    placed = sum(1 for o in outcomes if o.node)
    verdict = "all as asked" if all(o.ok for o in outcomes) else "SOME NOT AS ASKED"
    lines.append(f"{placed} of {len(outcomes)} pods placed; {verdict}")
    return lines


@contextmanager
def cluster_stack(workdir: Path) -> Iterator[tuple[KubeTest, dict[str, SimTopologyNode], Recorder]]:
    say("starting etcd and kube-apiserver ...")
    with running_cluster(workdir / "k8s") as cluster:
        k8s = KubeTest(cluster)
        extender = Extender(cluster.kubeconfig, workdir / "extender.log")
        nodes: dict[str, SimTopologyNode] = {}
        recorder: Recorder | None = None
        try:
            say("starting gpuvisor scheduler (the extender) ...")
            extender.start()
            recorder = Recorder(extender.port)
            say("starting kube-scheduler with the extender ...")
            k8s.start_scheduler(scheduler_config(recorder.port))
            for name, (topo, _what) in NODES.items():
                nodes[name] = SimTopologyNode.launch(k8s, name, topo, workdir)
            for name, node in nodes.items():
                node.wait_ready(k8s)
                say(
                    f"node {name}: {NODES[name][1]}; gpuvisor device-plugin registered with "
                    f"kubelet and published {len(node.inventory['gpus'])} GPUs"
                )
            yield k8s, nodes, recorder
        finally:
            for node in nodes.values():
                node.stop()
            if recorder is not None:
                recorder.stop()
            extender.stop()
            k8s.teardown()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=Path, help="keep the logs in this directory")
    args = ap.parse_args(argv)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gv-demo-cluster-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        with cluster_stack(workdir) as (k8s, nodes, recorder):
            outcomes = [place_and_run(k8s, nodes, recorder, w) for w in WORKLOADS]
    for line in summary(outcomes):
        say(line)
    say(f"({time.monotonic() - began:.0f} s)")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
