"""Destroying a context while its gated launches are in flight.

Under an SM limit every gated launch is bracketed by two events made in its
stream's context, which the meter thread reads and destroys later
(native/shim/sm_meter.c).  Destroying the context destroys those events
(the simulator does so too, as a real driver does), and their memory is
reused for the program's next events: a meter that went on with the old
handles queried and destroyed the program's own events, whose next
cuEventRecord failed with CUDA_ERROR_INVALID_HANDLE.  The interposer now
has the meter settle and drop a context's launches before the driver
destroys it (cuCtxDestroy, a primary context's reset, its release to zero
references); the settled launches leave nothing in flight, so launches in
another context go on at once.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import CU_CHK, SimNode, run_json, run_py

ROUNDS = 5

# Every program's start: chk, cuInit, a spin kernel and a stream in the current
# context (kernel_in), and one launch of it for us microseconds.
HEAD = (
    CU_CHK
    + """
import json, sys, threading, time
def kernel_in(ctx):
    mod = chk(cu.cuModuleLoadData(b"any image"))
    return chk(cu.cuModuleGetFunction(mod, b"spin")), chk(cu.cuStreamCreate(0))
def launch(f, s, us):
    return cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, ((us,), (ctypes.c_uint32,)), 0)[0]
chk(cu.cuInit(0))
"""
)

PROGRAM = (
    HEAD
    + """
how, rounds = sys.argv[1], int(sys.argv[2])
# The context the program goes on with, made beforehand: its events come
# right after the destruction, in the memory the destroyed events had,
# before the meter's next poll (every 100 us) would have found them gone.
other = chk(cu.cuCtxCreate(None, 0, 0))
spin2, s2 = kernel_in(other)
inflight, errors, slowest = [], {}, 0.0
for _ in range(rounds):
    if how == "destroy":
        ctx = chk(cu.cuCtxCreate(None, 0, 0))            # pushed: current
    else:
        ctx = chk(cu.cuDevicePrimaryCtxRetain(0))
        chk(cu.cuCtxPushCurrent(ctx))
    spin, s = kernel_in(ctx)
    for _ in range(4):
        chk(launch(spin, s, 30000))
    inflight.append(cu.cuStreamQuery(s)[0].name)
    if how == "destroy":
        chk(cu.cuCtxDestroy(ctx))                        # pops it: other is current
    else:
        chk(cu.cuCtxPopCurrent())
        if how == "reset":
            chk(cu.cuDevicePrimaryCtxReset(0))
        chk(cu.cuDevicePrimaryCtxRelease(0))             # (after a reset: to zero)
    events = [cu.cuEventCreate(0) for _ in range(16)]
    for e in events:
        chk(e[0])
    events = [e[1] for e in events]
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.1:
        for e in events:
            for name, rc in (("record", cu.cuEventRecord(e, s2)[0]),
                             ("sync", cu.cuEventSynchronize(e)[0])):
                if rc != R:
                    errors[name + " " + rc.name] = errors.get(name + " " + rc.name, 0) + 1
    for e in events:
        rc = cu.cuEventDestroy(e)[0]
        if rc != R:
            errors["destroy " + rc.name] = errors.get("destroy " + rc.name, 0) + 1
    # Gated launches in the other context: nothing of the destroyed one
    # may still count as in flight and hold them at the bound.
    t0 = time.monotonic()
    for _ in range(10):
        chk(launch(spin2, s2, 1000))
    chk(cu.cuStreamSynchronize(s2))
    slowest = max(slowest, time.monotonic() - t0)
