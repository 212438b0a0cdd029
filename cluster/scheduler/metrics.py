"""Cluster metrics with HAMi's scheduler names (docs/kubernetes.md), read
from the allocator at each scrape, plus the extender's own request counts."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .state import ClusterState

MIB = 1 << 20
ZONE = "vGPU"


class ClusterCollector(Collector):
    def __init__(self, state: ClusterState) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        dev = ["nodeid", "deviceuuid", "deviceidx", "zone"]
        mem_limit = GaugeMetricFamily(
            "GPUDeviceMemoryLimit", "Device memory limit for a certain GPU (bytes)", labels=dev
        )
        core_limit = GaugeMetricFamily(
            "GPUDeviceCoreLimit", "Device core limit for a certain GPU (percent)", labels=dev
        )
        mem_alloc = GaugeMetricFamily(
            "GPUDeviceMemoryAllocated",
            "Device memory allocated for a certain GPU (bytes)",
            labels=[*dev, "devicecores"],
        )
        core_alloc = GaugeMetricFamily(
            "GPUDeviceCoreAllocated", "Device core allocated for a certain GPU", labels=dev
        )
        shared = GaugeMetricFamily(
            "GPUDeviceSharedNum", "Number of containers sharing this GPU", labels=dev
        )
        ctr = ["podnamespace", "podname", "containeridx", "nodename", "deviceuuid", "zone"]
        v_mem = GaugeMetricFamily(
            "vGPUMemoryAllocated", "vGPU memory allocated from a container (bytes)", labels=ctr
        )
        v_core = GaugeMetricFamily(
            "vGPUCoreAllocated", "vGPU core allocated from a container", labels=ctr
        )
        pods = GaugeMetricFamily(
            "vGPUPodsDeviceAllocated",
            "vGPU memory allocated to a pod's container on a device (bytes)",
            labels=[*ctr, "deviceusedcore"],
        )
        mig = GaugeMetricFamily(
            "nodeGPUMigInstance",
            "MIG instances of a GPU: 1 allocated to a pod, 0 existing and free",
            labels=["nodeid", "deviceuuid", "deviceidx", "migname", "placement", "zone"],
        )
        for name, st in list(self.state.allocator.nodes.items()):
            with st.lock:
                usage = [(st.mem[i], st.cores[i], st.slots[i]) for i in range(len(st.inv.gpus))]
                allocations = [a for a, _c in st.pods.values()]
            allocated_mig: set[tuple[int, int, int]] = set()
            for a in allocations:
                for c in a.containers:
                    for g in c.gpus:
                        labels = [a.pod.split("/", 1)[0], a.pod.split("/", 1)[1], c.name, name]
                        labels += [g.uuid, ZONE]
                        v_mem.add_metric(labels, g.memory_mib * MIB)
                        v_core.add_metric(labels, g.cores)
                        pods.add_metric([*labels, str(g.cores)], g.memory_mib * MIB)
                        if g.mig is not None:
                            p = g.mig.placement
                            allocated_mig.add((g.index, p.start, p.size))
                            where = f"{p.start}:{p.size}"
                            mig_labels = [name, g.uuid, str(g.index), g.mig.profile, where, ZONE]
                            mig.add_metric(mig_labels, 1)
            for gpu, (mem, cores, slots) in zip(st.inv.gpus, usage, strict=True):
                labels = [name, gpu.uuid, str(gpu.index), ZONE]
                mem_limit.add_metric(labels, gpu.memory_mib * MIB)
                core_limit.add_metric(labels, 100)
                mem_alloc.add_metric([*labels, str(cores)], mem * MIB)
                core_alloc.add_metric(labels, cores)
                shared.add_metric(labels, slots)
                for inst in gpu.mig.instances if gpu.mig else ():
                    p = inst.placement
                    if (gpu.index, p.start, p.size) not in allocated_mig:
                        where = f"{p.start}:{p.size}"
                        mig_labels = [name, gpu.uuid, str(gpu.index), inst.profile, where, ZONE]
                        mig.add_metric(mig_labels, 0)
        yield from (mem_limit, core_limit, mem_alloc, core_alloc, shared, v_mem, v_core, pods, mig)


class Metrics:
    def __init__(self, state: ClusterState) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(ClusterCollector(state))
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
