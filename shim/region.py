"""The container's shared accounting region, through the C API.

One region per process: the library attaches to a single region file and
attaching to another path in the same process fails (GV_EINVAL).
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from pathlib import Path

from .capi import GV_EINVAL, GV_ENOENT, UNLIMITED, GpuvisorError, check, encode_text, lib


@dataclass(frozen=True)
class DeviceUsage:
    """One device entry of the region."""

    index: int
    uuid: str
    limit: int | None  # None: no limit (GV_UNLIMITED)
    used: int
    physical_total: int
    oom_count: int
    # What a new context of the container is reserved before it is created
    # (the smallest any of its processes measured); 0 while none was.
    context_cost: int
    # Oversubscription (docs/oversubscription.md): of `used`, the bytes
    # served from host memory; the rest is resident on the device.
    spilled: int = 0
    # The device memory the container is guaranteed (limit / S); 0 when
    # none of its processes allocated under CUDA_OVERSUBSCRIBE.
    guarantee: int = 0

    @property
    def resident(self) -> int:
        """Bytes of `used` resident on the device."""
        return max(self.used - self.spilled, 0)


SM_POLICIES = ("fixed-share", "burst-share", "best-effort")
YIELD_MAX_S = 60.0  # the longest yield lease (GV_SM_YIELD_MAX_MS)


@dataclass(frozen=True)
class SmState:
    """SM-time quota of one device entry."""

    limit: int | None  # percent; None: no limit
    share: float  # percent the launch gate enforces now (0: paused, 100: whole GPU)
    policy: str
    priority: int  # CUDA_TASK_PRIORITY: 0 high, 1 low (unset: 1, as in HAMi-core)
    busy_ns: int  # GPU time measured for the container's kernels
    wait_ns: int  # time launches waited at the gate
    launches: int


def default_region_path() -> str:
    """The library's region path when none is given (GV_DEFAULT_REGION_PATH)."""
    return os.fsdecode(lib().gv_region_default_path())


_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1


def _c_int(value: int, field: str) -> int:
    """value for a C int (int32_t) parameter.

    ctypes converts a Python int to a C int modulo 2^32 without a word
    (2**32 would reach the library as device 0): refused instead."""
    if isinstance(value, bool) or not isinstance(value, int) or not _INT_MIN <= value <= _INT_MAX:
        raise GpuvisorError(GV_EINVAL, f"gpuvisor: {field}={value!r} is not a C int")
    return value


def _dev(dev: int) -> int:
    return _c_int(dev, "device index")


def _u64_out(func_name: str, dev: int) -> int:
    value = ctypes.c_uint64()
    check(getattr(lib(), func_name)(_dev(dev), ctypes.byref(value)), func_name)
    return value.value


def _limit_arg(limit: int | None, field: str) -> int:
    if limit is None:
        return UNLIMITED
    # Up to and with 2^64-1 bytes (GV_UNLIMITED), as the C parser and
    # gv_device_set_limit accept it.
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= UNLIMITED:
        raise GpuvisorError(GV_EINVAL, f"gpuvisor: {field}={limit!r} is not a positive byte count")
    return limit


