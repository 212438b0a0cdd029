"""Node inventory documents (docs/inventory.md, version 1) for the allocator's tests and benchmark.

Built directly as documents: DGX-like NVSwitch boxes, NVLink-pair boxes with
two PCIe switches, PCIe-only boxes, MIG-capable A100/H100 with their profile
tables (the A100-80GB's as NVML reports them: 8 memory slices, 7 compute).
"""

from __future__ import annotations

from typing import Any

# (name, id, memory MiB, memory slices, compute slices, legal starts)
A100_80GB_PROFILES = [
    ("1g.10gb", 19, 9728, 1, 1, [0, 1, 2, 3, 4, 5, 6]),
    ("1g.20gb", 15, 19968, 2, 1, [0, 2, 4, 6]),
    ("2g.20gb", 14, 19968, 2, 2, [0, 2, 4]),
    ("3g.40gb", 9, 40192, 4, 3, [0, 4]),
    ("4g.40gb", 5, 40192, 4, 4, [0]),
    ("7g.80gb", 0, 80896, 8, 7, [0]),
]
A100_40GB_PROFILES = [
    ("1g.5gb", 19, 4864, 1, 1, [0, 1, 2, 3, 4, 5, 6]),
    ("1g.10gb", 15, 9856, 2, 1, [0, 2, 4, 6]),
    ("2g.10gb", 14, 9856, 2, 2, [0, 2, 4]),
    ("3g.20gb", 9, 19968, 4, 3, [0, 4]),
    ("4g.20gb", 5, 19968, 4, 4, [0]),
    ("7g.40gb", 0, 40192, 8, 7, [0]),
]


def mig_state(
    profiles: list[tuple[str, int, int, int, int, list[int]]],
    enabled: bool = False,
    instances: list[tuple[str, int, bool]] = (),  # type: ignore[assignment]
    uuid_prefix: str = "MIG",
) -> dict[str, Any]:
    """A MIG block; instances as (profile name, start, in_use)."""
    table = {p[0]: p for p in profiles}
    insts = []
    for gi, (name, start, in_use) in enumerate(instances, 1):
        _n, pid, mem, ms, _cs, _st = table[name]
        insts.append(
            {
                "gi_id": gi,
                "profile_id": pid,
                "profile": name,
                "placement": {"start": start, "size": ms},
                "uuid": f"{uuid_prefix}-{gi}-{name}",
                "memory_mib": mem,
                "in_use": in_use,
            }
        )
    return {
        "capable": True,
        "mode": "enabled" if enabled else "disabled",
        "memory_slices": 8,
        "compute_slices": 7,
        "profiles": [
            {
                "id": pid,
                "name": name,
                "memory_mib": mem,
                "memory_slices": ms,
                "compute_slices": cs,
                "max_count": len(starts),
                "placements": [{"start": s, "size": ms} for s in starts],
            }
            for name, pid, mem, ms, cs, starts in profiles
        ],
        "instances": insts,
        "remaining": {},
    }


def gpu(
    node: str,
    i: int,
    model: str,
    memory_mib: int,
    numa: int = 0,
    mig: dict[str, Any] | None = None,
    healthy: bool = True,
) -> dict[str, Any]:
    return {
        "index": i,
        "uuid": f"GPU-{node}-{i}",
        "model": model,
        "memory_mib": memory_mib,
        "numa": numa,
        "pci_bus_id": f"00000000:{i + 7:02x}:00.0",
        "healthy": healthy,
        "mig": mig,
    }


def links_nvswitch(n: int = 8) -> list[list[str]]:
    return [["X" if i == j else "NV18" for j in range(n)] for i in range(n)]


def links_pairs() -> list[list[str]]:
    """NVLink pairs (0,1) (2,3) (4,5) (6,7); PCIe switches {0-3} and {4-7}; two sockets."""
    m = []
    for i in range(8):
        row = []
        for j in range(8):
            if i == j:
                row.append("X")
            elif i // 2 == j // 2:
                row.append("NV4")
            elif i // 4 == j // 4:
                row.append("PIX")
            else:
                row.append("SYS")
        m.append(row)
    return m


