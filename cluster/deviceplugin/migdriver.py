"""MIG instances through NVML, as the device plugin makes and removes them:
turn a GPU's MIG mode on (and off again), create a GPU instance at a placement with one
compute instance spanning it (one MIG device), list them with whether a
process uses them, destroy one.  Every call names the GPU by UUID.

MigDriver is what the plugin needs; NvmlMig is the real thing (pynvml,
real or simulated NVML); tests may wrap it to inject failures."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

from ..inventory import compute_instances, compute_profiles


class MigDriverError(Exception):
    """An NVML MIG operation failed; the message names the GPU and the call."""


@dataclass(frozen=True)
class MigInstance:
    """A GPU instance with its MIG device (its first compute instance)."""

    gpu: str  # the GPU's UUID
    gi_id: int
    profile_id: int
    start: int
    size: int
    uuid: str | None  # the MIG device's UUID; None: no compute instance
    memory_mib: int
    in_use: bool  # a process has memory on it


class MigDriver(Protocol):
    def enabled(self, gpu: str) -> bool: ...

    def busy(self, gpu: str) -> bool:
        """A process runs on the GPU or on one of its instances."""
        ...

    def enable(self, gpu: str) -> None: ...

    def disable(self, gpu: str) -> None:
        """MIG mode off (NVML refuses while an instance or a process is left)."""
        ...

    def instances(self, gpu: str) -> list[MigInstance]: ...

    def create(self, gpu: str, profile_id: int, start: int, size: int) -> MigInstance:
        """A GPU instance at the placement and a compute instance spanning
        it; if the compute instance cannot be made, the GPU instance is
        destroyed again before the error is raised."""
        ...

    def destroy(self, gpu: str, gi_id: int) -> None:
        """The GPU instance and its compute instances."""
        ...


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _why(exc: pynvml.NVMLError) -> str:
    """NVML's text and its code (a driver may not name every code)."""
    return f"{exc} (NVML error {exc.value})"


