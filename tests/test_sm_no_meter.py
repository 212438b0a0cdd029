"""The SM quota when the meter thread cannot be started.

A process that cannot create threads (a container at its pids limit; here
its address space is capped, so no thread stack can be mapped) cannot run
the meter thread that measures gated launches.  Its launches must still go,
paced on their estimates, as the library's one error line says.
"""

from __future__ import annotations

import json

from tests.helpers import CU_SPIN_PRELUDE, SimNode, run_py

NO_THREADS = (
    CU_SPIN_PRELUDE
    + """
import json, resource, threading, time
with open("/proc/self/status") as f:
    vm = int(next(ln for ln in f if ln.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 4 * 1024 * 1024, resource.RLIM_INFINITY))
try:
    threading.Thread(target=lambda: None).start()
    threads = True
except RuntimeError:
    threads = False
t0 = time.monotonic()
for _ in range(300):
    launch(100)
chk(cu.cuStreamSynchronize(s))
print(json.dumps({"threads": threads, "seconds": time.monotonic() - t0}))
"""
)


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
