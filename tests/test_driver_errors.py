"""The driver's own failures pass through the shim and leave no charge behind.

Uses the simulator's fault knobs: GPUVISOR_SIM_FAIL_ALLOC_AT=N makes the
N-th allocating call fail with CUDA_ERROR_OUT_OF_MEMORY (a physical
out-of-memory), GPUVISOR_SIM_NVML_FAIL makes NVML functions fail.
"""

from __future__ import annotations

from tests.helpers import MiB, SimNode, run_json

FAILED_ALLOC = """
from tests.cuclient import *
from gpuvisor.shim.region import Region
init()                                         # context: not an allocation call
base = used()
a = ok(cu.cuMemAlloc, 64 * MiB)                # 1st allocation
err, b = call(cu.cuMemAlloc, 64 * MiB)         # 2nd: the driver refuses
after_fail = used()
c = ok(cu.cuMemAlloc, 64 * MiB)                # 3rd
ok(cu.cuMemFree, a); ok(cu.cuMemFree, c)
bogus = call(cu.cuMemFree, 0xdead0000)[0]      # never allocated: driver's answer
r = Region.attach()
emit(err=err.name, base=base, after_fail=after_fail, end=used(), bogus=bogus.name,
     region=r.devices()[0].used)
"""


def test_driver_failure_leaves_no_charge(node: SimNode) -> None:
    out = run_json(
        FAILED_ALLOC, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g", GPUVISOR_SIM_FAIL_ALLOC_AT="2")
    )
    assert out["err"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert out["after_fail"] == out["base"] + 64 * MiB  # the refused one is not charged
    assert out["end"] == out["base"]
    assert out["region"] == 32 * MiB  # only the context remains
    assert out["bogus"] == "CUDA_ERROR_INVALID_VALUE"  # untracked free: the driver decides


NVML = """
import pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
try:
    pynvml.nvmlDeviceGetMemoryInfo(h)
    code = 0
except pynvml.NVMLError as e:
    code = e.value
emit(code=code)
"""


def test_nvml_errors_pass_through(node: SimNode) -> None:
    out = run_json(
        "from tests.cuclient import emit\n" + NVML,
        node.shimmed(
            CUDA_DEVICE_MEMORY_LIMIT="4g", GPUVISOR_SIM_NVML_FAIL="nvmlDeviceGetMemoryInfo"
        ),
    )
    assert out["code"] == 999  # NVML_ERROR_UNKNOWN from the driver, unchanged
