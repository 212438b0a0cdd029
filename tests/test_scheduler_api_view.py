"""The extender's watches read the API's JSON without building the
client's models (cluster/scheduler/api_view.py): what ClusterState reads of
a pod or node is the same either way."""

from __future__ import annotations

import json
from typing import Any

import kubernetes.client
from gpuvisor.cluster.allocation import ANNOTATION
from gpuvisor.cluster.scheduler.api_view import ApiView, camel, view
from gpuvisor.cluster.scheduler.state import started_containers

API = kubernetes.client.ApiClient()


def pod_doc() -> dict[str, Any]:
    running = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    waiting = {"waiting": {"reason": "ContainerCreating"}}

    def status(name: str, state: dict[str, Any], restarts: int = 0) -> dict[str, Any]:
        return {
            "name": name,
            "image": "busybox",
            "imageID": "",
            "ready": False,
            "restartCount": restarts,
            "state": state,
        }

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u-1",
            "resourceVersion": "42",
            "annotations": {ANNOTATION: "{}", "other": "x"},
            "labels": {"app": "a"},
        },
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
        "status": {
            "phase": "Pending",
            "initContainerStatuses": [status("init", {"terminated": {"exitCode": 0}})],
            "containerStatuses": [
                status("main", running),
                status("side", waiting),
                status("again", waiting, restarts=2),
            ],
        },
    }


def test_a_pod_reads_the_same_as_its_model() -> None:
    doc = pod_doc()
    model = API.deserialize(json.dumps(doc), "V1Pod", "application/json")
    raw = view(json.loads(json.dumps(doc)))
    assert isinstance(raw, ApiView)
    for field in ("name", "namespace", "uid", "resource_version", "annotations", "labels"):
        assert getattr(raw.metadata, field) == getattr(model.metadata, field), field
    assert isinstance(raw.metadata.annotations, dict)
    assert raw.status.phase == model.status.phase == "Pending"
    assert started_containers(raw) == started_containers(model) == {"init", "main", "again"}
    assert raw.metadata.deletion_timestamp is None  # absent: None, as in the model
    assert raw.spec.node_name is None


def test_names_and_missing_parts() -> None:
    assert camel("resource_version") == "resourceVersion"
    assert camel("init_container_statuses") == "initContainerStatuses"
    assert camel("phase") == "phase"
    assert view({"status": None}).status is None
    assert started_containers(view({"metadata": {"name": "x"}})) == frozenset()
    assert view([{"a": 1}, 2])[0].a == 1
