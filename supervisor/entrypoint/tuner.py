"""The tuning loop: every 100 ms, read the container's usage and apply the
node agent's instructions.

Each tick reads the region (memory used/limit per device, the SM quota's
state and counters) and applies what the latest ack asked for:
`yield_devices` -> Region.set_sm_yield, `memory_limits` -> Region.set_limit,
`sm_limits` -> Region.set_sm_limit, all live.  Instructions name devices by
UUID; one for a device the region does not list yet (the workload has not
used it) waits until the device appears.  In an ack's limits, a missing
key leaves that limit as it is and null means "no limit" (protocol.py);
a kind in `restore` (an administrator cleared their limit) is no longer
applied as pushed: the container's own limit is set instead (_own_limit:
what the container's first CUDA use of the device configures, from the
library; the strictest the environment gives any device when the
device's CUDA ordinal, which per-device variables name, cannot be known).
Yield flags and the others' share are the agent's live view: they hold
only while the agent answers.  When no ack has come for ack_timeout
seconds (agent_ack_timeout: 3 report intervals, at least 2 s), or at once
when the reporter loses the connection (agent_lost), every yield flag the
agent set is cleared and no others' share is passed on until the next ack;
limits the agent pushed stay (an administrator's change, applied).
A yield flag is a lease of YIELD_LEASE_S that every tick renews while the
agent asks for it: a supervisor that dies (SIGKILL, when it is not PID 1
and the workload outlives it) or hangs leaves the workload paused for at
most that long, never for good.
Once a second it also refreshes the workload's process tree (psutil),
NVML's device utilisation (pynvml, when it loads) and reclaims the region
slots of dead processes; once NVML has loaded, it reads which of the
node's devices the workload can see (visible_devices), which the reports
carry (`visible`: the agent keeps an administrator's limits on them).

The shim adapts burst-share/best-effort shares from NVML by itself; the
tuner carries out the node-wide view of the agent.  Everything runs in a
daemon thread; errors are logged once, never raised.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil
from gpuvisor.shim.capi import GpuvisorError
from gpuvisor.shim.limits import DeviceEnvLimits
from gpuvisor.shim.region import DeviceUsage, Region, SmState

from ..protocol import MAX_PIDS, MAX_VISIBLE, Instructions
from .config import EnvLimits

log = logging.getLogger("gpuvisor.run")

TICK_S = 0.1
SLOW_EVERY = 10  # ticks between process-tree / NVML / reclaim refreshes
ACK_TIMEOUT_INTERVALS = 3  # report intervals without an ack before the agent's view lapses
ACK_TIMEOUT_MIN_S = 2.0
# How long a yield flag holds unless a tick renews it (20 ticks: a tuner
# held up for a moment does not let it lapse).
YIELD_LEASE_S = 2.0
_UNSET = object()


def agent_ack_timeout(report_interval: float) -> float:
    """Seconds without an ack after which the agent's yield flags lapse."""
    return max(ACK_TIMEOUT_INTERVALS * report_interval, ACK_TIMEOUT_MIN_S)


@dataclass(frozen=True)
class DeviceSample:
    usage: DeviceUsage
    sm: SmState
    utilization: int | None  # NVML device utilisation in percent (None: unknown)


@dataclass(frozen=True)
class Sample:
    ts: float  # time.monotonic()
    devices: list[DeviceSample] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    # The devices the container can see, used or not (visible_devices;
    # None: not known yet)
    visible: tuple[str, ...] | None = None


class Nvml:
    """Device utilisation from NVML, handles cached by UUID."""

    def __init__(self, simulator_nvml: str | None = None) -> None:
        if simulator_nvml is not None:
            # Load it under its soname first: pynvml's dlopen("libnvidia-ml.so.1")
            # then finds this one.
            ctypes.CDLL(simulator_nvml, mode=ctypes.RTLD_GLOBAL)
        import pynvml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        self._handles: dict[str, Any] = {}

    def utilization(self, uuid: str) -> int | None:
        try:
            handle = self._handles.get(uuid)
            if handle is None:
                handle = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
                self._handles[uuid] = handle
            return int(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:
            return None

    def devices(self) -> list[tuple[str, int]]:
        """(uuid, total memory in bytes) of every device of the node, in
        NVML's order; raises what NVML raises."""
        out = []
        for i in range(int(self._nvml.nvmlDeviceGetCount())):
            handle = self._nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = self._nvml.nvmlDeviceGetUUID(handle)
            if isinstance(uuid, bytes):  # older pynvml
                uuid = uuid.decode()
            out.append((str(uuid), int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total)))
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


