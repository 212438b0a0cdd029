"""The node inventory: a node's GPUs, how they are connected and their MIG
state, read through NVML (real or simulated) into the versioned document of
docs/inventory.md, which the allocator reads.

`read_inventory()` expects NVML to be initialised (`nvml_session()` does it,
loading the simulated library first when asked to).
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pynvml

from .links import link_matrix, normalize_bus_id, read_nvlinks

KIND = "gpuvisor.io/node-inventory"
VERSION = 1
MiB = 1 << 20

Document = dict[str, Any]


@contextmanager
def nvml_session(simulator_nvml: str | None = None) -> Iterator[None]:
    """NVML initialised for the block.  With simulator_nvml (a path), that
    library is loaded under its soname first, so pynvml's dlopen finds it."""
    if simulator_nvml is not None:
        ctypes.CDLL(simulator_nvml, mode=ctypes.RTLD_GLOBAL)
    pynvml.nvmlInit()
    try:
        yield
    finally:
        pynvml.nvmlShutdown()


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _gi_profiles(handle: Any) -> list[dict[str, Any]]:
    """The GPU-instance profiles the GPU supports, each with every legal placement."""
    profiles: list[dict[str, Any]] = []
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue
        count = ctypes.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            handle, info.id, None, ctypes.byref(count)
        )
        placements = (pynvml.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            handle, info.id, placements, ctypes.byref(count)
        )
        spots = [{"start": p.start, "size": p.size} for p in placements[: count.value]]
        name = _text(info.name).removeprefix("MIG ")
        profiles.append(
            {
                "id": info.id,
                "name": name,
                "memory_mib": int(info.memorySizeMB),
                "memory_slices": spots[0]["size"] if spots else 0,
                "compute_slices": info.sliceCount,
                "max_count": info.instanceCount,
                "placements": spots,
            }
        )
    profiles.sort(key=lambda p: (p["compute_slices"], p["memory_mib"], p["name"]))
    return profiles


def _mig_devices(handle: Any) -> dict[tuple[int, int], dict[str, Any]]:
    """The MIG devices of a GPU, by (GPU-instance id, compute-instance id)."""
    devices: dict[tuple[int, int], dict[str, Any]] = {}
    gpu_name = _text(pynvml.nvmlDeviceGetName(handle))
    for i in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except pynvml.NVMLError_NotFound:
            continue
        gi = pynvml.nvmlDeviceGetGpuInstanceId(mig)
        ci = pynvml.nvmlDeviceGetComputeInstanceId(mig)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(mig)
        name = _text(pynvml.nvmlDeviceGetName(mig))
        devices[(gi, ci)] = {
            "profile": name.removeprefix(gpu_name).strip().removeprefix("MIG ") or None,
            "uuid": _text(pynvml.nvmlDeviceGetUUID(mig)),
            "memory_mib": pynvml.nvmlDeviceGetMemoryInfo(mig).total // MiB,
            "in_use": bool(procs),
        }
    return devices


def compute_profiles(gi: Any) -> Iterator[Any]:
    """The compute-instance profiles (shared engines) GPU instance gi offers."""
    for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            yield pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue


def compute_instances(gi: Any) -> Iterator[tuple[Any, Any]]:
    """(profile info, compute instance) for each compute instance of gi."""
    for info in compute_profiles(gi):
        arr = (pynvml.c_nvmlComputeInstance_t * max(info.instanceCount, 1))()
        count = ctypes.c_uint(0)
        pynvml.nvmlGpuInstanceGetComputeInstances(gi, info.id, arr, ctypes.byref(count))
        for ci in arr[: count.value]:
            yield info, ci


