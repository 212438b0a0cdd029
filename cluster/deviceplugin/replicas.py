"""Replica device IDs: each physical GPU appears to kubelet split_count
times as `<GPU UUID>-<i>` (HAMi's naming, deviceSplitCount), so up to
split_count containers can share it; which GPU an ID is on is a pure
function of the ID."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from . import defaults
from .gpus import Gpu

DEFAULT_SPLIT_COUNT = defaults.SPLIT_COUNT


class UnknownDevice(ValueError):
    """A device ID that is not one of this plugin's replicas."""


def replica_id(uuid: str, i: int) -> str:
    return f"{uuid}-{i}"


@dataclass(frozen=True)
class Replicas:
    gpus: tuple[Gpu, ...]
    split_count: int = DEFAULT_SPLIT_COUNT

    def __post_init__(self) -> None:
        if self.split_count < 1:
            raise ValueError(f"split count {self.split_count}: must be at least 1")

    def ids(self, gpu: Gpu) -> list[str]:
        return [replica_id(gpu.uuid, i) for i in range(self.split_count)]

    def all_ids(self) -> list[str]:
        return [d for g in self.gpus for d in self.ids(g)]

    def gpu_of(self, device_id: str) -> Gpu:
        uuid, sep, n = device_id.rpartition("-")
        if sep and n.isdigit() and str(int(n)) == n and int(n) < self.split_count:
            for g in self.gpus:
                if g.uuid == uuid:
                    return g
        raise UnknownDevice(f"device ID {device_id!r} is not a replica of a GPU of this node")

    def physical(self, device_ids: Iterable[str]) -> list[Gpu]:
        """The distinct GPUs of device_ids, by NVML index (the order the
        container's CUDA_VISIBLE_DEVICES lists them, and so its ordinals)."""
        found = {g.uuid: g for g in (self.gpu_of(d) for d in device_ids)}
        return sorted(found.values(), key=lambda g: g.index)

    def by_gpu(self, device_ids: Sequence[str]) -> dict[str, list[str]]:
        """device_ids grouped by GPU UUID, in the order given."""
        out: dict[str, list[str]] = {}
        for d in device_ids:
            out.setdefault(self.gpu_of(d).uuid, []).append(d)
        return out