def visible_devices(nvml: Nvml, env_limits: EnvLimits) -> tuple[str, ...] | None:
    """The UUIDs of the node's devices the workload can see, in CUDA
    ordinal order: those the library maps to a CUDA ordinal through the
    workload's CUDA_VISIBLE_DEVICES (env_device_limits, as its processes
    map them), at most MAX_VISIBLE.  None when it cannot be told (NVML's
    list unreadable, the environment not known or refused)."""
    if env_limits.env is None:
        return None
    try:
        devices = nvml.devices()
    except Exception as exc:
        log.debug("listing the node's devices failed: %s", exc)
        return None
    ordinals: list[tuple[int, str]] = []
    for uuid, total in devices:
        try:
            ordinal = env_limits.device(uuid, total).ordinal
        except GpuvisorError as exc:
            log.debug("the CUDA ordinal of %s: %s", uuid, exc)
            return None
        if ordinal is not None:
            ordinals.append((ordinal, uuid))
    return tuple(uuid for _, uuid in sorted(ordinals))[:MAX_VISIBLE]


def open_nvml(simulator_nvml: str | None) -> Nvml | None:
    try:
        return Nvml(simulator_nvml)
    except Exception as exc:
        log.info("NVML unavailable (%s): no device utilisation", exc)
        return None


def read_sample(
    region: Region,
    devices: list[DeviceUsage] | None = None,
    util: Mapping[str, int | None] | None = None,
    pids: list[int] | None = None,
    visible: tuple[str, ...] | None = None,
) -> Sample:
    """The region's devices (read now unless given) and their SM counters
    now, with NVML's utilisation by UUID where known."""
    if devices is None:
        devices = region.devices()
    util = util or {}
    samples = [
        DeviceSample(usage=d, sm=region.sm(d.index), utilization=util.get(d.uuid)) for d in devices
    ]
    return Sample(ts=time.monotonic(), devices=samples, pids=list(pids or []), visible=visible)


def clear_yields(region: Region) -> None:
    """Clear the yield flags left in the region before the workload starts.

    The region file outlives its supervisor (a restarted container keeps
    it): a flag the agent had a previous supervisor set would otherwise
    pause the new workload until its lease ends (2 s, or up to 60 s when
    another caller of the API set it).  Only the agent's acks set them
    again."""
    try:
        for d in region.devices():
            region.set_sm_yield(d.index, 0)
    except GpuvisorError as exc:
        log.warning("clearing the region's yield flags failed: %s", exc)


