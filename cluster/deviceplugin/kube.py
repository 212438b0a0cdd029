"""The device plugin's view of the Kubernetes API: a pod's allocation
annotation (read when its container starts), and the placements bound to
this node that no container has realised yet (GetPreferredAllocation).

PodSource is what the plugin needs; KubePods reads it with the Kubernetes
client; tests pass their own."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from gpuvisor.cluster.allocation import ANNOTATION

from .grant import GrantError, PodGrant, parse_grant

API_TIMEOUT = 10.0  # seconds; kubelet gives PreStartContainer 30


class PodSource(Protocol):
    def pod(self, namespace: str, pod: str) -> Mapping[str, Any]:
        """The pod as the API server has it (JSON: its metadata, with the
        `gpuvisor.io/allocation` annotation, and its spec, with the
        containers' resource requests)."""
        ...

    def bound(self, node: str) -> list[PodGrant]:
        """The grants of the pods bound to node, oldest bind first."""
        ...


def allocation_of(pod: Mapping[str, Any]) -> str | None:
    """The pod's `gpuvisor.io/allocation` annotation; None if it has none."""
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    value = annotations.get(ANNOTATION) if isinstance(annotations, Mapping) else None
    return value if isinstance(value, str) else None


class KubePods:
    """PodSource through the Kubernetes API (in-cluster config, else kubeconfig)."""

    def __init__(self, api: Any = None) -> None:
        if api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = client.CoreV1Api()
        self.api = api

    def pod(self, namespace: str, pod: str) -> Mapping[str, Any]:
        raw = self.api.read_namespaced_pod(
            pod, namespace, _preload_content=False, _request_timeout=API_TIMEOUT
        )
        doc = json.loads(raw.data)
        if not isinstance(doc, Mapping):
            raise ValueError(f"pod {namespace}/{pod}: the API answered {type(doc).__name__}")
        return doc

    def bound(self, node: str) -> list[PodGrant]:
        pods = self.api.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node},status.phase=Pending",
            _request_timeout=API_TIMEOUT,
        ).items
        pods.sort(key=lambda p: p.metadata.creation_timestamp)
        out = []
        for p in pods:
            text = (p.metadata.annotations or {}).get(ANNOTATION)
            if not isinstance(text, str):
                continue
            try:
                out.append(parse_grant(text))
            except GrantError:
                continue  # PreStartContainer reports it, for the pod concerned
        return out
