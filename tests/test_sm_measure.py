"""The SM meter measures each process's own kernels, however the container's
processes launch around each other.

A gated launch is measured with events recorded just before and just after
it.  On the simulated device, which runs kernels in launch order across
processes, another process's kernel queued between those calls runs
between the events; the interposer makes the begin event, the launch and
the end event while no other gated process on the device does the same
(native/shim/sm_enqueue.c), so each kernel is measured alone.
GPUVISOR_SIM_LAUNCH_US makes every launch take a while in the driver, as a
real one does on a loaded machine, so that the processes' launches overlap
often.
"""

from __future__ import annotations

import json

from tests.helpers import CU_SPIN_PRELUDE, SimNode, run_json, start_ready

# Launches `count` spin kernels of 200 us to 2 ms, then waits for them and for
# its meter to have settled them all (it polls every 100 us); prints the GPU
# time it launched.
WORKER = (
    CU_SPIN_PRELUDE
    + """
import json, random, sys, time
count, seed = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(seed)
print("ready", flush=True)
sys.stdin.readline()
launched = 0
for _ in range(count):
    us = rng.randint(200, 2000)
    launch(us)
    launched += us
chk(cu.cuStreamSynchronize(s))
time.sleep(0.3)
print(json.dumps({"launched_ns": launched * 1000}), flush=True)
"""
)

BUSY = """
import json
from gpuvisor.shim.region import Region
sm = Region.attach().sm(0)
print(json.dumps({"busy_ns": sm.busy_ns, "launches": sm.launches}))
"""


def test_processes_launching_at_once_are_each_measured_alone(node: SimNode) -> None:
    """Two processes of one container, launching 200 kernels each at once,
    every launch taking 300 us in the driver: what the meter measured for
    the container is the GPU time its kernels took, within 3 % (0.2 % when
    written).  Without the enqueue word the other process's kernels were
    measured too: the container was charged 11-13 % more than it ran (three
    runs), and would have run that much under a limit."""
    env = node.shimmed(CUDA_DEVICE_SM_LIMIT="100", GPUVISOR_SIM_LAUNCH_US="300")
    workers = [start_ready(WORKER, env, "200", str(seed)) for seed in (1, 2)]
    for w in workers:
        assert w.stdin is not None
        w.stdin.write("go\n")
        w.stdin.flush()
    launched = 0
    for w in workers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, out + err
        launched += json.loads(out.strip().splitlines()[-1])["launched_ns"]
    got = run_json(BUSY, node.shimmed())
    ratio = got["busy_ns"] / launched
    print(f"launched {launched / 1e6:.1f} ms, measured {got['busy_ns'] / 1e6:.1f} ms: {ratio:.3f}")
    assert got["launches"] == 400
    assert abs(ratio - 1) < 0.03


def test_measure_worker_runs_alone(node: SimNode) -> None:
    """The same worker alone: what it launched is what was measured (the
    comparison above holds without any other process too)."""
    env = node.shimmed(CUDA_DEVICE_SM_LIMIT="100", GPUVISOR_SIM_LAUNCH_US="300")
    w = start_ready(WORKER, env, "100", "3")
    assert w.stdin is not None
    w.stdin.write("go\n")
    w.stdin.flush()
    out, err = w.communicate(timeout=120)
    assert w.returncode == 0, out + err
    launched = json.loads(out.strip().splitlines()[-1])["launched_ns"]
    got = run_json(BUSY, node.shimmed())
    assert got["launches"] == 100
    assert abs(got["busy_ns"] / launched - 1) < 0.03
