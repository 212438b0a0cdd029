"""Children that fork or exec register in the region correctly.

fork: the child is a new process with its own slot (and its own usage);
the parent's allocations stay the parent's.
exec: the new image keeps the PID; the old image's memory died with it, so
its slot is reset and reused, never counted twice.
"""

from __future__ import annotations

from tests.helpers import GiB, MiB, SimNode, run_json, run_py

FORK = """
import json, os
from tests.cuclient import *
from gpuvisor.shim.region import Region
# CUDA cannot be carried across fork, so (as with multiprocessing's fork
# start method) the parent forks before it initialises CUDA; the library
# itself is already loaded and set up in both.
go_child, go_child_w = os.pipe()
report_r, report_w = os.pipe()
done_r, done_w = os.pipe()
pid = os.fork()
if pid == 0:
    os.read(go_child, 1)
    init()
    b = ok(cu.cuMemAlloc, 256 * MiB)
    f, t = mem_info()
    os.write(report_w, json.dumps({"free": f, "total": t, "pid": os.getpid()}).encode())
    os.read(done_r, 1)
    os._exit(0)
init()
a = ok(cu.cuMemAlloc, 1 * GiB)
os.write(go_child_w, b"x")
child = json.loads(os.read(report_r, 4096))
reg = Region.attach()
during = {str(p): reg.process_used(p, 0) for p in reg.processes()}
os.write(done_w, b"x")
os.waitpid(pid, 0)
reg.reclaim_dead()
emit(child=child, parent=os.getpid(), during=during,
     after_used=reg.devices()[0].used, procs=reg.processes())
"""

EXEC_FIRST = """
import os, sys
from tests.cuclient import *
init()
a = ok(cu.cuMemAlloc, 1 * GiB)
os.execv(sys.executable, [sys.executable, "-c", sys.argv[1]])
"""

EXEC_SECOND = """
import os
from tests.cuclient import *
from gpuvisor.shim.region import Region
reg = Region.attach()
before = reg.devices()[0].used if reg.devices() else 0
init()
b = ok(cu.cuMemAlloc, 512 * MiB)
emit(pid=os.getpid(), procs=reg.processes(), used=reg.devices()[0].used,
     mine=reg.process_used(os.getpid(), 0), before=before, free=mem_info()[0])
"""

CTX = 32 * MiB  # what a simulated context takes, charged to the quota


def test_fork_child_gets_its_own_slot(node: SimNode) -> None:
    out = run_json(FORK, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g"))
    # The child saw the parent's 1 GiB + context, plus its own 256 MiB + context.
    assert out["child"]["total"] == 4 * GiB
    assert out["child"]["free"] == 4 * GiB - (1 * GiB + CTX) - (256 * MiB + CTX)
    assert out["during"] == {
        str(out["parent"]): 1 * GiB + CTX,
        str(out["child"]["pid"]): 256 * MiB + CTX,
    }
    # The child has exited: its slot was reclaimed, only the parent remains.
    assert out["procs"] == [out["parent"]]
    assert out["after_used"] == 1 * GiB + CTX


def test_exec_resets_the_old_image(node: SimNode) -> None:
    import textwrap

    proc = run_py(
        EXEC_FIRST,
        node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g"),
        args=[textwrap.dedent(EXEC_SECOND)],
    )
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["procs"] == [out["pid"]]
    # The pre-exec image's 1 GiB is gone: only the new image's usage counts.
    assert out["mine"] == 512 * MiB + CTX
    assert out["used"] == 512 * MiB + CTX
    assert out["free"] == 4 * GiB - (512 * MiB + CTX)


EXEC_AWAY = """
import os
from tests.cuclient import *
init()
a = ok(cu.cuMemAlloc, 512 * MiB)
os.execv("/bin/sh", ["sh", "-c", "echo ready; read line"])
"""

ALLOC_600 = """
from tests.cuclient import *
init()
err = call(cu.cuMemAlloc, 600 * MiB)[0]
emit(err=err.name)
"""


def alloc_600_beside(node: SimNode, code: str, *args: str) -> str:
    """What cuMemAlloc of 600 MiB answers under a 1 GiB quota while code
    (started with args, holding 512 MiB and then exec()ing) waits."""
    from tests.helpers import start_ready

    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g")
    away = start_ready(code, env, *args)
    try:
        out = run_json(ALLOC_600, env)
    finally:
        away.kill()
        away.communicate(timeout=30)
    return str(out["err"])


def test_exec_into_a_program_without_the_gpu_gives_the_memory_back(node: SimNode) -> None:
    """A process that allocates and then exec()s a program that never uses
    the GPU keeps its pid and start time, but the driver freed its memory
    at exec: the others may use it.  Before, its slot stayed charged until
    that program ended (a 600 MiB allocation next to it failed under a
    1 GiB quota)."""
    assert alloc_600_beside(node, EXEC_AWAY) == "CUDA_SUCCESS"


EXEC_NVML = """
import os, sys
from tests.cuclient import *
init()
a = ok(cu.cuMemAlloc, 512 * MiB)
os.execv(sys.executable, [sys.executable, "-c", sys.argv[1]])
"""

# What the process runs after exec(): no CUDA, only NVML's memory figures,
# through the shim it still preloads (LD_PRELOAD is inherited), as a
# monitoring tool does.
NVML_MONITOR = """
import pynvml
pynvml.nvmlInit()
m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
print("ready", flush=True)
input()
"""


def test_exec_into_an_nvml_program_under_the_shim_gives_the_memory_back(node: SimNode) -> None:
    """As above, but the program exec() runs loads the shim too and asks
    NVML for memory figures, so it maps the region: the others could no
    longer tell it from the old image, and the old image's 512 MiB stayed
    charged for as long as it ran (a 600 MiB allocation next to it failed
    under a 1 GiB quota).  The new image drops the old image's slot when
    it attaches."""
    assert alloc_600_beside(node, EXEC_NVML, NVML_MONITOR) == "CUDA_SUCCESS"
