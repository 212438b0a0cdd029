"""A process's memory leaves the container's usage when the process does.

Normal exit: the library gives its slot back in a destructor, so the next
reader sees the memory gone at once.  SIGKILL: the usage reports (cuMemGetInfo,
NVML) reclaim dead processes' slots at most a second later.  Nobody has to
call gv_reclaim_dead().
"""

from __future__ import annotations

import time

from tests.helpers import GiB, Holder, MiB, SimNode, run_json

USAGE = """
import json
from gpuvisor.shim.region import Region
r = Region.attach()
print(json.dumps({"used": r.devices()[0].used, "procs": r.processes()}))
"""

CTX = 32 * MiB


def test_normal_exit_releases_at_once(node: SimNode) -> None:
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g")
    run_json("from tests.cuclient import *\ninit()\nok(cu.cuMemAlloc, 1 * GiB)\nemit()", env)
    after = run_json(USAGE, node.env)  # no shim, no reclaim: just read
    assert after == {"used": 0, "procs": []}


def test_killed_process_leaves_usage_reports_within_a_second(node: SimNode) -> None:
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g")
    holder = Holder("from tests.cuclient import *\ninit()\nok(cu.cuMemAlloc, 1 * GiB)\nhold()", env)
    with holder:
        holder.kill()
    time.sleep(1.2)
    out = run_json(
        "from tests.cuclient import *\ninit()\nfree, total = mem_info()\nemit(free=free)", env
    )
    assert out["free"] == 4 * GiB - CTX  # only this process's own context
