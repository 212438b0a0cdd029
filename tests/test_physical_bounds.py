"""The quota view never shows more memory than the device physically has.

- A quota larger than the device reports the device's size.
- When something outside the container (here: a process without the shim,
  e.g. another tenant) holds physical memory, free is capped by what is
  physically free, in CUDA and in NVML.
"""

from __future__ import annotations

from tests.helpers import GiB, Holder, MiB, SimNode, run_json

VIEW = """
import pynvml
from tests.cuclient import *
init()
free, total = mem_info()
pynvml.nvmlInit()
m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
emit(free=free, total=total, device_total=ok(cu.cuDeviceTotalMem, 0),
     nvml_total=m.total, nvml_free=m.free)
"""

CTX = 32 * MiB


def test_quota_above_physical_reports_physical(node: SimNode) -> None:
    out = run_json(VIEW, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="64g"))
    assert out["total"] == 16 * GiB
    assert out["device_total"] == 16 * GiB
    assert out["nvml_total"] == 16 * GiB
    assert out["free"] == 16 * GiB - CTX


def test_free_is_capped_by_physical_free(node: SimNode) -> None:
    # Another tenant, outside the container, takes 14 GiB of the 16 GiB device.
    other = Holder(
        "from tests.cuclient import *\ninit()\nok(cu.cuMemAlloc, 14 * GiB)\nhold()", node.env
    )
    with other:
        out = run_json(VIEW, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g"))
    physical_free = 16 * GiB - (14 * GiB + CTX) - CTX
    assert out["total"] == 4 * GiB
    assert out["free"] == physical_free  # < the 4 GiB - 32 MiB the quota alone would allow
    assert out["nvml_total"] == 4 * GiB
    assert out["nvml_free"] == physical_free
