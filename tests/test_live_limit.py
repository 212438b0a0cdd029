"""A limit changed while the workload runs applies to its next allocation.

The workload (cuda-python under the shim) holds 2 GiB of a 4 GiB quota.
Another process — as the supervisor would — lowers the limit to 1 GiB
through the region API: the workload now sees a 1 GiB device with 0 free
(not a wrapped-around 17 TB), and its next allocation is refused; frees still
work.  Raising the limit to 8 GiB lets a 5 GiB allocation through.
"""

from __future__ import annotations

from tests.helpers import GiB, MiB, SimNode, answer, run_json, start_piped

WORKLOAD = """
import json, sys
import pynvml
from tests.cuclient import *
init()
pynvml.nvmlInit()
nv = pynvml.nvmlDeviceGetHandleByIndex(0)
held = [ok(cu.cuMemAlloc, 2 * GiB)]
def report(**extra):
    free, total = mem_info()
    m = pynvml.nvmlDeviceGetMemoryInfo(nv)
    print(json.dumps(dict(free=free, total=total, nvml_total=m.total, nvml_free=m.free,
                          nvml_used=m.used, **extra)), flush=True)
report()
for line in sys.stdin:
    cmd, arg = line.split()
    if cmd == "alloc":
        err, p = call(cu.cuMemAlloc, int(arg))
        if err == SUCCESS:
            held.append(p)
        report(alloc=err.name)
    elif cmd == "free":
        ok(cu.cuMemFree, held.pop())
        report()
"""

SET_LIMIT = """
from gpuvisor.shim.region import Region
r = Region.attach()
r.set_limit(0, {limit})
print('{{"limit": %d}}' % r.devices()[0].limit)
"""

CTX = 32 * MiB


def test_live_limit_change(node: SimNode) -> None:
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g")
    proc = start_piped(WORKLOAD, env)
    assert proc.stdin is not None
    try:
        start = answer(proc)
        assert start["total"] == 4 * GiB
        assert start["free"] == 4 * GiB - 2 * GiB - CTX

        assert run_json(SET_LIMIT.format(limit=1 * GiB), env)["limit"] == 1 * GiB
        low = answer(proc, "alloc 67108864")
        assert low["alloc"] == "CUDA_ERROR_OUT_OF_MEMORY"
        assert low["total"] == 1 * GiB
        assert low["free"] == 0  # usage above the new limit: 0, never a wrap-around
        assert low["nvml_total"] == 1 * GiB
        assert low["nvml_free"] == 0
        assert low["nvml_used"] == 1 * GiB  # shown clamped to the total
        freed = answer(proc, "free 0")  # frees always succeed
        assert freed["free"] == 1 * GiB - CTX

        assert run_json(SET_LIMIT.format(limit=8 * GiB), env)["limit"] == 8 * GiB
        high = answer(proc, f"alloc {5 * GiB}")
        assert high["alloc"] == "CUDA_SUCCESS"
        assert high["total"] == 8 * GiB
        assert high["free"] == 8 * GiB - 5 * GiB - CTX
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert proc.returncode == 0
