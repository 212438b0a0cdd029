"""Another container's region file, by its path (gv_region_file_*).

For a reader of many containers' regions, the node agent, which learns of
containers through their region files (docs/hami.md): the C library opens
the file without following a symbolic link, never creates or replaces it,
and reads it into a private copy; what an untrusted container wrote there
only makes up what is reported of that container.  Region.attach, by
contrast, makes the process one of the container's own.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass

from .capi import GV_EINVAL, UNLIMITED, GpuvisorError, check, encode_text, lib
from .region import SM_POLICIES, YIELD_MAX_S

MAX_DEVICES = 16  # GV_MAX_DEVICES: the most entries a region holds
KEEP = 0xFFFFFFFF  # GV_KEEP


class _FileDevice(ctypes.Structure):
    """struct gv_region_file_device (gpuvisor.h)."""

    _fields_ = [
        ("uuid", ctypes.c_char * 48),
        ("limit", ctypes.c_uint64),
        ("used", ctypes.c_uint64),
        ("spilled", ctypes.c_uint64),
        ("physical_total", ctypes.c_uint64),
        ("oom_count", ctypes.c_uint64),
        ("sm_limit", ctypes.c_uint32),
        ("sm_share", ctypes.c_uint32),
        ("sm_policy", ctypes.c_uint32),
        ("sm_priority", ctypes.c_uint32),
        ("busy_ns", ctypes.c_uint64),
        ("wait_ns", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("yield_ms", ctypes.c_uint64),
    ]


@dataclass(frozen=True)
class FileDevice:
    """One initialised device entry of a region file, as read now.  The
    values are the container's own: nothing bounds them but their C types."""

    index: int
    uuid: str
    limit: int | None  # None: no limit (GV_UNLIMITED)
    used: int
    spilled: int
    physical_total: int
    oom_count: int
    sm_limit: int | None  # percent; None: no limit
    sm_share: float  # percent the launch gate enforces now
    policy: str  # "?" for a value no library writes
    priority: int  # 0 high, anything else low
    busy_ns: int
    wait_ns: int
    launches: int
    yield_s: float  # what is left of its yield lease (0: none)


def read_region_file(path: str | os.PathLike[str]) -> list[FileDevice]:
    """The device entries of the region file at path.  GpuvisorError
    (GV_ECORRUPT, GV_EIO) with a one-line reason naming the file for one
    that is not a gpuvisor region of this layout or cannot be read."""
    buf = (_FileDevice * MAX_DEVICES)()
    n = check(
        lib().gv_region_file_devices(encode_text(os.fspath(path), "region path"), buf, MAX_DEVICES),
        "gv_region_file_devices",
    )
    out = []
    for i in range(n):
        d = buf[i]
        out.append(
            FileDevice(
                index=i,
                uuid=d.uuid.decode("ascii", "replace"),
                limit=None if d.limit == UNLIMITED else int(d.limit),
                used=int(d.used),
                spilled=int(d.spilled),
                physical_total=int(d.physical_total),
                oom_count=int(d.oom_count),
                sm_limit=int(d.sm_limit) if 1 <= d.sm_limit <= 100 else None,
                sm_share=min(100.0, d.sm_share / 100),
                policy=SM_POLICIES[d.sm_policy] if d.sm_policy < len(SM_POLICIES) else "?",
                priority=int(d.sm_priority),
                busy_ns=int(d.busy_ns),
                wait_ns=int(d.wait_ns),
                launches=int(d.launches),
                yield_s=d.yield_ms / 1000,
            )
        )
    return out


def set_region_file_sm(
    path: str | os.PathLike[str],
    uuid: str,
    yield_s: float | None = None,
    others_pct: float | None = None,
) -> None:
    """In the region file at path, on device uuid's entry: the yield lease
    (seconds from now, at most YIELD_MAX_S; 0 resumes) and the other
    containers' share (percent); None leaves either as it is."""
    ms = KEEP
    if yield_s is not None:
        if isinstance(yield_s, bool) or not 0 <= yield_s <= YIELD_MAX_S:
            raise GpuvisorError(
                GV_EINVAL, f"gpuvisor: yield seconds={yield_s!r} is not 0..{YIELD_MAX_S:g}"
            )
        ms = math.ceil(yield_s * 1000)
    bp = KEEP
    if others_pct is not None:
        if isinstance(others_pct, bool) or not 0.0 <= float(others_pct) <= 100.0:
            raise GpuvisorError(GV_EINVAL, f"gpuvisor: others share={others_pct!r} is not 0..100")
        bp = round(float(others_pct) * 100)
    check(
        lib().gv_region_file_set_sm(
            encode_text(os.fspath(path), "region path"), encode_text(uuid, "uuid"), ms, bp
        ),
        "gv_region_file_set_sm",
    )
