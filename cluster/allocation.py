"""The allocation record: what a pod holds on a node (docs/placement.md, "The allocation").

One JSON object per pod.  It is the per-pod object that `gpuvisor place
--json` prints, the entries of a node's `allocations` in CLUSTER.json, and
the value of the pod annotation `gpuvisor.io/allocation` that the scheduler
extender writes and the device plugin reads.  Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .inventory_model import DocumentError, Placement, boolean, fail, integer, obj, seq, string

ANNOTATION = "gpuvisor.io/allocation"
ALLOCATION_VERSION = 1


@dataclass(frozen=True)
class MigGrant:
    profile: str
    profile_id: int
    placement: Placement
    instance: str | None  # an existing instance's uuid, or None: create it
    destroy: tuple[str, ...] = ()  # idle instances to destroy first
    enable: bool = False  # turn MIG mode on first

    def to_json(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "profile_id": self.profile_id,
            "placement": {"start": self.placement.start, "size": self.placement.size},
            "instance": self.instance,
            "destroy": list(self.destroy),
            "enable_mig_mode": self.enable,
        }


@dataclass(frozen=True)
class GpuGrant:
    uuid: str
    index: int
    memory_mib: int
    cores: int
    mig: MigGrant | None

    def to_json(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "index": self.index,
            "memory_mib": self.memory_mib,
            "cores": self.cores,
            "mig": None if self.mig is None else self.mig.to_json(),
        }


@dataclass(frozen=True)
class ContainerGrant:
    name: str
    init: bool
    gpus: tuple[GpuGrant, ...]
    sm_policy: str | None = None
    priority: int | None = None
    sidecar: bool = False  # an init container that runs on (restartPolicy: Always)

    @property
    def plain_init(self) -> bool:
        """An init container that ends before the next one starts."""
        return self.init and not self.sidecar

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "init": self.init,
            "gpus": [g.to_json() for g in self.gpus],
            "sm_policy": self.sm_policy,
            "priority": self.priority,
        }
        if self.sidecar:
            out["sidecar"] = True
        return out


@dataclass(frozen=True)
class Allocation:
    pod: str  # namespace/name
    uid: str
    node: str
    containers: tuple[ContainerGrant, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": ALLOCATION_VERSION,
            "pod": self.pod,
            "uid": self.uid,
            "node": self.node,
            "containers": [c.to_json() for c in self.containers],
        }

    def annotation(self) -> str:
        """The value of the pod annotation `gpuvisor.io/allocation`."""
        return json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True)


def load_mig_grant(v: Any, path: str) -> MigGrant | None:
    if v is None:
        return None
    m = obj(v, path)
    pl = obj(m.get("placement"), f"{path}.placement")
    start = integer(pl.get("start"), f"{path}.placement.start")
    size = integer(pl.get("size"), f"{path}.placement.size", 1)
    instance = m.get("instance")
    if instance is not None:
        instance = string(instance, f"{path}.instance")
    destroy = seq(m.get("destroy", []), f"{path}.destroy")
    return MigGrant(
        profile=string(m.get("profile"), f"{path}.profile"),
        profile_id=integer(m.get("profile_id"), f"{path}.profile_id"),
        placement=Placement(start, size),
        instance=instance,
        destroy=tuple(string(d, f"{path}.destroy[{i}]") for i, d in enumerate(destroy)),
        enable=boolean(m.get("enable_mig_mode", False), f"{path}.enable_mig_mode"),
    )


def load_allocation(doc: Any, path: str = "allocation", node: str | None = None) -> Allocation:
    """Read an allocation object (or its annotation string); one-line errors name the field."""
    if isinstance(doc, str):
        try:
            doc = json.loads(doc)
        except json.JSONDecodeError as e:
            raise DocumentError(f"{path}: not JSON ({e.msg} at {e.pos})") from None
    m = obj(doc, path)
    version = m.get("version", ALLOCATION_VERSION)
    if version != ALLOCATION_VERSION:
        raise fail(f"{path}.version", f"expected {ALLOCATION_VERSION}", version)
    where = m.get("node", node)
    if node is not None and where != node:
        raise fail(f"{path}.node", f"expected {node!r} (the node it is listed under)", where)
    containers: list[ContainerGrant] = []
    for i, c in enumerate(seq(m.get("containers"), f"{path}.containers")):
        cp = f"{path}.containers[{i}]"
        cm: Mapping[str, Any] = obj(c, cp)
        name = string(cm.get("name"), f"{cp}.name")
        if any(other.name == name for other in containers):
            raise fail(f"{cp}.name", "listed twice (a pod's container names are unique)", name)
        gpus = []
        for j, g in enumerate(seq(cm.get("gpus", []), f"{cp}.gpus")):
            gp = f"{cp}.gpus[{j}]"
            gm = obj(g, gp)
            gpus.append(
                GpuGrant(
                    uuid=string(gm.get("uuid"), f"{gp}.uuid"),
                    index=integer(gm.get("index"), f"{gp}.index"),
                    memory_mib=integer(gm.get("memory_mib"), f"{gp}.memory_mib"),
                    cores=integer(gm.get("cores"), f"{gp}.cores"),
                    mig=load_mig_grant(gm.get("mig"), f"{gp}.mig"),
                )
            )
        prio = cm.get("priority")
        init = boolean(cm.get("init", False), f"{cp}.init")
        sidecar = boolean(cm.get("sidecar", False), f"{cp}.sidecar")
        if sidecar and not init:
            raise fail(f"{cp}.sidecar", "a sidecar is an init container (init: true)", sidecar)
        containers.append(
            ContainerGrant(
                name=name,
                init=init,
                gpus=tuple(gpus),
                sm_policy=cm.get("sm_policy") if isinstance(cm.get("sm_policy"), str) else None,
                priority=None if prio is None else integer(prio, f"{cp}.priority"),
                sidecar=sidecar,
            )
        )
    return Allocation(
        pod=string(m.get("pod"), f"{path}.pod"),
        uid=str(m.get("uid", "")),
        node=string(where, f"{path}.node"),
        containers=tuple(containers),
    )
