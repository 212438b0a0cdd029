"""Prometheus exposition of the node agent's state (docs/metrics.md).

A custom Collector reads the agent's state at scrape time, so reports cost
no metric-object churn.  Two sets of names: gpuvisor_* (ours) and HAMi's
vGPU-monitor names (hami_*), plus HAMi's legacy names behind
--legacy-metrics.  Host-level device numbers come from NVML when it loads.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from gpuvisor.shim.cli import shown
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .state import AgentState

log = logging.getLogger("gpuvisor.metrics")

CTR_LABELS = ["podnamespace", "podname", "ctrname", "deviceuuid", "deviceidx"]
DEV_LABELS = ["deviceuuid", "deviceidx"]
HAMI_CTR_LABELS = ["namespace", "pod", "container", "vdevice_index", "device_uuid"]
HAMI_HOST_LABELS = ["device_index", "device_uuid", "device_type", "node"]
LEGACY_CTR_LABELS = ["podnamespace", "podname", "ctrname", "vdeviceid", "deviceuuid"]
LEGACY_HOST_LABELS = ["deviceidx", "deviceuuid", "devicetype", "nodeid"]
GPU_INFO_LABELS = ["deviceuuid", "deviceidx", "model", "numa"]
MIG_LABELS = ["deviceuuid", "deviceidx", "gi_id", "profile", "placement", "miguuid"]
# A container's device under HAMi's vGPU-monitor names (HAMI_CTR_LABELS) and
# under its legacy ones (LEGACY_CTR_LABELS, --legacy-metrics): key: (name, help).
HAMI_CTR_GAUGES = {
    "used": ("hami_vgpu_memory_used_bytes", "vGPU device memory usage in bytes"),
    "limit": ("hami_vgpu_memory_limit_bytes", "vGPU device memory limit in bytes"),
    "mem": ("hami_container_device_memory_bytes", "Container device memory usage in bytes"),
    "util": (
        "hami_container_device_utilization_ratio",
        "Container device SM utilization ratio (0-100)",
    ),
}
LEGACY_CTR_GAUGES = {
    "used": ("vGPU_device_memory_usage_in_bytes", "vGPU device usage"),
    "limit": ("vGPU_device_memory_limit_in_bytes", "vGPU device limit"),
    "util": ("Device_utilization_desc_of_container", "Container device utilization description"),
}


@dataclass(frozen=True)
class HostGpu:
    index: int
    uuid: str
    name: str
    memory_used: int
    memory_total: int
    utilization: float | None  # percent, None: not supported


# Times nvmlDeviceGetProcessUtilization is asked before its samples are given
# up for the round (process_samples).
SAMPLE_TRIES = 5


def process_samples(nv: Any, handle: Any, since: int) -> list[Any]:
    """nvmlDeviceGetProcessUtilization(handle, since) with nv (pynvml):
    [] when no process has samples since then.  The binding asks NVML for
    the number of samples, then for the samples; when there are more by
    then (a process that started, or on a real driver a sample period that
    ended in between) the second call fails with INSUFFICIENT_SIZE, so it
    is asked again, up to SAMPLE_TRIES times.  Other NVML errors, and the
    last INSUFFICIENT_SIZE, are raised."""

    def once() -> list[Any]:
        try:
            return list(nv.nvmlDeviceGetProcessUtilization(handle, since))
        except nv.NVMLError_NotFound:
            return []

    for _ in range(SAMPLE_TRIES - 1):
        try:
            return once()
        except nv.NVMLError_InsufficientSize:
            continue
    return once()


# Reads the node inventory (docs/inventory.md) from an initialised NVML,
# given the node's name (None: the host name): gpuvisor.cluster's reader,
# passed in by the CLI group (the agent does not import the cluster half).
InventoryReader = Callable[[str | None], dict[str, Any]]


_T = TypeVar("_T")


class Fresh(Generic[_T]):
    """A value read again at most every max_age seconds.  A caller that
    finds it fresh takes it without the lock (no wait behind a per-process
    query holding it); otherwise the first to get the lock reads it (lock
    held), and those that waited for the lock take what it read."""

    def __init__(self, lock: threading.Lock, value: _T) -> None:
        self._lock = lock
        self._at = (-math.inf, value)

    def get(self, max_age: float, read: Callable[[], _T]) -> _T:
        ts, value = self._at
        if time.monotonic() - ts < max_age:
            return value
        with self._lock:
            ts, value = self._at
            if time.monotonic() - ts < max_age:
                return value
            value = read()
            self._at = (time.monotonic(), value)
            return value


class HostGpus:
    """Host-level device numbers from NVML; empty when NVML is unavailable."""

    def __init__(self, inventory: InventoryReader | None = None, node: str = "") -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._cache: Fresh[list[HostGpu]] = Fresh(self._lock, [])
        self._read_inventory = inventory
        self._node = node or None
        self._inventory: Fresh[dict[str, Any] | None] = Fresh(self._lock, None)
        # What failed, by query, as last logged: a failure goes on for as
        # long as the driver is in trouble, and the queries run every
        # scrape and every per-process read (2 a second).
        self._problems: dict[str, str] = {}
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as exc:  # NVMLError, OSError, ImportError: no host metrics
            log.info("NVML unavailable, host device metrics omitted: %s", exc)

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def _failed(self, query: str, exc: Exception) -> None:
        """Log that query failed, once while it keeps failing the same way
        (call with the lock held)."""
        text = str(exc)
        if self._problems.get(query) != text:
            self._problems[query] = text
            log.warning("%s failed: %s", query, text)

    def _answered(self, query: str) -> None:
        """query worked: a later failure is logged again (lock held)."""
        if self._problems.pop(query, None) is not None:
            log.warning("%s works again", query)

    def _ask(self, nv: Any, query: str, call: Callable[[], _T], failed: _T) -> _T:
        """call()'s answer to query, or failed when NVML raises (logged once
        while it keeps failing; lock held)."""
        try:
            answer = call()
        except nv.NVMLError as exc:
            self._failed(query, exc)
            return failed
        self._answered(query)
        return answer

    def read(self, max_age: float = 1.0) -> list[HostGpu]:
        nv = self._nvml
        if nv is None:
            return []
        return self._cache.get(max_age, partial(self._read_devices, nv))

    def _read_devices(self, nv: Any) -> list[HostGpu]:
        """Every device NVML can read (lock held): one it cannot (lost,
        resetting) is left out, not the whole node."""
        gpus: list[HostGpu] = []
        for i in range(self._ask(nv, "NVML query", nv.nvmlDeviceGetCount, 0)):
            read = partial(self._read_device, nv, i)
            gpu = self._ask(nv, f"NVML query of device {i}", read, None)
            if gpu is not None:
                gpus.append(gpu)
        return gpus

    @staticmethod
    def _read_device(nv: Any, i: int) -> HostGpu:
        h = nv.nvmlDeviceGetHandleByIndex(i)
        uuid = nv.nvmlDeviceGetUUID(h)
        name = nv.nvmlDeviceGetName(h)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        try:
            util: float | None = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
        except nv.NVMLError:
            util = None
        return HostGpu(
            index=i,
            uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
            name=name.decode() if isinstance(name, bytes) else str(name),
            memory_used=int(mem.used),
            memory_total=int(mem.total),
            utilization=util,
        )

    def inventory(self, max_age: float = 2.0) -> dict[str, Any] | None:
        """The node inventory document, read at most every max_age seconds;
        None without NVML or a reader, or when the reading fails (logged
        once while it keeps failing)."""
        nv, reader = self._nvml, self._read_inventory
        if nv is None or reader is None:
            return None
        read = partial(reader, self._node)
        return self._inventory.get(max_age, lambda: self._ask(nv, "NVML inventory", read, None))

    def process_use(self, window: float) -> dict[str, dict[int, float]]:
        """Per device uuid, each process's SM utilisation (percent, the
        mean of NVML's per-process samples of the last `window` seconds);
        PIDs as NVML gives them (the host's PID namespace on a node)."""
        nv = self._nvml
        if nv is None:
            return {}
        since = int((time.time() - window) * 1e6)
        out: dict[str, dict[int, float]] = {}
        with self._lock:
            count = self._ask(nv, "NVML per-process query", nv.nvmlDeviceGetCount, 0)
            for i in range(count):
                try:
                    h = nv.nvmlDeviceGetHandleByIndex(i)
                    uuid = nv.nvmlDeviceGetUUID(h)
                    samples = process_samples(nv, h, since)
                except nv.NVMLError:  # the device lost, or samples kept changing
                    continue
                seen: dict[int, list[float]] = {}
                for smp in samples:
                    seen.setdefault(int(smp.pid), []).append(float(smp.smUtil))
                key = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                out[key] = {pid: sum(v) / len(v) for pid, v in seen.items()}
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:
                log.debug("nvmlShutdown: %s", exc)
            self._nvml = None


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _gauges(table: dict[str, tuple[str, str]], labels: list[str]) -> dict[str, GaugeMetricFamily]:
    """A gauge per entry of a table of key: (name, help), all with these labels."""
    return {key: _gauge(name, doc, labels) for key, (name, doc) in table.items()}


def _one(
    kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, value: float
) -> Metric:
    """A metric of one sample, without labels."""
    metric = kind(name, doc, labels=[])
    metric.add_metric([], float(value))
    return metric


def _by_reason(name: str, doc: str, counts: dict[str, int]) -> CounterMetricFamily:
    """A counter of one sample per reason."""
    metric = CounterMetricFamily(name, doc, labels=["reason"])
    for reason, n in list(counts.items()):
        metric.add_metric([reason], float(n))
    return metric


class AgentCollector(Collector):
    def __init__(
        self, state: AgentState, gpus: HostGpus, legacy: bool = False, node: str = ""
    ) -> None:
        self.state = state
        self.gpus = gpus
        self.legacy = legacy
        # The host series' node label, as HAMi's monitor has it (NODE_NAME).
        self.node = node or socket.gethostname()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        state = self.state
        g = {
            "mem_used": _gauge(
                "gpuvisor_container_memory_used_bytes",
                "Device memory the container uses (its region's count), bytes",
                CTR_LABELS,
            ),
            "mem_limit": _gauge(
                "gpuvisor_container_memory_limit_bytes",
                "Container's device memory limit, bytes (absent: no limit)",
                CTR_LABELS,
            ),
            "mem_spilled": _gauge(
                "gpuvisor_container_memory_spilled_bytes",
                "Of the memory the container uses, bytes served from host memory "
                "(CUDA_OVERSUBSCRIBE); the rest is on the device",
                CTR_LABELS,
            ),
            "mem_phys": _gauge(
                "gpuvisor_container_memory_physical_bytes",
                "Physical memory of the device as the container's region records it, bytes",
                CTR_LABELS,
            ),
            "share": _gauge(
                "gpuvisor_container_sm_share_ratio",
                "Share of the GPU's time the container's kernels used since the last report (0..1)",
                CTR_LABELS,
            ),
            "sm_limit": _gauge(
                "gpuvisor_container_sm_limit_ratio",
                "Container's SM-time limit (0..1; absent: no limit)",
                CTR_LABELS,
            ),
            "enforced": _gauge(
                "gpuvisor_container_sm_enforced_ratio",
                "Share the container's launch gate enforces now (0..1)",
                CTR_LABELS,
            ),
            "throttled": _gauge(
                "gpuvisor_container_throttled",
                "1 if launches waited at the gate since the previous report",
                CTR_LABELS,
            ),
            "yield": _gauge(
                "gpuvisor_container_yield",
                "1 if the agent asks this low-priority container to yield the device",
                CTR_LABELS,
            ),
        }
        oom = CounterMetricFamily(
            "gpuvisor_container_oom_refusals",
            "Allocations refused because they would pass the container's limit",
            labels=CTR_LABELS,
        )
        ctr_labels = ["podnamespace", "podname", "ctrname"]
        procs = _gauge(
            "gpuvisor_container_processes", "Processes the container reported", ctr_labels
        )
        prio = _gauge(
            "gpuvisor_container_priority",
            "Container's task priority (0 high, 1 low; CUDA_TASK_PRIORITY unset: 1)",
            ctr_labels,
        )
        last = _gauge(
            "gpuvisor_container_last_report_timestamp_seconds",
            "Unix time the agent received the container's latest report",
            ctr_labels,
        )
        h = _gauges(HAMI_CTR_GAUGES, HAMI_CTR_LABELS)
        legacy = self.legacy
        lg = _gauges(LEGACY_CTR_GAUGES, LEGACY_CTR_LABELS) if legacy else {}
        if legacy:
            lg["desc"] = _gauge(
                "Device_memory_desc_of_container",
                "Container device memory description",
                [*LEGACY_CTR_LABELS, "context", "module", "data", "offset"],
            )

        for st in list(state.containers.values()):
            r = st.report
            cid = st.id
            # A cgroup path (a container named by it) may hold characters
            # that are not printable: escaped, as `gpuvisor top` shows them.
            ns, pod, ctr = (shown(x) for x in cid.labels)
            base = [ns, pod, ctr]
            procs.add_metric(base, float(len(r.pids)))
            prio.add_metric(base, float(r.priority))
            last.add_metric(base, st.last_wall)
            yields = None
            now = time.monotonic()
            for d in r.devices:
                share = state.share_of(cid.key, r, d, now)
                idx = str(d.index)
                lv = [ns, pod, ctr, d.uuid, idx]
                g["mem_used"].add_metric(lv, float(d.memory_used))
                if d.memory_limit is not None:
                    g["mem_limit"].add_metric(lv, float(d.memory_limit))
                g["mem_spilled"].add_metric(lv, float(d.memory_spilled))
                g["mem_phys"].add_metric(lv, float(d.memory_physical))
                g["share"].add_metric(lv, share / 100.0)
                if d.sm_limit is not None:
                    g["sm_limit"].add_metric(lv, d.sm_limit / 100.0)
                g["enforced"].add_metric(lv, d.sm_enforced / 100.0)
                g["throttled"].add_metric(lv, 1.0 if d.throttled else 0.0)
                if r.priority != 0:
                    if yields is None:
                        yields = _yields(state, st)
                    g["yield"].add_metric(lv, 1.0 if yields.get(d.uuid) else 0.0)
                else:
                    g["yield"].add_metric(lv, 0.0)
                oom.add_metric(lv, float(d.oom_refusals))
                hv = [ns, pod, ctr, idx, d.uuid]
                limit = d.memory_limit if d.memory_limit is not None else d.memory_physical
                h["used"].add_metric(hv, float(d.memory_used))
                h["limit"].add_metric(hv, float(limit))
                h["mem"].add_metric(hv, float(d.memory_used))
                h["util"].add_metric(hv, share)
                if legacy:
                    lv2 = [ns, pod, ctr, idx, d.uuid]
                    lg["used"].add_metric(lv2, float(d.memory_used))
                    lg["limit"].add_metric(lv2, float(limit))
                    lg["desc"].add_metric(
                        [*lv2, "0", "0", str(d.memory_used), "0"], float(d.memory_used)
                    )
                    lg["util"].add_metric(lv2, share)
        yield from g.values()
        yield oom
        yield procs
        yield prio
        yield last
        yield from h.values()
        yield from lg.values()

        yield from self._agent_metrics()
        yield from self._host_metrics()
        yield from self._inventory_metrics()

    def _agent_metrics(self) -> Iterator[Metric]:
        state = self.state
        library = state.build["library"]
        lib_fields = library if isinstance(library, dict) else {}
        build = GaugeMetricFamily(
            "gpuvisor_build_info",
            "Always 1: the node agent's release and the library's release and build id",
            labels=["version", "library_version", "library_build_id"],
        )
        build.add_metric(
            [
                str(state.build["version"]),
                str(lib_fields.get("version", "")),
                str(lib_fields.get("build_id", "")),
            ],
            1.0,
        )
        yield build
        yield _one(
            CounterMetricFamily,
            "gpuvisor_agent_reports",
            "Reports accepted by the node agent",
            state.reports_total,
        )
        yield _by_reason(
            "gpuvisor_agent_rejected_reports",
            "Messages the node agent rejected, by reason",
            state.rejected,
        )
        yield _by_reason(
            "gpuvisor_agent_disconnects",
            "Connections the node agent closed, by reason",
            state.disconnects,
        )
        yield _one(
            GaugeMetricFamily,
            "gpuvisor_agent_connections",
            "Open supervisor connections",
            state.connections,
        )
        yield _one(
            GaugeMetricFamily,
            "gpuvisor_agent_containers",
            "Containers with a recent report",
            len(state.containers),
        )
        yield _one(
            CounterMetricFamily,
            "gpuvisor_agent_expired_containers",
            "Containers expired for lack of reports",
            state.expired_total,
        )
        yield _one(
            CounterMetricFamily,
            "gpuvisor_agent_replaced_containers",
            "Containers dropped for a newer label set from the same cgroup",
            state.replaced_total,
        )

    def _host_metrics(self) -> Iterator[Metric]:
        gpus = self.gpus.read()
        if not gpus:
            return
        used = _gauge(
            "gpuvisor_device_memory_used_bytes", "Device memory used (NVML), bytes", DEV_LABELS
        )
        total = _gauge(
            "gpuvisor_device_memory_total_bytes", "Device memory (NVML), bytes", DEV_LABELS
        )
        util = _gauge(
            "gpuvisor_device_utilization_ratio", "GPU utilization (NVML, 0..1)", DEV_LABELS
        )
        h_used = _gauge(
            "hami_host_gpu_memory_used_bytes", "GPU device memory usage in bytes", HAMI_HOST_LABELS
        )
        h_util = _gauge(
            "hami_host_gpu_utilization_ratio",
            "GPU core utilization ratio (0-100)",
            HAMI_HOST_LABELS,
        )
        l_used = _gauge("HostGPUMemoryUsage", "GPU device memory usage", LEGACY_HOST_LABELS)
        l_util = _gauge("HostCoreUtilization", "GPU core utilization", LEGACY_HOST_LABELS)
        unmanaged = _gauge(
            "gpuvisor_device_unmanaged_processes",
            "Processes NVML saw working on the GPU that no container under gpuvisor "
            "reports (their SM use is not limited)",
            DEV_LABELS,
        )
        # What the last per-process reading found (unmanaged.py).
        watched = self.state.unmanaged.gpus
        for gpu in gpus:
            seen = watched.get(gpu.uuid)
            if seen is not None and seen.judged:
                unmanaged.add_metric([gpu.uuid, str(gpu.index)], float(len(seen.unmanaged_pids)))
            dv = [gpu.uuid, str(gpu.index)]
            hv = [str(gpu.index), gpu.uuid, "NVIDIA-" + gpu.name, self.node]
            used.add_metric(dv, float(gpu.memory_used))
            total.add_metric(dv, float(gpu.memory_total))
            h_used.add_metric(hv, float(gpu.memory_used))
            l_used.add_metric(hv, float(gpu.memory_used))
            if gpu.utilization is not None:
                util.add_metric(dv, gpu.utilization / 100.0)
                h_util.add_metric(hv, gpu.utilization)
                l_util.add_metric(hv, gpu.utilization)
        yield used
        yield total
        yield util
        yield h_used
        yield h_util
        yield unmanaged
        if self.legacy:
            yield l_used
            yield l_util

    def _inventory_metrics(self) -> Iterator[Metric]:
        """gpuvisor_gpu_info per GPU, and per MIG GPU instance its memory and
        whether a process uses it, from the node inventory (docs/inventory.md)."""
        doc = self.gpus.inventory()
        if doc is None:
            return
        info = _gauge(
            "gpuvisor_gpu_info",
            "A GPU of the node (1): its model and NUMA node (empty when unknown)",
            GPU_INFO_LABELS,
        )
        memory = _gauge(
            "gpuvisor_mig_instance_memory_bytes", "Memory of a MIG GPU instance, bytes", MIG_LABELS
        )
        in_use = _gauge(
            "gpuvisor_mig_instance_in_use",
            "1 while a process runs on a MIG GPU instance, else 0",
            MIG_LABELS,
        )
        for gpu in doc["gpus"]:
            if gpu["uuid"] is None:
                continue
            numa = "" if gpu["numa"] < 0 else str(gpu["numa"])
            info.add_metric([gpu["uuid"], str(gpu["index"]), gpu["model"] or "", numa], 1.0)
            for inst in (gpu["mig"] or {}).get("instances", []):
                place = inst["placement"]
                labels = [
                    gpu["uuid"],
                    str(gpu["index"]),
                    str(inst["gi_id"]),
                    inst["profile"] or "",
                    "" if place is None else f"{place['start']}:{place['size']}",
                    inst["uuid"] or "",
                ]
                memory.add_metric(labels, float(inst["memory_mib"]) * (1 << 20))
                in_use.add_metric(labels, 1.0 if inst["in_use"] else 0.0)
        yield info
        yield memory
        yield in_use


def _yields(state: AgentState, st: Any) -> dict[str, bool]:
    now = time.monotonic()
    return {d.uuid: state.busy_for(st.id.key, d.uuid, now) for d in st.report.devices}


def render(collector: AgentCollector, accept: str | None) -> tuple[bytes, str]:
    encoder, content_type = choose_encoder(accept or "")
    return encoder(collector.registry), content_type
