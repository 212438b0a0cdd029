"""A pod's placement as the device plugin reads it from the pod's
`gpuvisor.io/allocation` annotation (JSON, one object per pod):

    {"pod": "ns/name", "node": "n1", "containers": [
        {"name": "main", "gpus": [{"uuid": "GPU-...", "index": 0,
         "memory_mib": 3000, "cores": 30, "mig": null}],
         "sm_policy": null, "priority": null}]}

The allocator (gpuvisor.cluster) owns this format and writes it; this
module reads only the fields the plugin acts on, and refuses anything it
cannot act on with one line that names the field.  When the allocator's
reader is on main, this module becomes a thin use of it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gpuvisor.cluster.allocation import ANNOTATION, MigGrant, load_mig_grant
from gpuvisor.cluster.inventory_model import DocumentError


class GrantError(ValueError):
    """A malformed allocation: the message names the field and the value."""


@dataclass(frozen=True)
class GpuGrant:
    uuid: str
    index: int
    memory_mib: int
    cores: int  # percent of the GPU's time; 0: no limit
    mig: MigGrant | None  # a MIG instance to realise (the allocator's plan)


@dataclass(frozen=True)
class ContainerGrant:
    name: str
    gpus: tuple[GpuGrant, ...]
    init: bool = False
    sm_policy: str | None = None
    priority: int | None = None
    # an init container with restartPolicy: Always: it runs on beside the
    # app containers, and kubelet hands its devices to no other container
    sidecar: bool = False

    @property
    def plain_init(self) -> bool:
        """An init container that ends before the next one starts."""
        return self.init and not self.sidecar


@dataclass(frozen=True)
class PodGrant:
    pod: str
    node: str
    containers: tuple[ContainerGrant, ...]
    uid: str = ""  # the pod's UID, where the reader knows it (not in the annotation)

    def container(self, name: str) -> ContainerGrant | None:
        for c in self.containers:
            if c.name == name:
                return c
        return None


def _bad(path: str, why: str, value: Any) -> GrantError:
    return GrantError(f"{ANNOTATION}: {path}={json.dumps(value)[:80]}: {why}")


def _str(m: dict[str, Any], key: str, path: str) -> str:
    v = m.get(key)
    if not isinstance(v, str) or not v:
        raise _bad(f"{path}.{key}", "must be a non-empty string", v)
    return v


def _int(m: dict[str, Any], key: str, path: str, lo: int, hi: int | None = None) -> int:
    v = m.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f"from {lo}" + (f" to {hi}" if hi is not None else "")
        raise _bad(f"{path}.{key}", f"must be a whole number {rng}", v)
    return v


def _obj(v: Any, path: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _bad(path, "must be an object", v)
    return v


def _list(v: Any, path: str) -> list[Any]:
    if not isinstance(v, list):
        raise _bad(path, "must be a list", v)
    return v


def parse_grant(text: str) -> PodGrant:
    """The PodGrant of an annotation value; GrantError names what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrantError(f"{ANNOTATION}: not JSON ({exc.msg} at {exc.pos})") from None
    m = _obj(doc, "allocation")
    containers: list[ContainerGrant] = []
    for i, c in enumerate(_list(m.get("containers"), "containers")):
        cp = f"containers[{i}]"
        cm = _obj(c, cp)
        gpus = []
        for j, g in enumerate(_list(cm.get("gpus", []), f"{cp}.gpus")):
            gp = f"{cp}.gpus[{j}]"
            gm = _obj(g, gp)
            try:
                mig = load_mig_grant(gm.get("mig"), f"{gp}.mig")
            except DocumentError as exc:
                raise GrantError(f"{ANNOTATION}: {exc}") from None
            gpus.append(
                GpuGrant(
                    uuid=_str(gm, "uuid", gp),
                    index=_int(gm, "index", gp, 0),
                    memory_mib=_int(gm, "memory_mib", gp, 1),
                    cores=_int(gm, "cores", gp, 0, 100),
                    mig=mig,
                )
            )
        policy = cm.get("sm_policy")
        if policy is not None and policy not in ("fixed-share", "burst-share", "best-effort"):
            raise _bad(f"{cp}.sm_policy", "use fixed-share, burst-share or best-effort", policy)
        priority = None if cm.get("priority") is None else _int(cm, "priority", cp, 0, 1)
        init = cm.get("init", False)
        if not isinstance(init, bool):
            raise _bad(f"{cp}.init", "must be true or false", init)
        sidecar = cm.get("sidecar", False)
        if not isinstance(sidecar, bool):
            raise _bad(f"{cp}.sidecar", "must be true or false", sidecar)
        if sidecar and not init:
            raise _bad(f"{cp}.sidecar", "a sidecar is an init container (init: true)", sidecar)
        name = _str(cm, "name", cp)
        if any(other.name == name for other in containers):
            raise _bad(f"{cp}.name", "listed twice (a pod's container names are unique)", name)
        containers.append(ContainerGrant(name, tuple(gpus), init, policy, priority, sidecar))
    return PodGrant(_str(m, "pod", "allocation"), _str(m, "node", "allocation"), tuple(containers))
