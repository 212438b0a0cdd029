"""A small CUDA client on cuda-python (cuda-bindings), run in child processes.

Test code imports it as ``from tests.cuclient import *`` inside a process
that has the shim preloaded; it talks to the driver exactly as any
cuda-python program does.
"""

from __future__ import annotations

import json
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from cuda.bindings import driver as cu

GiB = 1 << 30
MiB = 1 << 20
SUCCESS = cu.CUresult.CUDA_SUCCESS


class CudaError(Exception):
    def __init__(self, func: str, err: Any) -> None:
        super().__init__(f"{func} -> {err.name}")
        self.func = func
        self.err = err


def call(fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """(CUresult, value) of a cuda-bindings call; value is None/one/tuple."""
    res = fn(*args)
    err, vals = res[0], res[1:]
    if not vals:
        return err, None
    return err, vals[0] if len(vals) == 1 else tuple(vals)


def ok(fn: Callable[..., Any], *args: Any) -> Any:
    err, value = call(fn, *args)
    if err != SUCCESS:
        raise CudaError(fn.__name__, err)
    return value


def add_alloc_node(graph: Any, nbytes: int, device: int = 0) -> Any:
    """Add to graph (no dependencies) a memory node that allocates nbytes of
    device memory on device; the address it will allocate at."""
    p = cu.CUDA_MEM_ALLOC_NODE_PARAMS()
    p.poolProps.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.poolProps.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.poolProps.location.id = device
    p.bytesize = nbytes
    ok(cu.cuGraphAddMemAllocNode, graph, None, 0, p)
    return p.dptr


def init(ordinal: int = 0, *, create: bool = False) -> Any:
    """cuInit, then make a context on ordinal current (primary by default)."""
    ok(cu.cuInit, 0)
    dev = ok(cu.cuDeviceGet, ordinal)
    if create:
        return ok(cu.cuCtxCreate, None, 0, dev)
    ctx = ok(cu.cuDevicePrimaryCtxRetain, dev)
    ok(cu.cuCtxSetCurrent, ctx)
    return ctx


def mem_info() -> tuple[int, int]:
    free, total = ok(cu.cuMemGetInfo)
    return int(free), int(total)


def used() -> int:
    free, total = mem_info()
    return total - free


def uuid(ordinal: int) -> str:
    """The "GPU-xxxxxxxx-xxxx-..." form NVML uses."""
    raw = bytes(ok(cu.cuDeviceGetUuid, ok(cu.cuDeviceGet, ordinal)).bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def emit(**values: Any) -> None:
    """Print one JSON line (the test reads the last one)."""
    print(json.dumps(values, default=str), flush=True)


def hold(**values: Any) -> None:
    """Report READY with values, then wait until the parent writes a line."""
    print("READY " + json.dumps(values, default=str), flush=True)
    sys.stdin.readline()


# --- every allocation API: alloc(nbytes, device) -> handle, free(handle) ----


def _array_desc(nbytes: int) -> Any:
    # UINT32 x 4 channels = 16 bytes per element; 8192 x (nbytes / 128 KiB) rows.
    desc = cu.CUDA_ARRAY_DESCRIPTOR()
    desc.Width = 8192
    desc.Height = nbytes // (8192 * 16)
    desc.Format = cu.CUarray_format.CU_AD_FORMAT_UNSIGNED_INT32
    desc.NumChannels = 4
    return desc


def _array3d_desc(nbytes: int, *, depth: bool = True) -> Any:
    desc = cu.CUDA_ARRAY3D_DESCRIPTOR()
    desc.Width = 1024 if depth else 8192
    desc.Height = 1024 if depth else nbytes // (8192 * 16)
    desc.Depth = nbytes // (1024 * 1024 * 16) if depth else 0
    desc.Format = cu.CUarray_format.CU_AD_FORMAT_UNSIGNED_INT32
    desc.NumChannels = 4
    desc.Flags = 0
    return desc


def _device_location(dev: int) -> Any:
    loc = cu.CUmemLocation()
    loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = dev
    return loc


def pool_props(dev: int = 0, *, host: bool = False) -> Any:
    """CUmemPoolProps of a pinned pool on device dev, or in host memory."""
    props = cu.CUmemPoolProps()
    props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.handleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
    if host:
        props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
        props.location.id = 0
    else:
        props.location = _device_location(dev)
    return props


def _vmm_prop(dev: int) -> Any:
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = _device_location(dev)
    return prop


class Allocator(ABC):
    """One allocation API.  alloc returns (CUresult, handle)."""

    name = ""

    def __init__(self, dev: int = 0) -> None:
        self.dev = dev

    @abstractmethod
    def alloc(self, nbytes: int) -> tuple[Any, Any]: ...

    @abstractmethod
    def free(self, handle: Any) -> None: ...


class CreateDestroy(Allocator):
    """An API that takes the size (args) and returns the handle, freed by
    the API named destroy with the handle alone."""

    destroy = "cuMemFree"

    def args(self, nbytes: int) -> tuple[Any, ...]:
        return (nbytes,)

    def alloc(self, nbytes: int) -> tuple[Any, Any]:
        return call(getattr(cu, self.name), *self.args(nbytes))

    def free(self, handle: Any) -> None:
        ok(getattr(cu, self.destroy), handle)


class MemAlloc(CreateDestroy):
    name = "cuMemAlloc"


class MemAllocPitch(CreateDestroy):
    name = "cuMemAllocPitch"

    def alloc(self, nbytes: int) -> tuple[Any, Any]:
        err, value = call(cu.cuMemAllocPitch, MiB, nbytes // MiB, 4)
        return err, None if value is None else value[0]


class MemAllocManaged(CreateDestroy):
    name = "cuMemAllocManaged"

    def args(self, nbytes: int) -> tuple[Any, ...]:
        return nbytes, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL


class ArrayCreate(CreateDestroy):
    name = "cuArrayCreate"
    destroy = "cuArrayDestroy"

    def args(self, nbytes: int) -> tuple[Any, ...]:
        return (_array_desc(nbytes),)


class Array3DCreate(CreateDestroy):
    name = "cuArray3DCreate"
    destroy = "cuArrayDestroy"

    def args(self, nbytes: int) -> tuple[Any, ...]:
        return (_array3d_desc(nbytes),)


class MipmappedArrayCreate(CreateDestroy):
    name = "cuMipmappedArrayCreate"
    destroy = "cuMipmappedArrayDestroy"

    def args(self, nbytes: int) -> tuple[Any, ...]:
        return _array3d_desc(nbytes, depth=False), 1


class MemCreate(CreateDestroy):
    name = "cuMemCreate"
    destroy = "cuMemRelease"

    def args(self, nbytes: int) -> tuple[Any, ...]:
        return nbytes, _vmm_prop(self.dev), 0


class MemAllocAsync(Allocator):
    """Stream-ordered: each allocation and free is synchronized, so that
    the memory is mapped (or given back) when alloc or free returns."""

    name = "cuMemAllocAsync"

    def __init__(self, dev: int = 0) -> None:
        super().__init__(dev)
        self.stream = ok(cu.cuStreamCreate, 0)

    def alloc_async(self, nbytes: int) -> tuple[Any, Any]:
        return call(cu.cuMemAllocAsync, nbytes, self.stream)

    def alloc(self, nbytes: int) -> tuple[Any, Any]:
        err, ptr = self.alloc_async(nbytes)
        if err == SUCCESS:
            ok(cu.cuStreamSynchronize, self.stream)
        return err, ptr

    def free(self, handle: Any) -> None:
        ok(cu.cuMemFreeAsync, handle, self.stream)
        ok(cu.cuStreamSynchronize, self.stream)


class MemAllocFromPoolAsync(MemAllocAsync):
    name = "cuMemAllocFromPoolAsync"

    def __init__(self, dev: int = 0) -> None:
        super().__init__(dev)
        self.pool = ok(cu.cuMemPoolCreate, pool_props(dev))

    def alloc_async(self, nbytes: int) -> tuple[Any, Any]:
        return call(cu.cuMemAllocFromPoolAsync, nbytes, self.pool, self.stream)

    def free(self, handle: Any) -> None:
        super().free(handle)
        ok(cu.cuMemPoolTrimTo, self.pool, 0)


ALLOCATORS: dict[str, type[Allocator]] = {
    cls.name: cls
    for cls in (
        MemAlloc,
        MemAllocPitch,
        MemAllocManaged,
        ArrayCreate,
        Array3DCreate,
        MipmappedArrayCreate,
        MemCreate,
        MemAllocAsync,
        MemAllocFromPoolAsync,
    )
}
