"""The node agent's decisions per device: which devices a low-priority
container must yield (busy_for), what each container claims of a device and
the others' share there, and NVML's per-process use standing in for the
containers whose gate measures nothing.

A report is the container's word: what it says of its use of a device
only counts toward a neighbour (a yield, a claim) while the agent's own
NVML reading shows the container's processes working there (uses): a
container that does not use a GPU can neither pause a neighbour on it nor
keep a burst-share neighbour from lending it (issue 36, 4).

DeviceShares is AgentState's base (state.py): the same
object, mutated only by the agent's event-loop thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from ..protocol import DeviceReport, Report
from .config import AgentConfig
from .records import ContainerState, is_region_container


def drop_entry(table: dict[str, dict[str, float]], uuid: str, key: str) -> None:
    """Take container `key` out of a per-device table; a device left with no
    entry is dropped (device UUIDs come from reports: any UUID in NVML's form)."""
    entries = table.get(uuid)
    if entries is not None:
        entries.pop(key, None)
        if not entries:
            del table[uuid]


class DeviceShares:
    """The per-device tables of AgentState and what is decided from them."""

    containers: dict[str, ContainerState]  # set by AgentState

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
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

    def _forget_active(self, key: str) -> None:
        for table in (self.high_active, self.nvml_active):
            for uuid in [u for u, entries in table.items() if key in entries]:
                drop_entry(table, uuid, key)
        self._update_claims(key)

    def active_hold(self, st: ContainerState) -> float:
        """Seconds an active report of st keeps its devices busy: the
        active window, or until its next report is due if it reports less
        often (its sm_share covers the time since its previous report):
        two of its report intervals, declared or else measured."""
        interval = st.report.interval if st.report.interval is not None else st.interval
        return max(self.config.active_window, 2 * interval if interval is not None else 0.0)

    def nvml_use(self, key: str, uuid: str, now: float | None = None) -> float | None:
        """NVML's figure for container `key`'s processes on device `uuid`
        (percent), while it is fresh (within the active window); None when
        the agent has no fresh reading (NVML unavailable, not read, or the
        device's per-process use not supported)."""
        seen = self.nvml_share.get(key, {}).get(uuid)
        if seen is None:
            return None
        if (time.monotonic() if now is None else now) - seen[1] > self.config.active_window:
            return None
        return seen[0]

    def at_its_word(self, key: str) -> bool:
        """Is container `key` one the agent learnt of through its region
        file (region_dir.py)?  It knows none of its processes' PIDs, so NVML
        cannot confirm what the region says: it is taken at its word, as
        every report was before (docs/security.md: not closed for them)."""
        st = self.containers.get(key)
        return st is not None and is_region_container(st.id)

    def uses(self, key: str, uuid: str, now: float | None = None) -> bool:
        """Does the agent's own NVML reading show container `key`'s
        processes working on device `uuid` (above the active threshold,
        within the active window)?  What a report says of that device only
        counts toward the neighbours (busy_for, _claim) while it does
        (a container known by its region file: at_its_word)."""
        if self.at_its_word(key):
            return True
        use = self.nvml_use(key, uuid, now)
        return use is not None and use > self.config.active_threshold

    def busy_for(self, key: str, uuid: str, now: float) -> bool:
        """Must container `key` (low priority) yield device `uuid`: is
        another, high-priority container active there, by its last report
        (active_hold) while NVML shows its processes working there, or by
        NVML within the active window?"""
        entries = self.high_active.get(uuid)
        if entries and any(
            k != key and now <= until and self.uses(k, uuid, now)
            for k, until in list(entries.items())
        ):
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
    def unmeasured(d: DeviceReport) -> bool:
        """Does the container's gate measure nothing on this device?  Its
        launches are gated only with an SM limit (or, with a low priority,
        while it yields, when it launches nothing anyway): a low-priority
        container without a limit keeps the fast path, as a high-priority
        one does, whatever its priority."""
        return d.sm_limit is None

    def wants_process_use(self) -> bool:
        """Is NVML's per-process use worth reading: does some container
        report without measuring its GPU time, or two containers report the
        same device (a report counts toward a neighbour only as far as NVML
        shows it true: uses)?"""
        seen: set[str] = set()
        for st in list(self.containers.values()):
            for d in st.report.devices:
                if self.unmeasured(d) or d.uuid in seen:
                    return True
                seen.add(d.uuid)
        return False

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
                    or any(self.unmeasured(d) for d in st.report.devices if d.uuid == uuid)
                ):
                    self.nvml_active.setdefault(uuid, {})[k] = now
                # What it claims follows NVML's view of its use (_claim).
                self._update_claims(k, now=now)

    def share_of(self, key: str, report: Report, d: DeviceReport, now: float) -> float:
        """The container's SM share of device d: what its gate measured, or
        for a container whose gate measures nothing, NVML's figure while
        one is fresh (within the active window)."""
        if self.unmeasured(d):
            seen = self.nvml_share.get(key, {}).get(d.uuid)
            if seen is not None and now - seen[1] <= self.config.active_window:
                return seen[0]
        return d.sm_share

    def _claim(self, key: str, report: Report, d: DeviceReport, now: float | None) -> float:
        """What a container claims of a device: nothing while idle; while
        active, its SM limit (the whole device without one) or its use if
        higher.  A starved container (using less than its limit because
        others crowd the device) still claims its limit.  A best-effort
        container with a limit claims nothing: it has no guarantee, and
        yields to the others.  A container whose
        gate measures nothing reports 0 %: it is active while NVML saw its
        processes work within the active window (nvml_active).

        Active, and the use above its limit, only as far as the agent's
        own NVML reading of its processes shows (uses, nvml_use): a
        report of use on a device its processes do not use claims nothing,
        and a share reported above what NVML saw counts as NVML's figure
        (an inflated claim would keep burst-share neighbours from lending).
        Without a fresh NVML reading nothing is claimed: the lenders then
        go by their own gate's reading of the others' use."""
        use = 100.0 if self.at_its_word(key) else self.nvml_use(key, d.uuid, now)
        if use is None or use <= self.config.active_threshold:
            return 0.0
        active = d.sm_share > self.config.active_threshold or (
            self.unmeasured(d) and key in self.nvml_active.get(d.uuid, {})
        )
        if not active:
            return 0.0
        if d.sm_limit is not None and report.policy == "best-effort":
            # No guarantee to get back: its limit only turns its gate on
            # (its floor is 1 %), and what it uses is what the others left
            # it.  Claimed (its limit, or even its use), it told a
            # burst-share neighbour to keep off that part of the device, so
            # the neighbour could not take it back: the opposite of
            # yielding.  The lenders see its use in NVML's figures, as
            # without the agent, and take it back when they need it.
            return 0.0
        return max(min(d.sm_share, use), float(d.sm_limit) if d.sm_limit is not None else 100.0)

    def _update_claims(self, key: str, gone: bool = False, now: float | None = None) -> None:
        """Replace what container `key` claims in device_share with what
        its last report and NVML's view say at `now` (monotonic; None: the
        clock's now), nothing once it is gone."""
        st = self.containers.get(key)
        if st is None:
            return
        new: dict[str, float] = {}
        for d in [] if gone else st.report.devices:
            new[d.uuid] = new.get(d.uuid, 0.0) + self._claim(key, st.report, d, now)
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
