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
def launches_on(ctx):
    chk(cu.cuCtxSetCurrent(ctx))
    f = chk(cu.cuModuleGetFunction(chk(cu.cuModuleLoadData(b"any image")), b"spin"))
    s = chk(cu.cuStreamCreate(0))
    for _ in range(5):
        chk(cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, ((100,), (ctypes.c_uint32,)), 0))
    chk(cu.cuStreamSynchronize(s))
    handle = int(s)
    chk(cu.cuStreamDestroy(s))
    return handle
chk(cu.cuInit(0))
ctxs = [chk(cu.cuCtxCreate(None, 0, chk(cu.cuDeviceGet(i)))) for i in (0, 1)]
handles = [launches_on(c) for c in ctxs]
r = Region.attach()
print(json.dumps({"handles": handles,
                  "launches": {r.device_uuid(d): r.sm(d).launches
                               for d in range(r.device_count())}}))
"""
)


def test_a_reused_stream_handle_is_paced_on_its_own_device(node: SimNode) -> None:
    """Five gated launches on a stream of device 0, the stream destroyed,
    then five on a stream of device 1 that the driver gave the same handle:
    each device's gate counts its own five (before the thread forgot what
    it knew of the handle, device 0's counted all ten)."""
    got = run_json(PROGRAM, node.shimmed(CUDA_DEVICE_SM_LIMIT="50"), timeout=60)
    print(got)
    assert got["handles"][0] == got["handles"][1], "the driver made a new handle: no reuse"
    assert sorted(got["launches"].values()) == [5, 5], got