def _compute_instances(gi: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for info, ci in compute_instances(gi):
        ci_info = pynvml.nvmlComputeInstanceGetInfo(ci)
        out.append(
            {
                "ci_id": ci_info.id,
                "profile_id": ci_info.profileId,
                "profile": _text(info.name).removeprefix("MIG "),
                "placement": {
                    "start": ci_info.placement.start,
                    "size": ci_info.placement.size,
                },
            }
        )
    out.sort(key=lambda c: c["ci_id"])
    return out


def _placement_of(gi_id: int, size: int, memory_slices: int) -> dict[str, int] | None:
    """A GPU instance's placement from its id, as the driver numbers them
    (0 the whole GPU, then the halves, the quarters, the eighths)."""
    if size < 1 or memory_slices % size:
        return None
    start = (gi_id - (memory_slices // size - 1)) * size
    if start < 0 or start + size > memory_slices:
        return None
    return {"start": start, "size": size}


def _instances_seen_by_devices(
    devices: dict[tuple[int, int], dict[str, Any]], profiles: list[dict[str, Any]]
) -> list[Any]:
    """The GPU instances as their MIG devices show them, for a caller that may
    not list GPU instances (NVML_ERROR_NO_PERMISSION: a real driver lets only
    root): the profile by the device's name, the placement from the
    instance's id (null when they do not fit the profile table)."""
    by_name = {p["name"]: p for p in profiles}
    slices = max((p["start"] + p["size"] for pr in profiles for p in pr["placements"]), default=0)
    out: dict[int, dict[str, Any]] = {}
    for (gi, _ci), dev in sorted(devices.items()):
        prof = by_name.get(dev["profile"] or "")
        place = _placement_of(gi, prof["memory_slices"], slices) if prof else None
        if prof and place and place not in prof["placements"]:
            place = None
        inst = out.setdefault(
            gi,
            {
                "gi_id": gi,
                "profile_id": prof["id"] if prof else None,
                "profile": dev["profile"],
                "placement": place,
                "uuid": dev["uuid"],
                "memory_mib": dev["memory_mib"],
                "in_use": False,
                "compute_instances": [],
            },
        )
        inst["in_use"] = inst["in_use"] or dev["in_use"]
    return list(out.values())


def _instances(handle: Any, profiles: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPU instances that exist, each with its compute instances and MIG devices."""
    devices = _mig_devices(handle)
    try:
        return _listed_instances(handle, profiles, devices)
    except pynvml.NVMLError_NoPermission:
        return _instances_seen_by_devices(devices, profiles)


def _listed_instances(
    handle: Any, profiles: list[dict[str, Any]], devices: dict[tuple[int, int], dict[str, Any]]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for prof in profiles:
        arr = (pynvml.c_nvmlGpuInstance_t * max(prof["max_count"], 1))()
        count = ctypes.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstances(handle, prof["id"], arr, ctypes.byref(count))
        for gi in arr[: count.value]:
            info = pynvml.nvmlGpuInstanceGetInfo(gi)
            cis = _compute_instances(gi)
            for ci in cis:
                ci["uuid"] = devices.get((info.id, ci["ci_id"]), {}).get("uuid")
            mine = [d for (g, _), d in devices.items() if g == info.id]
            out.append(
                {
                    "gi_id": info.id,
                    "profile_id": info.profileId,
                    "profile": prof["name"],
                    "placement": {"start": info.placement.start, "size": info.placement.size},
                    "uuid": cis[0]["uuid"] if cis else None,
                    "memory_mib": prof["memory_mib"],
                    "in_use": any(d["in_use"] for d in mine),
                    "compute_instances": cis,
                }
            )
    out.sort(key=lambda g: g["gi_id"])
    return out


def _mig(handle: Any) -> dict[str, Any] | None:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return None
    profiles = _gi_profiles(handle)
    enabled = current == pynvml.NVML_DEVICE_MIG_ENABLE
    remaining: dict[str, int] = {}
    instances: list[dict[str, Any]] = []
    if enabled:
        instances = _instances(handle, profiles)
        try:
            for prof in profiles:
                n = pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, prof["id"])
                remaining[prof["name"]] = n
        except pynvml.NVMLError_NoPermission:
            remaining = {}  # not ours to know: none claimed
    return {
        "capable": True,
        "mode": "enabled" if enabled else "disabled",
        "memory_slices": max(
            (p["start"] + p["size"] for prof in profiles for p in prof["placements"]), default=0
        ),
        "compute_slices": max((p["compute_slices"] for p in profiles), default=0),
        "profiles": profiles,
        "instances": instances,
        "remaining": remaining,
    }


def _numa(handle: Any) -> int:
    """The GPU's NUMA node, -1 when NVML knows none (its own convention)."""
    try:
        node = pynvml.nvmlDeviceGetNumaNodeId(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return -1
    return -1 if node < 0 or node >= 0x7FFFFFFF else int(node)


def _gpu(index: int, handle: Any) -> dict[str, Any]:
    """One GPU; a GPU that fails a query is listed with what is known and healthy false."""
    try:
        return _gpu_facts(index, handle)
    except pynvml.NVMLError:
        uuid: str | None
        try:
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError:
            uuid = None
        return {
            "index": index,
            "uuid": uuid,
            "model": None,
            "memory_mib": None,
            "numa": -1,
            "pci_bus_id": None,
            "healthy": False,
            "mig": None,
        }


def _gpu_facts(index: int, handle: Any) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
        "model": _text(pynvml.nvmlDeviceGetName(handle)),
        "memory_mib": pynvml.nvmlDeviceGetMemoryInfo(handle).total // MiB,
        "numa": _numa(handle),
        "pci_bus_id": normalize_bus_id(pynvml.nvmlDeviceGetPciInfo(handle).busId),
        "healthy": True,
        "mig": _mig(handle),
    }


def read_inventory(node: str | None = None) -> Document:
    """The inventory document of this node, read from an initialised NVML."""
    count = pynvml.nvmlDeviceGetCount()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    gpus = [_gpu(i, h) for i, h in enumerate(handles)]
    nvlinks = [read_nvlinks(h) for h in handles]

    def pcie(i: int, j: int) -> int:
        try:
            level: int = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
        except pynvml.NVMLError:
            level = pynvml.NVML_TOPOLOGY_SYSTEM  # unknown: the farthest
        return level

    return {
        "kind": KIND,
        "version": VERSION,
        "node": node or platform.node(),
        "driver_version": _text(pynvml.nvmlSystemGetDriverVersion()),
        "gpus": gpus,
        "links": link_matrix([g["pci_bus_id"] or "" for g in gpus], nvlinks, pcie),
    }
