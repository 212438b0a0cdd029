"""The node's GPUs as the device plugin sees them, and their health.

The plugin takes a GpuSource, so the inventory can be swapped: NvmlGpus
reads NVML through pynvml (until gpuvisor.cluster's inventory lands, which
then provides a source with the same two methods); tests pass a fixed list.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import pynvml


@dataclass(frozen=True)
class Gpu:
    uuid: str
    index: int  # NVML index on the node
    memory_mib: int
    numa_node: int | None = None  # None: not known
    model: str = ""  # NVML's name; "" when not known


class GpuSource(Protocol):
    def gpus(self) -> list[Gpu]:
        """The node's GPUs, by NVML index (read once, at start)."""
        ...

    def unhealthy(self) -> dict[str, str]:
        """The GPUs that are unhealthy now: uuid -> why (polled)."""
        ...


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


class NvmlGpus:
    """GPUs and their health through NVML (read-only: nothing is changed).

    A GPU is unhealthy while NVML cannot find it by UUID or read its memory
    (fallen off the bus, driver lost it); it is healthy again once it can."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # pynvml's calls from the poller and the server
        pynvml.nvmlInit()
        with self._lock:
            self._gpus = [self._read(i) for i in range(pynvml.nvmlDeviceGetCount())]

    @staticmethod
    def _read(index: int) -> Gpu:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        try:
            numa: int | None = int(pynvml.nvmlDeviceGetNumaNodeId(h))
        except (pynvml.NVMLError, AttributeError):
            numa = None
        if numa is not None and numa < 0:
            numa = None  # NVML's -1: it knows none (an H200 in a VM said so)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        return Gpu(
            _text(pynvml.nvmlDeviceGetUUID(h)),
            index,
            int(mem.total) >> 20,
            numa,
            _text(pynvml.nvmlDeviceGetName(h)),
        )

    def gpus(self) -> list[Gpu]:
        return list(self._gpus)

    def unhealthy(self) -> dict[str, str]:
        bad = {}
        with self._lock:
            for gpu in self._gpus:
                try:
                    pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid))
                except pynvml.NVMLError as exc:
                    bad[gpu.uuid] = f"NVML: {exc}"
        return bad
