"""Memory-limit values, parsed by the C library (the single parser)."""

from __future__ import annotations

import ctypes

from .capi import GV_EINVAL, UNLIMITED, GpuvisorError, check, encode_text, lib


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
