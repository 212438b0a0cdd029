"""Publishing the node's inventory where the scheduler extender reads it:
the Node's `gpuvisor.io/node-inventory` annotation, holding the inventory
document (docs/inventory.md) as JSON.

The document is gpuvisor.cluster's NVML inventory (read at start: links,
MIG state), with the GPUs the plugin finds unhealthy marked so.  When that
reader fails, `inventory_document` builds one from the plugin's GpuSource
(no links: readers take SYS between every pair; `mig` null).  The plugin
publishes at start and whenever a GPU's health changes; the extender
watches Nodes."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from gpuvisor.cluster.inventory_model import KIND, VERSION

from .gpus import Gpu

NODE_INVENTORY = "gpuvisor.io/node-inventory"
API_TIMEOUT = 10.0

log = logging.getLogger("gpuvisor.device-plugin")


def inventory_document(
    node: str, gpus: Sequence[Gpu], unhealthy: Mapping[str, str], driver_version: str = ""
) -> dict[str, Any]:
    """The node's inventory document (version 1) from the plugin's GPUs."""
    return {
        "kind": KIND,
        "version": VERSION,
        "node": node,
        "driver_version": driver_version,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "model": g.model or "unknown",
                "memory_mib": g.memory_mib,
                "numa": g.numa_node if g.numa_node is not None else -1,
                "healthy": g.uuid not in unhealthy,
                "mig": None,
            }
            for g in sorted(gpus, key=lambda g: g.index)
        ],
    }


class NodeAnnotator(Protocol):
    def annotate(self, node: str, key: str, value: str) -> None: ...


class KubeNodes:
    """NodeAnnotator through the Kubernetes API (a merge patch of one annotation)."""

    def __init__(self, api: Any) -> None:
        self.api = api  # kubernetes.client.CoreV1Api

    def annotate(self, node: str, key: str, value: str) -> None:
        body = {"metadata": {"annotations": {key: value}}}
        self.api.patch_node(node, body, _request_timeout=API_TIMEOUT)


class InventoryPublisher:
    """Writes the node's inventory annotation when it differs from the last one written.

    `document` is the node's inventory as read at start (gpuvisor.cluster's
    NVML reader, with links and MIG state; or `inventory_document` when that
    reader fails); each publish marks the GPUs unhealthy now.  With
    `reader` (the NVML reader again), `publish(reread=True)` reads the
    document afresh first: after a MIG change, and at each health poll on a
    node with a MIG-capable GPU (instances in use come and go)."""

    def __init__(
        self,
        node: str,
        document: Mapping[str, Any],
        nodes: NodeAnnotator,
        reader: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        if not node:
            raise ValueError("the node's name is needed to publish its inventory (--node-name)")
        self.node = node
        self.document = json.loads(json.dumps(document))  # a private copy
        self.document["node"] = node
        self.nodes = nodes
        self.reader = reader
        self.published: str | None = None
        self._lock = threading.Lock()  # the health poll and a MIG change publish

    @property
    def has_mig(self) -> bool:
        """A GPU of the document can do MIG."""
        return any(isinstance(g.get("mig"), dict) for g in self.document.get("gpus", []))

    def publish(self, unhealthy: Mapping[str, str], reread: bool = False) -> bool:
        """Publish if changed; True when written.  Errors propagate (retried next poll)."""
        with self._lock:
            if reread and self.reader is not None:
                fresh = json.loads(json.dumps(self.reader()))
                fresh["node"] = self.node
                self.document = fresh
            doc = json.loads(json.dumps(self.document))
            for gpu in doc.get("gpus", []):
                if gpu.get("uuid") in unhealthy:
                    gpu["healthy"] = False
            text = json.dumps(doc, separators=(",", ":"))
            if text == self.published:
                return False
            self.nodes.annotate(self.node, NODE_INVENTORY, text)
            self.published = text
        log.info("published the inventory of node %s (%d GPUs)", self.node, len(doc["gpus"]))
        return True
