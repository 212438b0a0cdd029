"""Cluster metrics with HAMi's scheduler names (docs/kubernetes.md), read
from the allocator at each scrape, plus the extender's own request counts
and its waker's (cluster/scheduler/wake.py).  prometheus-client formats
every sample; a node's lines are kept until its state moves, and the
metrics port answers a scrape from a worker thread (server.py), never on
the loop the extender's verbs run on."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from gpuvisor.cluster.allocator import NodeState
from prometheus_client import CollectorRegistry, Counter, Histogram, Metric, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from .state import ClusterState
from .wake import WakeCounters

MIB = 1 << 20
ZONE = "vGPU"
DEV = ("nodeid", "deviceuuid", "deviceidx", "zone")
CTR = ("podnamespace", "podname", "containeridx", "nodename", "deviceuuid", "zone")
MIG = ("nodeid", "deviceuuid", "deviceidx", "migname", "placement", "zone")
# HAMi's names, help texts and labels, in the order a scrape lists them.
FAMILIES = (
    ("GPUDeviceMemoryLimit", "Device memory limit for a certain GPU (bytes)", DEV),
    ("GPUDeviceCoreLimit", "Device core limit for a certain GPU (percent)", DEV),
    (
        "GPUDeviceMemoryAllocated",
        "Device memory allocated for a certain GPU (bytes)",
        (*DEV, "devicecores"),
    ),
    ("GPUDeviceCoreAllocated", "Device core allocated for a certain GPU", DEV),
    ("GPUDeviceSharedNum", "Number of containers sharing this GPU", DEV),
    ("vGPUMemoryAllocated", "vGPU memory allocated from a container (bytes)", CTR),
    ("vGPUCoreAllocated", "vGPU core allocated from a container", CTR),
    (
        "vGPUPodsDeviceAllocated",
        "vGPU memory allocated to a pod's container on a device (bytes)",
        (*CTR, "deviceusedcore"),
    ),
    (
        "nodeGPUMigInstance",
        "MIG instances of a GPU: 1 allocated to a pod, 0 existing and free",
        MIG,
    ),
)


# a node's samples, by family name, as of one of its states (NodeState, version)
NodeSamples = tuple[NodeState, int, dict[str, list[Sample]]]


def node_samples(name: str, st: NodeState) -> NodeSamples:
    """The node's samples of the cluster families, read under its lock (the
    state and version they are of with them)."""
    fam = {
        fname: GaugeMetricFamily(fname, "", labels=list(labels)) for fname, _t, labels in FAMILIES
    }
    with st.lock:
        version = st.version
        usage = [(st.mem[i], st.cores[i], st.slots[i]) for i in range(len(st.inv.gpus))]
        allocations = [a for a, _c in st.pods.values()]
    allocated_mig: set[tuple[int, int, int]] = set()
    for a in allocations:
        for c in a.containers:
            for g in c.gpus:
                labels = [a.pod.split("/", 1)[0], a.pod.split("/", 1)[1], c.name, name]
                labels += [g.uuid, ZONE]
                fam["vGPUMemoryAllocated"].add_metric(labels, g.memory_mib * MIB)
                fam["vGPUCoreAllocated"].add_metric(labels, g.cores)
                fam["vGPUPodsDeviceAllocated"].add_metric(
                    [*labels, str(g.cores)], g.memory_mib * MIB
                )
                if g.mig is not None:
                    p = g.mig.placement
                    allocated_mig.add((g.index, p.start, p.size))
                    where = f"{p.start}:{p.size}"
                    mig_labels = [name, g.uuid, str(g.index), g.mig.profile, where, ZONE]
                    fam["nodeGPUMigInstance"].add_metric(mig_labels, 1)
    for gpu, (mem, cores, slots) in zip(st.inv.gpus, usage, strict=True):
        labels = [name, gpu.uuid, str(gpu.index), ZONE]
        fam["GPUDeviceMemoryLimit"].add_metric(labels, gpu.memory_mib * MIB)
        fam["GPUDeviceCoreLimit"].add_metric(labels, 100)
        fam["GPUDeviceMemoryAllocated"].add_metric([*labels, str(cores)], mem * MIB)
        fam["GPUDeviceCoreAllocated"].add_metric(labels, cores)
        fam["GPUDeviceSharedNum"].add_metric(labels, slots)
        for inst in gpu.mig.instances if gpu.mig else ():
            p = inst.placement
            if (gpu.index, p.start, p.size) not in allocated_mig:
                where = f"{p.start}:{p.size}"
                mig_labels = [name, gpu.uuid, str(gpu.index), inst.profile, where, ZONE]
                fam["nodeGPUMigInstance"].add_metric(mig_labels, 0)
    return st, version, {fname: f.samples for fname, f in fam.items() if f.samples}


class Families(Collector):
    """Metric families made already, for `generate_latest` to format."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


