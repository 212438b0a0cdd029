"""What `gpuvisor demo` watches: the node agent's /status and NVML.

Every poll reads two independent sources:

- the node agent's /status (what the supervisors reported: memory used and
  limit, refusals, the SM share the library measured, the enforced share);
- NVML's per-process utilisation (`nvmlDeviceGetProcessUtilization`) on
  every device, summed per container through the PIDs the agent lists.
  This is the share the GPU itself saw, the one other containers feel, and
  the one the summary and the plot use.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
import urllib.error
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..agent.metrics import process_samples
from ..views import fetch_status


@dataclass
class Point:
    t: float  # seconds since the demo started
    sm: float | None  # NVML: percent of the GPU's time over the last poll interval
    sm_reported: float | None  # the supervisor's report (library-measured)
    sm_enforced: float | None
    memory_used: int
    memory_limit: int | None
    refusals: int


@dataclass
class Series:
    name: str
    points: list[Point] = field(default_factory=list)

    @property
    def last(self) -> Point | None:
        return self.points[-1] if self.points else None

    def mean_sm(self, t0: float, t1: float) -> float | None:
        vals = [p.sm for p in self.points if p.sm is not None and t0 <= p.t <= t1]
        return sum(vals) / len(vals) if vals else None

    def peak_memory(self) -> int:
        return max((p.memory_used for p in self.points), default=0)

    def refusals(self) -> int:
        return max((p.refusals for p in self.points), default=0)


class ProcessUtilization:
    """Per-process SM utilisation from NVML, on every device."""

    def __init__(self, simulator_nvml: str | None) -> None:
        if simulator_nvml is not None:
            # Loaded under its soname first, pynvml's dlopen finds this one.
            ctypes.CDLL(simulator_nvml, mode=ctypes.RTLD_GLOBAL)
        import pynvml

        self.nvml: Any = pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        now_us = int(time.time() * 1e6)
        self.last_seen = [now_us] * count
        # Each PID's newest sample taken, per device: a known PID is asked
        # for from its own, because a driver does not publish every
        # process's sample of a period at once, and asking from another
        # PID's newer timestamp loses the samples published later (on an
        # H200 about half of each, with two busy processes).
        self.pid_seen: list[dict[int, int]] = [{} for _ in range(count)]
        self.start_us = now_us
        self.last_poll = time.monotonic()

    # A PID this far behind the newest sample of anyone's is asked for no more.
    FORGET_US = 10_000_000
    # New PIDs are looked for this far behind the newest sample of anyone's
    # (a PID whose samples are published later would never be found).
    DISCOVER_US = 1_000_000

    def _samples(self, handle: Any, since: int) -> list[Any]:
        try:
            return process_samples(self.nvml, handle, since)
        except self.nvml.NVMLError:
            return []  # the device lost, or samples kept changing

    def poll(self) -> dict[int, float]:
        """Percent of each device's time each PID's kernels ran since the last poll."""
        shares: dict[int, float] = defaultdict(float)
        for i, handle in enumerate(self.handles):
            known = self.pid_seen[i]
            by_pid: dict[int, list[int]] = defaultdict(list)
            newest: dict[int, int] = {}
            # New PIDs, from the newest sample of anyone's; then each known
            # PID from its own newest.
            discover = max(self.start_us, self.last_seen[i] - self.DISCOVER_US)
            asks: list[tuple[int | None, int]] = [(None, discover)]
            asks += list(known.items())
            for who, since in asks:
                for s in self._samples(handle, since):
                    pid = int(s.pid)
                    if pid != who and (who is not None or pid in known):
                        continue
                    by_pid[pid].append(int(s.smUtil))
                    newest[pid] = max(newest.get(pid, 0), int(s.timeStamp))
            for pid, ts in newest.items():
                known[pid] = ts
                self.last_seen[i] = max(self.last_seen[i], ts)
            for pid in [p for p, ts in known.items() if ts + self.FORGET_US < self.last_seen[i]]:
                del known[pid]
            for pid, vals in by_pid.items():
                shares[pid] += sum(vals) / len(vals)
        return dict(shares)

    def close(self) -> None:
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()


class Sampler:
    """Polls the agent and NVML and keeps one Series per container (by pod name)."""

    def __init__(self, status_url: str, nvml: ProcessUtilization | None, t0: float) -> None:
        self.url = status_url
        self.nvml = nvml
        self.t0 = t0
        self.series: dict[str, Series] = {}
        self.agent: dict[str, Any] = {}

    def poll(self) -> None:
        t = time.monotonic() - self.t0
        try:
            status = fetch_status(self.url, timeout=2.0)
        except (OSError, urllib.error.URLError, ValueError):
            return
        self.agent = status.get("agent", {})
        util = self.nvml.poll() if self.nvml is not None else {}
        for c in status.get("containers", []):
            name = str(c["container"].get("pod") or c["key"])
            devices = c.get("devices") or []
            if not devices:
                continue
            sm = sum(util.get(int(pid), 0.0) for pid in c.get("pids", []))
            series = self.series.setdefault(name, Series(name))
            series.points.append(
                Point(
                    t=t,
                    sm=min(sm, 100.0) if self.nvml is not None else None,
                    sm_reported=sum(float(d["sm_share"]) for d in devices),
                    sm_enforced=max(float(d["sm_enforced"]) for d in devices),
                    memory_used=sum(int(d["memory_used"]) for d in devices),
                    memory_limit=devices[0]["memory_limit"],
                    refusals=sum(int(d["oom_refusals"]) for d in devices),
                )
            )
