"""NVML's per-process samples as the supervisor reads them.

nvidia-ml-py's nvmlDeviceGetProcessUtilization asks NVML twice: once for
the number of samples newer than the timestamp, then for the samples.  If
there are more by the second call (a process that starts running kernels;
on a real driver also each sample period that completes), the second call
fails with NVML_ERROR_INSUFFICIENT_SIZE.  The node agent's reading
(HostGpus.process_use: which high-priority containers work, and the SM
share of containers whose gate measures nothing) dropped the device for
that round when it happened, and so did the demo's sampler.

The race is made certain here: between the binding's two calls, a second
process runs a kernel.
"""

from __future__ import annotations

from tests.helpers import CU_SPIN_PRELUDE, SimNode, run_json, start_ready

BUSY = (
    CU_SPIN_PRELUDE
    + """
import sys, time
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
while time.monotonic() - t0 < 20:
    launch(20000)
    chk(cu.cuStreamSynchronize(s))
"""
)

READ = """
import json, subprocess, sys, time
import pynvml
from gpuvisor.supervisor.agent.metrics import HostGpus

ONE_KERNEL = @ONE_KERNEL@
real = pynvml._nvmlGetFunctionPointer
state = {"raced": 0}

def second_process_in_between(name):
    fn = real(name)
    if name != "nvmlDeviceGetProcessUtilization":
        return fn
    def wrapped(handle, samples, count, since):
        rc = fn(handle, samples, count, since)
        if samples is None and not state["raced"]:
            state["raced"] = 1
            subprocess.run([sys.executable, "-c", ONE_KERNEL], check=True, timeout=60)
            time.sleep(0.25)     # the sample periods of its kernel have ended
        return rc
    return wrapped

pynvml._nvmlGetFunctionPointer = second_process_in_between
gpus = HostGpus()
time.sleep(0.3)                  # the busy process has samples by now
use = gpus.process_use(5.0)
print(json.dumps({"raced": state["raced"],
                  "use": {u: {str(p): v for p, v in d.items()} for u, d in use.items()}}))
"""

ONE_KERNEL = CU_SPIN_PRELUDE + "launch(50000)\nchk(cu.cuStreamSynchronize(s))\n"


def test_a_sample_completing_between_the_two_calls_loses_no_reading(node: SimNode) -> None:
    """With a second process appearing between the binding's two calls,
    the reading still has both processes (it asks again), instead of
    leaving the device out."""
    busy = start_ready(BUSY, node.env)
    try:
        assert busy.stdin is not None
        busy.stdin.write("go\n")
        busy.stdin.flush()
        got = run_json(READ.replace("@ONE_KERNEL@", repr(ONE_KERNEL)), node.env)
    finally:
        busy.kill()
        busy.communicate(timeout=30)
    assert got["raced"] == 1, got
    per_pid = {pid: v for d in got["use"].values() for pid, v in d.items()}
    assert per_pid.get(str(busy.pid), 0) > 0, got
    assert len(per_pid) == 2, got