# each cluster family's HELP and TYPE lines, as prometheus-client writes them
HEADERS = [
    (name, generate_latest(Families([GaugeMetricFamily(name, text, labels=list(labels))])))
    for name, text, labels in FAMILIES
]

# a node's sample lines, by family name, as of one of its states (NodeState, version)
NodeText = tuple[NodeState, int, dict[str, bytes]]


def node_text(name: str, st: NodeState) -> NodeText:
    """The node's sample lines of the cluster families, formatted by
    prometheus-client (its HELP and TYPE lines left out)."""
    st, version, samples = node_samples(name, st)
    lines = {}
    for fname, some in samples.items():
        fam = GaugeMetricFamily(fname, "")
        fam.samples = some
        # "# HELP ...", "# TYPE ...", then the samples (no value has a raw newline)
        lines[fname] = generate_latest(Families([fam])).split(b"\n", 2)[2]
    return st, version, lines


class ClusterText:
    """The cluster families in the text format, each node's lines kept
    from scrape to scrape and made again only for a node whose state moved
    since (a pod held or released there: its version; its inventory
    published again: another NodeState).  Collecting and formatting every
    node's samples at each scrape cost 0.3-1.3 s of CPU at 1,000 nodes x 8
    GPUs (tests/bench/metrics_bench.py).  The same bytes as
    `generate_latest` over a collector yielding every node's samples."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self._kept: dict[str, NodeText] = {}
        self._lock = threading.Lock()  # two scrapes at once share `_kept`

    def text(self) -> bytes:
        with self._lock:
            kept: dict[str, NodeText] = {}
            for name, st in list(self.state.allocator.nodes.items()):
                hit = self._kept.get(name)
                # a version read without the node's lock: an equal one means
                # the lines are of the state before any change in progress
                if hit is None or hit[0] is not st or hit[1] != st.version:
                    hit = node_text(name, st)
                kept[name] = hit
            self._kept = kept
        parts = []
        for fname, header in HEADERS:
            parts.append(header)
            parts.extend(lines[fname] for _st, _v, lines in kept.values() if fname in lines)
        return b"".join(parts)


def unanswered_counter(registry: CollectorRegistry) -> Counter:
    """Binds whose Binding got no answer (extender.py `_send`), by what
    became of the pod's room: `bound` (its watch showed it bound: the bind
    answered done) or `kept` (held as an assumption; the bind answered an
    error)."""
    counter = Counter(
        "gpuvisor_scheduler_binds_unanswered",
        "Binds whose Binding got no answer from the API server (a timeout, a connection "
        "lost, a 504), by outcome (bound: seen bound, answered done; kept: room kept, "
        "answered an error)",
        ["outcome"],
        registry=registry,
    )
    for outcome in ("bound", "kept"):
        counter.labels(outcome)  # each shows from the start, at 0
    return counter


class Metrics:
    def __init__(self, state: ClusterState) -> None:
        self.cluster = ClusterText(state)
        # the extender's own metrics; the cluster's are `cluster`, before them
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "gpuvisor_scheduler_requests",
            "Extender requests by verb and result (ok, error)",
            ["verb", "result"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "gpuvisor_scheduler_request_seconds",
            "Time to answer an extender request",
            ["verb"],
            registry=self.registry,
        )
        self.wake = WakeCounters.register(self.registry)
        self.unanswered = unanswered_counter(self.registry)

    def exposition(self) -> bytes:
        """What GET /metrics answers (text format 0.0.4)."""
        return self.cluster.text() + generate_latest(self.registry)
