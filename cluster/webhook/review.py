"""The admission decision for one Pod (docs/kubernetes.md, "Admission webhook").

`admit(review, config)` answers an admission.k8s.io/v1 AdmissionReview.  A
Pod that asks for no GPU resource passes unchanged.  A GPU Pod is read with
the allocator's own parser (`gpuvisor.cluster.request.pod_request`), so the
webhook refuses exactly what the scheduler extender would refuse, with the
parser's one-line message; an admitted one gets a JSONPatch that sets the
scheduler name and writes out the defaults the parser applied (HAMi's
webhook defaults: `nvidia.com/gpu: 1` when only memory or cores are asked,
`nvidia.com/gpucores: 100` for a whole GPU).  Pure: no I/O.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..inventory_model import DocumentError
from ..request import GPU, GPUCORES, GPUMEM, GPUMEM_PCT, ContainerRequest, pod_request

DEFAULT_SCHEDULER = "gpuvisor-scheduler"
# The scheduler a Pod gets when it names none; the webhook takes those over.
KUBE_DEFAULT_SCHEDULER = "default-scheduler"
GPU_RESOURCES = (GPU, GPUMEM, GPUMEM_PCT, GPUCORES)
API_VERSION = "admission.k8s.io/v1"


class ReviewError(ValueError):
    """The AdmissionReview itself is malformed (answered with HTTP 400)."""


# Who may write a pod's gpuvisor.io/allocation (guard.py): the scheduler
# extender, which runs as this service account (deploy/rbac.yaml).
DEFAULT_ALLOCATION_WRITER = "system:serviceaccount:gpuvisor:gpuvisor-scheduler"


@dataclass(frozen=True)
class WebhookConfig:
    scheduler_name: str = DEFAULT_SCHEDULER
    allocation_writers: tuple[str, ...] = (DEFAULT_ALLOCATION_WRITER,)


def _pointer(*parts: str | int) -> str:
    """A JSON pointer (RFC 6901): `nvidia.com/gpu` becomes `nvidia.com~1gpu`."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _resources(container: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    res = container.get("resources") or {}
    if not isinstance(res, Mapping):
        return {}, {}
    limits = res.get("limits") or {}
    requests = res.get("requests") or {}
    return (
        limits if isinstance(limits, Mapping) else {},
        requests if isinstance(requests, Mapping) else {},
    )


def _containers(spec: Mapping[str, Any]) -> list[tuple[str, int, Any]]:
    """(spec key, index, container) for init containers, then app containers."""
    out: list[tuple[str, int, Any]] = []
    for key in ("initContainers", "containers"):
        items = spec.get(key) or []
        if isinstance(items, list):
            out += [(key, i, c) for i, c in enumerate(items)]
    return out


def asks_for_gpu(container: Any) -> bool:
    if not isinstance(container, Mapping):
        return False
    limits, requests = _resources(container)
    return any(r in limits or r in requests for r in GPU_RESOURCES)


def _defaults_patch(
    key: str, index: int, container: Mapping[str, Any], parsed: ContainerRequest
) -> list[dict[str, Any]]:
    """Write out the defaults `pod_request` applied, where the container left them out."""
    limits, requests = _resources(container)
    added: dict[str, str] = {}
    if parsed.count and GPU not in limits and GPU not in requests:
        added[GPU] = str(parsed.count)
    if parsed.count and GPUCORES not in limits and GPUCORES not in requests and parsed.exclusive:
        added[GPUCORES] = str(parsed.cores)
    if not added:
        return []
    res = container.get("resources")
    if not isinstance(res, Mapping) or not res:
        path = _pointer("spec", key, index, "resources")
        return [{"op": "add", "path": path, "value": {"limits": added}}]
    if not isinstance(res.get("limits"), Mapping) or not res.get("limits"):
        path = _pointer("spec", key, index, "resources", "limits")
        return [{"op": "add", "path": path, "value": added}]
    return [
        {"op": "add", "path": _pointer("spec", key, index, "resources", "limits", name), "value": v}
        for name, v in added.items()
    ]


@dataclass(frozen=True)
class Decision:
    """What the webhook answers: allowed with a patch (possibly empty), or a refusal."""

    allowed: bool
    patch: tuple[dict[str, Any], ...] = ()
    message: str = ""
    warnings: tuple[str, ...] = ()