print(json.dumps({"inflight": inflight, "errors": errors, "slowest": slowest}))
"""
)


@pytest.mark.parametrize("how", ["destroy", "reset", "release"])
def test_a_destroyed_contexts_launches_leave_the_programs_events_alone(
    node: SimNode, how: str
) -> None:
    """A context with 4 kernels of 30 ms in flight is destroyed (created:
    cuCtxDestroy; primary: cuDevicePrimaryCtxReset, or its last
    cuDevicePrimaryCtxRelease), 5 times.  After each, 16 new events in
    another context are recorded and synchronized for 0.1 s: every call
    succeeds (before the fix, the meter destroyed some of them: their
    records failed with CUDA_ERROR_INVALID_HANDLE).  Then 10 gated launches
    of 1 ms in the other context finish within 2 s at a 50 % limit (20 ms
    of pacing; what a stuck in-flight count would hold for good; the
    child's timeout catches a hang)."""
    got = run_json(
        PROGRAM, node.shimmed(CUDA_DEVICE_SM_LIMIT="50"), timeout=120, args=[how, str(ROUNDS)]
    )
    print(got)
    assert got["inflight"] == ["CUDA_ERROR_NOT_READY"] * ROUNDS, got
    assert got["errors"] == {}, got
    assert got["slowest"] < 2.0, got


STUCK = (
    HEAD
    + """
ctx = chk(cu.cuCtxCreate(None, 0, 0))
spin, s = kernel_in(ctx)
for _ in range(4):
    chk(launch(spin, s, 30000))
time.sleep(0.05)  # the meter is now inside a cuEventQuery that takes 1.5 s
t0 = time.monotonic()
chk(cu.cuCtxDestroy(ctx))
took = time.monotonic() - t0
again = chk(cu.cuCtxCreate(None, 0, 0))  # the program goes on
chk(cu.cuCtxDestroy(again))
print(json.dumps({"took": took}))
"""
)


def test_a_context_is_destroyed_even_while_the_meter_is_stuck(node: SimNode) -> None:
    """The meter lets go of a context's launches before the driver destroys
    it, and cuCtxDestroy waits for that; a meter stuck in a driver call (each
    cuEventQuery taking 1.5 s) must not hold the destruction for good: after
    1 s it goes ahead, with one error line saying so."""
    proc = run_py(
        STUCK,
        node.shimmed(CUDA_DEVICE_SM_LIMIT="50", GPUVISOR_SIM_EVENT_QUERY_MS="1500"),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    took = json.loads(proc.stdout.strip().splitlines()[-1])["took"]
    assert 0.9 <= took < 3.0, took
    said = [ln for ln in proc.stderr.splitlines() if "did not let go of a context" in ln]
    assert len(said) == 1, proc.stderr


RACING = (
    HEAD
    + """
other = chk(cu.cuCtxCreate(None, 0, 0))
spin2, s2 = kernel_in(other)
doomed = chk(cu.cuCtxCreate(None, 0, 0))
spin, s = kernel_in(doomed)
results = {}
started = threading.Event()
def launcher():
    chk(cu.cuCtxSetCurrent(doomed))
    started.set()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        rc = launch(spin, s, 2000)
        results[rc.name] = results.get(rc.name, 0) + 1
t = threading.Thread(target=launcher)
t.start()
started.wait()
time.sleep(0.2)
chk(cu.cuCtxDestroy(doomed))  # while the other thread launches in it
t.join(30)
chk(cu.cuCtxSetCurrent(other))
t0 = time.monotonic()
for _ in range(10):
    chk(launch(spin2, s2, 1000))
chk(cu.cuStreamSynchronize(s2))
print(json.dumps({"alive": t.is_alive(), "results": results, "after": time.monotonic() - t0}))
"""
)


def test_launches_racing_the_destruction_of_their_context(node: SimNode) -> None:
    """One thread launches back to back into a context that another thread
    destroys (a program's bug, but one that must not hang or crash the
    interposer): launches before it succeed, launches after it fail with a
    CUDA error, the launching thread ends, and gated launches in another
    context then run at once (nothing of the destroyed context is left
    counting as in flight)."""
    got = run_json(RACING, node.shimmed(CUDA_DEVICE_SM_LIMIT="50"), timeout=60)
    print(got)
    assert got["alive"] is False
    assert got["results"].get("CUDA_SUCCESS", 0) > 0, got
    assert set(got["results"]) - {"CUDA_SUCCESS"}, got  # some after the destroy failed
    assert got["after"] < 2.0, got