class NvmlMig:
    """MigDriver through pynvml (NVML initialised by the caller)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def _handle(self, gpu: str) -> Any:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(gpu)
        except pynvml.NVMLError as exc:
            raise MigDriverError(f"GPU {gpu}: nvmlDeviceGetHandleByUUID: {_why(exc)}") from None

    def enabled(self, gpu: str) -> bool:
        with self._lock:
            try:
                current, _pending = pynvml.nvmlDeviceGetMigMode(self._handle(gpu))
            except pynvml.NVMLError as exc:
                raise MigDriverError(f"GPU {gpu}: nvmlDeviceGetMigMode: {_why(exc)}") from None
            return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)

    def busy(self, gpu: str) -> bool:
        with self._lock:
            try:
                return bool(pynvml.nvmlDeviceGetComputeRunningProcesses(self._handle(gpu)))
            except pynvml.NVMLError as exc:
                raise MigDriverError(
                    f"GPU {gpu}: nvmlDeviceGetComputeRunningProcesses: {_why(exc)}"
                ) from None

    def enable(self, gpu: str) -> None:
        self._set_mode(gpu, pynvml.NVML_DEVICE_MIG_ENABLE, "enable", "MIG mode is pending")

    def disable(self, gpu: str) -> None:
        self._set_mode(
            gpu, pynvml.NVML_DEVICE_MIG_DISABLE, "disable", "turning MIG mode off is pending"
        )

    def _set_mode(self, gpu: str, mode: int, verb: str, pending_says: str) -> None:
        """Ask NVML for MIG mode `mode`; an error if it is not current at
        once (a change that waits for a GPU reset, which the device plugin
        never does)."""
        with self._lock:
            h = self._handle(gpu)
            try:
                pynvml.nvmlDeviceSetMigMode(h, mode)
                current, pending = pynvml.nvmlDeviceGetMigMode(h)
            except pynvml.NVMLError as exc:
                raise MigDriverError(
                    f"GPU {gpu}: nvmlDeviceSetMigMode({verb}): {_why(exc)}"
                ) from None
            if current != mode:
                raise MigDriverError(
                    f"GPU {gpu}: {pending_says} ({pending}) and needs a GPU reset; "
                    "not done by the device plugin"
                )

    def _devices(self, h: Any) -> dict[int, tuple[str, bool]]:
        """The GPU's MIG devices by GPU-instance id: (UUID, in use)."""
        out: dict[int, tuple[str, bool]] = {}
        for i in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except pynvml.NVMLError_NotFound:
                continue
            gi = int(pynvml.nvmlDeviceGetGpuInstanceId(mig))
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(mig)
            uuid = _text(pynvml.nvmlDeviceGetUUID(mig))
            prev = out.get(gi)
            out[gi] = (prev[0] if prev else uuid, bool(procs) or (prev is not None and prev[1]))
        return out

    def instances(self, gpu: str) -> list[MigInstance]:
        with self._lock:
            if not self.enabled(gpu):
                return []  # instances exist only in MIG mode
            h = self._handle(gpu)
            try:
                devices = self._devices(h)
                out = []
                for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
                    try:
                        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
                    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
                        continue
                    arr = (pynvml.c_nvmlGpuInstance_t * max(info.instanceCount, 1))()
                    count = ctypes.c_uint(0)
                    pynvml.nvmlDeviceGetGpuInstances(h, info.id, arr, ctypes.byref(count))
                    for gi in arr[: count.value]:
                        gi_info = pynvml.nvmlGpuInstanceGetInfo(gi)
                        uuid, used = devices.get(gi_info.id, (None, False))
                        out.append(
                            MigInstance(
                                gpu,
                                int(gi_info.id),
                                int(gi_info.profileId),
                                int(gi_info.placement.start),
                                int(gi_info.placement.size),
                                uuid,
                                int(info.memorySizeMB),
                                used,
                            )
                        )
            except pynvml.NVMLError as exc:
                raise MigDriverError(f"GPU {gpu}: listing MIG instances: {_why(exc)}") from None
            return sorted(out, key=lambda i: i.gi_id)

    def create(self, gpu: str, profile_id: int, start: int, size: int) -> MigInstance:
        with self._lock:
            h = self._handle(gpu)
            where = f"GPU {gpu}: profile {profile_id} at {start}+{size}"
            placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
            try:
                gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                    h, profile_id, ctypes.byref(placement)
                )
                gi_id = int(pynvml.nvmlGpuInstanceGetInfo(gi).id)
            except pynvml.NVMLError as exc:
                raise MigDriverError(
                    f"{where}: nvmlDeviceCreateGpuInstanceWithPlacement: {_why(exc)}"
                ) from None
            try:
                self._create_compute(gi)
            except pynvml.NVMLError as exc:
                self._destroy_gi(gpu, h, gi_id)
                raise MigDriverError(
                    f"{where}: nvmlGpuInstanceCreateComputeInstance: {_why(exc)} "
                    f"(GPU instance {gi_id} destroyed again)"
                ) from None
            for inst in self.instances(gpu):
                if inst.gi_id == gi_id and inst.uuid is not None:
                    return inst
            self._destroy_gi(gpu, h, gi_id)
            raise MigDriverError(
                f"{where}: no MIG device appeared (GPU instance {gi_id} destroyed again)"
            )

    def _create_compute(self, gi: Any) -> None:
        """One compute instance over the whole GPU instance (the profile with most slices)."""
        best = None
        for info in compute_profiles(gi):
            if best is None or info.sliceCount > best.sliceCount:
                best = info
        if best is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        pynvml.nvmlGpuInstanceCreateComputeInstance(gi, best.id)

    def _destroy_gi(self, gpu: str, h: Any, gi_id: int) -> None:
        try:
            gi = pynvml.nvmlDeviceGetGpuInstanceById(h, gi_id)
        except pynvml.NVMLError_NotFound:
            return
        for _info, ci in list(compute_instances(gi)):
            pynvml.nvmlComputeInstanceDestroy(ci)
        pynvml.nvmlGpuInstanceDestroy(gi)

    def destroy(self, gpu: str, gi_id: int) -> None:
        with self._lock:
            h = self._handle(gpu)
            try:
                self._destroy_gi(gpu, h, gi_id)
            except pynvml.NVMLError as exc:
                raise MigDriverError(
                    f"GPU {gpu}: destroying GPU instance {gi_id}: {_why(exc)}"
                ) from None
