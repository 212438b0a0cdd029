"""Prometheus series from the node inventory (docs/metrics.md): one
`gpuvisor_gpu_info` per GPU, and per MIG GPU instance its memory and whether
a process uses it."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from .inventory import Document

GPU_INFO_LABELS = ["deviceuuid", "deviceidx", "model", "numa"]
MIG_LABELS = ["deviceuuid", "deviceidx", "gi_id", "profile", "placement", "miguuid"]
MiB = 1 << 20


def inventory_metrics(doc: Document) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "gpuvisor_gpu_info",
        "A GPU of the node (1): its model and NUMA node (empty when unknown)",
        labels=GPU_INFO_LABELS,
    )
    memory = GaugeMetricFamily(
        "gpuvisor_mig_instance_memory_bytes",
        "Memory of a MIG GPU instance, bytes",
        labels=MIG_LABELS,
    )
    in_use = GaugeMetricFamily(
        "gpuvisor_mig_instance_in_use",
        "1 while a process runs on a MIG GPU instance, else 0",
        labels=MIG_LABELS,
    )
    for gpu in doc["gpus"]:
        if gpu["uuid"] is None:
            continue
        numa = "" if gpu["numa"] is None else str(gpu["numa"])
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
            memory.add_metric(labels, float(inst["memory_mib"] * MiB))
            in_use.add_metric(labels, 1.0 if inst["in_use"] else 0.0)
    yield info
    yield memory
    yield in_use
