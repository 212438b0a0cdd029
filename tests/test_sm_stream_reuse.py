"""A gated launch is paced on its stream's device, also when the stream's
handle was another device's stream before.

Each launching thread remembers its last stream's context and device
(native/shim/sm_meter.c), and forgets them whenever a stream or a context
is destroyed: a driver reuses a destroyed stream's handle for the next
stream made, in any context.
"""

from __future__ import annotations

from tests.helpers import CU_CHK, SimNode, run_json

PROGRAM = (
    CU_CHK
    + """
import json
from gpuvisor.shim.region import Region
def function(ctx):
    chk(cu.cuCtxSetCurrent(ctx))
    return chk(cu.cuModuleGetFunction(chk(cu.cuModuleLoadData(b"any image")), b"spin"))
def five(f, s):
    for _ in range(5):
        chk(cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, ((100,), (ctypes.c_uint32,)), 0))
    chk(cu.cuStreamSynchronize(s))
chk(cu.cuInit(0))
ctxs = [chk(cu.cuCtxCreate(None, 0, chk(cu.cuDeviceGet(i)))) for i in (0, 1)]
f0, f1 = function(ctxs[0]), function(ctxs[1])
# Until the driver gives device 1's new stream the handle of device 0's
# stream just destroyed (the simulator's handles are its allocations: the
# same as a rule, not always).
tries = 0
while True:
    tries += 1
    chk(cu.cuCtxSetCurrent(ctxs[0]))
    s0 = chk(cu.cuStreamCreate(0))
    five(f0, s0)
    chk(cu.cuStreamDestroy(s0))
    chk(cu.cuCtxSetCurrent(ctxs[1]))
    s1 = chk(cu.cuStreamCreate(0))
    if int(s1) == int(s0) or tries == 20:
        break
    chk(cu.cuStreamDestroy(s1))
five(f1, s1)
r = Region.attach()
print(json.dumps({"handles": [int(s0), int(s1)], "tries": tries,
                  "launches": [r.sm(d).launches for d in range(r.device_count())]}))
"""
)


def test_a_reused_stream_handle_is_paced_on_its_own_device(node: SimNode) -> None:
    """Five gated launches on a stream of device 0, the stream destroyed,
    then five on a stream of device 1 that the driver gave the same handle:
    each device's gate counts its own five (before the thread forgot what
    it knew of the handle, device 0's counted all ten).  The handle came
    back at the first try as a rule; a CI run once got another (the
    device-1 stream made after a module load then), so the program tries
    again, up to 20 times, with nothing allocated in between."""
    got = run_json(PROGRAM, node.shimmed(CUDA_DEVICE_SM_LIMIT="50"), timeout=60)
    print(got)
    assert got["handles"][0] == got["handles"][1], "the driver made a new handle in 20 tries"
    # device 0: five a try; device 1: its own five, none of device 0's
    assert got["launches"] == [5 * got["tries"], 5], got
