"""What the node agent knows: containers, their latest reports, admins' limits,
priority and the others' shares per device (supervisor/agent.py serves it).

Mutated only by the agent's event-loop thread; read by the HTTP thread for
/metrics and /status.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .agent_persist import SavedLimits, state_file_for
from .identity import PeerCred
from .protocol import (
    LIMIT_KINDS,
    MAX_DEVICES,
    OWN_LIMIT,
    ContainerId,
    DeviceReport,
    Instructions,
    Report,
)

RestoreMap = dict[str, tuple[str, ...]]

DEFAULT_SOCKET = "/run/gpuvisor/node.sock"
SOCKET_ENV = "GPUVISOR_NODE_SOCKET"

REJECT_REASONS = (
    "malformed",  # not JSON, not an object
    "version",  # wrong "v"
    "field",  # a missing or ill-typed field
    "type",  # unknown message type
    "identity",  # container.cgroup is not the peer's cgroup
    "rate",  # over the per-connection rate limit
    "oversize",  # a line longer than MAX_MESSAGE_BYTES
    "unauthorized",  # an admin message from a peer that may not send it
    "conflict",  # labels another live cgroup reports under
    "devices",  # a container's reports name more devices than a region holds
)
DISCONNECT_REASONS = ("oversize", "timeout", "slow-reader", "idle", "too-many", "errors")
# The library's "no memory limit" (GV_UNLIMITED): a region so limited
# reports memory_limit null.
UNLIMITED_BYTES = 2**64 - 1


def default_socket() -> str:
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


# The admin socket (set-limit) lives in a directory of its own, beside the
# reporting socket's directory and never inside it: that one is mounted into
# every workload, this one must not be (docs/protocol.md, "Admin").
ADMIN_SOCKET_ENV = "GPUVISOR_ADMIN_SOCKET"
ADMIN_SOCKET_NAME = "admin.sock"


def admin_socket_for(socket_path: str) -> str:
    """The default admin socket of an agent on socket_path: admin.sock in
    the sibling directory "<socket's directory>-admin"
    (/run/gpuvisor/node.sock -> /run/gpuvisor-admin/admin.sock)."""
    parent = os.path.dirname(os.path.abspath(socket_path)).rstrip("/") or "/gpuvisor"
    return os.path.join(parent + "-admin", ADMIN_SOCKET_NAME)


def admin_socket_problem(socket_path: str, admin_path: str) -> str | None:
    """Why admin_path cannot be the admin socket of an agent on socket_path
    (None: it can): its directory must not be the reporting socket's
    directory or lie below it, since that one is mounted into workloads."""
    shared = os.path.dirname(os.path.abspath(socket_path))
    admin_dir = os.path.dirname(os.path.abspath(admin_path))
    if admin_dir == shared or admin_dir.startswith(shared.rstrip("/") + "/"):
        return f"{admin_path}: must not be in {shared}, the reporting socket's directory"
    return None


# The file the agent keeps beside its socket, for the library to serialise
# context creations across the node with flock (native/shim/node_lock.c):
# containers that mount the socket's directory share it.
CONTEXT_LOCK_NAME = "context.lock"
NODE_LOCK_ENV = "GPUVISOR_NODE_LOCK"
# The library's default (native/shim/node_lock.c): in the directory HAMi's
# device plugin mounts from the host into every container it shares a GPU with.
HAMI_LOCK_DIR = "/tmp/vgpulock"


def context_lock_path(socket_path: str) -> str:
    return os.path.join(os.path.dirname(socket_path), CONTEXT_LOCK_NAME)


@dataclass
class AgentConfig:
    socket_path: str = DEFAULT_SOCKET
    admin_socket: str = ""  # "": admin_socket_for(socket_path)
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9400  # 0: any free port (printed in the ready line)
    expire_after: float = 10.0  # seconds without a report before a container expires
    read_timeout: float = 5.0  # a partial line or unread replies older than this: disconnect
    idle_timeout: float = 120.0  # no message at all for this long: disconnect
    http_timeout: float = 10.0  # an HTTP client stalled this long (read or write): disconnect
    rate: float = 50.0  # messages/s per connection (0: unlimited)
    burst: float = 100.0
    max_connections: int = 4096
    active_threshold: float = 1.0  # sm_share percent above which a container is active
    active_window: float = 3.0  # seconds an active report keeps a device "busy"
    legacy_metrics: bool = False
    node_name: str = ""  # the host series' node label ("": the host name)
    cpu: int | None = None  # pin the agent to this CPU
    # Containers (label sets) one verified cgroup may hold; a new one
    # replaces the one that reported least recently.
    max_per_cgroup: int = 16
    max_expire: float = 300.0  # cap on 3 x a container's report interval
    # Bad messages in a row after which a connection is closed (0: never)
    max_errors: int = 10
    # Seconds an administrator's limits outlive a container that left, for
    # the container that replaces it in the same pod (0: forgotten at once)
    limit_grace: float = 300.0
    # Where the administrators' limits are kept across an agent restart
    # ("": state_file_for(admin_socket_path), beside the admin socket)
    state_file: str = ""

    @property
    def admin_socket_path(self) -> str:
        return self.admin_socket or admin_socket_for(self.socket_path)

    @property
    def state_file_path(self) -> str:
        return self.state_file or state_file_for(self.admin_socket_path)

    @property
    def restore_window(self) -> float:
        """Seconds a restarted agent waits for the containers that were
        reporting when it stopped to take their administrators' limits
        back: as long as it would have kept them had it stayed up (the
        longest expiry, then --limit-grace)."""
        return max(self.expire_after, self.max_expire) + self.limit_grace


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


def _saved(
    admin: AdminLimits, labels: tuple[str, str, str], scope: str, until: float | None
) -> SavedLimits:
    return SavedLimits(
        labels=labels,
        scope=scope,
        until=until,
        memory=dict(admin.memory),
        sm=dict(admin.sm),
        restore=admin.restore_map(),
    )


def _drop(table: dict[str, dict[str, float]], uuid: str, key: str) -> None:
    """Take container `key` out of a per-device table; a device left with no
    entry is dropped (device UUIDs come from reports: any UUID in NVML's form)."""
    entries = table.get(uuid)
    if entries is not None:
        entries.pop(key, None)
        if not entries:
            del table[uuid]


class AgentState:
    """Everything the agent knows; mutated only by the event loop thread."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.started = time.time()
        self.containers: dict[str, ContainerState] = {}
        # container key -> its administrator's limits (set-limit): pushed in
        # every ack whose report does not show them, until the container goes
        self.admin_limits: dict[str, AdminLimits] = {}
        # device uuid -> {container key: monotonic time until which its last
        # active report keeps the device busy (active_hold)}
        self.high_active: dict[str, dict[str, float]] = {}
        # device uuid -> {container key: monotonic time NVML last showed the
        # container's processes working there}: containers without an SM
        # limit measure no GPU time of their own (their launches are not
        # gated, whatever their priority, except a low-priority one's while
        # it yields), so their reports say 0 %.  Only the high-priority
        # entries make a device busy (busy_for).
        self.nvml_active: dict[str, dict[str, float]] = {}
        # container key -> {device uuid: (percent, monotonic time)}: NVML's
        # figure for each container's processes, last read
        self.nvml_share: dict[str, dict[str, tuple[float, float]]] = {}
        # device uuid -> sum of the containers' claims there (kept
        # incrementally, so "the others' claim" costs O(devices) per report)
        self.device_share: dict[str, float] = {}
        # verified cgroup -> its containers' keys, least recently reported first
        self.by_cgroup: dict[str, dict[str, None]] = {}
        # (namespace, pod, container) -> the key of the container holding them
        self.by_labels: dict[tuple[str, str, str], str] = {}
        self.replaced_total = 0
        self.reports_total = 0
        self.rejected: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        self.disconnects: dict[str, int] = dict.fromkeys(DISCONNECT_REASONS, 0)
        self.connections = 0
        self.connections_total = 0
        self.expired_total = 0
        self.limit_pushes_total = 0
        # (namespace, pod, container) -> the administrator's limits of a
        # container that left, until --limit-grace ends (remove, _adopt)
        self.parked: dict[tuple[str, str, str], ParkedLimits] = {}
        # Bumped whenever admin_limits or parked change (the agent saves
        # them to its state file when it differs from what it saved)
        self.limits_gen = 0
        # wall clock - monotonic clock, once: parked times in the state
        # file are wall-clock, and stay the same from one save to the next
        self.wall_offset = time.time() - time.monotonic()

    # ---- reports -------------------------------------------------------

    def device_churn(self, report: Report) -> str | None:
        """Why the report is refused for naming too many devices (None: it
        is not).  A container's region holds at most MAX_DEVICES devices and
        never forgets one, so its reports name at most that many distinct
        UUIDs while the agent knows it: more are made up, and each would
        start metric series of its own."""
        st = self.containers.get(report.container.key)
        seen = set() if st is None else set(st.devices_seen)
        for i, d in enumerate(report.devices):
            seen.add(d.uuid)
            if len(seen) > MAX_DEVICES:
                return (
                    f"devices[{i}].uuid={d.uuid!r}: a device more than the {MAX_DEVICES} "
                    "this container's reports named (a region holds at most "
                    f"{MAX_DEVICES}, and never changes them)"
                )
        return None

    def accept_report(self, report: Report, peer: PeerCred, now: float) -> Instructions:
        key = report.container.key
        st = self.containers.get(key)
        if st is None:
            st = ContainerState(
                id=report.container,
                report=report,
                peer=peer,
                first_seen=time.time(),
                last_seen=now,
                last_wall=time.time(),
            )
            self._make_room(report.container.cgroup)
            self.containers[key] = st
            self.by_labels[report.container.labels] = key
            self._adopt(report.container, now)
        else:
            dt = now - st.last_seen
            st.interval = dt if st.interval is None else 0.8 * st.interval + 0.2 * dt
            if st.report.priority == 0 and report.priority != 0:
                self._forget_active(key)
            else:  # not active on a device its report no longer lists
                listed = {d.uuid for d in report.devices}
                for d in st.report.devices:
                    if d.uuid not in listed:
                        _drop(self.high_active, d.uuid, key)
                        _drop(self.nvml_active, d.uuid, key)
            st.report = report
            st.peer = peer
            st.last_seen = now
            st.last_wall = time.time()
            st.reports += 1
        st.devices_seen.update(d.uuid for d in report.devices)
        if report.visible is not None:
            st.visible = frozenset(report.visible)
        self._settle_adopted(key, now)
        self._note_cgroup(report.container.cgroup, key)
        self._update_claims(key)
        self.reports_total += 1

        threshold = self.config.active_threshold
        low = report.priority != 0
        yields: dict[str, bool] = {}
        for d in report.devices:
            if low:
                yields[d.uuid] = self.busy_for(key, d.uuid, now)
            else:
                yields[d.uuid] = False
                if d.sm_share > threshold:
                    self.high_active.setdefault(d.uuid, {})[key] = now + self.active_hold(st)
                else:
                    _drop(self.high_active, d.uuid, key)

        others = self._others_share(st)
        admin = self.admin_limits.get(key)
        if admin is None:
            instr = Instructions(yield_devices=yields, others_share=others)
        else:
            # Not settled once applied: a supervisor that restarts (or a
            # process that sets its own limit) puts the region's limit back
            # to what the container's environment says, and the next report
            # shows it, so the admin's limit is pushed again.
            due = admin.unapplied(report)
            instr = Instructions(
                yield_devices=yields,
                memory_limits=due.memory,
                sm_limits=due.sm,
                others_share=others,
                restore=due.restore_map(),
            )
        if report.final:
            self.remove(key, park=now)
        return instr

    def _note_cgroup(self, cgroup: str, key: str) -> None:
        keys = self.by_cgroup.setdefault(cgroup, {})
        keys.pop(key, None)
        keys[key] = None  # most recent last

    def _make_room(self, cgroup: str) -> None:
        """Before a new container of `cgroup`: drop its least recently
        reported ones beyond max_per_cgroup - 1, so one peer cannot fill
        the agent with label sets."""
        keys = self.by_cgroup.get(cgroup, {})
        while keys and len(keys) >= self.config.max_per_cgroup:
            oldest = next(iter(keys))
            self.remove(oldest)
            keys.pop(oldest, None)
            self.replaced_total += 1

    def _forget_active(self, key: str) -> None:
        for table in (self.high_active, self.nvml_active):
            for uuid in [u for u, entries in table.items() if key in entries]:
                _drop(table, uuid, key)
        self._update_claims(key)

    def active_hold(self, st: ContainerState) -> float:
        """Seconds an active report of st keeps its devices busy: the
        active window, or until its next report is due if it reports less
        often (its sm_share covers the time since its previous report):
        two of its report intervals, declared or else measured."""
        interval = st.report.interval if st.report.interval is not None else st.interval
        return max(self.config.active_window, 2 * interval if interval is not None else 0.0)

    def busy_for(self, key: str, uuid: str, now: float) -> bool:
        """Must container `key` (low priority) yield device `uuid`: is
        another, high-priority container active there, by its last report
        (active_hold) or by NVML within the active window?"""
        entries = self.high_active.get(uuid)
        if entries and any(k != key and now <= until for k, until in list(entries.items())):
            return True
        window = self.config.active_window
        seen = self.nvml_active.get(uuid) or {}
        return any(
            k != key and now - ts <= window and self._priority(k) == 0
            for k, ts in list(seen.items())
        )

    def _priority(self, key: str) -> int:
        st = self.containers.get(key)
        return st.report.priority if st is not None else 1

    @staticmethod
    def unmeasured(report: Report, d: DeviceReport) -> bool:
        """Does the container's gate measure nothing on this device?  Its
        launches are gated only with an SM limit (or, with a low priority,
        while it yields, when it launches nothing anyway): a low-priority
        container without a limit keeps the fast path, as a high-priority
        one does."""
        del report  # the priority no longer decides
        return d.sm_limit is None

    def wants_process_use(self) -> bool:
        """Is NVML's per-process use worth reading: does some container
        report without measuring its GPU time, or a low-priority container
        beside a high-priority one?"""
        prios = set()
        for st in list(self.containers.values()):
            r = st.report
            if any(self.unmeasured(r, d) for d in r.devices):
                return True
            prios.add(r.priority)
        return 0 in prios and len(prios) > 1

    def note_process_use(
        self,
        use: Mapping[str, Mapping[int, float]],
        cgroups_of: Callable[[int], frozenset[str]],
        now: float,
    ) -> None:
        """NVML's per-process utilisation (device uuid -> {pid: percent}),
        summed per container: it marks the high-priority containers whose
        processes worked, and is the SM share of containers whose gate
        measures nothing (share_of).

        A PID belongs to the container whose cgroup (as the agent read it)
        the process is in; containers that share a cgroup (processes
        started side by side outside a container runtime, as in the tests)
        are told apart by the PIDs they report, which are then in the
        agent's PID namespace.  A PID that matches no container, or more
        than one, is left out."""
        threshold = self.config.active_threshold
        for uuid, procs in use.items():
            on_dev = {
                k: st
                for k, st in list(self.containers.items())
                if any(d.uuid == uuid for d in st.report.devices)
            }
            totals = dict.fromkeys(on_dev, 0.0)
            for pid, pct in procs.items():
                try:
                    groups = cgroups_of(pid)
                except OSError:
                    continue  # gone, or not visible from here
                owners = [k for k, st in on_dev.items() if st.report.container.cgroup in groups]
                if len(owners) > 1:
                    owners = [k for k in owners if pid in on_dev[k].report.pids]
                if len(owners) == 1:
                    totals[owners[0]] += pct
            for k, total in totals.items():
                self.nvml_share.setdefault(k, {})[uuid] = (min(100.0, total), now)
                st = on_dev[k]
                if total > threshold and (
                    st.report.priority == 0
                    or any(
                        self.unmeasured(st.report, d) for d in st.report.devices if d.uuid == uuid
                    )
                ):
                    active = self.nvml_active.setdefault(uuid, {})
                    new = k not in active
                    active[k] = now
                    if new:
                        self._update_claims(k)

    def share_of(self, key: str, report: Report, d: DeviceReport, now: float) -> float:
        """The container's SM share of device d: what its gate measured, or
        for a container whose gate measures nothing, NVML's figure while
        one is fresh (within the active window)."""
        if self.unmeasured(report, d):
            seen = self.nvml_share.get(key, {}).get(d.uuid)
            if seen is not None and now - seen[1] <= self.config.active_window:
                return seen[0]
        return d.sm_share

    def _claim(self, key: str, report: Report, d: DeviceReport) -> float:
        """What a container claims of a device: nothing while idle; while
        active, its SM limit (the whole device without one) or its use if
        higher.  A starved container (using less than its limit because
        others crowd the device) still claims its limit.  A container whose
        gate measures nothing reports 0 %: it is active while NVML saw its
        processes work within the active window (nvml_active)."""
        active = d.sm_share > self.config.active_threshold or (
            self.unmeasured(report, d) and key in self.nvml_active.get(d.uuid, {})
        )
        if not active:
            return 0.0
        return max(d.sm_share, float(d.sm_limit) if d.sm_limit is not None else 100.0)

    def _update_claims(self, key: str, gone: bool = False) -> None:
        """Replace what container `key` claims in device_share with what
        its last report and NVML's view say now (nothing once it is gone)."""
        st = self.containers.get(key)
        if st is None:
            return
        new: dict[str, float] = {}
        for d in [] if gone else st.report.devices:
            new[d.uuid] = new.get(d.uuid, 0.0) + self._claim(key, st.report, d)
        for uuid in st.claims.keys() | new.keys():
            total = self.device_share.get(uuid, 0.0) - st.claims.get(uuid, 0.0) + new.get(uuid, 0.0)
            if total > 1e-6:
                self.device_share[uuid] = total
            else:  # nobody claims it: keep no entry for a device that may be gone
                self.device_share.pop(uuid, None)
        st.claims = new

    def _others_share(self, st: ContainerState) -> dict[str, float]:
        """Per device of the container's report: what the other containers
        claim there."""
        return {
            d.uuid: min(
                100.0, max(0.0, self.device_share.get(d.uuid, 0.0) - st.claims.get(d.uuid, 0.0))
            )
            for d in st.report.devices
        }

    def remove(self, key: str, park: float | None = None) -> None:
        """Forget container `key`.  park: the monotonic time now, when the
        container left in a way a restart follows (its final report,
        expiry, a restarted container taking its labels over): its
        administrator's limits are then kept for --limit-grace seconds for
        the container that replaces it in the same pod (_adopt)."""
        st = self.containers.get(key)
        admin = self.admin_limits.get(key)
        if admin is not None:
            self.limits_gen += 1
        if st is not None and admin is not None and park is not None:
            grace = self.config.limit_grace
            if grace > 0:
                self.parked[st.id.labels] = ParkedLimits(
                    admin, cgroup_scope(st.id.cgroup), park + grace
                )
        if st is not None:
            self._update_claims(key, gone=True)
        self.containers.pop(key, None)
        if st is not None:
            if self.by_labels.get(st.id.labels) == key:
                del self.by_labels[st.id.labels]
            keys = self.by_cgroup.get(st.id.cgroup)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self.by_cgroup[st.id.cgroup]
        self.admin_limits.pop(key, None)
        self.nvml_share.pop(key, None)
        self._forget_active(key)

    def _adopt(self, cid: ContainerId, now: float) -> None:
        """A new container takes the administrator's limits its pod's
        previous container with the same labels left (remove(park=...)),
        within --limit-grace seconds.  A container of another pod (its
        cgroup under another parent: a pod recreated with the same name)
        does not; nor does one that already has limits of its own."""
        parked = self.parked.get(cid.labels)
        if parked is None or now > parked.until or parked.scope != cgroup_scope(cid.cgroup):
            return
        del self.parked[cid.labels]
        self.limits_gen += 1
        if cid.key not in self.admin_limits:
            limits = parked.limits
            limits.adopted = limits.devices()
            limits.adopted_until = parked.until
            self.admin_limits[cid.key] = limits

    def _settle_adopted(self, key: str, now: float) -> None:
        """Adopted limits (_adopt) are the container's own once its reports
        list their device or name it visible (a device the container can
        see but has not used yet: its limit is kept for the container's
        life, as the administrator set it for the one before); those on
        devices neither listed nor named visible when the grace ends are
        dropped (a device the restarted container does not have would
        otherwise be pushed in every ack, show in pending_limits and count
        toward MAX_DEVICES for good).  A container whose reports do not
        say what it can see (a supervisor older than `visible`) keeps only
        those on the devices it listed."""
        admin = self.admin_limits.get(key)
        st = self.containers.get(key)
        if admin is None or st is None or not admin.adopted:
            return
        admin.adopted -= st.devices_seen
        if st.visible is not None:
            admin.adopted -= st.visible
        if now > admin.adopted_until:
            self.limits_gen += 1
            for uuid in list(admin.adopted):
                admin.drop_device(uuid)
            if not admin.devices():
                del self.admin_limits[key]

    def expiry(self, st: ContainerState) -> float:
        """Seconds without a report before the container expires: at least
        --expire-after, and 3 of its report intervals (at most --max-expire),
        by the interval its reports declare (from the first report on) and
        the one measured between them."""
        limit = self.config.expire_after
        for interval in (st.report.interval, st.interval):
            if interval is not None:
                limit = max(limit, min(3 * interval, self.config.max_expire))
        return limit

    def expire(self, now: float) -> int:
        expired = []
        for key, st in self.containers.items():
            if now - st.last_seen > self.expiry(st):
                expired.append(key)
        for key in expired:
            self.remove(key, park=now)
        self.expired_total += len(expired)
        for key in [k for k, a in self.admin_limits.items() if a.adopted]:
            self._settle_adopted(key, now)
        for labels in [k for k, p in self.parked.items() if now > p.until]:
            del self.parked[labels]
            self.limits_gen += 1
        for uuid, entries in list(self.high_active.items()):
            for k in [k for k, until in entries.items() if now > until]:
                _drop(self.high_active, uuid, k)
        window = self.config.active_window
        for uuid, entries in list(self.nvml_active.items()):
            for k in [k for k, ts in entries.items() if now - ts > window]:
                _drop(self.nvml_active, uuid, k)
                self._update_claims(k)
        return len(expired)

    def label_holder(self, cid: ContainerId) -> ContainerState | None:
        """The container of another cgroup that holds cid's labels, if any."""
        key = self.by_labels.get(cid.labels)
        st = None if key is None else self.containers.get(key)
        return st if st is not None and st.id.cgroup != cid.cgroup else None

    # ---- admin -----------------------------------------------------------

    def find_container(self, name: str) -> str | None:
        """A container key from a key or "namespace/pod/container"."""
        if name in self.containers:
            return name
        matches = [
            k
            for k, st in list(self.containers.items())
            if f"{st.id.namespace or ''}/{st.id.pod or ''}/{st.id.container or ''}" == name
        ]
        return matches[0] if len(matches) == 1 else None

    def set_limit(self, key: str, device: str, msg: dict[str, Any]) -> None:
        """Record an administrator's limit on one device of container `key`
        (set-limit); it replaces the admin's earlier one of that kind and
        stays until the container goes.  A kind given as "env" clears the
        admin's setting: the supervisor is asked to put the container's own
        limit back (also when the admin set none: that changes nothing).
        ValueError: the container has admin limits on MAX_DEVICES other
        devices already."""
        admin = self.admin_limits.get(key) or AdminLimits()
        if device not in admin.devices() and len(admin.devices()) >= MAX_DEVICES:
            raise ValueError(
                f"device={device!r}: the container has limits on {MAX_DEVICES} devices already"
            )
        self.admin_limits[key] = admin
        self.limits_gen += 1
        admin.adopted.discard(device)  # set for this container: kept
        for kind, table in (("memory", admin.memory), ("sm", admin.sm)):
            if kind not in msg:
                continue
            value = msg[kind]
            restore = admin.restore.setdefault(device, set())
            if value == OWN_LIMIT:
                table.pop(device, None)
                restore.add(kind)
            else:
                restore.discard(kind)
                # Pushed as null: the report shows it so (applied).
                table[device] = None if value == UNLIMITED_BYTES else value
            if not restore:
                del admin.restore[device]
        self.limit_pushes_total += 1

    # ---- the state file (supervisor/agent_persist.py) ----------------------

    def saved_limits(self) -> list[SavedLimits]:
        """The administrators' limits as the state file keeps them: those
        of the containers the agent knows (until None), then the parked ones
        (until: wall clock; None for one still awaiting its container)."""
        out = []
        for key, admin in list(self.admin_limits.items()):
            st = self.containers.get(key)
            if st is not None:
                out.append(_saved(admin, st.id.labels, cgroup_scope(st.id.cgroup), None))
        for labels, p in list(self.parked.items()):
            until = None if p.awaiting else round(p.until + self.wall_offset, 3)
            out.append(_saved(p.limits, labels, p.scope, until))
        return out

    def restore_saved(self, entries: list[SavedLimits], now: float, wall: float) -> int:
        """Park the state file's entries (at agent start) for the
        containers that take them back (_adopt): a parked entry until its
        wall-clock end (one already past is dropped), a container's that
        was reporting for restore_window seconds from now.  Two entries
        with the same labels: the reporting container's wins, else the one
        kept longer.  Returns how many were dropped as expired."""
        dropped = 0
        window = self.config.restore_window
        for e in entries:
            if e.until is not None and e.until <= wall:
                dropped += 1
                continue
            awaiting = e.until is None
            until = now + window if e.until is None else now + (e.until - wall)
            held = self.parked.get(e.labels)
            if held is not None and (held.awaiting or (not awaiting and held.until >= until)):
                continue
            limits = AdminLimits(
                memory=dict(e.memory),
                sm=dict(e.sm),
                restore={u: set(kinds) for u, kinds in e.restore.items()},
            )
            if limits.devices():
                self.parked[e.labels] = ParkedLimits(limits, e.scope, until, awaiting)
        self.limits_gen += 1
        return dropped

    # ---- views -------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        wall = time.time()
        containers = []
        for key, st in list(self.containers.items()):
            r = st.report
            devices = []
            for d in r.devices:
                dd = asdict(d)
                dd["memory_used_ratio"] = d.memory_used / d.memory_limit if d.memory_limit else None
                dd["yield"] = r.priority != 0 and self.busy_for(key, d.uuid, now)
                dd["sm_share"] = self.share_of(key, r, d, now)
                devices.append(dd)
            admin = self.admin_limits.get(key)
            interval = st.interval if st.interval is not None else r.interval
            containers.append(
                {
                    "key": key,
                    "container": asdict(st.id),
                    "peer": asdict(st.peer),
                    "policy": r.policy,
                    "priority": r.priority,
                    "seq": r.seq,
                    "ts": r.ts,
                    "pids": list(r.pids),
                    "devices": devices,
                    "first_seen": st.first_seen,
                    "last_report": st.last_wall,
                    "age_s": round(wall - st.last_wall, 3),
                    "interval_s": None if interval is None else round(interval, 3),
                    "reports": st.reports,
                    "visible": None if st.visible is None else sorted(st.visible),
                    "admin_limits": None if admin is None else admin.view(),
                    "pending_limits": None if admin is None else admin.unapplied(r).view(),
                }
            )
        containers.sort(key=lambda c: str(c["key"]))
        return {
            "agent": {
                "pid": os.getpid(),
                "socket": self.config.socket_path,
                "started": self.started,
                "uptime_s": round(wall - self.started, 3),
                "connections": self.connections,
                "connections_total": self.connections_total,
                "reports_total": self.reports_total,
                "rejected_reports_total": dict(self.rejected),
                "disconnects_total": dict(self.disconnects),
                "expired_total": self.expired_total,
                "replaced_total": self.replaced_total,
                "limit_pushes_total": self.limit_pushes_total,
                "expire_after_s": self.config.expire_after,
                "limit_grace_s": self.config.limit_grace,
                "parked_limits": len(self.parked),
            },
            "containers": containers,
        }
