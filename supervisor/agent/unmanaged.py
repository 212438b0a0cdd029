"""GPUs where a process runs that is not under gpuvisor (issue 35).

The launch gates of the containers on a GPU share it between themselves;
a process that does not load the library, or has no SM limit in a
container the agent does not know, takes what it wants and the gated
containers get less than their share (docs/interposer.md, "Every
container on a shared GPU needs a limit").  The agent sees such a process
in its own NVML reading of per-process utilisation (the same reading as
the trust checks, shares.note_process_use): a PID NVML lists that no
container the agent knows reports.

A PID is managed when a container whose cgroup the process is in reports
it among its `pids`, as the host numbers it or as its own PID namespace
does (the innermost NSpid of /proc/<pid>/status: a supervisor reports
its container's PIDs).  A PID the agent cannot read (gone, or not
visible from the agent's PID namespace) is not judged.  A GPU on which a
container learnt of through its region file reports is not judged
either: the agent knows none of its PIDs (records.is_region_container).

A GPU counts as unmanaged while any such PID, unmanaged for at least the
active window (a container's first kernels may come before its
supervisor's first report lists their PID), worked there within it,
whether or not managed containers share the GPU (the count of those is
given beside it).  The agent reads NVML for this only
while it knows at least one container: on a node where none runs under
gpuvisor there is nothing for an unmanaged process to take from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..protocol import describe_unmanaged
from .records import ContainerState, is_region_container

log = logging.getLogger("gpuvisor.agent")


def pid_names(pid: int) -> frozenset[int]:
    """The numbers of process `pid` in each PID namespace it is in (NSpid
    of /proc/<pid>/status; just `pid` on kernels without it).  OSError
    when it is gone."""
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return frozenset(int(x) for x in line.split()[1:] if x.isdigit()) | {pid}
    return frozenset({pid})


@dataclass(frozen=True)
class GpuProcesses:
    """One GPU as the last reading saw it."""

    uuid: str
    unmanaged_pids: tuple[int, ...]  # seen within the window, sorted
    managed_containers: int  # containers that report the device
    judged: bool  # False: a region-file container reports it (no PIDs known)


class UnmanagedWatch:
    """Unmanaged PIDs per GPU from NVML's per-process readings.  Mutated
    only by the agent's event-loop thread (as AgentState)."""

    def __init__(self, window: float) -> None:
        self.window = window
        # device uuid -> {unmanaged pid: monotonic time NVML last listed it}
        self.seen: dict[str, dict[int, float]] = {}
        # device uuid -> {unmanaged pid: when it was first seen so}
        self.since: dict[str, dict[int, float]] = {}
        self.gpus: dict[str, GpuProcesses] = {}

    def note(
        self,
        use: Mapping[str, Mapping[int, float]],
        containers: Mapping[str, ContainerState],
        cgroups_of: Callable[[int], frozenset[str]],
        now: float,
        names_of: Callable[[int], frozenset[int]] = pid_names,
    ) -> None:
        """Record one reading (device uuid -> {pid: percent}) against the
        containers the agent knows; log once when a GPU becomes unmanaged
        and once when it is no longer."""
        ctrs = list(containers.values())
        for uuid, procs in use.items():
            on_dev = [st for st in ctrs if any(d.uuid == uuid for d in st.report.devices)]
            judged = not any(is_region_container(st.id) for st in on_dev)
            seen = self.seen.setdefault(uuid, {})
            if judged:
                # this reading's PIDs, and again those seen before: a
                # container's report that now lists a PID (its first report
                # came after its first kernel) makes it managed at once
                for pid in set(procs) | set(seen):
                    try:
                        groups = cgroups_of(pid)
                        names = names_of(pid)
                    except OSError:
                        seen.pop(pid, None)  # gone, or not visible from here
                        continue
                    if any(
                        st.report.container.cgroup in groups and names & set(st.report.pids)
                        for st in ctrs
                    ):
                        seen.pop(pid, None)
                    elif pid in procs:
                        seen[pid] = now
            for pid in [p for p, ts in seen.items() if not judged or now - ts > self.window]:
                del seen[pid]
            since = self.since.setdefault(uuid, {})
            for pid in list(since):
                if pid not in seen:
                    del since[pid]
            for pid in seen:
                since.setdefault(pid, now)
            # Unmanaged for a whole window first: a container's process may
            # run its first kernels before its supervisor's first report
            # lists it (a warning and its all-clear at a container's start)
            shown = tuple(sorted(p for p in seen if now - since[p] >= self.window))
            before = self.gpus.get(uuid)
            gpu = GpuProcesses(uuid, shown, len(on_dev), judged)
            self.gpus[uuid] = gpu
            if gpu.unmanaged_pids and not (before and before.unmanaged_pids):
                log.warning(
                    "GPU %s: %s beside %d managed container(s): its SM use is not "
                    "limited, the containers' shares there do not hold "
                    "(docs/interposer.md: every container on a shared GPU needs a limit)",
                    uuid,
                    describe_unmanaged(gpu.unmanaged_pids),
                    gpu.managed_containers,
                )
            elif before and before.unmanaged_pids and not gpu.unmanaged_pids:
                log.warning("GPU %s: no process outside gpuvisor any more", uuid)
        for uuid in [u for u in self.gpus if u not in use]:  # not read: device gone
            del self.gpus[uuid]
            self.seen.pop(uuid, None)
            self.since.pop(uuid, None)

    def clear(self) -> None:
        """No reading (no container known, NVML unavailable): nothing to show."""
        for uuid, gpu in self.gpus.items():
            if gpu.unmanaged_pids:
                log.warning("GPU %s: no container under gpuvisor left, not watched", uuid)
        self.gpus.clear()
        self.seen.clear()
        self.since.clear()

    def view(self) -> list[dict[str, object]]:
        """Per GPU of the last reading, for /status."""
        return [
            {
                "uuid": g.uuid,
                "unmanaged_pids": list(g.unmanaged_pids) if g.judged else None,
                "managed_containers": g.managed_containers,
            }
            for g in sorted(self.gpus.values(), key=lambda g: g.uuid)
        ]
