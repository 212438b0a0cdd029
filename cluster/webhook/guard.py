"""Who may write a pod's `gpuvisor.io/allocation` (docs/security.md, "The
cluster half"; docs/kubernetes.md, "Admission webhook").

The record is the scheduler extender's: it writes it in the pod's Binding
(the `pods/binding` subresource, which this webhook is not asked about),
and the device plugin turns it into the containers' limits.  A pod's
annotations are otherwise writable by whoever may edit the pod, so
`guard(review, config)` answers the validating webhook (POST /validate):
a Pod created with the record, or an update (of the pod or its status)
that sets, changes or removes it, is refused unless the requester is one
of `config.allocation_writers`.  Everything else is allowed.  Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..allocation import ANNOTATION
from .review import API_VERSION, WebhookConfig, review_request

# The subresources whose updates can carry the pod's metadata.
SUBRESOURCES = ("", "status")


def _record(obj: Any) -> str | None:
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    value = annotations.get(ANNOTATION) if isinstance(annotations, Mapping) else None
    return value if isinstance(value, str) else None


def refusal(request: Mapping[str, Any], config: WebhookConfig) -> str:
    """Why the request may not make its change to the record ("" if it may)."""
    kind = request.get("kind") if isinstance(request.get("kind"), Mapping) else {}
    assert isinstance(kind, Mapping)
    if kind.get("group", "") != "" or kind.get("kind") != "Pod":
        return ""
    if (request.get("subResource") or "") not in SUBRESOURCES:
        return ""
    operation = request.get("operation")
    new = _record(request.get("object"))
    if operation == "CREATE":
        old = None
    elif operation == "UPDATE":
        old = _record(request.get("oldObject"))
    else:
        return ""
    if new == old:
        return ""
    user_info = request.get("userInfo") if isinstance(request.get("userInfo"), Mapping) else {}
    assert isinstance(user_info, Mapping)
    user = str(user_info.get("username") or "")
    if user in config.allocation_writers:
        return ""
    done = (
        "set at creation"
        if old is None and operation == "CREATE"
        else ("removed" if new is None else "set" if old is None else "changed")
    )
    writers = ", ".join(config.allocation_writers) or "nobody"
    return (
        f"metadata.annotations[{ANNOTATION}]: {done} by {user or 'an anonymous user'}; "
        f"only the scheduler extender ({writers}) writes it, in the pod's Binding"
    )


def guard(review: Any, config: WebhookConfig) -> dict[str, Any]:
    """The AdmissionReview response of the validating webhook; raises ReviewError."""
    request = review_request(review)
    why = refusal(request, config)
    response: dict[str, Any] = {"uid": request["uid"], "allowed": not why}
    if why:
        response["status"] = {"code": 403, "reason": "Forbidden", "message": why}
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}
