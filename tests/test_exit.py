"""A process's memory leaves the container's usage when the process does.

Normal exit: the library gives its slot back in a destructor, so the next
reader sees the memory gone at once.  SIGKILL: the usage reports (cuMemGetInfo,
NVML) reclaim dead processes' slots at most a second later.  Nobody has to
call gv_reclaim_dead().
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from tests.helpers import LIBRARY, SIM_DIR, GiB, Holder, MiB, SimNode, run_json

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


# A library whose constructor allocates 1 GiB through the shim and whose
# destructor frees it: preloaded after libgpuvisor.so, its destructor runs
# after the shim's (which gives the process's slot back).
LATE_FREE_C = r"""
#include <stddef.h>
#include <stdio.h>
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
static CUdeviceptr held;
__attribute__((constructor)) static void early(void)
{
    CUdevice d;
    CUcontext c;
    int rc = cuInit(0) || cuDeviceGet(&d, 0) || cuDevicePrimaryCtxRetain(&c, d) ||
             cuCtxSetCurrent(c) || cuMemAlloc_v2(&held, 1u << 30);
    fprintf(stderr, "alloc %d\n", rc);
}
__attribute__((destructor)) static void late(void)
{
    fprintf(stderr, "free %d\n", cuMemFree_v2(held));
}
"""


def test_a_free_after_the_slot_was_given_back_is_not_an_accounting_bug(
    node: SimNode, tmp_path: Path
) -> None:
    """Memory freed after the shim's destructor gave the slot back (by a
    library whose destructor runs later, or a thread still running while
    the process exits) registered the process anew to take the bytes from
    its new, empty slot: an "accounting bug" error at every such exit, and
    the exited process listed in the region until someone reclaimed it."""
    src, lib = tmp_path / "late_free.c", tmp_path / "late_free.so"
    src.write_text(LATE_FREE_C)
    cc = os.environ.get("CC", "cc")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(lib), str(src), f"-L{SIM_DIR}", "-l:libcuda.so.1"],
        check=True,
    )
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g", LD_PRELOAD=f"{LIBRARY} {lib}")
    proc = subprocess.run(["true"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stderr.splitlines() == ["alloc 0", "free 0"]  # nothing from the shim
    assert run_json(USAGE, node.env) == {"used": 0, "procs": []}


PROBER = """
import sys, time
from tests.cuclient import *
init()
# The quota is full: refusals, so the last look for dead processes is recent.
refused = [call(cu.cuMemAlloc, 2 * GiB)[0].name for _ in range(200)]
hold(refused=sorted(set(refused)))
time.sleep(0.01)  # past the coarse clock's tick (1-4 ms): a quick look is due
t0 = time.monotonic()
tries = 0
while True:
    tries += 1
    err, _ = call(cu.cuMemAlloc, 2 * GiB)
    if err.name == "CUDA_SUCCESS" or time.monotonic() - t0 > 3:
        break
    time.sleep(0.001)
emit(err=err.name, tries=tries, seconds=time.monotonic() - t0)
"""


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _retry_after_kill(node: SimNode, reap: bool) -> dict[str, object]:
    """A holder of 3 GiB under a 4 GiB quota, a prober refused 200 times,
    the holder SIGKILLed (reaped, or left a zombie), then the prober's
    retries: what the first success took."""
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="4g")
    holder = Holder("from tests.cuclient import *\ninit()\nok(cu.cuMemAlloc, 3 * GiB)\nhold()", env)
    with holder:
        prober = Holder(PROBER, env)
        with prober as probed:
            assert probed["refused"] == ["CUDA_ERROR_OUT_OF_MEMORY"]
            if reap:
                holder.kill()
            else:
                assert holder.proc is not None
                holder.proc.kill()
                deadline = time.monotonic() + 10
                while _proc_state(holder.pid) != "Z" and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert _proc_state(holder.pid) == "Z"
            assert prober.proc is not None
            assert prober.proc.stdin is not None
            prober.proc.stdin.write("\n")
            prober.proc.stdin.flush()
            out, _ = prober.proc.communicate(timeout=30)
            if not reap:
                assert _proc_state(holder.pid) == "Z"  # still not reaped
    result: dict[str, object] = json.loads(out.splitlines()[-1])
    return result


def test_a_refused_allocation_takes_a_killed_and_reaped_process_memory_at_once(
    node: SimNode,
) -> None:
    """A process killed and reaped (its parent's wait() returned) no longer
    has a pid: a refusal checks that for each process holding memory (one
    kill(pid, 0) each; at most once per clock tick in each process, 1-4 ms),
    so the next allocation a tick later gets its memory,
    however recent the last full look for dead processes was (CI once
    failed a graph-memory test here: a second process ran within 100 ms of
    the first one's refusal and was refused the killed process's memory)."""
    result = _retry_after_kill(node, reap=True)
    assert result["err"] == "CUDA_SUCCESS", result
    assert result["tries"] == 1, result


def test_a_refused_allocation_takes_a_killed_zombie_memory_within_a_second(
    node: SimNode,
) -> None:
    """A killed process not yet reaped (a zombie: its pid still exists) is
    found by the full look, which a refusal makes at most every 100 ms per
    device, container-wide, not on every refusal (it reads /proc: that
    made a refusal cost O(processes)): a program that keeps retrying still
    gets that memory within a second."""
    result = _retry_after_kill(node, reap=False)
    assert result["err"] == "CUDA_SUCCESS", result
    assert result["seconds"] < 1.0, result  # type: ignore[operator]