def links_pcie(n: int = 8) -> list[list[str]]:
    """Two PCIe switches under one host bridge each, one per socket."""
    half = n // 2
    return [
        ["X" if i == j else ("PIX" if i // half == j // half else "SYS") for j in range(n)]
        for i in range(n)
    ]


def inventory(node: str, gpus: list[dict[str, Any]], links: list[list[str]]) -> dict[str, Any]:
    return {
        "kind": "gpuvisor.io/node-inventory",
        "version": 1,
        "node": node,
        "driver_version": "580.65.06",
        "gpus": gpus,
        "links": links,
    }


def eight_80gb(node: str, model: str, memory_mib: int, mig: bool) -> list[dict[str, Any]]:
    """Eight GPUs of model, four to a NUMA node, MIG-enabled (the A100 80GB
    profiles) if mig."""
    return [
        gpu(
            node,
            i,
            model,
            memory_mib,
            i // 4,
            mig_state(A100_80GB_PROFILES, uuid_prefix=f"MIG-{node}-{i}") if mig else None,
        )
        for i in range(8)
    ]


def dgx(node: str, mig: bool = False, model: str = "NVIDIA H100 80GB HBM3") -> dict[str, Any]:
    return inventory(node, eight_80gb(node, model, 81559, mig), links_nvswitch())


def pairs_box(node: str, model: str = "NVIDIA A100-SXM4-80GB", mig: bool = False) -> dict[str, Any]:
    return inventory(node, eight_80gb(node, model, 81920, mig), links_pairs())


def pcie_box(
    node: str, n: int = 8, model: str = "NVIDIA L40S", memory_mib: int = 46068
) -> dict[str, Any]:
    gpus = [gpu(node, i, model, memory_mib, i // max(1, n // 2)) for i in range(n)]
    return inventory(node, gpus, links_pcie(n))


def mig_box(
    node: str,
    n: int = 1,
    enabled: bool = True,
    instances: list[tuple[str, int, bool]] = (),  # type: ignore[assignment]
    model: str = "NVIDIA A100-SXM4-80GB",
) -> dict[str, Any]:
    gpus = [
        gpu(
            node,
            i,
            model,
            81920,
            0,
            mig_state(
                A100_80GB_PROFILES,
                enabled,
                instances if i == 0 else [],
                uuid_prefix=f"MIG-{node}-{i}",
            ),
        )
        for i in range(n)
    ]
    return inventory(node, gpus, links_pcie(n) if n > 1 else [["X"]])


def cluster(*docs: dict[str, Any]) -> dict[str, Any]:
    return {"nodes": {d["node"]: d for d in docs}}


def four_and_mig(four_node: str, mig_node: str) -> dict[str, Any]:
    """The benchmark's small cluster: a 4-GPU box (NVLink pairs, one PCIe
    switch) and a 2-GPU MIG-capable A100-40GB box (MIG mode off)."""
    four = inventory(
        four_node,
        [gpu(four_node, i, "NVIDIA L40S", 46068) for i in range(4)],
        [row[:4] for row in links_pairs()[:4]],
    )
    two = inventory(
        mig_node,
        [
            gpu(mig_node, i, "NVIDIA A100-SXM4-40GB", 40960, 0, mig_state(A100_40GB_PROFILES))
            for i in range(2)
        ],
        [["X", "NV12"], ["NV12", "X"]],
    )
    return cluster(four, two)


def pod(
    name: str,
    *containers: dict[str, Any],
    annotations: dict[str, str] | None = None,
    init: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = init
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "annotations": annotations or {}},
        "spec": spec,
    }


def ctr(name: str = "main", **limits: Any) -> dict[str, Any]:
    """A container; limits by short names: gpu, gpumem, gpumem_percentage, gpucores, priority."""
    res = {f"nvidia.com/{k.replace('_', '-')}": v for k, v in limits.items()}
    return {"name": name, "image": "busybox", "resources": {"limits": res}}