class Region:
    """Handle on the attached region; create it with Region.attach()."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def attach(cls, path: str | os.PathLike[str] | None = None) -> Region:
        """Attach to (creating if missing) the region at path.

        path=None: $CUDA_DEVICE_MEMORY_SHARED_CACHE, else the library default.
        """
        arg = None if path is None else encode_text(os.fspath(path), "region path")
        check(lib().gv_region_attach(arg), "gv_region_attach")
        raw = lib().gv_region_path()
        if not raw:
            raise GpuvisorError(GV_EINVAL, "gpuvisor: attached region has no path")
        return cls(Path(os.fsdecode(raw)))  # a path is bytes, not necessarily UTF-8

    def device_count(self) -> int:
        return check(lib().gv_device_count(), "gv_device_count")

    def device_uuid(self, dev: int) -> str:
        buf = ctypes.create_string_buffer(96)
        check(lib().gv_device_uuid(_dev(dev), buf, len(buf)), "gv_device_uuid")
        return buf.value.decode()

    def device(self, dev: int) -> DeviceUsage:
        limit = _u64_out("gv_device_get_limit", dev)
        return DeviceUsage(
            index=dev,
            uuid=self.device_uuid(dev),
            limit=None if limit == UNLIMITED else limit,
            used=_u64_out("gv_device_get_used", dev),
            physical_total=_u64_out("gv_device_get_physical_total", dev),
            oom_count=_u64_out("gv_device_get_oom_count", dev),
            context_cost=_u64_out("gv_device_get_context_cost", dev),
            spilled=_u64_out("gv_device_get_spilled", dev),
            guarantee=_u64_out("gv_device_get_guarantee", dev),
        )

    def devices(self) -> list[DeviceUsage]:
        return [self.device(i) for i in range(self.device_count())]

    def register_device(self, uuid: str, physical_total: int, limit: int | None) -> int:
        """Register (or find) the entry for uuid ("GPU-..."); returns its index."""
        if isinstance(physical_total, bool) or not isinstance(physical_total, int):
            raise GpuvisorError(
                GV_EINVAL, f"gpuvisor: physical_total={physical_total!r} is not an integer"
            )
        if not 0 <= physical_total < UNLIMITED:
            raise GpuvisorError(
                GV_EINVAL, f"gpuvisor: physical_total={physical_total} is out of range"
            )
        return check(
            lib().gv_device_register(
                encode_text(uuid, "uuid"), physical_total, _limit_arg(limit, "limit")
            ),
            "gv_device_register",
        )

    def get_limit(self, dev: int) -> int | None:
        limit = _u64_out("gv_device_get_limit", dev)
        return None if limit == UNLIMITED else limit

    def set_limit(self, dev: int, limit: int | None) -> None:
        """Set the device's quota in bytes (None: unlimited); applies to the next allocation."""
        check(
            lib().gv_device_set_limit(_dev(dev), _limit_arg(limit, "limit")), "gv_device_set_limit"
        )

    def used(self, dev: int) -> int:
        return _u64_out("gv_device_get_used", dev)

    def sm(self, dev: int) -> SmState:
        limit, share, policy, priority = (ctypes.c_uint32() for _ in range(4))
        check(
            lib().gv_device_get_sm(
                _dev(dev),
                ctypes.byref(limit),
                ctypes.byref(share),
                ctypes.byref(policy),
                ctypes.byref(priority),
            ),
            "gv_device_get_sm",
        )
        busy, wait, launches = (ctypes.c_uint64() for _ in range(3))
        check(
            lib().gv_device_get_sm_usage(
                _dev(dev), ctypes.byref(busy), ctypes.byref(wait), ctypes.byref(launches)
            ),
            "gv_device_get_sm_usage",
        )
        return SmState(
            limit=limit.value or None,
            share=share.value / 100,
            policy=SM_POLICIES[policy.value] if policy.value < len(SM_POLICIES) else "?",
            priority=priority.value,
            busy_ns=busy.value,
            wait_ns=wait.value,
            launches=launches.value,
        )

    def set_sm_limit(self, dev: int, percent: int | None) -> None:
        """Change the SM limit live (None: no limit); applies to the next launches."""
        value = 0 if percent is None else percent
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
            raise GpuvisorError(GV_EINVAL, f"gpuvisor: sm limit={percent!r} is not 0..100")
        check(lib().gv_device_set_sm_limit(_dev(dev), value), "gv_device_set_sm_limit")

    def set_sm_yield(self, dev: int, seconds: float) -> None:
        """Pause the container's launches on dev for `seconds` from now, at
        most YIELD_MAX_S (a lease: set it again before it ends to keep the
        pause), or resume them at once (0)."""
        ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
        if not ok or not 0 <= seconds <= YIELD_MAX_S:
            raise GpuvisorError(
                GV_EINVAL, f"gpuvisor: yield seconds={seconds!r} is not 0..{YIELD_MAX_S:g}"
            )
        ms = math.ceil(seconds * 1000)  # a lease under 1 ms is 1 ms, not a resume
        check(lib().gv_device_set_sm_yield(_dev(dev), ms), "gv_device_set_sm_yield")

    def set_sm_others(self, dev: int, percent: float) -> None:
        """The node agent's figure for the other containers' use of dev (percent)."""
        if isinstance(percent, bool) or not 0.0 <= float(percent) <= 100.0:
            raise GpuvisorError(GV_EINVAL, f"gpuvisor: others share={percent!r} is not 0..100")
        check(
            lib().gv_device_set_sm_others(_dev(dev), round(float(percent) * 100)),
            "gv_device_set_sm_others",
        )

    def sm_others(self, dev: int) -> tuple[float, float | None]:
        """(percent, age in seconds or None if never set) of the agent's figure."""
        share, age = ctypes.c_uint32(), ctypes.c_uint64()
        check(
            lib().gv_device_get_sm_others(_dev(dev), ctypes.byref(share), ctypes.byref(age)),
            "gv_device_get_sm_others",
        )
        return share.value / 100, None if age.value == UNLIMITED else age.value / 1000

    def processes(self) -> list[int]:
        """PIDs registered in the region."""
        cap = 64
        while True:
            pids = (ctypes.c_int32 * cap)()
            total = check(lib().gv_process_list(pids, cap), "gv_process_list")
            if total <= cap:
                return list(pids[:total])
            cap = total

    def process_used(self, pid: int, dev: int) -> int:
        value = ctypes.c_uint64()
        check(
            lib().gv_process_get_used(_c_int(pid, "pid"), _dev(dev), ctypes.byref(value)),
            "gv_process_get_used",
        )
        return value.value

    def process_spilled(self, pid: int, dev: int) -> int:
        """Of process_used, the bytes spilled to host memory."""
        value = ctypes.c_uint64()
        check(
            lib().gv_process_get_spilled(_c_int(pid, "pid"), _dev(dev), ctypes.byref(value)),
            "gv_process_get_spilled",
        )
        return value.value

    def usage_by_process(self, dev: int) -> dict[int, int]:
        """Bytes each registered process uses on dev.  A process that gives
        its slot back (it exits) between the listing and its query is left
        out: that race is not an error."""
        usage = {}
        for pid in self.processes():
            try:
                usage[pid] = self.process_used(pid, dev)
            except GpuvisorError as exc:
                if exc.code != GV_ENOENT:
                    raise
        return usage

    def reclaim_dead(self) -> int:
        """Reclaim the slots of dead processes; returns how many."""
        return check(lib().gv_reclaim_dead(), "gv_reclaim_dead")
