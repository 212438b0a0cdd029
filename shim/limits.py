"""Limit variables and values, read by the C library (the single parser)."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass

from .capi import (
    GV_EINVAL,
    GV_ENOENT,
    UNLIMITED,
    GpuvisorError,
    check,
    encode_text,
    last_error,
    lib,
)
from .region import SM_POLICIES


def parse_memory_limit(text: str, physical_total: int = 0) -> int:
    """Bytes for a CUDA_DEVICE_MEMORY_LIMIT value ("4g", "512MiB", "25%", ...).

    physical_total resolves percentages.  Raises GpuvisorError (GV_EINVAL)
    for anything malformed, zero or overflowing.
    """
    if (
        isinstance(physical_total, bool)
        or not isinstance(physical_total, int)
        or not (0 <= physical_total <= UNLIMITED)
    ):
        raise GpuvisorError(GV_EINVAL, f"gpuvisor: physical_total={physical_total!r} is invalid")
    out = ctypes.c_uint64()
    check(
        lib().gv_parse_memory_limit(
            encode_text(text, "memory limit"), physical_total, ctypes.byref(out)
        ),
        "gv_parse_memory_limit",
    )
    return out.value


def validate_environment() -> None:
    """Check this process's environment exactly as libgpuvisor.so will.

    Covers CUDA_DEVICE_MEMORY_LIMIT*, CUDA_DEVICE_SM_LIMIT*,
    GPUVISOR_SM_POLICY, GPU_CORE_UTILIZATION_POLICY and CUDA_TASK_PRIORITY.
    Raises GpuvisorError whose message is one line naming the variable and
    the value.
    """
    # check(): the message quotes the value, which need not be UTF-8.
    check(lib().gv_validate_env(), "gv_validate_env")


def _env_array(env: Mapping[str, str]) -> ctypes.Array[ctypes.c_char_p]:
    """env as the NULL-terminated "NAME=value" array the library reads."""
    items = [encode_text(k, "variable name") + b"=" + encode_text(v, k) for k, v in env.items()]
    return (ctypes.c_char_p * (len(items) + 1))(*items, None)


@dataclass(frozen=True)
class DeviceEnvLimits:
    """The limits an environment gives one device (env_device_limits)."""

    ordinal: int | None  # the device's CUDA ordinal; None: not known
    memory: int | None  # bytes; None: no limit
    sm: int | None  # percent; None: no limit
    why_unknown: str = ""  # the library's line when ordinal is None


def env_device_limits(env: Mapping[str, str], uuid: str, physical_total: int) -> DeviceEnvLimits:
    """The limits env gives the device uuid, exactly as a process of the
    container with env configures the device at its first CUDA use
    (gv_env_device_limits: CUDA_DEVICE_*_LIMIT_<i> for its CUDA ordinal <i>,
    found from NVML's list through env's CUDA_VISIBLE_DEVICES, else the
    plain variables; percentages of physical_total).

    When the ordinal cannot be known, ordinal is None and memory / sm are
    the strictest limits env gives any ordinal (None only where it gives
    none at all).  Raises GpuvisorError (GV_EINVAL) for a malformed value.
    The process's own environment is neither read nor changed."""
    if (
        isinstance(physical_total, bool)
        or not isinstance(physical_total, int)
        or not (0 <= physical_total <= UNLIMITED)
    ):
        raise GpuvisorError(GV_EINVAL, f"gpuvisor: physical_total={physical_total!r} is invalid")
    mem = ctypes.c_uint64()
    sm = ctypes.c_uint32()
    rc = lib().gv_env_device_limits(
        _env_array(env),
        encode_text(uuid, "uuid"),
        physical_total,
        ctypes.byref(mem),
        ctypes.byref(sm),
    )
    why = ""
    if rc == GV_ENOENT:
        why = last_error()
    else:
        check(rc, "gv_env_device_limits")
    return DeviceEnvLimits(
        ordinal=rc if rc >= 0 else None,
        memory=None if mem.value == UNLIMITED else mem.value,
        sm=sm.value or None,
        why_unknown=why,
    )


@dataclass(frozen=True)
class SmSettings:
    """The SM policy and task priority an environment gives (env_sm_settings)."""

    policy: str  # one of SM_POLICIES
    priority: int  # 0 high, 1 low


def env_sm_settings(env: Mapping[str, str]) -> SmSettings:
    """The SM policy and CUDA_TASK_PRIORITY env gives every device, as a
    process of the container with env configures them (gv_env_sm_settings:
    GPU_CORE_UTILIZATION_POLICY=force or disable mean fixed-share; an unset
    or empty priority means 1, low).  Raises GpuvisorError (GV_EINVAL) for a
    malformed SM variable.  The process's own environment is neither read
    nor changed."""
    policy = ctypes.c_uint32()
    priority = ctypes.c_uint32()
    check(
        lib().gv_env_sm_settings(_env_array(env), ctypes.byref(policy), ctypes.byref(priority)),
        "gv_env_sm_settings",
    )
    return SmSettings(policy=SM_POLICIES[policy.value], priority=priority.value)
