"""Launches back to back on one stream, measured together (segments).

A thread that keeps a stream busy opens a segment: one begin event before
its first launch, none for the launches that join it, one end event when
it ends (native/shim/sm_meter.c, docs/interposer.md).  What such launches
are charged must still be the GPU time their kernels took, and a segment
still open must not outlive its stream nor leave an event to be recorded
later into a stream that has begun capturing.

The programs first launch 100 us kernels one at a time (each
synchronized: measured alone, they teach the estimate), then 300 us kernels
back to back (the stream predicted busy by the estimate, and 40 of them
within the gate's in-flight bound at 100 %, so they join segments):
charged at their estimate alone, they would have been measured a third of
what ran.
"""

from __future__ import annotations

import pytest

from tests.helpers import SimNode, run_json

PROGRAM = """
import ctypes, sys, time
from tests.cuclient import *
from gpuvisor.shim.region import Region
init()
spin = ok(cu.cuModuleGetFunction, ok(cu.cuModuleLoadData, b"any image"), b"spin")
s = ok(cu.cuStreamCreate, 1)
def launch(stream, us):
    ok(cu.cuLaunchKernel, spin, 1, 1, 1, 32, 1, 1, 0, stream, ((us,), (ctypes.c_uint32,)), 0)
launched = 0
for _ in range(10):
    launch(s, 100)
    ok(cu.cuStreamSynchronize, s)
    launched += 100
for _ in range(40):
    launch(s, 300)
    launched += 300
nodes = -1
end = "-"
case = sys.argv[1]
if case == "capture":
    ok(cu.cuStreamBeginCapture, s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    for _ in range(3):
        launch(s, 1000)
    time.sleep(0.01)        # the meter ends an idle segment after 100 us
    err, g = call(cu.cuStreamEndCapture, s)
    end = err.name
    if err == cu.CUresult.CUDA_SUCCESS:
        nodes = ok(cu.cuGraphGetNodes, g, 0)[1]    # (nodes, count): the count
    ok(cu.cuStreamSynchronize, s)
elif case == "destroy":
    ok(cu.cuStreamDestroy, s)   # 40 kernels still queued
    # (Waited for: a new stream's first begin event would be done at once,
    # its kernel run after them, and measured with them.)
    ok(cu.cuCtxSynchronize)
    s = ok(cu.cuStreamCreate, 1)
    for _ in range(5):
        launch(s, 1000)
        launched += 1000
    ok(cu.cuStreamSynchronize, s)
else:
    ok(cu.cuStreamSynchronize, s)
time.sleep(0.05)            # the meter settles the last segment
sm = Region.attach().sm(0)
emit(launched_ns=launched * 1000, busy_ns=sm.busy_ns, launches=sm.launches, nodes=nodes,
     end_capture=end)
"""


@pytest.mark.parametrize("case", ["sync", "destroy", "capture"])
def test_launches_in_segments_are_charged_what_their_kernels_took(node: SimNode, case: str) -> None:
    """`sync`: the back-to-back 300 us kernels are measured within 10 % of
    the time they ran (0.1 % on a quiet machine; a launcher that is not run
    while its stream drains has that time charged too).  `destroy`: the
    stream is destroyed with them still queued (its open segment ends
    first, while the stream lives), then 5 more launches on a new stream
    (maybe the same handle): all measured.  `capture`: a capture begins on
    the stream right after them (the open segment ends before it begins):
    the captured graph holds the 3 kernels and nothing else, and the
    capture is not invalidated."""
    got = run_json(PROGRAM, node.shimmed(CUDA_DEVICE_SM_LIMIT="100"), 120, args=[case])
    print(got)
    ratio = got["busy_ns"] / got["launched_ns"]
    assert abs(ratio - 1) < 0.1, got
    assert got["launches"] == (55 if case == "destroy" else 50), got
    if case == "capture":
        assert got["end_capture"] == "CUDA_SUCCESS", got
        assert got["nodes"] == 3, got
