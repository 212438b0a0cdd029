"""Pods for the device plugin's test PodSources (tests/test_deviceplugin.py,
tests/test_deviceplugin_mig.py), which hold only allocation annotations:
the pod each annotation belongs to, asking for exactly what it grants (the
plugin checks a record against its pod's requests,
cluster/deviceplugin/within.py)."""

from __future__ import annotations

import json
from typing import Any

from gpuvisor.cluster.allocation import ANNOTATION


def pod_asking_for(namespace: str, name: str, text: str) -> dict[str, Any]:
    """The pod whose `gpuvisor.io/allocation` is `text`, its containers
    asking for what the record grants each (a record that does not parse
    gets containers without GPUs: the plugin refuses it first anyway)."""
    try:
        doc = json.loads(text)
        containers = [c for c in doc["containers"] if isinstance(c, dict)]
    except (ValueError, KeyError, TypeError):
        containers = []
    spec: dict[str, Any] = {"containers": [], "initContainers": []}
    for c in containers:
        gpus = [g for g in c.get("gpus") or [] if isinstance(g, dict)]
        limits: dict[str, Any] = {}
        if gpus:
            limits["nvidia.com/gpu"] = len(gpus)
            mems = [int(g["memory_mib"]) for g in gpus if isinstance(g.get("memory_mib"), int)]
            cores = [int(g["cores"]) for g in gpus if isinstance(g.get("cores"), int)]
            if mems:
                limits["nvidia.com/gpumem"] = max(1, *mems)
            limits["nvidia.com/gpucores"] = max([0, *cores])
        if c.get("priority") in (0, 1):
            limits["nvidia.com/priority"] = c["priority"]
        key = "initContainers" if c.get("init") is True else "containers"
        item: dict[str, Any] = {"name": str(c.get("name")), "resources": {"limits": limits}}
        if key == "initContainers" and c.get("sidecar") is True:
            item["restartPolicy"] = "Always"  # a sidecar (KEP-753)
        spec[key].append(item)
    if not spec["containers"]:
        spec["containers"] = [{"name": "main"}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": {ANNOTATION: text}},
        "spec": spec,
    }
