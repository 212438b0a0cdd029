"""Is a real NVIDIA GPU present on this machine?"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess


@functools.cache
def nvidia_smi_works() -> bool:
    """True when nvidia-smi exists and lists at least one GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU " in out.stdout


@functools.cache
def real_libcuda_loadable() -> bool:
    """True when the dynamic linker finds a libcuda.so.1 (without the simulator)."""
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_LOCAL)
    except OSError:
        return False
    return True


def real_gpu_present() -> bool:
    """A real GPU is usable: nvidia-smi works and the driver library loads."""
    return nvidia_smi_works() and real_libcuda_loadable()
