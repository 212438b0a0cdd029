"""A minimal CUDA driver-API client over ctypes (used by the demos).

It binds the driver the way a program linked with -lcuda does: libcuda.so.1
is loaded into the global scope and every symbol is looked up there, so a
preloaded libgpuvisor.so answers first.
"""

from __future__ import annotations

import ctypes
from typing import Any

# Names of the CUresult codes the demo can meet (values from the CUDA API).
RESULT_NAMES = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    800: "CUDA_ERROR_NOT_PERMITTED",
    999: "CUDA_ERROR_UNKNOWN",
}
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


class CudaError(RuntimeError):
    def __init__(self, func: str, code: int) -> None:
        super().__init__(f"{func} failed: {result_name(code)}")
        self.code = code


def result_name(code: int) -> str:
    return RESULT_NAMES.get(code, f"CUresult {code}")


class Driver:
    """The handful of driver calls the demo makes."""

    def __init__(self) -> None:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        self._scope = ctypes.CDLL(None)

    def _fn(self, name: str) -> Any:
        fn = getattr(self._scope, name)
        fn.restype = ctypes.c_int
        return fn

    def _ok(self, name: str, *args: Any) -> None:
        rc = int(self._fn(name)(*args))
        if rc != CUDA_SUCCESS:
            raise CudaError(name, rc)

    def init(self, ordinal: int = 0) -> int:
        """cuInit, cuDeviceGet and a current primary context; returns the device."""
        self._ok("cuInit", ctypes.c_uint(0))
        dev = ctypes.c_int()
        self._ok("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        ctx = ctypes.c_void_p()
        self._ok("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        self._ok("cuCtxSetCurrent", ctx)
        return dev.value

    def uuid(self, dev: int) -> str:
        raw = (ctypes.c_char * 16)()
        self._ok("cuDeviceGetUuid", raw, ctypes.c_int(dev))
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def mem_get_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._ok("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def mem_alloc(self, nbytes: int) -> tuple[int, int]:
        """(CUresult, device pointer) of cuMemAlloc."""
        ptr = ctypes.c_uint64()
        rc = int(self._fn("cuMemAlloc_v2")(ctypes.byref(ptr), ctypes.c_size_t(nbytes)))
        return rc, ptr.value

    def mem_free(self, ptr: int) -> None:
        self._ok("cuMemFree_v2", ctypes.c_uint64(ptr))

    def function(self, image: bytes, name: str) -> int:
        """cuModuleLoadData + cuModuleGetFunction: a CUfunction handle."""
        mod = ctypes.c_void_p()
        self._ok("cuModuleLoadData", ctypes.byref(mod), ctypes.c_char_p(image))
        fn = ctypes.c_void_p()
        self._ok("cuModuleGetFunction", ctypes.byref(fn), mod, name.encode())
        return int(fn.value or 0)

    def stream(self) -> int:
        """A non-blocking stream (cuStreamCreate with CU_STREAM_NON_BLOCKING)."""
        st = ctypes.c_void_p()
        self._ok("cuStreamCreate", ctypes.byref(st), ctypes.c_uint(1))
        return int(st.value or 0)

    def launch_u32(self, fn: int, stream: int, arg: int, blocks: int = 1) -> None:
        """cuLaunchKernel of fn with one 32-bit unsigned parameter."""
        value = ctypes.c_uint32(arg)
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(value), ctypes.c_void_p))
        u = ctypes.c_uint
        self._ok(
            "cuLaunchKernel",
            ctypes.c_void_p(fn),
            u(blocks), u(1), u(1), u(32), u(1), u(1),
            u(0),
            ctypes.c_void_p(stream),
            params,
            ctypes.c_void_p(None),
        )  # fmt: skip

    def synchronize(self, stream: int) -> None:
        self._ok("cuStreamSynchronize", ctypes.c_void_p(stream))
