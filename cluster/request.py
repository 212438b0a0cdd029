"""HAMi's request language, read from a Pod manifest (docs/placement.md, "Requests").

`pod_request(manifest)` turns a Pod (a dict, as parsed from YAML or JSON)
into a `PodRequest`, applying HAMi's webhook defaults, or raises
`DocumentError` naming the field.  Pure: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .inventory_model import DocumentError, fail

GPU = "nvidia.com/gpu"
GPUMEM = "nvidia.com/gpumem"
GPUMEM_PCT = "nvidia.com/gpumem-percentage"
GPUCORES = "nvidia.com/gpucores"
PRIORITY = "nvidia.com/priority"
USE_TYPE = "nvidia.com/use-gputype"
NOUSE_TYPE = "nvidia.com/nouse-gputype"
USE_UUID = "nvidia.com/use-gpuuuid"
NOUSE_UUID = "nvidia.com/nouse-gpuuuid"
VGPU_MODE = "nvidia.com/vgpu-mode"
NODE_POLICY = "hami.io/node-scheduler-policy"
GPU_POLICY = "hami.io/gpu-scheduler-policy"
SM_POLICY = "gpuvisor.io/sm-policy"
SGPU_QOS = "metax-tech.com/sgpu-qos-policy"

SM_POLICIES = ("fixed-share", "burst-share", "best-effort")
NODE_POLICIES = ("binpack", "spread")
GPU_POLICIES = ("binpack", "spread", "topology-aware")
MODES = ("hami-core", "mig")


class ContainerKind(enum.Enum):
    """How a container runs beside the pod's others (Kubernetes' rules)."""

    APP = "app"
    INIT = "init"  # a plain init container: alone, to its end, before the next
    SIDECAR = "sidecar"  # an init container with restartPolicy: Always: on to the pod's end

    @staticmethod
    def of(init: bool, sidecar: bool) -> ContainerKind:
        if not init:
            return ContainerKind.APP
        return ContainerKind.SIDECAR if sidecar else ContainerKind.INIT


@dataclass(frozen=True)
class ContainerRequest:
    name: str
    init: bool
    count: int  # vGPUs (0: no GPU)
    memory_mib: int | None  # per vGPU; None with memory_pct
    memory_pct: int | None  # per vGPU, 1..100
    cores: int  # percent of a GPU; 100 = exclusive
    priority: int | None
    # an init container with restartPolicy: Always (a sidecar): it starts in
    # the init order and runs on beside the later init and the app containers
    sidecar: bool = False

    @property
    def plain_init(self) -> bool:
        """An init container that ends before the next container starts."""
        return self.init and not self.sidecar

    @property
    def kind(self) -> ContainerKind:
        return ContainerKind.of(self.init, self.sidecar)

    @property
    def exclusive(self) -> bool:
        return self.cores >= 100

    def memory_on(self, gpu_memory_mib: int) -> int:
        if self.memory_mib is not None:
            return self.memory_mib
        return gpu_memory_mib * (self.memory_pct or 100) // 100


@dataclass(frozen=True)
class PodRequest:
    name: str  # namespace/name
    uid: str
    containers: tuple[ContainerRequest, ...]  # init containers first, manifest order
    use_types: tuple[str, ...]
    nouse_types: tuple[str, ...]
    use_uuids: tuple[str, ...]
    nouse_uuids: tuple[str, ...]
    mode: str | None  # hami-core, mig, or None (either)
    node_policy: str | None  # None: the allocator's default (Config)
    gpu_policy: str | None
    topology_aware: bool
    sm_policy: str | None

    @property
    def filtered(self) -> bool:
        """Whether any GPU filter other than health applies."""
        return bool(
            self.use_types or self.nouse_types or self.use_uuids or self.nouse_uuids or self.mode
        )

    @property
    def wants_gpu(self) -> bool:
        return any(c.count for c in self.containers)


def quantity(v: Any, path: str, lo: int, hi: int | None = None) -> int:
    """A resource value as HAMi reads it: a whole number (MiB, percent, count)."""
    if isinstance(v, bool):
        raise fail(path, "expected a whole number", v)
    if isinstance(v, int):
        n = v
    elif isinstance(v, str) and v.strip().isdigit():
        n = int(v.strip())
    elif isinstance(v, str):
        n = _whole_quantity(v, path)
    else:
        raise fail(path, "expected a whole number", v)
    if n < lo or (hi is not None and n > hi):
        limit = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise fail(path, f"expected {limit}", v)
    return n


def _whole_quantity(v: str, path: str) -> int:
    """A Kubernetes quantity in decimal form that is a whole number: the API
    server writes `nvidia.com/gpumem: 3000` back as `3k` (as HAMi, its value
    is 3000).  Binary suffixes (`8Gi`) are refused: they read as bytes, not
    as the MiB or percent these resources count."""
    # Imported here: the client is heavy and only pods read from the API need it.
    from kubernetes.utils.quantity import parse_quantity

    if v.strip().endswith("i"):
        raise fail(path, "expected a whole number", v)
    try:
        q = parse_quantity(v)
    except ValueError:
        raise fail(path, "expected a whole number", v) from None
    if q != q.to_integral_value():
        raise fail(path, "expected a whole number", v)
    return int(q)


def csv(annotations: Mapping[str, str], key: str) -> tuple[str, ...]:
    raw = annotations.get(key, "")
    return tuple(p.strip() for p in raw.split(",") if p.strip())


RESTART_POLICIES = ("Always", "OnFailure", "Never")


def container_request(c: Any, path: str, init: bool) -> ContainerRequest:
    if not isinstance(c, Mapping):
        raise fail(path, "expected an object", c)
    name = c.get("name")
    if not isinstance(name, str) or not name:
        raise fail(f"{path}.name", "expected a non-empty string", name)
    restart = c.get("restartPolicy")
    if restart is not None and restart not in RESTART_POLICIES:
        raise fail(f"{path}.restartPolicy", "expected " + ", ".join(RESTART_POLICIES), restart)
    # Kubernetes' sidecar containers: an init container that restarts always
    sidecar = init and restart == "Always"
    res = c.get("resources") or {}
    if not isinstance(res, Mapping):
        raise fail(f"{path}.resources", "expected an object", res)
    limits = res.get("limits") or {}
    requests = res.get("requests") or {}
    if not isinstance(limits, Mapping):
        raise fail(f"{path}.resources.limits", "expected an object", limits)
    if not isinstance(requests, Mapping):
        raise fail(f"{path}.resources.requests", "expected an object", requests)

    def get(key: str) -> tuple[Any, str] | None:
        if key in limits:
            return limits[key], f"{path}.resources.limits[{key}]"
        if key in requests:
            return requests[key], f"{path}.resources.requests[{key}]"
        return None

    gpu, mem, pct, cores, prio = (get(k) for k in (GPU, GPUMEM, GPUMEM_PCT, GPUCORES, PRIORITY))
    if mem is not None and pct is not None:
        raise DocumentError(f"{pct[1]}: set together with {GPUMEM}; give one of the two")
    memory_mib = quantity(*mem, 1) if mem else None
    memory_pct = quantity(*pct, 1, 100) if pct else None
    core_pct = quantity(*cores, 0, 100) if cores else None
    priority = quantity(*prio, 0, 1) if prio else None
    if gpu is not None:
        count = quantity(*gpu, 0)
    elif memory_mib is not None or memory_pct is not None or core_pct is not None:
        count = 1  # HAMi's defaultGPUNum
    else:
        count = 0
    if memory_mib is None and memory_pct is None:
        memory_pct = 100  # a count alone means each GPU's whole memory
    if core_pct is None:
        # HAMi's webhook: a whole-memory request with no cores is exclusive
        core_pct = 100 if memory_pct == 100 else 0
    return ContainerRequest(name, init, count, memory_mib, memory_pct, core_pct, priority, sidecar)


def policy(annotations: Mapping[str, str], key: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    parts = csv(annotations, key)
    for p in parts:
        if p not in allowed:
            raise DocumentError(
                f"metadata.annotations[{key}]: unknown value {p!r}, expected one of "
                + ", ".join(allowed)
            )
    return parts


def pod_request(pod: Any) -> PodRequest:
    """Read a Pod manifest; raises DocumentError with one line naming the field."""
    if not isinstance(pod, Mapping):
        raise fail("pod", "expected a Pod object", pod)
    if pod.get("kind", "Pod") != "Pod":
        raise fail("kind", "expected Pod", pod.get("kind"))
    meta = pod.get("metadata") or {}
    if not isinstance(meta, Mapping):
        raise fail("metadata", "expected an object", meta)
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise fail("metadata.name", "expected a non-empty string", name)
    ns = meta.get("namespace") or "default"
    ann = meta.get("annotations") or {}
    if not isinstance(ann, Mapping) or not all(isinstance(v, str) for v in ann.values()):
        raise fail("metadata.annotations", "expected an object of strings", ann)
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        raise fail("spec", "expected an object", spec)
    containers: list[ContainerRequest] = []
    for key, init in (("initContainers", True), ("containers", False)):
        items = spec.get(key) or []
        if not isinstance(items, list):
            raise fail(f"spec.{key}", "expected a list", items)
        containers += [container_request(c, f"spec.{key}[{i}]", init) for i, c in enumerate(items)]
    if not any(not c.init for c in containers):
        raise DocumentError("spec.containers: a Pod needs at least one container")

    mode = ann.get(VGPU_MODE)
    if mode is not None and mode not in MODES:
        raise DocumentError(
            f"metadata.annotations[{VGPU_MODE}]: unknown value {mode!r}, expected hami-core or mig"
        )
    node_pol = policy(ann, NODE_POLICY, NODE_POLICIES)
    gpu_pol = policy(ann, GPU_POLICY, GPU_POLICIES)
    if len(node_pol) > 1:
        raise DocumentError(f"metadata.annotations[{NODE_POLICY}]: give one of binpack, spread")
    packing = [p for p in gpu_pol if p != "topology-aware"]
    if len(packing) > 1:
        raise DocumentError(f"metadata.annotations[{GPU_POLICY}]: binpack and spread together")
    topo = "topology-aware" in gpu_pol
    sm = None
    for key in (SM_POLICY, SGPU_QOS):
        v = ann.get(key)
        if v is None:
            continue
        if v not in SM_POLICIES:
            raise DocumentError(
                f"metadata.annotations[{key}]: unknown value {v!r}, expected one of "
                + ", ".join(SM_POLICIES)
            )
        if sm is not None and v != sm:
            raise DocumentError(f"metadata.annotations[{key}]: {v!r} contradicts {SM_POLICY}")
        sm = v
    return PodRequest(
        name=f"{ns}/{name}",
        uid=str(meta.get("uid", "")),
        containers=tuple(containers),
        use_types=csv(ann, USE_TYPE),
        nouse_types=csv(ann, NOUSE_TYPE),
        use_uuids=csv(ann, USE_UUID),
        nouse_uuids=csv(ann, NOUSE_UUID),
        mode=mode,
        node_policy=node_pol[0] if node_pol else None,
        gpu_policy=packing[0] if packing else None,
        topology_aware=topo,
        sm_policy=sm,
    )
