"""End-to-end: real clients (cuda-python, nvidia-ml-py) under the shim on the
simulated GPU.  Every test runs its clients in child processes with
libgpuvisor.so preloaded and a fresh simulated node (2 x 16 GiB)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers import LIBRARY, GiB, Holder, MiB, SimNode, clean_env, run_json, run_py

SIM_CONTEXT = 32 * MiB  # what the simulator charges for one context
PRELUDE = "from tests.cuclient import *\n"
NOT_PERMITTED = "CUDA_ERROR_NOT_PERMITTED"
OOM = "CUDA_ERROR_OUT_OF_MEMORY"


def client(node: SimNode, code: str, **env: str) -> Any:
    return run_json(PRELUDE + code, node.shimmed(**env))


# --- cuMemGetInfo / cuDeviceTotalMem show the quota --------------------------


@pytest.mark.parametrize("create", [False, True], ids=["primary-ctx", "cuCtxCreate"])
def test_mem_get_info_shows_quota(node, create):
    out = client(
        node,
        f"""
init(0, create={create})
free, total = mem_info()
emit(free=free, total=total, devtotal=ok(cu.cuDeviceTotalMem, ok(cu.cuDeviceGet, 0)))
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["total"] == 4 * GiB
    assert out["devtotal"] == 4 * GiB
    # The context's charge (physical-free delta measured by the library).
    assert out["free"] == 4 * GiB - SIM_CONTEXT


