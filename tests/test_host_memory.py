"""Page-locked host memory takes no device quota.

cuMemAllocHost, cuMemHostAlloc (what cudaHostAlloc and PyTorch's pinned
memory call) and cuMemHostRegister pin host pages; a mapped one
(CU_MEMHOSTALLOC_DEVICEMAP) gets a device address through
cuMemHostGetDevicePointer, but no device memory.  None of it may count
against the container's device quota, nor show in cuMemGetInfo or NVML.
The simulated driver lacked cuMemHostAlloc, cuMemHostRegister,
cuMemHostUnregister and cuMemHostGetDevicePointer (cuda-python raised
FunctionNotFoundError), so no client could check it.
"""

from __future__ import annotations

from tests.helpers import MiB, SimNode, run_json

PRELUDE = "from tests.cuclient import *\n"
SIM_CONTEXT = 32 * MiB

HOST = """
import ctypes, mmap
import pynvml
from gpuvisor.shim.region import Region
init()
pynvml.nvmlInit()
nvml = pynvml.nvmlDeviceGetHandleByIndex(0)
def seen():
    return dict(used=used(), region=Region.attach().used(0),
                nvml=pynvml.nvmlDeviceGetMemoryInfo(nvml).used)
base = seen()
N = 512 * MiB
a = ok(cu.cuMemAllocHost, N)
b = ok(cu.cuMemHostAlloc, N, cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP)
mapped = int(ok(cu.cuMemHostGetDevicePointer, b, 0))
buf = mmap.mmap(-1, N)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
ok(cu.cuMemHostRegister, addr, N, cu.CU_MEMHOSTREGISTER_DEVICEMAP)
twice = call(cu.cuMemHostRegister, addr, N, 0)[0].name
held = seen()
err, d = call(cu.cuMemAlloc, 900 * MiB)            # the whole quota is still there
if err == SUCCESS:
    ok(cu.cuMemFree, d)
ok(cu.cuMemHostUnregister, addr)
unregistered = call(cu.cuMemHostUnregister, addr)[0].name
ok(cu.cuMemFreeHost, a)
ok(cu.cuMemFreeHost, b)
emit(base=base, held=held, device=err.name, mapped=mapped != 0, twice=twice,
     unregistered=unregistered, end=seen())
"""


def test_pinned_host_memory_takes_no_device_quota(node: SimNode) -> None:
    out = run_json(PRELUDE + HOST, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"))
    assert out["base"] == {"used": SIM_CONTEXT, "region": SIM_CONTEXT, "nvml": SIM_CONTEXT}
    # 1.5 GiB of pinned host memory under a 1 GiB quota: none of it charged.
    assert out["held"] == out["base"], out
    assert out["device"] == "CUDA_SUCCESS", out
    assert out["mapped"], out
    assert out["twice"] == "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", out
    assert out["unregistered"] == "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", out
    assert out["end"] == out["base"], out