class Tuner:
    def __init__(
        self,
        region: Region,
        root_pid: int,
        nvml: Nvml | None = None,
        tick: float = TICK_S,
        nvml_loader: Callable[[], Nvml | None] | None = None,
        ack_timeout: float | None = None,
        env_limits: EnvLimits | None = None,
    ) -> None:
        self.region = region
        # The container's own limits, put back when the agent says an
        # administrator cleared theirs (None: not known, see _own_limit).
        self.env_limits = env_limits or EnvLimits(memory_text=None, sm_known=False)
        self.root_pid = root_pid
        self.nvml = nvml
        self._nvml_loader = nvml_loader  # called in the thread: NVML may be slow to start
        self.tick_s = tick
        # Seconds after the latest ack when the agent's yield flags lapse
        # (None: never, only agent_lost clears them).
        self.ack_timeout = ack_timeout
        self._last_ack: float | None = None  # time.monotonic() of the latest ack
        self._lock = threading.Lock()
        # Desired state from the agent, by UUID; applied_* what we last set.
        self._want_yield: dict[str, bool] = {}
        self._want_mem: dict[str, int | None] = {}  # None: no limit
        self._want_sm: dict[str, int | None] = {}
        self._want_others: dict[str, float] = {}
        # (kind, uuid) whose administrator's limit was cleared: the
        # container's own limit is set instead (an ack's `restore`)
        self._restore: set[tuple[str, str]] = set()
        # uuid -> what the library says the environment gives the device
        # (or why it cannot), and the tick it was asked at (_device_limits)
        self._device_env: dict[str, tuple[DeviceEnvLimits | GpuvisorError, int]] = {}
        self._applied: dict[tuple[str, str], object] = {}
        self._sample = Sample(ts=time.monotonic())
        self._pids: list[int] = [root_pid]
        self._util: dict[str, int | None] = {}
        # The devices the workload can see (visible_devices): the node's
        # devices and the environment do not change, so read once known
        self._visible: tuple[str, ...] | None = None
        self._root: psutil.Process | None = None
        self._ticks = 0
        self._logged: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuvisor-tuner", daemon=True)

    # ---- from other threads --------------------------------------------------

    def submit(self, instructions: Instructions) -> None:
        """Instructions of the latest ack; applied on the next tick."""
        with self._lock:
            self._last_ack = time.monotonic()
            for uuid, kinds in instructions.restore.items():
                for kind in kinds:
                    (self._want_mem if kind == "memory" else self._want_sm).pop(uuid, None)
                    self._restore.add((kind, uuid))
            for kind, pushed in (
                ("memory", instructions.memory_limits),
                ("sm", instructions.sm_limits),
            ):
                self._restore.difference_update((kind, uuid) for uuid in pushed)
            self._want_yield.update(instructions.yield_devices)
            self._want_mem.update(instructions.memory_limits)
            self._want_sm.update(instructions.sm_limits)
            self._want_others.update(instructions.others_share)

    def agent_lost(self, why: str = "the connection to the node agent dropped") -> None:
        """The agent is gone (or stopped acking): run without its view."""
        with self._lock:
            self._drop_agent_view(why)

    def _drop_agent_view(self, why: str) -> None:
        """Clear the agent's yield flags and its pending others' share
        (self._lock held); applied on the next tick."""
        self._last_ack = None
        self._want_others = {}
        yielding = sorted(uuid for uuid, y in self._want_yield.items() if y)
        self._want_yield = dict.fromkeys(self._want_yield, False)
        if yielding:
            log.info("%s: no longer yielding %s", why, ", ".join(yielding))

    def sample(self) -> Sample:
        with self._lock:
            return self._sample

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)

    # ---- the loop --------------------------------------------------------------

    def _log_once(self, what: str, exc: BaseException) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning("%s: %s", what, exc)

    def _run(self) -> None:
        if self.nvml is None and self._nvml_loader is not None:
            try:
                self.nvml = self._nvml_loader()
            except Exception as exc:
                self._log_once("NVML unavailable", exc)
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:
                self._log_once("tuning failed", exc)
            next_t += self.tick_s
            now = time.monotonic()
            if next_t < now:
                next_t = now
            self._stop.wait(next_t - now)

    def _slow(self, devices: list[DeviceUsage]) -> None:
        try:
            if self._root is None:
                self._root = psutil.Process(self.root_pid)
            pids = [self.root_pid, *(c.pid for c in self._root.children(recursive=True))]
            self._pids = pids[:MAX_PIDS]
        except psutil.Error:
            self._pids = []
        if self.nvml is not None:
            self._util = {d.uuid: self.nvml.utilization(d.uuid) for d in devices}
            if self._visible is None:
                self._visible = visible_devices(self.nvml, self.env_limits)
        try:
            self.region.reclaim_dead()
        except GpuvisorError as exc:
            self._log_once("reclaiming dead processes' slots failed", exc)

    def _apply(self, devices: list[DeviceUsage]) -> None:
        with self._lock:
            if (
                self._last_ack is not None
                and self.ack_timeout is not None
                and time.monotonic() - self._last_ack > self.ack_timeout
            ):
                self._drop_agent_view(f"no ack from the node agent for {self.ack_timeout:g} s")
            wants: list[tuple[str, dict[str, bool] | dict[str, int | None]]] = [
                ("yield", dict(self._want_yield)),
                ("memory", dict(self._want_mem)),
                ("sm", dict(self._want_sm)),
            ]
            others = dict(self._want_others)
            restore = set(self._restore)
        # The agent's view of the other containers, written again at every
        # tick while the agent answers (it is dropped with the agent's view):
        # the shim's burst-share/best-effort lending uses it only while its
        # timestamp is under 2 s old, and with reports more than 2 s apart a
        # write per ack let it lapse for most of each interval, so a lender
        # went back to NVML alone and could take a starved neighbour's
        # guarantee again.
        for d in devices:
            if d.uuid in others:
                try:
                    self.region.set_sm_others(d.index, others[d.uuid])
                except GpuvisorError as exc:
                    self._log_once(f"passing on the others' share on {d.uuid} failed", exc)
        for d in devices:
            for kind, want in wants:
                if (kind, d.uuid) in restore:
                    value = self._own_limit(kind, d)
                elif d.uuid not in want:
                    continue
                else:
                    value = want[d.uuid]
                try:
                    # Limits are compared with the region, not with what was
                    # last set: the agent repeats a pushed limit until the
                    # reports show it, so one the region lost (the entry's
                    # first CUDA use configures it from the environment, a
                    # process of the container sets its own) is set again.
                    current: object
                    if kind == "yield":
                        # A yield is a lease, renewed at every tick while wanted.
                        current = _UNSET if value else self._applied.get((kind, d.uuid), _UNSET)
                    else:
                        limit = d.limit if kind == "memory" else self.region.sm(d.index).limit
                        if kind == "sm":
                            value = value or None  # 0: no limit, as the region reads it
                        if limit == value:
                            continue
                        current = limit
                    if current == value:
                        continue
                    if kind == "yield":
                        self.region.set_sm_yield(d.index, YIELD_LEASE_S if value else 0)
                    elif kind == "memory":
                        self.region.set_limit(d.index, None if value is None else int(value))
                    else:
                        self.region.set_sm_limit(d.index, None if value is None else int(value))
                    if self._applied.get((kind, d.uuid), _UNSET) != value:
                        log.info("%s on %s set to %s", kind, d.uuid, value)
                except GpuvisorError as exc:
                    self._log_once(f"setting {kind} on {d.uuid} to {value} failed", exc)
                self._applied[(kind, d.uuid)] = value

    def _own_limit(self, kind: str, d: DeviceUsage) -> int | None:
        """The container's own limit of kind on device d (None: no limit):
        exactly what its first CUDA use of d configures.  From the
        environment (EnvLimits) where no per-device variable of that kind
        is set; else from the library, which maps d's UUID to its CUDA
        ordinal as the container's processes do (env_device_limits).  When
        the ordinal cannot be known, the strictest limit the environment
        gives any ordinal (fail closed, never "no limit" by accident); when
        the library refuses the environment, the region's limit as it is."""
        if kind == "memory":
            known, value = self.env_limits.memory(d.physical_total)
        else:
            known, value = self.env_limits.sm_known, self.env_limits.sm
        if known:
            return value
        limits = self._device_limits(d)
        variable = "CUDA_DEVICE_MEMORY_LIMIT" if kind == "memory" else "CUDA_DEVICE_SM_LIMIT"
        if isinstance(limits, GpuvisorError):
            current: int | None = d.limit if kind == "memory" else self.region.sm(d.index).limit
            self._warn_once(
                f"own {kind} {d.uuid} refused",
                "cannot put the container's own %s limit back on %s (%s_<i>): %s; keeping %s",
                kind,
                d.uuid,
                variable,
                limits.message.removeprefix("gpuvisor: "),
                "no limit" if current is None else current,
            )
            return current
        own: int | None = limits.memory if kind == "memory" else limits.sm
        if limits.ordinal is None:
            self._warn_once(
                f"own {kind} {d.uuid} unknown ordinal",
                "%s: %s_<i> names CUDA device indices, and this device's is not known: "
                "putting back the strictest %s limit the environment gives any device, %s",
                limits.why_unknown.removeprefix("gpuvisor: "),
                variable,
                kind,
                "none" if own is None else own,
            )
        return own

    def _device_limits(self, d: DeviceUsage) -> DeviceEnvLimits | GpuvisorError:
        """env_limits.device(d), kept once the device's ordinal is known (the
        environment and the map do not change); asked again at most once a
        second while it is not."""
        cached = self._device_env.get(d.uuid)
        if cached is not None:
            limits, tick = cached
            if (isinstance(limits, DeviceEnvLimits) and limits.ordinal is not None) or (
                self._ticks - tick < SLOW_EVERY
            ):
                return limits
        try:
            result: DeviceEnvLimits | GpuvisorError = self.env_limits.device(
                d.uuid, d.physical_total
            )
        except GpuvisorError as exc:
            result = exc
        self._device_env[d.uuid] = (result, self._ticks)
        return result

    def _warn_once(self, what: str, fmt: str, *args: object) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(fmt, *args)

    def tick(self) -> Sample:
        """One round: read the region, apply instructions, publish a sample."""
        devices = self.region.devices()
        if self._ticks % SLOW_EVERY == 0:
            self._slow(devices)
        self._ticks += 1
        self._apply(devices)
        sample = read_sample(self.region, devices, self._util, list(self._pids), self._visible)
        with self._lock:
            self._sample = sample
        return sample
