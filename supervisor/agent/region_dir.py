"""Containers the node agent learns of through their region files
(docs/hami.md, "Metrics and the node agent").

Under HAMi every container that loads the library gets a directory of its
own on the host, /usr/local/vgpu/containers/<pod UID>_<container name>/
(mounted at /usr/local/vgpu in the container), and HAMi's device plugin
points CUDA_DEVICE_MEMORY_SHARED_CACHE at <random UUID>.cache in it: the
container's region file.  The scanner reads those files through the
library (gpuvisor.shim.region_file) every interval and hands each
container to AgentState as a report, the way a supervisor's report arrives
over the socket: the same series, the same priority decisions
(shares.py).  The yield flags and the others' share the agent decides are
then written into the region file, which a supervisor would do otherwise.

What names the container is the directory's name, which the device plugin
made on the host: pod UID and container name.  What is in the directory is
the container's own (it is mounted read-write into it), so a file there
only ever speaks for that container: a symbolic link is not followed, a
file that is not a gpuvisor region of this layout (HAMi-core's, a
malformed or truncated one) is skipped with one log line, and at most
MAX_FILES names of a directory are looked at.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field

from gpuvisor.shim.capi import GpuvisorError
from gpuvisor.shim.region_file import FileDevice, read_region_file, set_region_file_sm

from ..identity import PeerCred
from ..protocol import POLICIES, ContainerId, DeviceReport, Report
from .records import CGROUP_PREFIX
from .state import AgentState

log = logging.getLogger("gpuvisor.agent")

# HAMi's per-container directories (devicePlugin.libPath + "/containers").
HAMI_CONTAINERS_DIR = "/usr/local/vgpu/containers"
# The name HAMi's device plugin gives the region file: <random UUID>.cache.
REGION_SUFFIX = ".cache"
# Names of one directory looked at per scan, files of the whole directory
# and directories of the whole node logged as skipped (the rest counted).
MAX_FILES = 16
MAX_LOGGED = 4096
# How long a yield flag holds unless the next scan renews it (the tuner's
# lease, entrypoint/tuner.py: YIELD_LEASE_S); with scans 1 s apart two go
# by before it lapses.
YIELD_LEASE_S = 2.0
# <pod UID>_<container name>: a UUID and a DNS-1123 label.
DIR_NAME = re.compile(
    r"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})_([a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?)"
)


def default_region_dir() -> str:
    """HAMi's directory where it exists, else "" (no scan)."""
    return HAMI_CONTAINERS_DIR if os.path.isdir(HAMI_CONTAINERS_DIR) else ""


@dataclass
class _Seen:
    """A container's region file, as the last scan read it."""

    path: str
    cid: ContainerId
    seq: int = 0
    ts: float = 0.0  # time.monotonic() of the last reading
    busy: dict[str, int] = field(default_factory=dict)  # uuid -> busy_ns then
    yielding: set[str] = field(default_factory=set)  # uuids whose yield the agent set


