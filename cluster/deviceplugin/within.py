"""Whether an allocation record grants a pod no more than the pod asks for.

The record (`gpuvisor.io/allocation`) is a pod annotation, which whoever
may edit the pod can write; the pod's resource requests cannot change
once it exists.  So before the device plugin turns a record into a
container's limits, and before the scheduler extender takes one as a
reservation, both check it against the pod's own requests: a record that
grants a container more GPUs, more memory or more SM time than it asks
for (or a higher priority, a container it does not have or lists
twice, or a container of another kind: init, sidecar, app) is refused
with one line naming the field and the value.  The record's init
containers must also come in the pod's order: the device plugin reads
kubelet's hand-over of devices between them from it
(cluster/deviceplugin/handover.py).  The admission webhook keeps tenants
from writing the record at all (docs/security.md, "The
cluster half"); this check holds where the webhook is not installed.

A MIG grant's memory and cores are the instance's, larger than the
request by design (the smallest profile that holds it): only that the
pod allows MIG (`nvidia.com/vgpu-mode` is not hami-core) is checked.
Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from gpuvisor.cluster.allocation import ANNOTATION
from gpuvisor.cluster.request import GPU, GPUCORES, GPUMEM, PRIORITY, VGPU_MODE, PodRequest


class _Gpu(Protocol):
    @property
    def memory_mib(self) -> int: ...
    @property
    def cores(self) -> int: ...
    @property
    def mig(self) -> Any: ...
    @property
    def uuid(self) -> str: ...


class _Container(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def init(self) -> bool: ...
    @property
    def sidecar(self) -> bool: ...
    @property
    def priority(self) -> int | None: ...
    @property
    def gpus(self) -> Sequence[_Gpu]: ...


def beyond_request(
    containers: Sequence[_Container],
    request: PodRequest,
    gpu_memory: Callable[[str], int | None],
    gpus_known: bool = True,
) -> str | None:
    """Why the record's `containers` grant more than `request` asks for
    (one line, naming the record's field and value), or None.
    `gpu_memory(uuid)`: a GPU's memory in MiB (None: no such GPU), for
    requests in percent of it.  With `gpus_known` False (the node's GPUs
    are not known yet), memory is checked only against requests in MiB."""
    asked = {c.name: c for c in request.containers}
    # the pod's init containers (plain and sidecars) by their manifest place
    init_place = {c.name: k for k, c in enumerate(x for x in request.containers if x.init)}
    last_init: tuple[int, str] | None = None  # the record's previous init container
    seen: set[str] = set()

    def bad(path: str, value: Any, why: str) -> str:
        return f"{ANNOTATION}: {path}={json.dumps(value)}: {why}"

    for i, c in enumerate(containers):
        path = f"containers[{i}]"
        r = asked.get(c.name)
        if r is None:
            return bad(f"{path}.name", c.name, f"pod {request.name} has no such container")
        if c.name in seen:
            return bad(f"{path}.name", c.name, f"container {c.name} is listed twice")
        seen.add(c.name)
        if c.init != r.init:
            kind = "an init container" if r.init else "not an init container"
            return bad(f"{path}.init", c.init, f"container {c.name} is {kind}")
        if c.sidecar != r.sidecar:
            kind = "a sidecar" if r.sidecar else "not a sidecar"
            return bad(
                f"{path}.sidecar",
                c.sidecar,
                f"container {c.name} is {kind} (an init container with restartPolicy: Always)",
            )
        if c.init:
            place = init_place[c.name]
            if last_init is not None and place < last_init[0]:
                return bad(
                    f"{path}.name",
                    c.name,
                    f"init container {c.name} comes before {last_init[1]} in pod "
                    f"{request.name}, not after it",
                )
            last_init = (place, c.name)
        if len(c.gpus) > r.count:
            return bad(
                f"{path}.gpus",
                [g.uuid for g in c.gpus],
                f"{len(c.gpus)} GPUs, beyond the container's request ({GPU}: {r.count})",
            )
        if c.priority != r.priority:
            asked_for = "none" if r.priority is None else r.priority
            return bad(
                f"{path}.priority",
                c.priority,
                f"not the container's request ({PRIORITY}: {asked_for})",
            )
        for j, g in enumerate(c.gpus):
            gp = f"{path}.gpus[{j}]"
            if g.mig is not None:
                if request.mode == "hami-core":
                    return bad(
                        f"{gp}.mig.profile",
                        getattr(g.mig, "profile", None),
                        f"a MIG instance, but the pod asks for {VGPU_MODE}: hami-core",
                    )
                continue
            total = gpu_memory(g.uuid)
            if total is None and gpus_known:
                return bad(f"{gp}.uuid", g.uuid, "no such GPU on the node")
            mib = r.memory_on(total) if total is not None else r.memory_mib
            if mib is not None and g.memory_mib > mib:
                return bad(
                    f"{gp}.memory_mib",
                    g.memory_mib,
                    f"beyond the container's request of {mib} MiB ({GPUMEM})",
                )
            if g.cores > r.cores or (g.cores == 0 and r.cores > 0):
                return bad(
                    f"{gp}.cores",
                    g.cores,
                    f"beyond the container's request of {r.cores}% ({GPUCORES})",
                )
    return None
