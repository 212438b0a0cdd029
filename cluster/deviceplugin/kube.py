"""The device plugin's view of the Kubernetes API: a pod's allocation
annotation (read when its container starts), and the placements bound to
this node that no container has realised yet (GetPreferredAllocation).

PodSource is what the plugin needs; KubePods reads it with the Kubernetes
client; tests pass their own.

kubelet's PodResources API names a pod by namespace and name only, so the
pod the API has under that name may not be the one kubelet admitted (it
was deleted, and maybe created again).  KubePods, given this node's name,
answers only for a pod bound to this node; PodNotHere says why not, in
one line."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

from gpuvisor.cluster.allocation import ANNOTATION

from .grant import GrantError, PodGrant, parse_grant

API_TIMEOUT = 10.0  # seconds; kubelet gives PreStartContainer 30


class PodNotHere(Exception):
    """The API has no pod of that name bound to this node; the message
    follows "pod ns/name" (": not found in the API ...", " is bound to ...")."""


def api_error(exc: Exception) -> str:
    """One line for an error of the Kubernetes client (its ApiException
    spans lines: status, reason, headers, body): the HTTP status, reason
    and the Status message the API server sent."""
    status = getattr(exc, "status", None)
    if status is None:
        return " ".join(str(exc).split())
    message = ""
    body = getattr(exc, "body", None)
    try:
        doc = json.loads(body) if body else None
    except (TypeError, ValueError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("message"), str):
        message = f": {doc['message']}"
    reason = getattr(exc, "reason", None) or ""
    return " ".join(f"HTTP {status} {reason}{message}".split())


class PodSource(Protocol):
    def pod(self, namespace: str, pod: str) -> Mapping[str, Any]:
        """The pod as the API server has it (JSON: its metadata, with the
        `gpuvisor.io/allocation` annotation, and its spec, with the
        containers' resource requests)."""
        ...

    def bound(self, node: str) -> list[PodGrant]:
        """The grants of the pods bound to node and not started (Pending),
        oldest first, with their UIDs where known."""
        ...


def allocation_of(pod: Mapping[str, Any]) -> str | None:
    """The pod's `gpuvisor.io/allocation` annotation; None if it has none."""
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    value = annotations.get(ANNOTATION) if isinstance(annotations, Mapping) else None
    return value if isinstance(value, str) else None


class KubePods:
    """PodSource through the Kubernetes API (in-cluster config, else
    kubeconfig); with node, allocation answers only for a pod bound to it."""

    def __init__(self, api: Any = None, node: str = "") -> None:
        if api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = client.CoreV1Api()
        self.api = api
        self.node = node

    def pod(self, namespace: str, pod: str) -> Mapping[str, Any]:
        """The pod (JSON); PodNotHere when the API has no such pod, or has
        one not bound to this node (deleted and created again, bound
        elsewhere or not yet), RuntimeError (one line) when it fails."""
        try:
            raw = self.api.read_namespaced_pod(
                pod, namespace, _preload_content=False, _request_timeout=API_TIMEOUT
            )
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                raise PodNotHere(
                    ": not found in the API (deleted since kubelet admitted it)"
                ) from None
            raise RuntimeError(api_error(exc)) from None
        doc = json.loads(raw.data)
        if not isinstance(doc, Mapping):
            raise RuntimeError(f"pod {namespace}/{pod}: the API answered {type(doc).__name__}")
        spec = doc.get("spec")
        bound = spec.get("nodeName") if isinstance(spec, Mapping) else None
        if self.node and bound != self.node:
            if not bound:
                raise PodNotHere(
                    " is not bound to a node (it is not the pod kubelet admitted here: "
                    "deleted and created again?)"
                )
            raise PodNotHere(
                f" is bound to node {bound}, not to this node {self.node} (it is not the pod "
                "kubelet admitted here: deleted and created again?)"
            )
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
                out.append(replace(parse_grant(text), uid=p.metadata.uid or ""))
            except GrantError:
                continue  # PreStartContainer reports it, for the pod concerned
        return out