class RegionScanner:
    """Reads the region files under one directory into an AgentState."""

    def __init__(self, directory: str, state: AgentState, interval: float) -> None:
        self.directory = directory
        self.state = state
        self.interval = interval
        self.seen: dict[str, _Seen] = {}  # container directory -> its region
        self.logged: set[str] = set()  # what was logged as skipped
        self.skipped = 0  # files and directories the last scan skipped
        self.dir_problem: str | None = None

    def _skip(self, what: str, why: str) -> None:
        """Log once that `what` is skipped (while it stays so)."""
        self.skipped += 1
        if what not in self.logged and len(self.logged) < MAX_LOGGED:
            self.logged.add(what)
            log.warning("%s: skipped: %s", what, why)

    def scan(self, now: float | None = None) -> None:
        """One scan: every container directory's region read, reported to
        the state, and the state's decisions written back."""
        now = time.monotonic() if now is None else now
        self.skipped = 0
        try:
            with os.scandir(self.directory) as it:
                entries = sorted((e for e in it), key=lambda e: e.name)
            if self.dir_problem is not None:
                log.warning("--region-dir %s: readable again", self.directory)
                self.dir_problem = None
        except OSError as exc:
            why = exc.strerror or str(exc)
            if self.dir_problem != why:
                log.warning("--region-dir %s: cannot list it: %s", self.directory, why)
                self.dir_problem = why
            entries = []
        present: set[str] = set()
        for e in entries:
            m = DIR_NAME.fullmatch(e.name)
            if m is None or not e.is_dir(follow_symlinks=False):
                self._skip(e.path, "not a directory named <pod UID>_<container name>")
                continue
            region = self._region_of(e.path)
            if region is None:
                continue
            path, devices, owner = region
            present.add(e.path)
            self._report(e.path, path, m.group(1), m.group(2), devices, owner, now)
        for gone in [d for d in self.seen if d not in present]:
            self._forget(gone)
        # Names that went away may be logged again if they come back broken.
        self.logged = {p for p in self.logged if os.path.lexists(p)}

    def _region_of(self, directory: str) -> tuple[str, list[FileDevice], tuple[int, int]] | None:
        """The directory's region file: (path, devices, owner uid) of the
        first *.cache file by name that is a gpuvisor region (owner: the
        file's uid and gid); None when none is."""
        try:
            with os.scandir(directory) as it:
                names = []
                for n, e in enumerate(it):
                    if n >= MAX_FILES * 4:
                        break
                    if e.name.endswith(REGION_SUFFIX):
                        names.append(e.name)
        except OSError as exc:
            self._skip(directory, f"cannot list it: {exc.strerror or exc}")
            return None
        for name in sorted(names)[:MAX_FILES]:
            path = os.path.join(directory, name)
            try:
                devices = read_region_file(path)
                st = os.lstat(path)
                owner = (st.st_uid, st.st_gid)
            except GpuvisorError as exc:
                # The library's reason names the file: given once.
                self._skip(path, exc.message.removeprefix(f"gpuvisor: region {path}: "))
                continue
            except OSError as exc:
                self._skip(path, exc.strerror or str(exc))
                continue
            return path, devices, owner
        return None

    def _report(
        self,
        directory: str,
        path: str,
        pod_uid: str,
        container: str,
        devices: list[FileDevice],
        owner: tuple[int, int],
        now: float,
    ) -> None:
        seen = self.seen.get(directory)
        if seen is None or seen.path != path:
            if seen is not None:
                self._forget(directory)
            cid = ContainerId(cgroup=CGROUP_PREFIX + directory, pod=pod_uid, container=container)
            seen = self.seen[directory] = _Seen(path=path, cid=cid, ts=now)
        cid = seen.cid
        # The directory's name is the host's word for whose container this
        # is: a socket peer that reported the same labels gives them up.
        holder = self.state.label_holder(cid)
        if holder is not None:
            self.state.remove(holder.id.key)
        elapsed = now - seen.ts
        reports = []
        for d in devices:
            before = seen.busy.get(d.uuid, d.busy_ns)
            share = 0.0
            if elapsed > 0 and d.busy_ns >= before:
                share = min(100.0, (d.busy_ns - before) / (elapsed * 1e9) * 100)
            reports.append(
                DeviceReport(
                    uuid=d.uuid,
                    index=d.index,
                    memory_used=d.used,
                    memory_limit=d.limit,
                    memory_physical=d.physical_total,
                    oom_refusals=d.oom_count,
                    sm_share=round(share, 3),
                    sm_limit=d.sm_limit,
                    sm_enforced=d.sm_share,
                    throttled=False,
                    memory_spilled=min(d.spilled, d.used),
                )
            )
        seen.busy = {d.uuid: d.busy_ns for d in devices}
        seen.ts = now
        seen.seq += 1
        first = devices[0] if devices else None
        report = Report(
            seq=seen.seq,
            ts=time.time(),
            container=cid,
            policy=first.policy if first is not None and first.policy in POLICIES else POLICIES[0],
            # CUDA_TASK_PRIORITY as the region keeps it: 0 high, else low.
            priority=0 if first is not None and first.priority == 0 else 1,
            devices=reports,
            interval=self.interval,
        )
        if self.state.device_churn(report) is not None:
            self._forget(directory)  # a region that keeps changing its devices
            self._skip(path, "names more devices than a region holds")
            return
        instr = self.state.accept_report(report, PeerCred(pid=0, uid=owner[0], gid=owner[1]), now)
        for d in devices:
            want = instr.yield_devices.get(d.uuid, False)
            yield_s = YIELD_LEASE_S if want else (0.0 if d.uuid in seen.yielding else None)
            others = instr.others_share.get(d.uuid)
            if yield_s is None and others is None:
                continue
            try:
                set_region_file_sm(path, d.uuid, yield_s=yield_s, others_pct=others)
            except GpuvisorError as exc:
                self._skip(path, f"writing its yield flag: {exc.message}")
                continue
            if want and d.uuid not in seen.yielding:
                log.info("%s: %s yields %s", path, "/".join(cid.labels), d.uuid)
            if want:
                seen.yielding.add(d.uuid)
            else:
                seen.yielding.discard(d.uuid)

    def _forget(self, directory: str) -> None:
        seen = self.seen.pop(directory, None)
        if seen is not None:
            self.state.remove(seen.cid.key)