def test_mem_get_info_asked_for_one_figure_shows_the_quota(node):
    """cudaMemGetInfo(&free, NULL) and (NULL, &total) are common, and the
    driver answers them: the figure asked for is the quota's, not the
    device's 16 GiB."""
    out = client(
        node,
        """
import ctypes
lib = ctypes.CDLL("libcuda.so.1")
init()
ok(cu.cuMemAlloc, 100 * MiB)
P, U = ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_uint)
f, t, f1, t1 = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_uint(), ctypes.c_uint()
rcs = [lib.cuMemGetInfo_v2(ctypes.byref(f), P()), lib.cuMemGetInfo_v2(P(), ctypes.byref(t)),
       lib.cuMemGetInfo(ctypes.byref(f1), U()), lib.cuMemGetInfo(U(), ctypes.byref(t1)),
       lib.cuMemGetInfo_v2(P(), P())]
emit(rcs=rcs, free=f.value, total=t.value, free32=f1.value, total32=t1.value)
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["rcs"] == [0, 0, 0, 0, 1], out  # neither figure: CUDA_ERROR_INVALID_VALUE
    assert out["total"] == 1 * GiB
    assert out["free"] == 1 * GiB - SIM_CONTEXT - 100 * MiB
    assert out["total32"] == 1 * GiB
    assert out["free32"] == 1 * GiB - SIM_CONTEXT - 100 * MiB


def test_a_device_without_a_region_entry_shows_no_physical_figures(node):
    """The region has 16 device entries.  With 15 taken by other GPUs,
    device 0 gets the last and device 1 none: its memory-info calls fail
    closed (CUDA_ERROR_NOT_PERMITTED) like its allocations, rather than
    report the physical 16 GiB."""
    out = client(
        node,
        """
import os
from gpuvisor.shim.region import Region
r = Region.attach(os.environ["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
for i in range(15):
    r.register_device(f"GPU-{i:08x}-0000-0000-0000-000000000000", 16 * GiB, 1 * GiB)
init()
dev1 = ok(cu.cuDeviceGet, 1)
total1 = call(cu.cuDeviceTotalMem, dev1)[0]
total0 = ok(cu.cuDeviceTotalMem, ok(cu.cuDeviceGet, 0))
ctx1 = call(cu.cuCtxCreate, None, 0, dev1)[0]
emit(total1=total1.name, total0=int(total0), ctx1=ctx1.name)
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["total0"] == 1 * GiB, out
    assert out["total1"] == NOT_PERMITTED, out
    assert out["ctx1"] == NOT_PERMITTED, out


def test_alloc_past_quota_is_oom_and_free_restores(node):
    out = client(
        node,
        """
init()
base = used()
too_big, _ = call(cu.cuMemAlloc, 4 * GiB)
ptr = ok(cu.cuMemAlloc, 3 * GiB)
after = used()
one_more, _ = call(cu.cuMemAlloc, 1 * GiB)
ok(cu.cuMemFree, ptr)
freed = used()
again = ok(cu.cuMemAlloc, 3 * GiB)
emit(base=base, too_big=too_big.name, after=after, one_more=one_more.name, freed=freed)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["too_big"] == OOM
    assert out["after"] == out["base"] + 3 * GiB
    assert out["one_more"] == OOM
    assert out["freed"] == out["base"]


ARGUMENT_CHECKS = """
init()
base = used()
calls = {
    "pitch, element size 3": lambda n: call(cu.cuMemAllocPitch, MiB, n // MiB, 3)[0].name,
    "pitch, element size 4": lambda n: call(cu.cuMemAllocPitch, MiB, n // MiB, 4)[0].name,
    "managed, attach flags 4": lambda n: call(cu.cuMemAllocManaged, n, 4)[0].name,
    "managed, attach flags 1": lambda n: call(cu.cuMemAllocManaged, n, 1)[0].name,
}
invalid = ["pitch, element size 3", "managed, attach flags 4"]
emit(fits={k: calls[k](64 * MiB) for k in invalid},
     past={k: f(8 * GiB) for k, f in calls.items()}, grew=used() - base)
"""


def test_arguments_the_driver_refuses_are_refused_as_invalid_past_the_quota_too(node):
    # The quota is checked before the driver sees the call; a call it would
    # refuse for its arguments must get the driver's answer, not out of memory.
    out = client(node, ARGUMENT_CHECKS, CUDA_DEVICE_MEMORY_LIMIT="1g")
    invalid = "CUDA_ERROR_INVALID_VALUE"
    assert out["fits"] == {"pitch, element size 3": invalid, "managed, attach flags 4": invalid}
    assert out["past"] == {
        "pitch, element size 3": invalid,
        "pitch, element size 4": OOM,
        "managed, attach flags 4": invalid,
        "managed, attach flags 1": OOM,
    }
    assert out["grew"] == 0


# --- every allocation API is counted and refused past the quota --------------

ALLOCATION_APIS = [
    "cuMemAlloc",
    "cuMemAllocPitch",
    "cuMemAllocManaged",
    "cuArrayCreate",
    "cuArray3DCreate",
    "cuMipmappedArrayCreate",
    "cuMemCreate",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
]


@pytest.mark.parametrize("api", ALLOCATION_APIS)
def test_allocation_api_is_counted_and_limited(node, api):
    out = client(
        node,
        f"""
init()
a = ALLOCATORS[{api!r}]()
base = used()
err, h = a.alloc(1 * GiB)
assert err == SUCCESS, err
grown = used()
over, h2 = a.alloc(4 * GiB)
if over == SUCCESS:
    a.free(h2)
a.free(h)
emit(base=base, grown=grown, over=over.name, after=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["grown"] >= out["base"] + 1 * GiB, out
    assert out["grown"] < out["base"] + 1 * GiB + 64 * MiB, out
    assert out["over"] == OOM
    assert out["after"] == out["base"]


@pytest.mark.parametrize("free", ["cuMemFree", "cuMemFreeAsync"])
def test_a_destroyed_pool_keeps_its_charge_until_its_blocks_are_freed(node, free):
    """cuMemPoolDestroy with blocks still allocated returns at once, and the
    driver keeps those blocks until they are freed: so does the quota.
    Before, destroying the pool gave the charge back, and a loop of
    create / allocate 800 MiB / destroy went past a 1 GiB limit."""
    out = client(
        node,
        f"""
init()
a = ALLOCATORS["cuMemAllocFromPoolAsync"]()
base = used()
p = ok(cu.cuMemAllocFromPoolAsync, 800 * MiB, a.pool, a.stream)
ok(cu.cuStreamSynchronize, a.stream)
ok(cu.cuMemPoolDestroy, a.pool)
held = used()
second = ALLOCATORS["cuMemAllocFromPoolAsync"]()
refused = call(cu.cuMemAllocFromPoolAsync, 800 * MiB, second.pool, second.stream)[0]
if {free!r} == "cuMemFree":
    ok(cu.cuMemFree, p)
else:
    ok(cu.cuMemFreeAsync, p, a.stream)
    ok(cu.cuStreamSynchronize, a.stream)
freed = used()
again = call(cu.cuMemAllocFromPoolAsync, 800 * MiB, second.pool, second.stream)[0]
emit(base=base, held=held, refused=refused.name, freed=freed, again=again.name)
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["held"] >= out["base"] + 800 * MiB, out
    assert out["refused"] == OOM, out
    assert out["freed"] == out["base"], out
    assert out["again"] == "CUDA_SUCCESS", out


def test_a_destroyed_pool_without_blocks_gives_its_charge_back(node):
    out = client(
        node,
        """
init()
a = ALLOCATORS["cuMemAllocFromPoolAsync"]()
keep = cu.cuuint64_t(1 << 62)         # the pool keeps what is freed
ok(cu.cuMemPoolSetAttribute, a.pool,
   cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, keep)
base = used()
p = ok(cu.cuMemAllocFromPoolAsync, 300 * MiB, a.pool, a.stream)
ok(cu.cuMemFreeAsync, p, a.stream)
ok(cu.cuStreamSynchronize, a.stream)
kept = used()                        # the pool keeps its reserve after the free
ok(cu.cuMemPoolDestroy, a.pool)
emit(base=base, kept=kept, after=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["kept"] >= out["base"] + 300 * MiB, out
    assert out["after"] == out["base"], out


def test_a_host_located_pool_takes_no_device_quota(node):
    """A pool located in host memory (CUDA 12.2+) holds no device memory:
    its allocations, on a stream of device 0, pass uncharged, even past the
    device quota.  Before, the hook kept no record of such a pool and
    charged its allocations to the stream's device."""
    out = client(
        node,
        """
init()
s = ok(cu.cuStreamCreate, 0)
pool = ok(cu.cuMemPoolCreate, pool_props(host=True))
base = used()
p = ok(cu.cuMemAllocFromPoolAsync, 1536 * MiB, pool, s)
ok(cu.cuStreamSynchronize, s)
held = used()
device = ALLOCATORS["cuMemAllocFromPoolAsync"]()        # a device pool still counts
over = call(cu.cuMemAllocFromPoolAsync, 1536 * MiB, device.pool, s)[0]
ok(cu.cuMemFreeAsync, p, s)
ok(cu.cuStreamSynchronize, s)
ok(cu.cuMemPoolDestroy, pool)
emit(base=base, held=held, over=over.name, after=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["held"] == out["base"], out
    assert out["over"] == OOM, out
    assert out["after"] == out["base"], out


def test_destroying_a_default_pool_is_refused_and_leaves_it_as_it_was(node):
    """A device's default pool cannot be destroyed: the driver answers
    CUDA_ERROR_INVALID_VALUE.  The hook used to trim the pool before asking,
    so the refused call still gave back the memory the pool kept for reuse.
    Now the pool keeps its reserve, and the quota its charge."""
    out = client(
        node,
        """
init()
s = ok(cu.cuStreamCreate, 0)
pool = ok(cu.cuDeviceGetDefaultMemPool, ok(cu.cuDeviceGet, 0))
ok(cu.cuMemPoolSetAttribute, pool,
   cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, cu.cuuint64_t(1 << 62))
base = used()
ok(cu.cuMemFreeAsync, ok(cu.cuMemAllocAsync, 300 * MiB, s), s)
ok(cu.cuStreamSynchronize, s)
kept = used()
refused = call(cu.cuMemPoolDestroy, pool)[0]
reserve = int(ok(cu.cuMemPoolGetAttribute, pool,
                 cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT))
emit(base=base, kept=kept, refused=refused.name, after=used(), reserve=reserve)
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["refused"] == "CUDA_ERROR_INVALID_VALUE", out
    assert out["kept"] >= out["base"] + 300 * MiB, out
    assert out["reserve"] >= 300 * MiB, out
    assert out["after"] == out["kept"], out


def test_a_destroyed_pool_used_again_keeps_its_blocks_charged(node):
    """A pool destroyed with a block still allocated keeps the block's memory
    charged until it is freed.  Allocating from the destroyed pool (the
    driver refuses it) used to be taken for a new pool with the same handle:
    the old pool's charge was dropped while its block was still held, and
    each such call left 2 MiB charged for good."""
    out = client(
        node,
        """
init()
s = ok(cu.cuStreamCreate, 0)
base = used()
pool = ok(cu.cuMemPoolCreate, pool_props())
p = ok(cu.cuMemAllocFromPoolAsync, 800 * MiB, pool, s)
ok(cu.cuStreamSynchronize, s)
ok(cu.cuMemPoolDestroy, pool)
held = used()
again = [call(cu.cuMemAllocFromPoolAsync, 1, pool, s)[0].name for _ in range(3)]
still = used()
over = call(cu.cuMemAlloc, 800 * MiB)[0]
ok(cu.cuMemFreeAsync, p, s)
ok(cu.cuStreamSynchronize, s)
emit(base=base, held=held, again=again, still=still, over=over.name, after=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["held"] >= out["base"] + 800 * MiB, out
    assert out["again"] == ["CUDA_ERROR_INVALID_VALUE"] * 3, out
    assert out["still"] == out["held"], out
    assert out["over"] == OOM, out
    assert out["after"] == out["base"], out


def test_an_allocation_from_no_pool_takes_no_charge(node):
    """cuMemAllocFromPoolAsync with a handle that is no pool fails in the
    driver and charges nothing.  It used to keep its pre-charge (and a pool
    record) for the rest of the process: three such calls of 300 MiB made a
    later 900 MiB allocation fail under a 1 GiB quota."""
    out = client(
        node,
        """
init()
s = ok(cu.cuStreamCreate, 0)
base = used()
bogus = cu.CUmemoryPool(0x1000)
failed = [call(cu.cuMemAllocFromPoolAsync, 300 * MiB, bogus, s)[0].name for _ in range(3)]
after = used()
p = ok(cu.cuMemAlloc, 900 * MiB)
emit(base=base, failed=failed, after=after)
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["failed"] == ["CUDA_ERROR_INVALID_VALUE"] * 3, out
    assert out["after"] == out["base"], out


def test_another_devices_default_pool_is_charged_to_that_device(node):
    """A pool may serve a stream of another device.  Device 1's default
    pool, used through a stream of device 0, is charged to device 1, whose
    memory it takes: it used to be charged to the stream's device 0, and
    device 1 could then hold 1800 MiB under a 1 GiB quota."""
    out = client(
        node,
        """
init(0)
s0 = ok(cu.cuStreamCreate, 0)
dev1 = ok(cu.cuDeviceGet, 1)
ctx1 = ok(cu.cuDevicePrimaryCtxRetain, dev1)
pool1 = ok(cu.cuDeviceGetDefaultMemPool, dev1)
base0 = used()
ok(cu.cuCtxSetCurrent, ctx1)
base1 = used()
ok(cu.cuCtxSetCurrent, init(0))
p = ok(cu.cuMemAllocFromPoolAsync, 900 * MiB, pool1, s0)
ok(cu.cuStreamSynchronize, s0)
used0 = used()
ok(cu.cuCtxSetCurrent, ctx1)
used1 = used()
over1 = call(cu.cuMemAlloc, 900 * MiB)[0]
emit(base0=base0, base1=base1, used0=used0, used1=used1, over1=over1.name)
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["used0"] == out["base0"], out
    assert out["used1"] >= out["base1"] + 900 * MiB, out
    assert out["over1"] == OOM, out


@pytest.mark.parametrize("flag", ["DEFERRED_MAPPING", "SPARSE"])
def test_arrays_without_memory_at_creation_take_no_quota(node, flag):
    """A sparse or deferred-mapping array has no memory until some is mapped
    into it (from cuMemCreate handles, charged there): it is not charged,
    even one bigger than the quota.  An ordinary array of the same shape is
    charged its size."""
    out = client(
        node,
        f"""
init()
d = cu.CUDA_ARRAY3D_DESCRIPTOR()
d.Width, d.Height, d.Depth = 8192, 8192, 0
d.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
d.NumChannels = 4                                  # 1 GiB
d.Flags = cu.CUDA_ARRAY3D_{flag}
base = used()
a = ok(cu.cuArray3DCreate, d)
unbacked = used()
ok(cu.cuArrayDestroy, a)
d.Flags = 0
plain = call(cu.cuArray3DCreate, d)[0]
emit(base=base, unbacked=unbacked, plain=plain.name)
""",
        CUDA_DEVICE_MEMORY_LIMIT="512m",
    )
    assert out["unbacked"] == out["base"], out
    assert out["plain"] == OOM, out


@pytest.mark.parametrize(
    ("flag", "depth", "small", "big", "limit"),
    [("LAYERED", 48, 2048, 2048, "1g"), ("CUBEMAP", 6, 1024, 4096, "512m")],
)
def test_a_layered_mipmapped_array_is_charged_every_layer_at_every_level(
    node, flag, depth, small, big, limit
):
    """The depth of a layered or cubemap array counts layers (six faces):
    every mip level has all of them, only width and height halve.  Halving
    the layers too, the interposer charged a 48-layer 2048x2048 RGBA8
    array of 4 levels 878 MiB instead of 1020 MiB, and granted it under a
    1 GiB quota that had 992 MiB left."""
    out = client(
        node,
        f"""
init()
def create(width, layers):
    d = cu.CUDA_ARRAY3D_DESCRIPTOR()
    d.Width = d.Height = width
    d.Depth = layers
    d.Format = cu.CUarray_format.CU_AD_FORMAT_UNSIGNED_INT8
    d.NumChannels = 4
    d.Flags = cu.CUDA_ARRAY3D_{flag}
    return call(cu.cuMipmappedArrayCreate, d, 4)
base = used()
err, m = create({small}, {depth if flag == "CUBEMAP" else 8})
charged = used() - base
ok(cu.cuMipmappedArrayDestroy, m)
free = mem_info()[0]
emit(charged=charged, free=free, big=create({big}, {depth})[0].name)
""",
        CUDA_DEVICE_MEMORY_LIMIT=limit,
    )
    layers = depth if flag == "CUBEMAP" else 8
    size = sum(layers * (small >> level) ** 2 * 4 for level in range(4))
    assert out["charged"] == -(-size // (2 * MiB)) * 2 * MiB, out
    big_size = sum(depth * (big >> level) ** 2 * 4 for level in range(4))
    assert big_size > out["free"], out  # the shape does not fit what is left
    assert out["big"] == OOM, out


def test_a_mipmapped_array_is_charged_only_the_levels_the_driver_makes(node):
    """The driver clamps the level count to 1 + floor(log2(largest
    extent)).  The interposer summed every level asked for: a 1024 x 1024
    RGBA8 array of 2^32-1 levels (6 MiB: 11 levels) spun in the hook for
    seconds and was refused as 2 TB."""
    out = client(
        node,
        """
import time
init()
d = cu.CUDA_ARRAY3D_DESCRIPTOR()
d.Width = d.Height = 1024
d.Format = cu.CUarray_format.CU_AD_FORMAT_UNSIGNED_INT8
d.NumChannels = 4
base = used()
t0 = time.monotonic()
err, m = call(cu.cuMipmappedArrayCreate, d, 2**32 - 1)
emit(err=err.name, charged=used() - base, secs=time.monotonic() - t0)
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["err"] == "CUDA_SUCCESS", out
    assert out["charged"] == 6 * MiB, out
    assert out["secs"] < 2, out


def test_a_pool_that_cannot_be_accounted_for_is_refused(node):
    """The interposer keeps a record per memory pool (256).  A pool past
    that is refused at cuMemPoolCreate with CUDA_ERROR_OUT_OF_MEMORY instead
    of handing out memory nobody charges; a destroyed pool's record is
    reused."""
    out = client(
        node,
        """
init()
s = ok(cu.cuStreamCreate, 0)
props = pool_props()
pools, refused = [], None
while len(pools) < 400:
    err, pool = call(cu.cuMemPoolCreate, props)
    if err != SUCCESS:
        refused = err.name
        break
    pools.append(pool)
ok(cu.cuMemPoolDestroy, pools.pop())
pool = ok(cu.cuMemPoolCreate, props)
base = used()
p = ok(cu.cuMemAllocFromPoolAsync, 600 * MiB, pool, s)
ok(cu.cuStreamSynchronize, s)
over = call(cu.cuMemAllocFromPoolAsync, 600 * MiB, pool, s)[0]
emit(made=len(pools) + 1, refused=refused, grown=used() - base, over=over.name)
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["refused"] == OOM, out
    assert out["made"] <= 256, out
    assert out["grown"] >= 600 * MiB, out
    assert out["over"] == OOM, out


VMM = """
def vmm_prop(kind):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = kind
    prop.location.id = 0
    return prop
DEVICE = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
HOST = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
"""


@pytest.mark.parametrize("first", ["host", "device"])
def test_a_mapped_handle_stays_charged_until_unmapped_even_in_one_unmap_of_several(node, first):
    """A cuMemCreate handle that is released while mapped keeps its memory
    until it is unmapped.  One cuMemUnmap may cover several mappings, also
    of host handles that take no quota: every device handle in the range is
    given back (before, a host mapping first in the range stopped the walk,
    and the device handle behind it stayed charged for good)."""
    kinds = ["HOST", "DEVICE"] if first == "host" else ["DEVICE", "DEVICE"]
    out = client(
        node,
        VMM
        + f"""
init()
base = used()
handles = [ok(cu.cuMemCreate, 64 * MiB, vmm_prop({kinds[0]}), 0),
           ok(cu.cuMemCreate, 64 * MiB, vmm_prop({kinds[1]}), 0)]
va = ok(cu.cuMemAddressReserve, 128 * MiB, 0, 0, 0)
ok(cu.cuMemMap, va, 64 * MiB, 0, handles[0], 0)
ok(cu.cuMemMap, int(va) + 64 * MiB, 64 * MiB, 0, handles[1], 0)
for h in handles:
    ok(cu.cuMemRelease, h)
released = used()
ok(cu.cuMemUnmap, va, 128 * MiB)
emit(base=base, released=released, unmapped=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    device_handles = 1 if first == "host" else 2
    assert out["released"] == out["base"] + device_handles * 64 * MiB, out
    assert out["unmapped"] == out["base"], out


@pytest.mark.parametrize("how", ["unmap-with-a-gap", "address-free"])
def test_mappings_gone_with_their_range_give_their_handles_back(node, how):
    """The driver unmaps every mapping in a cuMemUnmap range, also past a
    gap between mappings, and cuMemAddressFree unmaps what is still mapped
    in the range it frees.  Released handles mapped there are given back
    either way: before, a gap stopped the walk and cuMemAddressFree was not
    seen, and each round left 128 MiB charged for good."""
    free_range = (
        "ok(cu.cuMemUnmap, va, 1024 * MiB)"
        if how == "unmap-with-a-gap"
        else "ok(cu.cuMemAddressFree, va, 1024 * MiB)"
    )
    out = client(
        node,
        VMM
        + f"""
init()
base = used()
after = []
for _ in range(4):
    handles = [ok(cu.cuMemCreate, 128 * MiB, vmm_prop(DEVICE), 0) for _ in range(2)]
    va = ok(cu.cuMemAddressReserve, 1024 * MiB, 0, 0, 0)
    ok(cu.cuMemMap, va, 128 * MiB, 0, handles[0], 0)
    ok(cu.cuMemMap, int(va) + 512 * MiB, 128 * MiB, 0, handles[1], 0)
    for h in handles:
        ok(cu.cuMemRelease, h)
    {free_range}
    if "{how}" == "unmap-with-a-gap":
        ok(cu.cuMemAddressFree, va, 1024 * MiB)
    after.append(used())
emit(base=base, after=after)
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["after"] == [out["base"]] * 4, out


def test_a_retained_handle_takes_a_release_of_its_own(node):
    """cuMemRetainAllocationHandle gives a reference that takes its own
    cuMemRelease.  The common "retain, read the properties, release" look at
    a mapped address used to count as the owner's release: the handle was
    uncharged at its unmap while its owner still held it, and mapped again it
    held 256 MiB uncharged.  A handle released while mapped and retained
    again is the retainer's until that reference is released."""
    out = client(
        node,
        VMM
        + """
init()
base = used()
h = ok(cu.cuMemCreate, 256 * MiB, vmm_prop(DEVICE), 0)
va = ok(cu.cuMemAddressReserve, 512 * MiB, 0, 0, 0)
ok(cu.cuMemMap, va, 256 * MiB, 0, h, 0)
seen = ok(cu.cuMemRetainAllocationHandle, int(va) + 4096)
same = int(seen) == int(h)
ok(cu.cuMemGetAllocationPropertiesFromHandle, seen)
ok(cu.cuMemRelease, seen)
ok(cu.cuMemUnmap, va, 256 * MiB)
owned = used()                              # the owner still holds h
ok(cu.cuMemMap, int(va) + 256 * MiB, 256 * MiB, 0, h, 0)
ok(cu.cuMemRelease, h)                      # released while mapped ...
back = ok(cu.cuMemRetainAllocationHandle, int(va) + 256 * MiB)   # ... taken back
ok(cu.cuMemUnmap, int(va) + 256 * MiB, 256 * MiB)
retained = used()
ok(cu.cuMemRelease, back)
emit(base=base, same=same, owned=owned, retained=retained, after=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["same"], out
    assert out["owned"] == out["base"] + 256 * MiB, out
    assert out["retained"] == out["base"] + 256 * MiB, out
    assert out["after"] == out["base"], out


def test_a_reset_primary_context_keeps_its_retains_and_its_charges_follow(node):
    """As CUDA documents, resetting a primary context frees all it held but
    does not release it: every retain still takes its release, also one
    made before the reset, and the next retain makes the context anew.  The
    quota follows: after the reset only the new context is charged, and
    after the last release nothing (the simulator used to zero the retain
    count at a reset, unlike CUDA)."""
    out = client(
        node,
        """
from gpuvisor.shim.region import Region
init()
dev = ok(cu.cuDeviceGet, 0)
p = ok(cu.cuMemAlloc, 256 * MiB)
held = used()
ok(cu.cuDevicePrimaryCtxReset, dev)
ctx = ok(cu.cuDevicePrimaryCtxRetain, dev)          # made anew; two retains now
ok(cu.cuCtxSetCurrent, ctx)
after_reset = used()
ok(cu.cuDevicePrimaryCtxRelease, dev)
alive = ok(cu.cuDevicePrimaryCtxGetState, dev)[1]
ok(cu.cuDevicePrimaryCtxRelease, dev)
gone = ok(cu.cuDevicePrimaryCtxGetState, dev)[1]
extra = call(cu.cuDevicePrimaryCtxRelease, dev)[0]
emit(held=held, after_reset=after_reset, alive=alive, gone=gone, extra=extra.name,
     region=Region.attach().devices()[0].used)
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["held"] == SIM_CONTEXT + 256 * MiB, out
    assert out["after_reset"] == SIM_CONTEXT, out
    assert out["alive"] == 1, out
    assert out["gone"] == 0, out
    assert out["extra"] == "CUDA_ERROR_INVALID_CONTEXT", out
    assert out["region"] == 0, out


def test_an_nvml_only_process_sees_the_quota_without_cuda_being_initialised(node):
    """A process that only uses NVML (a parent that picks a GPU before it
    forks CUDA workers, which CUDA does not allow after cuInit) sees the
    quota in NVML's memory figures, and the interposer does not initialise
    CUDA for it: the driver library is not even loaded.  It used to call
    cuInit to map the device's UUID to a CUDA ordinal."""
    out = client(
        node,
        """
import pynvml as n
n.nvmlInit()
m = n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(0))
emit(total=m.total, cuda_loaded="libcuda.so.1" in open("/proc/self/maps").read())
""",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    assert out["total"] == 1 * GiB, out
    assert out["cuda_loaded"] is False, out


GRAPH_OF = """
def graph_of(nbytes, free_inside=True):
    \"\"\"A captured graph that allocates nbytes (and frees them inside).\"\"\"
    s = ok(cu.cuStreamCreate, 0)
    ok(cu.cuStreamBeginCapture, s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    p = ok(cu.cuMemAllocAsync, nbytes, s)
    if free_inside:
        ok(cu.cuMemFreeAsync, p, s)
    g = ok(cu.cuStreamEndCapture, s)
    return ok(cu.cuGraphInstantiate, g, 0), s, p
def graph_pool():
    return int(ok(cu.cuDeviceGetGraphMemAttribute, 0,
                  cu.CUgraphMem_attribute.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT))
"""


def test_graph_memory_is_charged_and_limited(node):
    """Graph allocations take their memory from the device's graph pool when
    the graph is launched, not when the cuMemAllocAsync is captured: the
    pool's reserve is charged at launch, a launch past the quota fails with
    CUDA_ERROR_OUT_OF_MEMORY before anything is taken, and a trim gives the
    memory back."""
    out = client(
        node,
        GRAPH_OF
        + """
init()
base = used()
e, s, _ = graph_of(3 * GiB)
captured = used()
launch = call(cu.cuGraphLaunch, e, s)[0]
after_launch, pool = used(), graph_pool()
plain = call(cu.cuMemAlloc, 2 * GiB)[0]           # 3 + 2 > 4: refused
ok(cu.cuDeviceGraphMemTrim, 0)
trimmed = used()
q = ok(cu.cuMemAlloc, 2 * GiB)                    # now it fits
again = call(cu.cuGraphLaunch, e, s)[0]           # 2 + 3 > 4: refused
refused_pool, refused_used = graph_pool(), used()
ok(cu.cuMemFree, q)
third = call(cu.cuGraphLaunch, e, s)[0]
emit(base=base, captured=captured, launch=launch.name, after_launch=after_launch, pool=pool,
     plain=plain.name, trimmed=trimmed, again=again.name, refused_pool=refused_pool,
     refused_used=refused_used, third=third.name, end=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["captured"] == out["base"], out  # capturing allocates nothing
    assert out["launch"] == "CUDA_SUCCESS", out
    assert out["pool"] == 3 * GiB, out
    assert out["after_launch"] == out["base"] + 3 * GiB, out
    assert out["plain"] == OOM, out
    assert out["trimmed"] == out["base"], out
    assert out["again"] == OOM, out
    assert out["refused_pool"] == 0, out
    assert out["refused_used"] == out["base"] + 2 * GiB, out
    assert out["third"] == "CUDA_SUCCESS", out
    assert out["end"] == out["base"] + 3 * GiB, out


def test_a_paced_graph_launch_holds_no_graph_memory_lock(node):
    """A graph launch that waits for its turn under the SM quota (here held
    by the yield flag) does not block the process's other threads that
    touch graph memory: a trim from another thread returns at once, and the
    launch goes through with its memory charged once the yield is lifted."""
    out = client(
        node,
        GRAPH_OF
        + """
import threading, time
from gpuvisor.shim.region import Region
init()
base = used()
e, s, _ = graph_of(1 * GiB)
ok(cu.cuGraphLaunch, e, s)                # starts the meter; the pool keeps 1 GiB
ok(cu.cuStreamSynchronize, s)
region = Region.attach()
region.set_sm_yield(0, 30)
time.sleep(0.5)                           # the meter's next update pauses launches
result = {}
def launch():
    ok(cu.cuCtxSetCurrent, ok(cu.cuDevicePrimaryCtxRetain, 0))
    result["rc"] = call(cu.cuGraphLaunch, e, s)[0].name
    result["at"] = time.monotonic()
t = threading.Thread(target=launch)
t.start()
time.sleep(0.3)
lift = threading.Timer(3.0, region.set_sm_yield, (0, 0))
lift.start()
t0 = time.monotonic()
ok(cu.cuDeviceGraphMemTrim, 0)
trim = time.monotonic() - t0
waiting = t.is_alive()                    # the trim returned while it was held
t.join(10)
lift.join()
ok(cu.cuStreamSynchronize, s)
emit(trim=trim, waiting=waiting, rc=result.get("rc"), charged=used() - base)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
        CUDA_DEVICE_SM_LIMIT="50",
        CUDA_TASK_PRIORITY="1",
    )
    assert out["waiting"], out  # the launch was still held
    assert out["trim"] < 1.0, out  # 3 s if it waited for the launch
    assert out["rc"] == "CUDA_SUCCESS", out
    assert out["charged"] == 1 * GiB, out


def test_capturing_a_graph_allocation_takes_no_quota(node):
    """Capturing cuMemAllocAsync into a graph maps nothing, so it succeeds
    even when the quota is nearly used; the graph's launch is what needs the
    room."""
    out = client(
        node,
        GRAPH_OF
        + """
init()
held = ok(cu.cuMemAlloc, 3 * GiB)
base = used()
e, s, _ = graph_of(2 * GiB)
captured = used()
full = call(cu.cuGraphLaunch, e, s)[0]
ok(cu.cuMemFree, held)
room = call(cu.cuGraphLaunch, e, s)[0]
emit(base=base, captured=captured, full=full.name, room=room.name)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["captured"] == out["base"], out
    assert (out["full"], out["room"]) == (OOM, "CUDA_SUCCESS"), out


def test_a_captured_free_of_a_plain_allocation_keeps_its_charge(node):
    """Captured, cuMemFreeAsync only records a free node, which must free a
    graph allocation; a cuMemAlloc pointer freed that way is not freed (the
    driver refuses it), so it stays charged until a real cuMemFree."""
    out = client(
        node,
        """
init()
base = used()
ptr = ok(cu.cuMemAlloc, 1 * GiB)
s = ok(cu.cuStreamCreate, 0)
ok(cu.cuStreamBeginCapture, s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
err = call(cu.cuMemFreeAsync, ptr, s)[0]
end = call(cu.cuStreamEndCapture, s)[0]
held = used()
ok(cu.cuMemFree, ptr)
emit(base=base, err=err.name, end=end.name, held=held, after=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["err"] != "CUDA_SUCCESS", out
    assert out["held"] == out["base"] + 1 * GiB, out
    assert out["after"] == out["base"], out


EXPLICIT_GRAPH = """
def explicit_graph(nbytes):
    \"\"\"A graph with one allocation node that the graph does not free.\"\"\"
    g = ok(cu.cuGraphCreate, 0)
    dptr = add_alloc_node(g, nbytes)
    return g, dptr
def instantiate_uploading(g, s):
    prm = cu.CUDA_GRAPH_INSTANTIATE_PARAMS()
    prm.flags = cu.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD
    prm.hUploadStream = s
    return call(cu.cuGraphInstantiateWithParams, g, prm)
"""


def test_graph_memory_uploaded_at_instantiation_and_left_live(node):
    """cuGraphInstantiateWithParams with CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD
    maps the graph's memory at instantiation: charged then, or refused then.
    An allocation the graph leaves live stays charged after cuMemFree until
    the pool is trimmed."""
    out = client(
        node,
        GRAPH_OF
        + EXPLICIT_GRAPH
        + """
init()
base = used()
s = ok(cu.cuStreamCreate, 0)
g, dptr = explicit_graph(3 * GiB)
big, _ = instantiate_uploading(explicit_graph(5 * GiB)[0], s)
err, e = instantiate_uploading(g, s)
uploaded = used()
launch = call(cu.cuGraphLaunch, e, s)[0]
launched = used()
ok(cu.cuMemFree, dptr)
freed = used()
ok(cu.cuDeviceGraphMemTrim, 0)
emit(base=base, big=big.name, err=err.name, uploaded=uploaded, launch=launch.name,
     launched=launched, freed=freed, trimmed=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    b = out["base"]
    assert out["big"] == OOM, out
    assert (out["err"], out["launch"]) == ("CUDA_SUCCESS", "CUDA_SUCCESS"), out
    assert out["uploaded"] == out["launched"] == out["freed"] == b + 3 * GiB, out
    assert out["trimmed"] == b, out


def test_a_graph_with_memory_nodes_is_instantiated_once_at_a_time(node):
    """CUDA lets a graph with memory nodes have one executable graph at a
    time (cuGraphInstantiate's documentation): a second instantiation
    before cuGraphExecDestroy gets the driver's CUDA_ERROR_INVALID_VALUE
    through, charging and recording nothing, and the first one's launches
    are still charged.  An instantiation the interposer refuses (here an
    upload the 4 GiB quota cannot take) destroys the driver's executable
    graph, so the graph can be instantiated again; after a destroy it can
    too, and is charged again."""
    out = client(
        node,
        GRAPH_OF
        + EXPLICIT_GRAPH
        + """
init()
base = used()
s = ok(cu.cuStreamCreate, 0)
big_g, _ = explicit_graph(5 * GiB)
refused = instantiate_uploading(big_g, s)[0].name
big = call(cu.cuGraphInstantiate, big_g, 0)
again = call(cu.cuGraphInstantiate, big_g, 0)[0].name
big_launch = call(cu.cuGraphLaunch, big[1], s)[0].name
g, dptr = explicit_graph(3 * GiB)
e = ok(cu.cuGraphInstantiate, g, 0)
second = call(cu.cuGraphInstantiate, g, 0)[0].name
launch = call(cu.cuGraphLaunch, e, s)[0].name
launched = used()
ok(cu.cuMemFree, dptr)
ok(cu.cuGraphExecDestroy, e)
ok(cu.cuDeviceGraphMemTrim, 0)
trimmed = used()
e = ok(cu.cuGraphInstantiate, g, 0)
relaunch = call(cu.cuGraphLaunch, e, s)[0].name
relaunched = used()
emit(base=base, refused=refused, big=big[0].name, again=again, big_launch=big_launch,
     second=second, launch=launch, launched=launched, trimmed=trimmed, relaunch=relaunch,
     relaunched=relaunched)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    b = out.pop("base")
    assert out == {
        "refused": OOM,
        "big": "CUDA_SUCCESS",
        "again": "CUDA_ERROR_INVALID_VALUE",
        "big_launch": OOM,
        "second": "CUDA_ERROR_INVALID_VALUE",
        "launch": "CUDA_SUCCESS",
        "launched": b + 3 * GiB,
        "trimmed": b,
        "relaunch": "CUDA_SUCCESS",
        "relaunched": b + 3 * GiB,
    }, out


def test_graph_memory_on_two_devices_is_checked_on_each(node):
    """A graph whose allocation nodes are on devices 0 and 1 is checked
    against each device's own quota for the bytes it allocates there: 3 GiB
    on device 1 under a 2 GiB limit is refused before anything is taken, on
    either device; 1 GiB on each is charged to each."""
    out = client(
        node,
        """
init(0)
ctx0 = ok(cu.cuCtxGetCurrent)
ctx1 = ok(cu.cuDevicePrimaryCtxRetain, ok(cu.cuDeviceGet, 1))
def used_on(ctx):
    ok(cu.cuCtxSetCurrent, ctx)
    u = used()
    ok(cu.cuCtxSetCurrent, ctx0)
    return u
def pool(dev):
    return int(ok(cu.cuDeviceGetGraphMemAttribute, dev,
                  cu.CUgraphMem_attribute.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT))
def two_device_graph(on0, on1):
    g, ptrs = ok(cu.cuGraphCreate, 0), []
    for dev, nbytes in ((0, on0), (1, on1)):
        dptr = add_alloc_node(g, nbytes, dev)
        ptrs.append(dptr)
    return ok(cu.cuGraphInstantiate, g, 0), ptrs
s = ok(cu.cuStreamCreate, 0)
base0, base1 = used_on(ctx0), used_on(ctx1)
big = call(cu.cuGraphLaunch, two_device_graph(1 * GiB, 3 * GiB)[0], s)[0]
refused = (used_on(ctx0) - base0, used_on(ctx1) - base1, pool(0), pool(1))
e, ptrs = two_device_graph(1 * GiB, 1 * GiB)
fits = call(cu.cuGraphLaunch, e, s)[0]
ok(cu.cuStreamSynchronize, s)
launched = (used_on(ctx0) - base0, used_on(ctx1) - base1, pool(0), pool(1))
ok(cu.cuMemFree, ptrs[1])
ok(cu.cuDeviceGraphMemTrim, 1)
trimmed = (used_on(ctx0) - base0, used_on(ctx1) - base1)
emit(big=big.name, refused=refused, fits=fits.name, launched=launched, trimmed=trimmed)
""",
        CUDA_DEVICE_MEMORY_LIMIT_0="8g",
        CUDA_DEVICE_MEMORY_LIMIT_1="2g",
    )
    assert out["big"] == OOM, out
    assert out["refused"] == [0, 0, 0, 0], out
    assert out["fits"] == "CUDA_SUCCESS", out
    assert out["launched"] == [1 * GiB, 1 * GiB, 1 * GiB, 1 * GiB], out
    assert out["trimmed"] == [1 * GiB, 0], out


def test_graph_memory_passes_through_without_control(node):
    """CUDA_DISABLE_CONTROL: graphs allocate what the device has, unlimited."""
    out = client(
        node,
        GRAPH_OF
        + """
init()
e, s, _ = graph_of(6 * GiB)
emit(launch=call(cu.cuGraphLaunch, e, s)[0].name, pool=graph_pool())
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
        CUDA_DISABLE_CONTROL="true",
    )
    assert out == {"launch": "CUDA_SUCCESS", "pool": 6 * GiB}, out


def test_graph_memory_counts_for_the_whole_container(node):
    """A second process sees the first one's graph pool in its quota, and
    gets it back when that process is killed."""
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g")
    probe = "init()\nemit(big=call(cu.cuMemAlloc, 2 * GiB)[0].name)\n"
    code = PRELUDE + GRAPH_OF + "init()\ne, s, _ = graph_of(3 * GiB)\n"
    code += "ok(cu.cuGraphLaunch, e, s)\nhold(pool=graph_pool())\n"
    holder = Holder(code, env)
    with holder as held:
        assert held["pool"] == 3 * GiB
        assert client(node, probe, CUDA_DEVICE_MEMORY_LIMIT="4g") == {"big": OOM}
        holder.kill()
    assert client(node, probe, CUDA_DEVICE_MEMORY_LIMIT="4g") == {"big": "CUDA_SUCCESS"}


AUTO_FREE = """
from gpuvisor.shim.region import Region
AUTO = cu.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH
def region_used():
    return Region.attach().devices()[0].used
def left_live(nbytes, flags, captured=False):
    \"\"\"An executable graph that allocates nbytes and leaves them live, as
    PyTorch's captured graphs do (their outputs), and its address.\"\"\"
    if captured:
        s = ok(cu.cuStreamCreate, 0)
        ok(cu.cuStreamBeginCapture, s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        dptr = ok(cu.cuMemAllocAsync, nbytes, s)
        g = ok(cu.cuStreamEndCapture, s)
    else:
        g, dptr = explicit_graph(nbytes)
    return ok(cu.cuGraphInstantiate, g, flags), g, dptr
"""
SIXTY = 2458 * MiB  # 60 % of the 4 GiB quota, in whole 2 MiB steps


@pytest.mark.parametrize("captured", [False, True], ids=["node", "captured"])
def test_an_auto_free_graph_relaunches_with_its_memory_charged_once(node, captured):
    """A graph instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH
    (as PyTorch does) frees, at each relaunch, what its previous launch left
    live before it allocates again, so a graph taking 60 % of the quota
    relaunches and the container keeps 60 % charged.  The launch used to be
    charged as if the old allocation stayed: refused from the second launch.
    Destroying the executable graph leaves its allocation live (and charged)
    until it is freed; a trim then gives the pool back."""
    out = graph_client(
        node,
        f"""
e, g, dptr = left_live({SIXTY}, AUTO, captured={captured})
rcs, held = [], []
for _ in range(4):
    rcs.append(call(cu.cuGraphLaunch, e, s)[0].name)
    ok(cu.cuStreamSynchronize, s)
    held.append(region_used() - base)
plain = call(cu.cuMemAlloc, 2 * GiB)[0].name       # 2.4 + 2 > 4: still refused
ok(cu.cuGraphExecDestroy, e)
destroyed = region_used() - base
ok(cu.cuDeviceGraphMemTrim, 0)
trimmed_live = region_used() - base                  # still allocated: kept
ok(cu.cuMemFree, dptr)
ok(cu.cuDeviceGraphMemTrim, 0)
emit(rcs=rcs, held=held, plain=plain, destroyed=destroyed, trimmed_live=trimmed_live,
     end=region_used() - base)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["rcs"] == ["CUDA_SUCCESS"] * 4, out
    assert out["held"] == [SIXTY] * 4, out
    assert out["plain"] == OOM, out
    assert out["destroyed"] == out["trimmed_live"] == SIXTY, out
    assert out["end"] == 0, out


def test_a_graph_without_auto_free_gets_the_drivers_error_on_relaunch(node):
    """Without CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH, relaunching a
    graph whose allocation is still live is CUDA_ERROR_INVALID_VALUE, as
    CUDA documents: the driver's answer comes back, not an out-of-memory
    refusal of the interposer's, and nothing more is charged.  Once the
    allocation is freed, the relaunch runs in the memory the pool kept."""
    out = graph_client(
        node,
        f"""
e, g, dptr = left_live({SIXTY}, 0)
first = call(cu.cuGraphLaunch, e, s)[0].name
again = [call(cu.cuGraphLaunch, e, s)[0].name for _ in range(2)]
refused = region_used() - base
ok(cu.cuMemFree, dptr)
freed = call(cu.cuGraphLaunch, e, s)[0].name
emit(first=first, again=again, refused=refused, freed=freed, end=region_used() - base)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["first"] == "CUDA_SUCCESS", out
    assert out["again"] == ["CUDA_ERROR_INVALID_VALUE"] * 2, out
    assert out["refused"] == SIXTY, out
    assert out["freed"] == "CUDA_SUCCESS", out
    assert out["end"] == SIXTY, out


@pytest.mark.parametrize("free", ["cuMemFree", "cuMemFreeAsync", "free-node"])
def test_an_auto_free_graphs_allocation_freed_by_the_program_is_not_freed_twice(node, free):
    """The program frees an auto-free graph's 1.25 GiB allocation between
    launches (cuMemFree, cuMemFreeAsync, or another graph's free node) while
    another graph keeps 1.5 GiB live, and the pool is trimmed to that: the
    next launch must allocate the 1.25 GiB anew, so with 2 GiB more taken
    meanwhile it is refused (1.5 + 2 + 1.25 > 4), not counted as freeing
    memory it no longer holds.  Once there is room it runs, and relaunches
    with its 1.25 GiB charged once (1.5 + 1.25 + 1.25 > 4 before)."""
    out = graph_client(
        node,
        f"""
e, g, dptr = left_live(1280 * MiB, AUTO)
other = left_live(1536 * MiB, 0)[0]
ok(cu.cuGraphLaunch, e, s)
ok(cu.cuGraphLaunch, other, s)
if {free!r} == "cuMemFree":
    ok(cu.cuMemFree, dptr)
elif {free!r} == "cuMemFreeAsync":
    ok(cu.cuMemFreeAsync, dptr, s)
else:
    fg = ok(cu.cuGraphCreate, 0)
    ok(cu.cuGraphAddMemFreeNode, fg, None, 0, dptr)
    ok(cu.cuGraphLaunch, ok(cu.cuGraphInstantiate, fg, 0), s)
ok(cu.cuStreamSynchronize, s)
ok(cu.cuDeviceGraphMemTrim, 0)
trimmed = region_used() - base
plain = ok(cu.cuMemAlloc, 2 * GiB)
full = call(cu.cuGraphLaunch, e, s)[0].name
refused = region_used() - base
ok(cu.cuMemFree, plain)
rcs = [call(cu.cuGraphLaunch, e, s)[0].name for _ in range(3)]
emit(trimmed=trimmed, full=full, refused=refused, rcs=rcs, end=region_used() - base)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["trimmed"] == 1536 * MiB, out
    assert out["full"] == OOM, out
    assert out["refused"] == 1536 * MiB + 2 * GiB, out
    assert out["rcs"] == ["CUDA_SUCCESS"] * 3, out
    assert out["end"] == 2816 * MiB, out


def test_a_graph_pool_that_cannot_be_read_is_charged_in_full(node):
    """When the driver will not tell the graph pool's use and reserve
    (cuDeviceGetGraphMemAttribute fails), a launch is charged every byte its
    allocation nodes may take, as the pool may grow that much: a 5 GiB
    graph is refused under a 4 GiB quota, a 3 GiB one is charged 3 GiB, and
    the charge stays (a trim cannot be read either), so relaunching it is
    refused.  Such launches used to run uncharged."""
    out = client(
        node,
        GRAPH_OF
        + AUTO_FREE
        + """
init()
base = region_used()
big, s, _ = graph_of(5 * GiB)
refused = call(cu.cuGraphLaunch, big, s)[0].name
e, s, _ = graph_of(3 * GiB)
first = call(cu.cuGraphLaunch, e, s)[0].name
ok(cu.cuStreamSynchronize, s)
launched = region_used() - base
plain = call(cu.cuMemAlloc, 2 * GiB)[0].name
ok(cu.cuDeviceGraphMemTrim, 0)
trimmed = region_used() - base
again = call(cu.cuGraphLaunch, e, s)[0].name
emit(refused=refused, first=first, launched=launched, plain=plain, trimmed=trimmed, again=again)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
        GPUVISOR_SIM_CUDA_FAIL="cuDeviceGetGraphMemAttribute",
    )
    assert out["refused"] == OOM, out
    assert out["first"] == "CUDA_SUCCESS", out
    assert out["launched"] == out["trimmed"] == 3 * GiB, out
    assert out["plain"] == OOM, out
    assert out["again"] == OOM, out


@pytest.mark.parametrize(
    "query",
    [
        "cuGraphGetNodes",
        "cuGraphNodeGetType",
        "cuGraphMemAllocNodeGetParams",
        "cuGraphMemFreeNodeGetParams",
    ],
)
def test_a_graph_whose_memory_nodes_cannot_be_read_is_not_instantiated(node, query):
    """The memory nodes of a graph are read when it is instantiated; if the
    driver will not tell them, the graph may allocate without the quota
    knowing, so the instantiation fails with the driver's error and nothing
    can be launched.  Such a graph used to be left untracked: a 5 GiB graph
    then launched under a 4 GiB quota, uncharged."""
    out = client(
        node,
        GRAPH_OF
        + AUTO_FREE
        + """
init()
base = region_used()
s = ok(cu.cuStreamCreate, 0)
ok(cu.cuStreamBeginCapture, s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
ok(cu.cuMemFreeAsync, ok(cu.cuMemAllocAsync, 5 * GiB, s), s)
g = ok(cu.cuStreamEndCapture, s)
err, e = call(cu.cuGraphInstantiate, g, 0)
launch = call(cu.cuGraphLaunch, e, s)[0].name if err == SUCCESS else None
ok(cu.cuStreamSynchronize, s)
emit(err=err.name, launch=launch, charged=region_used() - base)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
        GPUVISOR_SIM_CUDA_FAIL=query,
    )
    assert out == {"err": "CUDA_ERROR_UNKNOWN", "launch": None, "charged": 0}, out


NESTED = """
OWN = cu.CUgraphChildGraphNodeOwnership
def nest(g, depth, ownership=OWN.CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE):
    \"\"\"g moved (or cloned) into a child graph node, depth levels down.\"\"\"
    for _ in range(depth):
        parent = ok(cu.cuGraphCreate, 0)
        prm = cu.CUgraphNodeParams()
        prm.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_GRAPH
        prm.graph.graph = g
        prm.graph.ownership = ownership
        ok(cu.cuGraphAddNode, parent, None, None, 0, prm)
        g = parent
    return g
"""


def graph_client(node: SimNode, code: str, *, nested: bool = False, **env: str) -> Any:
    """client() with the graph helpers (EXPLICIT_GRAPH, AUTO_FREE, and NESTED
    when asked), the driver initialised, the quota's use at the start as
    base and a stream s, before code."""
    start = "init()\nbase = region_used()\ns = ok(cu.cuStreamCreate, 0)\n"
    helpers = EXPLICIT_GRAPH + AUTO_FREE + (NESTED if nested else "")
    return client(node, helpers + start + code, **env)


@pytest.mark.parametrize("depth", [1, 32])
def test_graph_memory_in_child_graphs_is_charged(node, depth):
    """CUDA 12.9 lets a graph with memory nodes be moved into a child graph
    node (cuGraphAddNode, CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE), at any
    depth; a cloned child graph cannot hold them (cuGraphAddChildGraphNode
    refuses).  A moved child's allocations are charged at the parent's
    launch as the parent's own, one level down or 32 (as deep as the
    interposer reads): 5 GiB is refused under a 4 GiB quota, 3 GiB is
    charged 3 GiB.  Only the parent's own nodes used to be read, and such
    a graph launched uncharged."""
    out = graph_client(
        node,
        f"""
big, _ = explicit_graph(5 * GiB)
clone = call(cu.cuGraphAddChildGraphNode, ok(cu.cuGraphCreate, 0), None, 0, big)[0]
big_e = ok(cu.cuGraphInstantiate, nest(big, {depth}), 0)
refused = call(cu.cuGraphLaunch, big_e, s)[0].name
g, dptr = explicit_graph(3 * GiB)
e = ok(cu.cuGraphInstantiate, nest(g, {depth}), 0)
launch = call(cu.cuGraphLaunch, e, s)[0].name
ok(cu.cuStreamSynchronize, s)
launched = region_used() - base
ok(cu.cuMemFree, dptr)
ok(cu.cuDeviceGraphMemTrim, 0)
emit(clone=clone.name, refused=refused, launch=launch, launched=launched,
     trimmed=region_used() - base)
""",
        nested=True,
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["clone"] == "CUDA_ERROR_INVALID_VALUE", out
    assert out["refused"] == OOM, out
    assert out["launch"] == "CUDA_SUCCESS", out
    assert out["launched"] == 3 * GiB, out
    assert out["trimmed"] == 0, out


@pytest.mark.parametrize("how", ["unreadable", "too_deep"])
def test_a_child_graph_that_cannot_be_read_fails_the_instantiation(node, how):
    """A child graph whose nodes cannot be read (cuGraphChildGraphNodeGetGraph
    fails: the driver's error), or that lies deeper than the interposer
    reads (CUDA_ERROR_NOT_SUPPORTED), may hold memory nodes, so the
    instantiation fails and nothing can be launched uncharged."""
    deep = 33 if how == "too_deep" else 1
    out = graph_client(
        node,
        f"""
g, _ = explicit_graph(5 * GiB)
err, e = call(cu.cuGraphInstantiate, nest(g, {deep}), 0)
launch = call(cu.cuGraphLaunch, e, s)[0].name if err == SUCCESS else None
ok(cu.cuStreamSynchronize, s)
emit(err=err.name, launch=launch, charged=region_used() - base)
""",
        nested=True,
        CUDA_DEVICE_MEMORY_LIMIT="4g",
        **(
            {"GPUVISOR_SIM_CUDA_FAIL": "cuGraphChildGraphNodeGetGraph"}
            if how == "unreadable"
            else {}
        ),
    )
    err = "CUDA_ERROR_UNKNOWN" if how == "unreadable" else "CUDA_ERROR_NOT_SUPPORTED"
    assert out == {"err": err, "launch": None, "charged": 0}, out


def test_a_graph_instantiated_in_a_destroyed_context_is_still_charged(node):
    """An executable graph outlives the context it was instantiated in (CUDA
    lists no CUgraphExec among what cuCtxDestroy takes, and the simulator
    launches it), so its record stays until cuGraphExecDestroy: launched
    from another context, a 5 GiB graph is refused under a 4 GiB quota and a
    3 GiB one is charged.  Destroying the context used to drop the records,
    and such launches ran uncharged."""
    out = client(
        node,
        GRAPH_OF
        + AUTO_FREE
        + """
prim = init()
ctx = ok(cu.cuCtxCreate, None, 0, ok(cu.cuDeviceGet, 0))
big, _, _ = graph_of(5 * GiB)
e, _, _ = graph_of(3 * GiB)
ok(cu.cuCtxDestroy, ctx)
ok(cu.cuCtxSetCurrent, prim)
base = region_used()
s = ok(cu.cuStreamCreate, 0)
refused = call(cu.cuGraphLaunch, big, s)[0].name
fits = call(cu.cuGraphLaunch, e, s)[0].name
ok(cu.cuStreamSynchronize, s)
launched = region_used() - base
ok(cu.cuGraphExecDestroy, e)
ok(cu.cuGraphExecDestroy, big)
ok(cu.cuDeviceGraphMemTrim, 0)
emit(refused=refused, fits=fits, launched=launched, end=region_used() - base)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out == {"refused": OOM, "fits": "CUDA_SUCCESS", "launched": 3 * GiB, "end": 0}, out


def test_executable_graphs_never_destroyed_across_contexts_are_all_recorded(node):
    """A program whose contexts come and go, each instantiating graphs with
    memory nodes it never destroys (2,000 here, in 20 contexts), is never
    refused an instantiation: the records live in the process's table,
    which grows with them (a record is refused only when host memory is
    out).  Every record still charges its graph's launches after its
    context is gone: the first one's 5 GiB is refused under a 4 GiB quota,
    and the first and last 64 MiB ones are charged."""
    out = client(
        node,
        EXPLICIT_GRAPH
        + AUTO_FREE
        + """
prim = init()
dev = ok(cu.cuDeviceGet, 0)
execs, fails = [], []
for c in range(20):
    ctx = ok(cu.cuCtxCreate, None, 0, dev)
    if c == 0:
        big = ok(cu.cuGraphInstantiate, explicit_graph(5 * GiB)[0], 0)
    for i in range(100):
        g, dptr = explicit_graph(64 * MiB)
        ok(cu.cuGraphAddMemFreeNode, g, None, 0, dptr)
        err, e = call(cu.cuGraphInstantiate, g, 0)
        if err.name != "CUDA_SUCCESS":
            fails.append(err.name)
        execs.append(e)
        ok(cu.cuGraphDestroy, g)
    ok(cu.cuCtxDestroy, ctx)
ok(cu.cuCtxSetCurrent, prim)
base = region_used()
s = ok(cu.cuStreamCreate, 0)
rcs = [call(cu.cuGraphLaunch, x, s)[0].name for x in (big, execs[0], execs[-1])]
ok(cu.cuStreamSynchronize, s)
launched = region_used() - base
for x in execs + [big]:
    ok(cu.cuGraphExecDestroy, x)
ok(cu.cuDeviceGraphMemTrim, 0)
emit(n=len(execs), fails=fails[:3], rcs=rcs, launched=launched, end=region_used() - base)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out == {
        "n": 2000,
        "fails": [],
        "rcs": [OOM, "CUDA_SUCCESS", "CUDA_SUCCESS"],
        "launched": 64 * MiB,
        "end": 0,
    }, out


HEAP = "cu.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE"
PENDING = "cu.CUlimit.CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT"


def test_memory_the_driver_takes_on_its_own_is_charged(node):
    """cuCtxSetLimit makes the driver take device memory (here a 3 GiB device
    heap) without any allocation call.  NVML's per-process figure shows it,
    so it is charged: cuMemGetInfo shows it used, the next 2 GiB allocation
    is refused, and it comes back when the limit is lowered."""
    out = client(
        node,
        f"""
init()
base = used()
ok(cu.cuCtxSetLimit, {HEAP}, 3 * GiB)
heap = used()
big = call(cu.cuMemAlloc, 2 * GiB)[0]
ok(cu.cuCtxSetLimit, {HEAP}, 8 * MiB)
lowered = used()
q = ok(cu.cuMemAlloc, 2 * GiB)
emit(base=base, heap=heap, big=big.name, lowered=lowered)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["heap"] == out["base"] + 3 * GiB - 8 * MiB, out
    assert out["big"] == OOM, out
    assert out["lowered"] == out["base"], out


def test_a_limit_that_does_not_fit_the_quota_is_refused_and_set_back(node):
    """A 5 GiB heap under a 4 GiB quota: cuCtxSetLimit returns out-of-memory
    and the heap keeps its old size (the simulated device has 16 GiB, so
    only the quota stops it)."""
    out = client(
        node,
        f"""
init()
base = used()
err = call(cu.cuCtxSetLimit, {HEAP}, 5 * GiB)[0]
emit(err=err.name, heap=int(ok(cu.cuCtxGetLimit, {HEAP})), base=base, after=used(),
     stack=call(cu.cuCtxSetLimit, cu.CUlimit.CU_LIMIT_STACK_SIZE, 2048)[0].name,
     with_stack=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert (out["err"], out["heap"]) == (OOM, 8 * MiB), out
    assert out["after"] == out["base"], out
    # 1 KiB more stack for 2048 threads on each of the 108 default SMs
    assert out["stack"] == "CUDA_SUCCESS", out
    assert out["with_stack"] == out["base"] + 216 * MiB, out


def test_a_pending_launch_buffer_that_does_not_fit_the_quota_is_refused_and_set_back(node):
    """The device runtime's buffer of pending launches is device memory the
    driver sets aside (CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT; 1 KiB a
    launch in the simulator): 5M launches, 5 GiB, under a 4 GiB quota are
    refused with out-of-memory and the old count kept, as a heap would be;
    1M fit and are charged.  Only the stack, FIFO and heap were checked, so
    the buffer was granted past the quota (the reading after it charged
    it, 5 GiB held under a 4 GiB quota)."""
    out = client(
        node,
        f"""
init()
base = used()
err = call(cu.cuCtxSetLimit, {PENDING}, 5 << 20)[0]
kept = int(ok(cu.cuCtxGetLimit, {PENDING}))
refused = used()
fits = call(cu.cuCtxSetLimit, {PENDING}, 1 << 20)[0]
emit(err=err.name, kept=kept, base=base, refused=refused, fits=fits.name, after=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert (out["err"], out["kept"]) == (OOM, 2048), out
    assert out["refused"] == out["base"], out
    assert out["fits"] == "CUDA_SUCCESS", out
    assert out["after"] == out["base"] + 1 * GiB - 2 * MiB, out


@pytest.mark.parametrize("kernel_us", [0, 300_000, 1_500_000], ids=["reached", "busy", "long"])
def test_a_limit_raised_while_a_stream_ordered_free_is_pending_is_still_measured(node, kernel_us):
    """A 5 GiB heap under a 4 GiB quota, asked for just after cuMemFreeAsync
    of a cuMemAlloc block: the free is in flight until a hook sees its
    stream get there, and no reading of NVML is used meanwhile.  The
    reading that cuCtxSetLimit takes was skipped then, so the heap was
    granted past the quota (whether the stream had reached the free, was
    busy for 0.3 s, or for 1.5 s).  Now the pending frees the streams have
    reached are released before the reading, cuCtxSetLimit waits (a second
    at most) for a reading it can use, and without one it sets the old
    limit back and answers CUDA_ERROR_OUT_OF_MEMORY."""
    out = client(
        node,
        f"""
import ctypes
init()
s = ok(cu.cuStreamCreate, 0)
spin = ok(cu.cuModuleGetFunction, ok(cu.cuModuleLoadData, b"any image"), b"spin")
base = used()
p = ok(cu.cuMemAlloc, 64 * MiB)
if {kernel_us}:
    ok(cu.cuLaunchKernel, spin, 1, 1, 1, 32, 1, 1, 0, s, (({kernel_us},), (ctypes.c_uint32,)), 0)
ok(cu.cuMemFreeAsync, p, s)
err = call(cu.cuCtxSetLimit, {HEAP}, 5 * GiB)[0]
heap = int(ok(cu.cuCtxGetLimit, {HEAP}))
ok(cu.cuStreamSynchronize, s)
fits = call(cu.cuCtxSetLimit, {HEAP}, 2 * GiB)[0]
emit(err=err.name, heap=heap, base=base, fits=fits.name, after=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert (out["err"], out["heap"]) == (OOM, 8 * MiB), out
    assert out["fits"] == "CUDA_SUCCESS", out
    assert out["after"] == out["base"] + 2 * GiB - 8 * MiB, out


def test_a_limit_lowered_while_a_stream_ordered_free_is_pending_gives_its_memory_back(node):
    """A 2 GiB heap is lowered to 8 MiB just after cuMemFreeAsync of a
    cuMemAlloc block queued behind a 0.3 s kernel.  The reading cuCtxSetLimit
    took to give the heap's charge back was skipped while the free was in
    flight, and so was every later one until the stream got there: a 3 GiB
    allocation right after, which fits a 4 GiB quota once the heap is gone,
    was refused.  Now cuCtxSetLimit waits for a reading it can use (a second
    at most) whichever way the limit moves."""
    out = client(
        node,
        f"""
import ctypes
init()
s = ok(cu.cuStreamCreate, 0)
spin = ok(cu.cuModuleGetFunction, ok(cu.cuModuleLoadData, b"any image"), b"spin")
base = used()
ok(cu.cuCtxSetLimit, {HEAP}, 2 * GiB)
heap = used()
p = ok(cu.cuMemAlloc, 64 * MiB)
ok(cu.cuLaunchKernel, spin, 1, 1, 1, 32, 1, 1, 0, s, ((300_000,), (ctypes.c_uint32,)), 0)
ok(cu.cuMemFreeAsync, p, s)
ok(cu.cuCtxSetLimit, {HEAP}, 8 * MiB)
big = call(cu.cuMemAlloc, 3 * GiB)[0]
emit(base=base, heap=heap, big=big.name)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["heap"] == out["base"] + 2 * GiB - 8 * MiB, out
    assert out["big"] == "CUDA_SUCCESS", out


def test_memory_the_driver_takes_while_a_stream_ordered_free_is_always_pending_is_charged(node):
    """A loop that always has a cuMemFreeAsync of a cuMemAlloc block pending
    (2 MiB blocks freed into a stream kept 1 s or more behind, as an async
    allocator's loop keeps one) loads a module, which takes 1 GiB of device
    memory without any call the interposer charges (the simulator's
    GPUVISOR_SIM_MODULE_MIB).  No reading of untracked memory was used while
    any such free was pending, so the module was never charged and an
    allocation that fits the quota only without it passed.  Now the reading
    takes the pending blocks as a range (NVML may show them freed or not)
    and charges what is certain: here everything, since the simulator shows
    them freed, so the container's usage is what the device gave it; and
    when pending blocks are released, their charge going too, it is read
    again at once, so the container's usage is never short of it."""
    out = client(
        node,
        """
import ctypes, time
init()
s = ok(cu.cuStreamCreate, 0)
lib = ok(cu.cuLibraryLoadData, b"any image", None, None, 0, None, None, 0)
spin = ok(cu.cuKernelGetFunction, ok(cu.cuLibraryGetKernel, lib, b"spin"))

def launch(us):
    ok(cu.cuLaunchKernel, spin, 1, 1, 1, 32, 1, 1, 0, s, ((us,), (ctypes.c_uint32,)), 0)

def step():
    p = ok(cu.cuMemAlloc, 2 * MiB)
    launch(40_000)
    ok(cu.cuMemFreeAsync, p, s)
    time.sleep(0.025)
    return used()

base = used()
launch(1_000_000)
for _ in range(10):
    step()
mod = ok(cu.cuModuleLoadData, b"any image")
t0 = time.monotonic()
seen = None
while time.monotonic() - t0 < 2.0:
    u = step()
    if seen is None and u >= base + GiB:
        seen = time.monotonic() - t0
pending = call(cu.cuStreamQuery, s)[0].name
big, q = call(cu.cuMemAlloc, 4 * GiB - base - 512 * MiB)
if big == SUCCESS:
    ok(cu.cuMemFree, q)
big = big.name
short = max(base + GiB - step() for _ in range(20))
ok(cu.cuStreamSynchronize, s)
# Readings come once a second (when CLOCK_MONOTONIC's second changes): 16
# blocks freed behind a kernel that ends 0.15 s into the next second, and a
# second module loaded, are read (NVML shows the blocks freed) just after
# that second begins; the blocks are released by a synchronisation within
# the same second, so no tick reads again for it.
if time.monotonic() % 1 > 0.6:  # leave the frees and the load the rest of a second
    time.sleep(1.05 - time.monotonic() % 1)
edge = int(time.monotonic()) + 1
launch(int((edge + 0.15 - time.monotonic()) * 1e6))
for _ in range(16):
    ok(cu.cuMemFreeAsync, ok(cu.cuMemAlloc, 2 * MiB), s)
mod2 = ok(cu.cuModuleLoadData, b"any image")
time.sleep(max(0.0, edge + 0.02 - time.monotonic()))
read = used()
still = call(cu.cuStreamQuery, s)[0].name
ok(cu.cuStreamSynchronize, s)
settled = used()
same_second = int(time.monotonic()) == edge
ok(cu.cuModuleUnload, mod2)
ok(cu.cuModuleUnload, mod)
time.sleep(1.1)
ok(cu.cuMemFree, ok(cu.cuMemAlloc, 2 * MiB))
emit(base=base, seen=seen, pending=pending, big=big, short=short, read=read, still=still,
     settled=settled, same_second=same_second, unloaded=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
        GPUVISOR_SIM_MODULE_MIB="1024",
    )
    print(out)
    assert out["pending"] == "CUDA_ERROR_NOT_READY", out  # a free was pending throughout
    assert out["seen"] is not None, out  # charged at all
    assert out["seen"] <= 1.5, out  # within the re-read interval (1 s) and a step
    assert out["big"] == OOM, out
    assert out["short"] <= 0, out  # never short of what the device gave, while looping
    assert out["still"] == "CUDA_ERROR_NOT_READY", out
    assert out["read"] == out["base"] + 2 * GiB, out  # 2 GiB less 32 MiB, and the 32 MiB
    # released at the synchronisation, their charge gone: read again at once
    # (same_second: no tick did it; false only on a machine stalled 0.8 s)
    assert out["settled"] == out["base"] + 2 * GiB, out
    assert out["unloaded"] == out["base"], out


@pytest.mark.parametrize(
    ("short", "reader"), [(1, 0), (0, 1)], ids=["dev1-by-dev0", "dev0-by-dev1"]
)
def test_pending_frees_of_another_device_released_by_a_reading_read_that_device_again(
    node, short, reader
):
    """One device (1, or 0) has 16 blocks of 2 MiB freed into a stream
    behind a 0.1 s kernel, and a 1 GiB module (GPUVISOR_SIM_MODULE_MIB)
    loaded meanwhile: a reading of it then (cuCtxSetLimit setting a limit to
    what it is) charges the module only up to what is certain, 32 MiB short
    of it (the simulator shows the blocks freed while they are still
    charged).  Once the kernel is done, a reading of the other device
    (cuCtxSetLimit there) releases the pending frees of every device first,
    the first device's among them, their charge gone, but read only its own
    device after it (as a reading of every device read none again that it
    had read earlier in its loop), so the first device's usage stayed 32 MiB
    short of what the device gave the process until the next second's
    reading, and an allocation 16 MiB past its quota passed.  Now a reading
    that releases another device's frees reads that device again at once.
    Everything happens within one second (same_second), so no once-a-second
    reading makes up for it."""
    out = client(
        node,
        f"""
import ctypes, time
STACK = cu.CUlimit.CU_LIMIT_STACK_SIZE
init({reader})
ctx_reader = ok(cu.cuCtxGetCurrent)
ctx_short = ok(cu.cuDevicePrimaryCtxRetain, ok(cu.cuDeviceGet, {short}))
ok(cu.cuCtxSetCurrent, ctx_short)
s = ok(cu.cuStreamCreate, 0)
lib = ok(cu.cuLibraryLoadData, b"any image", None, None, 0, None, None, 0)
spin = ok(cu.cuKernelGetFunction, ok(cu.cuLibraryGetKernel, lib, b"spin"))
blocks = [ok(cu.cuMemAlloc, 2 * MiB) for _ in range(16)]
time.sleep(1.02 - time.monotonic() % 1)  # just after a second begins
edge = int(time.monotonic())
base = used()  # this second's reading (of every device)
ok(cu.cuLaunchKernel, spin, 1, 1, 1, 32, 1, 1, 0, s, ((100_000,), (ctypes.c_uint32,)), 0)
t0 = time.monotonic()
for p in blocks:
    ok(cu.cuMemFreeAsync, p, s)
mod = ok(cu.cuModuleLoadData, b"any image")
ok(cu.cuCtxSetLimit, STACK, int(ok(cu.cuCtxGetLimit, STACK)))  # reads the short device
during = used()
time.sleep(max(0.0, t0 + 0.15 - time.monotonic()))  # the stream reaches the frees
ok(cu.cuCtxSetCurrent, ctx_reader)
ok(cu.cuCtxSetLimit, STACK, int(ok(cu.cuCtxGetLimit, STACK)))  # reads the other one
ok(cu.cuCtxSetCurrent, ctx_short)
after = used()
truth = base - 32 * MiB + GiB  # the blocks gone, the module there
big, q = call(cu.cuMemAlloc, 4 * GiB - truth + 16 * MiB)
if big == SUCCESS:
    ok(cu.cuMemFree, q)
same_second = int(time.monotonic()) == edge
emit(base=base, during=during, after=after, truth=truth, big=big.name, same_second=same_second)
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
        GPUVISOR_SIM_MODULE_MIB="1024",
    )
    print(out)
    # read while the blocks were pending: the module charged 32 MiB short,
    # the blocks still charged themselves, so the total is right
    assert out["during"] == out["truth"], out
    assert out["same_second"], out  # false only on a machine stalled 0.8 s
    assert out["after"] == out["truth"], out
    assert out["big"] == OOM, out


def test_memory_the_driver_took_counts_for_the_container_until_the_process_dies(node):
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g")
    probe = "init()\nemit(big=call(cu.cuMemAlloc, 2 * GiB)[0].name)\n"
    holder = Holder(PRELUDE + f"init()\nok(cu.cuCtxSetLimit, {HEAP}, 3 * GiB)\nhold()\n", env)
    with holder:
        assert client(node, probe, CUDA_DEVICE_MEMORY_LIMIT="4g") == {"big": OOM}
        holder.kill()
    assert client(node, probe, CUDA_DEVICE_MEMORY_LIMIT="4g") == {"big": "CUDA_SUCCESS"}


# --- which limit applies to which device --------------------------------------

TOTALS = """
ok(cu.cuInit, 0)
n = ok(cu.cuDeviceGetCount)
emit(
    totals=[ok(cu.cuDeviceTotalMem, ok(cu.cuDeviceGet, i)) for i in range(n)],
    uuids=[uuid(i) for i in range(n)],
)
"""


def test_per_device_limit_overrides_global(node):
    out = client(node, TOTALS, CUDA_DEVICE_MEMORY_LIMIT="4g", CUDA_DEVICE_MEMORY_LIMIT_1="2g")
    assert out["totals"] == [4 * GiB, 2 * GiB]
    out = client(
        node,
        "init(1)\nfree, total = mem_info()\nemit(free=free, total=total)",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
        CUDA_DEVICE_MEMORY_LIMIT_1="2g",
    )
    assert out["total"] == 2 * GiB
    assert out["free"] == 2 * GiB - SIM_CONTEXT


def test_visible_devices_reorder_limits(node):
    # Node order and UUIDs, from the simulator without the shim.
    plain = run_json(PRELUDE + TOTALS, node.env)
    assert plain["totals"] == [16 * GiB, 16 * GiB]
    out = client(
        node,
        TOTALS,
        CUDA_VISIBLE_DEVICES="1,0",
        CUDA_DEVICE_MEMORY_LIMIT_0="2g",
        CUDA_DEVICE_MEMORY_LIMIT_1="3g",
    )
    # Ordinal 0 is node device 1: limit _0 applies to it.
    assert out["uuids"] == [plain["uuids"][1], plain["uuids"][0]]
    assert out["totals"] == [2 * GiB, 3 * GiB]


def test_percentage_limit(node):
    out = client(node, TOTALS, CUDA_DEVICE_MEMORY_LIMIT="25%")
    assert out["totals"] == [4 * GiB, 4 * GiB]


# The quota seen, and whether 5 GiB can be allocated (4 GiB limits below).
TOTAL_AND_5G = """
init()
free, total = mem_info()
err, _ = call(cu.cuMemAlloc, 5 * GiB)
emit(total=total, big=err.name)
"""


def test_disable_control_passes_through(node):
    out = client(
        node,
        TOTAL_AND_5G,
        CUDA_DEVICE_MEMORY_LIMIT="4g",
        CUDA_DISABLE_CONTROL="true",
    )
    assert out["total"] == 16 * GiB
    assert out["big"] == "CUDA_SUCCESS"


@pytest.mark.parametrize("value", ["true", "1"])
def test_oversubscribe_keeps_the_quota(node, value):
    """With CUDA_OVERSUBSCRIBE=true (HAMi's device plugin sets it) the quota
    still holds: an allocation past it is refused.  What changes is where
    the memory under it lives (tests/test_oversubscribe.py)."""
    proc = run_py(
        PRELUDE + TOTAL_AND_5G,
        node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g", CUDA_OVERSUBSCRIBE=value),
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"total": 4 * GiB, "big": OOM}
    assert "CUDA_OVERSUBSCRIBE" not in proc.stderr


def test_oversubscribe_false_says_nothing(node):
    proc = run_py(
        PRELUDE + "init()\nemit(total=mem_info()[1])\n",
        node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g", CUDA_OVERSUBSCRIBE="false"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "CUDA_OVERSUBSCRIBE" not in proc.stderr


# --- NVML (nvidia-ml-py) -------------------------------------------------------

NVML = """
import pynvml
pynvml.nvmlInit()
def nvml_mem(index, v2=False):
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    m = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2) if v2 else \\
        pynvml.nvmlDeviceGetMemoryInfo(h)
    u = pynvml.nvmlDeviceGetUUID(h)
    return dict(total=m.total, used=m.used, free=m.free,
                uuid=u.decode() if isinstance(u, bytes) else u)
"""


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_nvml_shows_quota_and_container_usage(node, v2):
    out = client(
        node,
        NVML
        + f"""
init()
ptr = ok(cu.cuMemAlloc, 1 * GiB)
emit(cuda_used=used(), mem=[nvml_mem(i, {v2}) for i in range(2)], uuid0=uuid(0))
""",
        CUDA_DEVICE_MEMORY_LIMIT_0="4g",
    )
    limited, other = out["mem"]
    assert limited["uuid"] == out["uuid0"]
    assert limited["total"] == 4 * GiB
    assert limited["used"] == out["cuda_used"] == SIM_CONTEXT + 1 * GiB
    if not v2:
        assert limited["free"] == limited["total"] - limited["used"]
    # Device 1 has no limit: physical numbers pass through.
    assert other["total"] == 16 * GiB


def test_nvml_shows_graph_pools_and_driver_taken_memory(node):
    """What nvidia-smi reads (NVML memory info) counts a graph's pool and a
    device heap like any allocation."""
    out = client(
        node,
        NVML
        + GRAPH_OF
        + f"""
init()
base = nvml_mem(0)["used"]
e, s, _ = graph_of(1 * GiB)
ok(cu.cuGraphLaunch, e, s)
ok(cu.cuCtxSetLimit, {HEAP}, 512 * MiB)
emit(base=base, after=nvml_mem(0)["used"], cuda_used=used())
""",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    assert out["after"] == out["cuda_used"] == out["base"] + 1 * GiB + 504 * MiB, out


def test_nvml_matches_devices_by_uuid(node):
    """CUDA_VISIBLE_DEVICES=1: the container's ordinal 0 is NVML index 1."""
    out = client(
        node,
        NVML + "emit(mem=[nvml_mem(i) for i in range(2)])",
        CUDA_VISIBLE_DEVICES="1",
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    invisible, visible = out["mem"]
    assert visible["total"] == 4 * GiB
    assert invisible["total"] == 16 * GiB


# Two devices whose UUIDs share the prefix GPU-aaaa.
TWINS = (
    "16g:uuid=GPU-aaaa0000-0000-0000-0000-000000000000,"
    "16g:uuid=GPU-aaaa1111-0000-0000-0000-000000000000"
)


@pytest.mark.parametrize(
    "visible",
    [
        "1 ,0",
        "1,\t0 ",
        "1,1,0",
        "0,,1",
        "gpu-aaaa1111,0",
        "GPU-aaaa",
        "GPU-aaaa1,GPU-aaaa",
        "0,x,1",
    ],
)
def test_nvml_only_process_counts_ordinals_as_the_driver_does(tmp_path, build_dir, visible):
    """A process that has used only NVML matches NVML devices to CUDA
    ordinals from CUDA_VISIBLE_DEVICES itself.  It must read the list as
    the driver does (blanks around entries, UUID prefixes in any case, an
    ambiguous prefix, a repeated or invalid entry ends the list): a device
    given another ordinal's limit keeps that limit in the region for the
    whole container, and a device the driver hides must not get one."""
    node = SimNode.create(tmp_path, devices=TWINS)
    limits = {
        "CUDA_VISIBLE_DEVICES": visible,
        "CUDA_DEVICE_MEMORY_LIMIT": "4g",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "2g",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "3g",
    }
    # The driver's own order (the simulator without the library).
    plain = run_json(
        PRELUDE
        + "n = ok(cu.cuDeviceGetCount) if call(cu.cuInit, 0)[0] == SUCCESS else 0\n"
        + "emit(uuids=[uuid(i) for i in range(n)])",
        {**node.env, "CUDA_VISIBLE_DEVICES": visible},
    )["uuids"]
    quota = [2 * GiB, 3 * GiB] + [4 * GiB] * 8
    # First in the container: a process that only asks NVML.
    out = client(node, NVML + "emit(mem=[nvml_mem(i) for i in range(2)])", **limits)
    for mem in out["mem"]:
        want = quota[plain.index(mem["uuid"])] if mem["uuid"] in plain else 16 * GiB
        assert mem["total"] == want, (visible, plain, out)
    # The limits it put in the region are those of the CUDA ordinals.
    if plain:
        out = client(node, TOTALS, **limits)
        assert out["uuids"] == plain
        assert out["totals"] == quota[: len(plain)]


def test_nvml_in_second_process_sees_first_process_usage(node):
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g")
    with Holder(PRELUDE + "init()\np = ok(cu.cuMemAlloc, 1 * GiB)\nhold(used=used())", env) as a:
        out = run_json(PRELUDE + NVML + "emit(mem=nvml_mem(0))", env)
    assert out["mem"]["total"] == 4 * GiB
    assert out["mem"]["used"] == a["used"] == SIM_CONTEXT + 1 * GiB


# --- several processes of one container share the quota ------------------------


def test_second_process_sees_first_process_usage(node):
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g")
    with Holder(PRELUDE + "init()\np = ok(cu.cuMemAlloc, 1 * GiB)\nhold(used=used())", env):
        out = run_json(
            PRELUDE + "init()\nfree, total = mem_info()\nemit(free=free, total=total)", env
        )
    assert out["total"] == 4 * GiB
    assert out["free"] == 4 * GiB - 2 * SIM_CONTEXT - 1 * GiB


def test_two_processes_share_one_quota(node):
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g")
    with Holder(PRELUDE + "init()\np = ok(cu.cuMemAlloc, 3 * GiB)\nhold()", env):
        out = run_json(
            PRELUDE
            + """
init()
big, _ = call(cu.cuMemAlloc, 2 * GiB)
small, _ = call(cu.cuMemAlloc, 512 * MiB)
emit(big=big.name, small=small.name)
""",
            env,
        )
    assert out == {"big": OOM, "small": "CUDA_SUCCESS"}


# --- fail closed ---------------------------------------------------------------

BAD_LIMITS = [
    ("CUDA_DEVICE_MEMORY_LIMIT", "abc"),
    ("CUDA_DEVICE_MEMORY_LIMIT", "-1"),
    ("CUDA_DEVICE_MEMORY_LIMIT", "0"),
    ("CUDA_DEVICE_MEMORY_LIMIT", "12q"),
    ("CUDA_DEVICE_MEMORY_LIMIT", "150%"),
    ("CUDA_DEVICE_MEMORY_LIMIT", "1.5.5g"),
    ("CUDA_DEVICE_MEMORY_LIMIT_1", "abc"),
    ("CUDA_DEVICE_MEMORY_LIMIT_x", "1g"),
    ("CUDA_DEVICE_MEMORY_LIMIT_", "1g"),
]

TRY_EVERYTHING = """
res = {"init": call(cu.cuInit, 0)[0].name}
allocs = []
err, dev = call(cu.cuDeviceGet, 0)
if err == SUCCESS:
    err, ctx = call(cu.cuDevicePrimaryCtxRetain, dev)
    if err == SUCCESS:
        call(cu.cuCtxSetCurrent, ctx)
allocs.append(call(cu.cuMemAlloc, 1 * MiB)[0].name)
allocs.append(call(cu.cuMemAllocManaged, 1 * MiB, 1)[0].name)
res["allocs"] = allocs
emit(**res)
"""


@pytest.mark.parametrize(("var", "value"), BAD_LIMITS, ids=[f"{v}={x}" for v, x in BAD_LIMITS])
def test_bad_limit_fails_closed(node, var, value):
    proc = run_py(PRELUDE + TRY_EVERYTHING, node.shimmed(**{var: value}))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["init"] == NOT_PERMITTED
    assert "CUDA_SUCCESS" not in out["allocs"]
    naming = [line for line in proc.stderr.splitlines() if var in line and value in line]
    assert len(naming) == 1, proc.stderr


def test_bad_limit_fails_closed_in_nvml(node):
    out = client(
        node,
        NVML
        + """
h = pynvml.nvmlDeviceGetHandleByIndex(0)
try:
    pynvml.nvmlDeviceGetMemoryInfo(h)
    emit(error=None)
except pynvml.NVMLError as e:
    emit(error=e.value)
""",
        CUDA_DEVICE_MEMORY_LIMIT="abc",
    )
    assert out["error"] == 4  # NVML_ERROR_NO_PERMISSION


def test_corrupt_region_fails_closed(node):
    node.region.write_bytes(b"this is not a gpuvisor region\n" * 100)
    proc = run_py(PRELUDE + TRY_EVERYTHING, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["init"] == NOT_PERMITTED
    assert "CUDA_SUCCESS" not in out["allocs"]
    assert str(node.region) in proc.stderr


# Takes 3 GiB on device 0 through ctypes (no imports from the checkout: it
# runs in a directory of its own), prints the codes, then waits for stdin.
TAKE_3G = """
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
codes = [cu.cuInit(0)]
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
codes.append(cu.cuDeviceGet(ctypes.byref(dev), 0))
codes.append(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
codes.append(cu.cuCtxSetCurrent(ctx))
codes.append(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(3 << 30)))
print(*codes, flush=True)
sys.stdin.readline()
"""


def test_relative_region_path_fails_closed(node, tmp_path):
    """A relative CUDA_DEVICE_MEMORY_SHARED_CACHE names another file in
    each working directory: two processes of one container would each get
    the whole quota.  Refused, with one line naming it; no file is made."""
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g", CUDA_DEVICE_MEMORY_SHARED_CACHE="r.shr")
    procs = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-S", "-c", TAKE_3G],
                    cwd=tmp_path / name,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
            assert procs[-1].stdout is not None
            codes = procs[-1].stdout.readline().split()
            # Never 3 GiB each out of one 4 GiB quota; in fact nothing.
            assert codes[0] == "800", codes
            assert codes[-1] != "0", codes
    finally:
        outs = [p.communicate("\n", timeout=30) for p in procs]
    for _, err in outs:
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert 'CUDA_DEVICE_MEMORY_SHARED_CACHE="r.shr": not an absolute path' in lines[0]
    assert not list(tmp_path.glob("*/r.shr*"))


# --- the same on a real GPU (skipped without one) --------------------------------


@pytest.mark.gpu
def test_real_gpu_quota(tmp_path):
    env = clean_env()
    env.update(
        LD_PRELOAD=str(LIBRARY),
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "region.shr"),
        CUDA_DEVICE_MEMORY_LIMIT="4g",
    )
    out = run_json(
        PRELUDE
        + """
init()
free, total = mem_info()
over, _ = call(cu.cuMemAlloc, 5 * GiB)
p = ok(cu.cuMemAlloc, 1 * GiB)
grown = used()
ok(cu.cuMemFree, p)
emit(free=free, total=total, over=over.name, grown=grown, after=used())
""",
        env,
    )
    assert out["total"] == 4 * GiB
    assert 0 < out["free"] < 4 * GiB  # the context's real charge is counted
    assert out["over"] == OOM
    assert out["grown"] >= 4 * GiB - out["free"] + 1 * GiB
    assert out["after"] == 4 * GiB - out["free"]