def decide(pod: Any, namespace: str, config: WebhookConfig) -> Decision:
    """The decision for a Pod being created in `namespace`."""
    if not isinstance(pod, Mapping) or not isinstance(pod.get("spec"), Mapping):
        return Decision(True)
    spec: Mapping[str, Any] = pod["spec"]
    entries = _containers(spec)
    if not any(asks_for_gpu(c) for _, _, c in entries):
        return Decision(True)
    meta = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    name = meta.get("name") or meta.get("generateName") or ""
    shown = f"pod {namespace}/{name}"

    scheduler = spec.get("schedulerName") or ""
    if scheduler not in ("", KUBE_DEFAULT_SCHEDULER, config.scheduler_name):
        # As HAMi: a Pod that names another scheduler is that scheduler's.
        return Decision(
            True,
            warnings=(
                f"{shown} asks for GPUs but names scheduler {scheduler!r}: gpuvisor leaves it "
                f"alone, and its device plugin starts only pods {config.scheduler_name!r} placed",
            ),
        )
    node_name = spec.get("nodeName")
    if node_name:
        return Decision(
            False,
            message=f"spec.nodeName: set to {node_name!r}, which bypasses "
            f"{config.scheduler_name}; a GPU pod must be placed by it "
            "(choose the node with a nodeSelector on kubernetes.io/hostname instead)",
        )
    for key, index, c in entries:
        security = c.get("securityContext") if isinstance(c, Mapping) else None
        if asks_for_gpu(c) and isinstance(security, Mapping) and security.get("privileged"):
            return Decision(
                False,
                message=f"spec.{key}[{index}].securityContext.privileged: true in a container "
                "that asks for GPUs; a privileged container sees every GPU of its node, "
                "beyond its limits",
            )

    # The allocator's parser needs a name; one made from generateName does
    # not exist yet at admission.
    named = copy.deepcopy(dict(pod))
    named["metadata"] = {**meta, "name": name or "pod", "namespace": namespace}
    try:
        request = pod_request(named)
    except DocumentError as exc:
        return Decision(False, message=str(exc))

    patch: list[dict[str, Any]] = []
    if scheduler != config.scheduler_name:
        op = "replace" if "schedulerName" in spec else "add"
        patch.append({"op": op, "path": "/spec/schedulerName", "value": config.scheduler_name})
    for (key, index, c), parsed in zip(entries, request.containers, strict=True):
        patch += _defaults_patch(key, index, c, parsed)
    return Decision(True, patch=tuple(patch))


def review_request(review: Any) -> Mapping[str, Any]:
    if not isinstance(review, Mapping):
        raise ReviewError("the body is not a JSON object")
    if review.get("apiVersion") != API_VERSION or review.get("kind") != "AdmissionReview":
        raise ReviewError(
            f"expected an {API_VERSION} AdmissionReview, got "
            f"{review.get('apiVersion')!r} {review.get('kind')!r}"
        )
    request = review.get("request")
    if not isinstance(request, Mapping) or not isinstance(request.get("uid"), str):
        raise ReviewError("request.uid: missing")
    return request


def admit(review: Any, config: WebhookConfig) -> dict[str, Any]:
    """The AdmissionReview response to an AdmissionReview request; raises ReviewError."""
    request = review_request(review)
    kind = request.get("kind") if isinstance(request.get("kind"), Mapping) else {}
    assert isinstance(kind, Mapping)
    is_pod_create = (kind.get("group", "") == "" and kind.get("kind") == "Pod") and request.get(
        "operation"
    ) == "CREATE"
    if is_pod_create and not request.get("subResource"):
        decision = decide(request.get("object"), str(request.get("namespace") or ""), config)
    else:
        decision = Decision(True)
    response: dict[str, Any] = {"uid": request["uid"], "allowed": decision.allowed}
    if not decision.allowed:
        response["status"] = {
            "code": 400,
            "reason": "BadRequest",
            "message": decision.message,
        }
    if decision.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(list(decision.patch)).encode()).decode()
    if decision.warnings:
        response["warnings"] = list(decision.warnings)
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def patch_of(response: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
    """The decoded JSONPatch of an AdmissionReview response (empty when none)."""
    raw = response["response"].get("patch")
    return json.loads(base64.b64decode(raw)) if raw else []
