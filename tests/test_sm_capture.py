"""Stream capture next to the SM quota's own threads.

CUDA forbids "potentially unsafe" calls, cuEventQuery among them, to any
thread in the default (GLOBAL) capture interaction mode while another
thread captures a graph in GLOBAL mode, the mode PyTorch's torch.cuda.graph
uses by default: such a call fails and invalidates the capture.  The SM
meter thread polls its launches' events every 100 us while kernels are in
flight; the simulator enforces the rule for cuEventQuery and
cuEventSynchronize (docs/simulator.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import MiB, SimNode, run_json

CAPTURE_BESIDE_GATED_WORK = """
import ctypes, time
from tests.cuclient import *
init()
spin = ok(cu.cuModuleGetFunction, ok(cu.cuModuleLoadData, b"any image"), b"spin")
s = ok(cu.cuStreamCreate, 0)
c = ok(cu.cuStreamCreate, 0)
def launch(stream, us):
    ok(cu.cuLaunchKernel, spin, 1, 1, 1, 32, 1, 1, 0, stream, ((us,), (ctypes.c_uint32,)), 0)
launch(s, 300_000)          # gated under a limit: in flight while we capture
ok(cu.cuStreamBeginCapture, c, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
launch(c, 1000)
time.sleep(0.05)
err, g = call(cu.cuStreamEndCapture, c)
ok(cu.cuStreamSynchronize, s)
emit(end_capture=err.name)
"""


def test_a_graph_captured_while_gated_kernels_run_is_not_invalidated(
    node: SimNode, tmp_path: Path
) -> None:
    """A graph captured in GLOBAL mode while a gated kernel is in flight:
    the meter thread's cuEventQuery invalidated the capture
    (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED from cuStreamEndCapture) under
    any SM limit; the meter thread now polls in THREAD_LOCAL interaction
    mode, which other threads' captures do not concern.  Without a limit
    (no meter) the capture always succeeded."""
    free = run_json(
        CAPTURE_BESIDE_GATED_WORK,
        node.shimmed(CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "free.shr")),
    )
    limited = run_json(CAPTURE_BESIDE_GATED_WORK, node.shimmed(CUDA_DEVICE_SM_LIMIT="50"))
    assert free["end_capture"] == "CUDA_SUCCESS", free
    assert limited["end_capture"] == "CUDA_SUCCESS", limited


UNSAFE_QUERY = """
import threading
from tests.cuclient import *
init()
s = ok(cu.cuStreamCreate, 0)
c = ok(cu.cuStreamCreate, 0)
e = ok(cu.cuEventCreate, 0)
ok(cu.cuEventRecord, e, s)
mode = getattr(cu.CUstreamCaptureMode, sys.argv[1])
got = {}
def other():
    ok(cu.cuCtxSetCurrent, CTX)
    ok(cu.cuThreadExchangeStreamCaptureMode, mode)
    got["query"] = call(cu.cuEventQuery, e)[0].name
CTX = ok(cu.cuCtxGetCurrent)
ok(cu.cuStreamBeginCapture, c, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
t = threading.Thread(target=other)
t.start()
t.join()
err, g = call(cu.cuStreamEndCapture, c)
emit(query=got["query"], end_capture=err.name)
"""


@pytest.mark.parametrize(
    ("mode", "query", "end"),
    [
        (
            "CU_STREAM_CAPTURE_MODE_GLOBAL",
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        ),
        ("CU_STREAM_CAPTURE_MODE_THREAD_LOCAL", "CUDA_SUCCESS", "CUDA_SUCCESS"),
        ("CU_STREAM_CAPTURE_MODE_RELAXED", "CUDA_SUCCESS", "CUDA_SUCCESS"),
    ],
)
def test_the_simulator_forbids_an_event_query_during_another_threads_global_capture(
    node: SimNode, mode: str, query: str, end: str
) -> None:
    """The rule the test above depends on, without the interposer: another
    thread's cuEventQuery in GLOBAL interaction mode fails and invalidates
    a GLOBAL capture; in THREAD_LOCAL or RELAXED mode it is allowed."""
    out = run_json("import sys\n" + UNSAFE_QUERY, dict(node.env), args=[mode])
    assert out == {"query": query, "end_capture": end}, out


# A stream-ordered free still waiting for its stream (a 0.3 s kernel ahead of
# it), then a GLOBAL capture in this thread while another thread, in the
# default GLOBAL interaction mode, asks for the memory figures as a monitor
# does (cuMemGetInfo, or NVML's, which a process's pynvml monitor calls): the
# library looks at the waiting free's event there.
CAPTURE_BESIDE_A_MONITOR = """
import ctypes, sys, threading
import pynvml
from tests.cuclient import *
ctx = init()
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
spin = ok(cu.cuModuleGetFunction, ok(cu.cuModuleLoadData, b"any image"), b"spin")
s = ok(cu.cuStreamCreate, 0)
c = ok(cu.cuStreamCreate, 0)
p = ok(cu.cuMemAlloc, 64 * MiB)
ok(cu.cuLaunchKernel, spin, 1, 1, 1, 32, 1, 1, 0, s, ((300_000,), (ctypes.c_uint32,)), 0)
ok(cu.cuMemFreeAsync, p, s)
def monitor():
    ok(cu.cuCtxSetCurrent, ctx)
    if sys.argv[1] == "cuMemGetInfo":
        mem_info()
    else:
        pynvml.nvmlDeviceGetMemoryInfo(handle)
ok(cu.cuStreamBeginCapture, c, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
t = threading.Thread(target=monitor)
t.start()
t.join()
err, g = call(cu.cuStreamEndCapture, c)
ok(cu.cuStreamSynchronize, s)
emit(end_capture=err.name, used=used())
"""


@pytest.mark.parametrize("query", ["cuMemGetInfo", "nvmlDeviceGetMemoryInfo"])
def test_a_memory_query_beside_a_capture_does_not_invalidate_it(node: SimNode, query: str) -> None:
    """The library's look at a waiting stream-ordered free (cuEventQuery)
    was made in the calling thread's interaction mode: from a monitoring
    thread in GLOBAL mode it invalidated the GLOBAL capture of another
    thread, which made no forbidden call itself.  It is now made in RELAXED
    mode, and the free is still given back once the stream reaches it."""
    out = run_json(
        CAPTURE_BESIDE_A_MONITOR, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"), args=[query]
    )
    assert out["end_capture"] == "CUDA_SUCCESS", out
    assert out["used"] == 32 * MiB, out  # the context alone: the free was given back


# Launches under an SM limit, 20 of them into a capturing stream, the capture
# begun one of three ways (argv[1]): cuda-python's cuStreamBeginCapture
# (cuGetProcAddress: cuStreamBeginCapture_v2, or _v2_ptsz with cuda-python's
# per-thread default stream), or the exported cuStreamBeginCapture (v1) looked
# up with dlsym; then the graph launched once.  The region counts each launch
# the gate admits.
CAPTURED_LAUNCHES = """
import ctypes, sys
from tests.cuclient import *
from gpuvisor.shim.region import Region
init()
spin = ok(cu.cuModuleGetFunction, ok(cu.cuModuleLoadData, b"any image"), b"spin")
s = ok(cu.cuStreamCreate, 0)
def launch(us):
    ok(cu.cuLaunchKernel, spin, 1, 1, 1, 32, 1, 1, 0, s, ((us,), (ctypes.c_uint32,)), 0)
def admitted():
    return Region.attach().sm(0).launches
launch(1000)
ok(cu.cuStreamSynchronize, s)
first = admitted()
if sys.argv[1] == "dlsym-v1":
    rc = ctypes.CDLL("libcuda.so.1").cuStreamBeginCapture(ctypes.c_void_p(int(s)))
    assert rc == 0, rc
else:
    ok(cu.cuStreamBeginCapture, s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
for _ in range(20):
    launch(1000)
captured = admitted() - first
g = ok(cu.cuStreamEndCapture, s)
nodes = ok(cu.cuGraphGetNodes, g, 0)[1]
ex = ok(cu.cuGraphInstantiate, g, 0)
ok(cu.cuGraphLaunch, ex, s)
launch(1000)
ok(cu.cuStreamSynchronize, s)
emit(first=first, captured=captured, nodes=nodes, after=admitted() - first - captured)
"""


@pytest.mark.parametrize("begin", ["procaddr", "procaddr-ptsz", "dlsym-v1"])
def test_launches_into_a_capturing_stream_are_not_gated(node: SimNode, begin: str) -> None:
    """A kernel launched into a capturing stream is recorded into the
    graph, not run: the gate leaves it alone.  The gate asks the driver
    whether the stream captures only while this process has begun a
    capture (hooks_capture.c), so every way to begin one must be seen: the
    _v2 and _v2_ptsz entry points cuda-python gets from cuGetProcAddress,
    and the exported v1 symbol found with dlsym.  After the capture ends,
    launches are gated again: the graph's launch and the kernel after it."""
    env = node.shimmed(CUDA_DEVICE_SM_LIMIT="50")
    if begin == "procaddr-ptsz":
        env["CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM"] = "1"
    out = run_json(CAPTURED_LAUNCHES, env, args=[begin])
    assert out == {"first": 1, "captured": 0, "nodes": 20, "after": 2}, out
