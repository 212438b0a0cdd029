"""The node agent's records: one per container that reports
(ContainerState), and an administrator's limits, of a container the agent
knows (AdminLimits) or of one that left (ParkedLimits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..identity import PeerCred
from ..protocol import LIMIT_KINDS, OWN_LIMIT, ContainerId, Report

# The cgroup field of a container learnt of through its region file
# (region_dir.py): no process has it (its NVML use is not matched to it),
# and no peer of the socket can claim it (a peer's cgroup is read from the
# kernel).
CGROUP_PREFIX = "region:"


def is_region_container(cid: ContainerId) -> bool:
    """Was this container learnt of through its region file?"""
    return cid.cgroup.startswith(CGROUP_PREFIX)


RestoreMap = dict[str, tuple[str, ...]]


@dataclass
class ContainerState:
    id: ContainerId
    report: Report
    peer: PeerCred
    first_seen: float  # time.time()
    last_seen: float  # time.monotonic()
    last_wall: float  # time.time() of the last report
    interval: float | None = None  # smoothed seconds between reports
    reports: int = 1
    # device uuid -> what the container's claim added to device_share (what
    # is taken back when the report, NVML's view or the container changes)
    claims: dict[str, float] = field(default_factory=dict)
    # every device uuid its reports named (a region's devices never change:
    # at most MAX_DEVICES, see device_churn)
    devices_seen: set[str] = field(default_factory=set)
    # the devices its latest report that said so can see (`visible`, at
    # most MAX_VISIBLE; None: no report said, e.g. an older supervisor)
    visible: frozenset[str] | None = None


@dataclass
class AdminLimits:
    """An administrator's limits for one container (set-limit), per device
    uuid (None: no limit), and the kinds the administrator cleared (set-limit
    "env"): the container's own limit of that kind is to be put back.  Kept
    while the agent knows the container."""

    memory: dict[str, int | None] = field(default_factory=dict)
    sm: dict[str, int | None] = field(default_factory=dict)
    restore: dict[str, set[str]] = field(default_factory=dict)  # uuid -> kinds
    # Devices whose limits came from a container that left (parked, then
    # adopted: _adopt) that this container's reports have neither listed
    # nor named visible yet; dropped at adopted_until (the grace's end) if
    # still so.
    adopted: set[str] = field(default_factory=set)
    adopted_until: float = 0.0  # time.monotonic()

    def devices(self) -> set[str]:
        return self.memory.keys() | self.sm.keys() | self.restore.keys()

    def drop_device(self, uuid: str) -> None:
        self.memory.pop(uuid, None)
        self.sm.pop(uuid, None)
        self.restore.pop(uuid, None)
        self.adopted.discard(uuid)

    def unapplied(self, report: Report) -> AdminLimits:
        """The limits the report does not show applied: another value, or a
        device it does not list (the workload has not used it yet).  A
        cleared kind is always due: only the supervisor knows the
        container's own limit, and putting it back again changes nothing."""
        shown = {d.uuid: d for d in report.devices}
        return AdminLimits(
            memory={
                u: v for u, v in self.memory.items() if u not in shown or shown[u].memory_limit != v
            },
            sm={u: v for u, v in self.sm.items() if u not in shown or shown[u].sm_limit != v},
            restore={u: set(kinds) for u, kinds in self.restore.items()},
        )

    def restore_map(self) -> RestoreMap:
        """restore as an ack carries it: uuid -> kinds, in LIMIT_KINDS order."""
        return {u: tuple(k for k in LIMIT_KINDS if k in kinds) for u, kinds in self.restore.items()}

    def view(self) -> dict[str, dict[str, int | str | None]]:
        """{"memory": {uuid: bytes, null or "env"}, "sm": {...}}: "env" for a
        kind the administrator cleared."""
        out: dict[str, dict[str, int | str | None]] = {"memory": {}, "sm": {}}
        out["memory"].update(self.memory)
        out["sm"].update(self.sm)
        for uuid, kinds in self.restore.items():
            for kind in kinds:
                out[kind][uuid] = OWN_LIMIT
        return out


@dataclass
class ParkedLimits:
    """An administrator's limits of a container that left (final report,
    expiry, or a restarted container taking its labels over), kept for
    --limit-grace seconds for the container that replaces it in the same
    pod (same labels, a cgroup under the same parent)."""

    limits: AdminLimits
    scope: str  # the parent of the container's cgroup (its pod's, under Kubernetes)
    until: float  # time.monotonic()
    # Restored from the state file, of a container that was reporting when
    # the agent stopped: saved again as such (until: null), so that the
    # wait (AgentConfig.restore_window) runs from each start of the agent.
    awaiting: bool = False


def cgroup_scope(cgroup: str) -> str:
    """The cgroup that holds a container's: under Kubernetes its pod's
    (.../pod<uid>/<container>), which a restarted container shares and a
    recreated pod of the same name does not."""
    parent = cgroup.rstrip("/").rpartition("/")[0]
    return parent or "/"
