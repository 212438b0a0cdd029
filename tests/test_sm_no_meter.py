"""The SM quota when the meter thread cannot be started.

A process that cannot create threads (a container at its pids limit; here
its address space is capped, so no thread stack can be mapped) cannot run
the meter thread that measures gated launches.  Its launches must still go,
paced on their estimates, as the library's one error line says.
"""

from __future__ import annotations

import json
import subprocess
import time

from tests.helpers import (
    CU_SPIN_LAUNCHER,
    CU_SPIN_PRELUDE,
    SimNode,
    region_call,
    run_py,
    start_ready,
)

# Caps the address space just above what the process maps, so that no
# thread stack can be mapped; `threads` says whether one could start.
CANNOT_START_THREADS = """
import resource, threading
with open("/proc/self/status") as f:
    vm = int(next(ln for ln in f if ln.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 4 * 1024 * 1024, resource.RLIM_INFINITY))
try:
    threading.Thread(target=lambda: None).start()
    threads = True
except RuntimeError:
    threads = False
"""


def launches_without_threads(n: int) -> str:
    """n launches of 100 us by a process that cannot start threads, then
    one JSON line: whether threads could start, and the seconds it took."""
    return (
        CU_SPIN_PRELUDE
        + CANNOT_START_THREADS
        + f"""
import json, time
t0 = time.monotonic()
for _ in range({n}):
    launch(100)
chk(cu.cuStreamSynchronize(s))
print(json.dumps({{"threads": threads, "seconds": time.monotonic() - t0}}))
"""
    )


NO_THREADS = launches_without_threads(300)
FEW_WITHOUT_THREADS = launches_without_threads(20)


def test_launches_go_on_estimates_without_a_meter_thread(node: SimNode) -> None:
    """300 launches of 100 us kernels at 50 %, charged the 1 ms first
    estimate each (nothing measures them): about 0.6 s.  Before, each
    launch stayed in flight for good (posted to a meter that never ran), so
    the in-flight bound held every launch longer than the last: 200 such
    launches took 18 s, and the 1024th would never have gone."""
    proc = run_py(NO_THREADS, node.shimmed(CUDA_DEVICE_SM_LIMIT="50"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = [ln for ln in proc.stderr.splitlines() if "meter thread" in ln]
    print(f"{out}; {len(errors)} error line(s)")
    assert not out["threads"]  # the premise: no thread can start
    assert out["seconds"] < 3.0
    assert len(errors) == 1


DESTROY_WITHOUT_METER = (
    CU_SPIN_PRELUDE
    + """
import json, time
other = chk(cu.cuCtxCreate(None, 0, 0))                  # current from here on
spin2 = chk(cu.cuModuleGetFunction(chk(cu.cuModuleLoadData(b"any image")), b"spin"))
s2 = chk(cu.cuStreamCreate(0))
"""
    + CANNOT_START_THREADS
    + """
chk(cu.cuCtxPushCurrent(chk(cu.cuDevicePrimaryCtxRetain(0))))
for _ in range(4):
    launch(30000)                                         # in flight on the primary
busy = cu.cuStreamQuery(s)[0].name
chk(cu.cuCtxPopCurrent())
t0 = time.monotonic()
chk(cu.cuDevicePrimaryCtxReset(0))
reset_s = time.monotonic() - t0
events = [chk(cu.cuEventCreate(0)) for _ in range(16)]
# A gated launch in the other context: nothing of the reset one may be
# left to settle then (the program's new events lie where its events were).
chk(cu.cuLaunchKernel(spin2, 1, 1, 1, 32, 1, 1, 0, s2, ((100,), (ctypes.c_uint32,)), 0))
bad = 0
for _ in range(20):
    for e in events:
        bad += cu.cuEventRecord(e, s2)[0] != cu.CUresult.CUDA_SUCCESS
        bad += cu.cuEventSynchronize(e)[0] != cu.CUresult.CUDA_SUCCESS
print(json.dumps({"threads": threads, "busy": busy, "reset_s": reset_s, "bad": bad}))
"""
)


def test_a_context_reset_without_a_meter_thread_settles_its_launches(node: SimNode) -> None:
    """Without a meter thread each gated launch is settled at its estimate
    as it returns (its events destroyed then), so a context reset with 4
    kernels of 30 ms in flight finds nothing to hand over: it must not wait
    for a meter that is not there (the handover gives up only after 1 s),
    and the program's new events in another context all work, also after
    its next gated launch."""
    proc = run_py(DESTROY_WITHOUT_METER, node.shimmed(CUDA_DEVICE_SM_LIMIT="50"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(out)
    assert not out["threads"]  # the premise: no thread can start
    assert out["busy"] == "CUDA_ERROR_NOT_READY"
    assert out["bad"] == 0
    assert out["reset_s"] < 1.0


def test_a_share_of_0_left_by_a_process_killed_in_a_pause_does_not_hold_one_without_a_meter(
    node: SimNode,
) -> None:
    """A process of a container at 50 % is killed while its container is
    paused (its yield flag set): its meter had set the region's share to
    0, and nothing sets it back once the pause is cleared but another
    process's policy update.  A process that cannot start its meter thread
    has none: its launches waited for that update for good (20 launches of
    100 us had not gone after 15 s); the limit now stands in for it."""
    env = node.shimmed(CUDA_DEVICE_SM_LIMIT="50")
    w = start_ready(CU_SPIN_LAUNCHER, env)
    assert w.stdin is not None
    w.stdin.write("go\n")
    w.stdin.flush()
    time.sleep(0.5)
    region_call(node, "r.set_sm_yield(0, 30)")
    time.sleep(0.5)  # its meter sets the share to 0
    w.kill()
    w.communicate(timeout=30)
    region_call(node, "r.set_sm_yield(0, 0)")
    left = float(region_call(node, "print(r.sm(0).share)").strip())
    try:
        proc = run_py(FEW_WITHOUT_THREADS, env, timeout=20)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"20 launches of 100 us did not go within 20 s (share {left})") from e
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"share left {left}; {out}")
    assert left == 0  # the premise: the killed process's 0 stands
    assert not out["threads"]  # the premise: no thread can start
    assert out["seconds"] < 3.0
