"""Kubernetes objects as the API server sends them (JSON), read the way the
client's models are read: `pod.metadata.resource_version`, `None` for a
field the object does not have.

The extender's watches see every change of every pod and node.  Building
the client's models for them (pydantic-validated, field by field) cost
about 5 ms of the interpreter per pod event, three events per pod
scheduled, which the filters of the pods being scheduled waited for (make
bench-cluster); reading the JSON costs microseconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes import watch

# fields that are maps of strings: kept as dicts, as the models keep them
MAPS = frozenset({"annotations", "labels", "node_selector", "allocatable", "capacity"})


def camel(name: str) -> str:
    """A model's attribute name as the JSON field (`resource_version` -> `resourceVersion`)."""
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


class ApiView:
    """One JSON object of the API, read by the models' attribute names."""

    __slots__ = ("raw",)

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = self.raw.get(camel(name))
        return value if name in MAPS else view(value)

    def __repr__(self) -> str:
        return f"ApiView({self.raw!r})"


def view(value: Any) -> Any:
    """A JSON value with its objects read as `ApiView`s."""
    if isinstance(value, Mapping):
        return ApiView(value)
    if isinstance(value, list):
        return [view(v) for v in value]
    return value


class RawWatch(watch.Watch):  # type: ignore[misc]
    """The client's Watch, each event's object left as the JSON the API sent
    (`event["object"]` a dict; ERROR events are raised as before)."""

    def unmarshal_event(self, data: str, return_type: Any) -> Any:
        return super().unmarshal_event(data, None)


def listed(lister: Any, **kwargs: Any) -> ApiView:
    """A list call's answer (`items`, `metadata.resource_version`) as JSON."""
    import json

    raw = lister(_preload_content=False, **kwargs)
    return ApiView(json.loads(raw.data))
