"""What the node agent knows: containers, their latest reports, admins' limits,
priority and the others' shares per device (server.py serves it).
Its configuration is in config.py, its records in records.py, and the
decisions per device (yields, shares, NVML's view) in shares.py.

Mutated only by the agent's event-loop thread; read by the HTTP thread for
/metrics and /status.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, replace
from typing import Any

from gpuvisor.shim.version import build_info

from ..identity import PeerCred, cgroup_exists
from ..protocol import (
    MAX_DEVICES,
    OWN_LIMIT,
    ContainerId,
    Instructions,
    Report,
)
from .config import AgentConfig
from .persist import SavedBinding, SavedLimits, SavedTerms
from .records import AdminLimits, ContainerState, ParkedLimits, cgroup_scope
from .shares import DeviceShares, drop_entry
from .unmanaged import UnmanagedWatch

log = logging.getLogger("gpuvisor.agent")

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
# Terms (fixed_terms) recorded per cgroup, and cgroups with terms kept
# before those whose cgroup is gone are dropped; containers whose change
# of terms is logged (once each).
MAX_TERMS_PER_CGROUP = 64
MAX_TERM_CGROUPS = 65536
MAX_TERMS_LOGGED = 4096
# Label bindings (label_scopes) kept at most, and per scope (pod): those of
# pods that are gone are dropped when the first is reached; a scope past
# the second forgets its own least recently bound labels that no container
# holds (connection._scope_may_hold).
MAX_LABEL_SCOPES = 65536
MAX_SCOPE_LABELS = 64
DISCONNECT_REASONS = ("oversize", "timeout", "slow-reader", "idle", "too-many", "errors")
# The library's "no memory limit" (GV_UNLIMITED): a region so limited
# reports memory_limit null.
UNLIMITED_BYTES = 2**64 - 1


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


class AgentState(DeviceShares):
    """Everything the agent knows; mutated only by the event loop thread."""

    def __init__(self, config: AgentConfig) -> None:
        super().__init__(config)  # the per-device tables (shares.py)
        self.started = time.time()
        # what is installed: the package's release, the library's release and build id
        self.build = build_info()
        self.containers: dict[str, ContainerState] = {}
        # per GPU, the processes NVML lists that no container reports (unmanaged.py)
        self.unmanaged = UnmanagedWatch(config.active_window)
        # container key -> its administrator's limits (set-limit): pushed in
        # every ack whose report does not show them, until the container goes
        self.admin_limits: dict[str, AdminLimits] = {}
        # verified cgroup -> its containers' keys, least recently reported first
        self.by_cgroup: dict[str, dict[str, None]] = {}
        # (namespace, pod, container) -> the key of the container holding them
        self.by_labels: dict[tuple[str, str, str], str] = {}
        # labels -> the scope (pod cgroup, records.cgroup_scope) of the first
        # verified cgroup that reported them: no cgroup of another scope may
        # take them while that one exists (connection._labels_free)
        self.label_scopes: dict[tuple[str, str, str], str] = {}
        # scope -> the labels bound to it, least recently bound first (a
        # scope binds at most MAX_SCOPE_LABELS: connection._scope_may_hold)
        self.scope_labels: dict[str, dict[tuple[str, str, str], None]] = {}
        # Bumped whenever label_scopes or terms change (saved to the state
        # file, at most once a second: server.Agent.save_state)
        self.identity_gen = 0
        # verified cgroup -> {labels: (priority, policy)} as first reported
        # (fixed_terms), least recently reported first; kept while the
        # cgroup exists
        self.terms: dict[str, dict[tuple[str, str, str], tuple[int, str]]] = {}
        self.terms_ignored_total = 0  # reports whose other terms were not taken
        self.terms_logged: set[str] = set()
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

    def fixed_terms(self, report: Report) -> Report:
        """The report with the priority and policy its container first
        reported (recorded at the first report of that cgroup and label
        set, and kept while the cgroup exists: a final report or expiry
        does not reset them): a later report that says otherwise is taken
        with the recorded ones, and logged once per container.  A
        container's terms are its supervisor's configuration, which does not
        change while the container lives; a process of the container that
        reports other terms would give itself priority over its
        neighbours."""
        cid = report.container
        terms = (report.priority, report.policy)
        held = self.terms.setdefault(cid.cgroup, {})
        recorded = held.get(cid.labels)
        if recorded is None:
            if len(held) >= MAX_TERMS_PER_CGROUP:
                # The cgroup's own least recently recorded label set that no
                # container holds now: only the cgroup itself loses by it.
                for labels in list(held):
                    if self._holder_key(cid.cgroup, labels) is None:
                        del held[labels]
                        self.identity_gen += 1
                        break
                else:
                    return report  # every one held: not recorded (its own loss)
            if len(self.terms) > MAX_TERM_CGROUPS:
                for cgroup in [c for c in self.terms if c != cid.cgroup]:
                    if not cgroup_exists(cgroup):
                        del self.terms[cgroup]
            held[cid.labels] = terms
            self.identity_gen += 1
            return report
        held[cid.labels] = held.pop(cid.labels)  # most recent last
        if recorded == terms:
            return report
        self.terms_ignored_total += 1
        if cid.key not in self.terms_logged and len(self.terms_logged) < MAX_TERMS_LOGGED:
            self.terms_logged.add(cid.key)
            log.warning(
                "container %s: reports priority=%d policy=%s, but its first report said "
                "priority=%d policy=%s; the first ones stay for the container's life",
                cid.key,
                report.priority,
                report.policy,
                recorded[0],
                recorded[1],
            )
        return replace(report, priority=recorded[0], policy=recorded[1])

    def _holder_key(self, cgroup: str, labels: tuple[str, str, str]) -> str | None:
        """The key of the container of `cgroup` with `labels`, if the agent knows one."""
        key = self.by_labels.get(labels)
        st = None if key is None else self.containers.get(key)
        return key if st is not None and st.id.cgroup == cgroup else None

    def accept_report(self, report: Report, peer: PeerCred, now: float) -> Instructions:
        report = self.fixed_terms(report)
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
                        drop_entry(self.high_active, d.uuid, key)
                        drop_entry(self.nvml_active, d.uuid, key)
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
        self._update_claims(key, now=now)
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
                    drop_entry(self.high_active, d.uuid, key)

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
                drop_entry(self.high_active, uuid, k)
        window = self.config.active_window
        for uuid, entries in list(self.nvml_active.items()):
            for k in [k for k, ts in entries.items() if now - ts > window]:
                drop_entry(self.nvml_active, uuid, k)
        # Claims stand only while NVML's reading of the claimant is fresh.
        for k in [k for k, st in self.containers.items() if st.claims]:
            self._update_claims(k, now=now)
        return len(expired)

    def label_holder_key(self, labels: tuple[str, str, str]) -> str | None:
        """The key of the container the agent knows with these labels, if any."""
        key = self.by_labels.get(labels)
        return key if key is not None and key in self.containers else None

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

    # ---- the state file (persist.py) ----------------------------------

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

    def bind_scope(self, labels: tuple[str, str, str], scope: str) -> None:
        """Bind labels to scope (connection._scope_may_hold decides when)."""
        old = self.label_scopes.get(labels)
        if old == scope:
            return
        if old is not None:
            self.unbind_scope(labels)
        self.label_scopes[labels] = scope
        self.scope_labels.setdefault(scope, {})[labels] = None
        self.identity_gen += 1

    def unbind_scope(self, labels: tuple[str, str, str]) -> None:
        scope = self.label_scopes.pop(labels, None)
        if scope is None:
            return
        held = self.scope_labels.get(scope)
        if held is not None:
            held.pop(labels, None)
            if not held:
                del self.scope_labels[scope]
        self.identity_gen += 1

    def saved_bindings(self) -> list[SavedBinding]:
        return [SavedBinding(labels, scope) for labels, scope in list(self.label_scopes.items())]

    def saved_terms(self) -> list[SavedTerms]:
        return [
            SavedTerms(cgroup, labels, prio, policy)
            for cgroup, held in list(self.terms.items())
            for labels, (prio, policy) in list(held.items())
        ]

    def restore_identity(self, bindings: list[SavedBinding], terms: list[SavedTerms]) -> None:
        """Take back the state file's label bindings and first-reported
        terms (at agent start), so that a restart does not open a race for
        them: a binding whose pod is gone, or terms whose cgroup is, is
        dropped when the table is full, as one made in this run."""
        for b in bindings[:MAX_LABEL_SCOPES]:
            self.bind_scope(b.labels, b.scope)
        for t in terms:
            held = self.terms.setdefault(t.cgroup, {})
            if len(held) < MAX_TERMS_PER_CGROUP and len(self.terms) <= MAX_TERM_CGROUPS:
                held[t.labels] = (t.priority, t.policy)
            elif not held:
                del self.terms[t.cgroup]
        self.identity_gen += 1

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
                "terms_ignored_total": self.terms_ignored_total,
                "replaced_total": self.replaced_total,
                "limit_pushes_total": self.limit_pushes_total,
                "expire_after_s": self.config.expire_after,
                "limit_grace_s": self.config.limit_grace,
                "parked_limits": len(self.parked),
                "build": self.build,
            },
            "containers": containers,
            "gpus": self.unmanaged.view(),
        }
