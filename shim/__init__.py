"""gpuvisor.shim: Python side of the libgpuvisor.so interposer.

- loader: find the native libraries, build LD_PRELOAD environments;
- region: the container's shared accounting region (through the C API);
- limits: memory-limit values, parsed by the C library.
"""

from .capi import GpuvisorError
from .limits import parse_memory_limit
from .loader import NativeLibraryNotFound, library_path, preload_env, simulator_dir
from .region import DeviceUsage, Region

__all__ = [
    "DeviceUsage",
    "GpuvisorError",
    "NativeLibraryNotFound",
    "Region",
    "library_path",
    "parse_memory_limit",
    "preload_env",
    "simulator_dir",
]
