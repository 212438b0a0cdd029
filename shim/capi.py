"""ctypes bindings of the C API in native/include/gpuvisor.h.

The shared region's layout belongs to the C library; Python reaches the
region only through these gv_* functions.  Loading libgpuvisor.so with
ctypes (RTLD_LOCAL) interposes nothing in this process: the library does
no CUDA work at load time.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any

from .loader import LIBRARY_NAME, library_path

API_VERSION = 8
UNLIMITED = (1 << 64) - 1  # GV_UNLIMITED

ERROR_NAMES = {
    0: "GV_OK",
    -1: "GV_EINVAL",
    -2: "GV_ENOENT",
    -3: "GV_ENOMEM",
    -4: "GV_EIO",
    -5: "GV_ECORRUPT",
    -6: "GV_EFULL",
    -7: "GV_ENOTATTACHED",
}
GV_EINVAL = -1
GV_ENOENT = -2
GV_ENOMEM = -3
GV_EIO = -4
GV_ECORRUPT = -5
GV_EFULL = -6
GV_ENOTATTACHED = -7


class GpuvisorError(RuntimeError):
    """A gv_* call failed; carries the GV_E* code and gv_last_error()."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def code_name(self) -> str:
        return ERROR_NAMES.get(self.code, f"GV_E({self.code})")

    def __str__(self) -> str:
        return f"{self.message} ({self.code_name})"


_u64 = ctypes.c_uint64
_pu64 = ctypes.POINTER(ctypes.c_uint64)
_i32p = ctypes.POINTER(ctypes.c_int32)
_pu32 = ctypes.POINTER(ctypes.c_uint32)

# name -> (restype, argtypes), one line per function of gpuvisor.h.
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "gv_api_version": (ctypes.c_int, []),
    "gv_version": (ctypes.c_char_p, []),
    "gv_build_id": (ctypes.c_char_p, []),
    "gv_last_error": (ctypes.c_char_p, []),
    "gv_region_attach": (ctypes.c_int, [ctypes.c_char_p]),
    "gv_region_default_path": (ctypes.c_char_p, []),
    "gv_region_path": (ctypes.c_char_p, []),
    "gv_parse_memory_limit": (ctypes.c_int, [ctypes.c_char_p, _u64, _pu64]),
    "gv_validate_env": (ctypes.c_int, []),
    "gv_env_device_limits": (
        ctypes.c_int,
        [ctypes.POINTER(ctypes.c_char_p), ctypes.c_char_p, _u64, _pu64, _pu32],
    ),
    "gv_env_sm_settings": (ctypes.c_int, [ctypes.POINTER(ctypes.c_char_p), _pu32, _pu32]),
    "gv_device_count": (ctypes.c_int, []),
    "gv_device_uuid": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
    "gv_device_register": (ctypes.c_int, [ctypes.c_char_p, _u64, _u64]),
    "gv_device_get_limit": (ctypes.c_int, [ctypes.c_int, _pu64]),
    "gv_device_set_limit": (ctypes.c_int, [ctypes.c_int, _u64]),
    "gv_device_get_used": (ctypes.c_int, [ctypes.c_int, _pu64]),
    "gv_device_get_physical_total": (ctypes.c_int, [ctypes.c_int, _pu64]),
    "gv_device_get_oom_count": (ctypes.c_int, [ctypes.c_int, _pu64]),
    "gv_device_get_context_cost": (ctypes.c_int, [ctypes.c_int, _pu64]),
    "gv_device_get_spilled": (ctypes.c_int, [ctypes.c_int, _pu64]),
    "gv_device_get_guarantee": (ctypes.c_int, [ctypes.c_int, _pu64]),
    "gv_device_get_sm": (ctypes.c_int, [ctypes.c_int, _pu32, _pu32, _pu32, _pu32]),
    "gv_device_get_sm_usage": (ctypes.c_int, [ctypes.c_int, _pu64, _pu64, _pu64]),
    "gv_device_set_sm_limit": (ctypes.c_int, [ctypes.c_int, ctypes.c_uint32]),
    "gv_device_set_sm_yield": (ctypes.c_int, [ctypes.c_int, ctypes.c_uint32]),
    "gv_device_set_sm_others": (ctypes.c_int, [ctypes.c_int, ctypes.c_uint32]),
    "gv_device_get_sm_others": (ctypes.c_int, [ctypes.c_int, _pu32, _pu64]),
    "gv_process_list": (ctypes.c_int, [_i32p, ctypes.c_int]),
    "gv_process_get_used": (ctypes.c_int, [ctypes.c_int32, ctypes.c_int, _pu64]),
    "gv_process_get_spilled": (ctypes.c_int, [ctypes.c_int32, ctypes.c_int, _pu64]),
    "gv_reclaim_dead": (ctypes.c_int, []),
    "gv_region_file_devices": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]),
    "gv_region_file_set_sm": (
        ctypes.c_int,
        [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32],
    ),
}


def _bind(handle: ctypes.CDLL, path: Path, name: str) -> Any:
    """handle's function name with its signature declared."""
    try:
        func = getattr(handle, name)
    except AttributeError:
        raise GpuvisorError(
            GV_EINVAL,
            f"gpuvisor: {path} does not export {name} "
            f"(not a libgpuvisor.so of API version {API_VERSION}; rebuild it)",
        ) from None
    func.restype, func.argtypes = _SIGNATURES[name]
    return func


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def lib() -> ctypes.CDLL:
    """The loaded libgpuvisor.so, with every signature declared and the API version checked."""
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            try:
                handle = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
            except OSError as exc:
                # Cut short, another architecture, a missing dependency:
                # dlerror's text already names the file.
                raise GpuvisorError(
                    GV_EINVAL, f"gpuvisor: cannot load {LIBRARY_NAME}: {exc}"
                ) from None
            # The version first, then every function: a stale build or
            # another library under this name is one clear error, not a
            # bare AttributeError from ctypes.
            version = _bind(handle, path, "gv_api_version")()
            if version != API_VERSION:
                raise GpuvisorError(
                    GV_EINVAL,
                    f"gpuvisor: {path} has API version {version}, expected {API_VERSION}",
                )
            for name in _SIGNATURES:
                _bind(handle, path, name)
            _lib = handle
        return _lib


def last_error() -> str:
    raw = lib().gv_last_error()
    return raw.decode(errors="replace") if raw else "gpuvisor: unknown error"


def check(rc: int, what: str) -> int:
    """Raise GpuvisorError for a negative return code; return rc otherwise."""
    if rc < 0:
        message = last_error() or f"gpuvisor: {what} failed"
        raise GpuvisorError(rc, message)
    return rc


def encode_text(value: str | Path, field: str) -> bytes:
    """Encode a str for a C string argument; NUL bytes are a clear error.

    As os.fsencode: the bytes of a value that came from the environment or
    the file system with surrogates for non-UTF-8 bytes are given back as
    they were (str.encode() would raise UnicodeEncodeError)."""
    text = str(value)
    if "\0" in text:
        raise GpuvisorError(GV_EINVAL, f"gpuvisor: {field}={text!r} contains a NUL byte")
    return os.fsencode(text)
