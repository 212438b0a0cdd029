"""Memory oversubscription on the stream-ordered path (cuMemAllocAsync,
cuMemAllocFromPoolAsync; docs/oversubscription.md).

The setting of tests/test_oversubscribe.py: two containers on one
simulated 4 GiB device, each with a 4 GiB quota and S = 2 (2 GiB
guaranteed each).  A pool that would have to grow past what the rules let
a container hold on the device is not grown: the allocation is served
from host memory (managed memory advised to the host), and cuMemFreeAsync
of it waits for its stream.  The witness is the simulated driver's own
per-process figure of device memory (NVML, read without the library).
"""

from __future__ import annotations

import json
import signal
import subprocess

from tests import helpers_oversub
from tests.helpers import GiB, SimNode, start_ready
from tests.helpers_oversub import (
    DEVICE,
    OVER,
    SIM_CONTEXT,
    check_guarantees,
    nothing_left,
    physical,
    race_and_kill,
    worker,
)

# A container's process: a primary context and one stream, then it obeys
# lines on stdin: "async N" (cuMemAllocAsync of N MiB on the stream),
# "pool N" (cuMemAllocFromPoolAsync from a pool of its own), "ipcpool N"
# (from an IPC-exportable pool), "capped N" (from a pool with a maxSize of
# 4 GiB), "freeasync" (cuMemFreeAsync of the last allocation, then a
# stream synchronisation), "free" (cuMemFree of it), "graph N" (capture an
# allocation of N MiB and its free into a graph, launch it, synchronise),
# "touch" (a memset and copies on every live allocation), "loop N" (N rounds of
# allocating 256 MiB on the stream and freeing it there, for the SIGKILL
# test).
WORKER = worker(
    """
s = ok(cu.cuStreamCreate, 0)
pools = {}
def pool(kind):
    if kind not in pools:
        props = pool_props()
        if kind == "ipc":
            h = cu.CUmemAllocationHandleType
            props.handleTypes = h.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if kind == "capped":
            props.maxSize = 4 * GiB
        pools[kind] = ok(cu.cuMemPoolCreate, props)
    return pools[kind]
def alloc_async(mib):
    n = int(mib) * MiB
    return keep(*call(cu.cuMemAllocAsync, n, s), n)
def from_pool(kind):
    def alloc(mib):
        n = int(mib) * MiB
        return keep(*call(cu.cuMemAllocFromPoolAsync, n, pool(kind), s), n)
    return alloc
def free_async():
    p, _ = held.pop()
    err = call(cu.cuMemFreeAsync, p, s)[0]
    ok(cu.cuStreamSynchronize, s)
    return {"err": err.name}
def graph(mib):
    ok(cu.cuStreamBeginCapture, s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    p = ok(cu.cuMemAllocAsync, int(mib) * MiB, s)
    ok(cu.cuMemFreeAsync, p, s)
    g = ok(cu.cuGraphInstantiate, ok(cu.cuStreamEndCapture, s), 0)
    err = call(cu.cuGraphLaunch, g, s)[0]
    ok(cu.cuStreamSynchronize, s)
    return {"err": err.name}
def loop(n):
    for _ in range(int(n)):
        err, p = call(cu.cuMemAllocAsync, 256 * MiB, s)
        if err == SUCCESS:
            ok(cu.cuMemFreeAsync, p, s)
        ok(cu.cuStreamSynchronize, s)
    return {"err": "CUDA_SUCCESS"}
COMMANDS = {"async": alloc_async, "pool": from_pool("own"), "ipcpool": from_pool("ipc"),
            "capped": from_pool("capped"), "freeasync": free_async, "free": free,
            "touch": touch, "graph": graph, "loop": loop}
"""
)


class Container(helpers_oversub.Container):
    """One container: its own region file, WORKER processes."""

    def __init__(self, node: SimNode, name: str, **env: str) -> None:
        super().__init__(node, name, WORKER, **env)


def test_stream_ordered_allocations_spill_and_keep_the_guarantees(small):
    a = Container(small, "a", **OVER)
    b = Container(small, "b", **OVER)
    try:
        for _ in range(3):
            assert a.ask("async 1024")["err"] == "CUDA_SUCCESS"
        check_guarantees(small, a)
        # B's unclaimed guarantee (less its context) stayed free for it.
        assert physical(small)["used"] <= 2 * GiB + SIM_CONTEXT
        for _ in range(3):
            assert b.ask("async 1024")["err"] == "CUDA_SUCCESS"
        check_guarantees(small, a, b)
        fa, fb = a.figures(), b.figures()
        assert fa["used"] >= 3 * GiB + SIM_CONTEXT, fa
        assert fa["spilled"] >= 1 * GiB - SIM_CONTEXT, fa
        assert fb["spilled"] >= 1 * GiB - SIM_CONTEXT, fb
        # Up to the quota and no further; the quota is what cuMemGetInfo says.
        assert a.ask("async 512")["err"] == "CUDA_SUCCESS"
        assert a.ask("async 1024")["err"] == "CUDA_ERROR_OUT_OF_MEMORY"
        # Kernels' stand-ins (memset, copies) work on spilled blocks.
        assert a.ask("touch")["err"] == "CUDA_SUCCESS"
        assert b.ask("touch")["err"] == "CUDA_SUCCESS"
        check_guarantees(small, a, b)
        # Stream-ordered frees and plain frees give everything back.
        assert a.ask("freeasync")["err"] == "CUDA_SUCCESS"
        assert a.ask("free")["err"] == "CUDA_SUCCESS"
        assert a.ask("freeasync")["err"] == "CUDA_SUCCESS"
        assert a.ask("freeasync")["err"] == "CUDA_SUCCESS"
        fa = a.figures()
        assert fa["spilled"] == 0, fa
        check_guarantees(small, b)
    finally:
        a.kill()
        b.kill()
    nothing_left(small, (a, b))


def test_a_pool_of_ones_own_spills_but_not_an_exportable_or_capped_one(small):
    """cuMemAllocFromPoolAsync from the container's own pool spills like
    cuMemAllocAsync; a pool whose blocks may be exported (IPC handle types)
    or whose size is capped (maxSize) keeps its blocks its own: with the
    device full it fails with out-of-memory, as without the variable."""
    a = Container(small, "a", **OVER)
    b = Container(small, "b", **OVER)
    try:
        assert b.ask("async 2048")["err"] == "CUDA_SUCCESS"
        assert a.ask("pool 1536")["err"] == "CUDA_SUCCESS"
        assert a.ask("pool 1024")["err"] == "CUDA_SUCCESS"
        assert a.figures()["spilled"] >= 512 * (1 << 20), a.figures()
        check_guarantees(small, a, b)
        # A's guarantee is taken; what is left of the device is B's.
        assert a.ask("ipcpool 256")["err"] == "CUDA_ERROR_OUT_OF_MEMORY"
        assert a.ask("capped 256")["err"] == "CUDA_ERROR_OUT_OF_MEMORY"
        assert a.ask("touch")["err"] == "CUDA_SUCCESS"
        assert a.ask("freeasync")["err"] == "CUDA_SUCCESS"
        assert a.ask("freeasync")["err"] == "CUDA_SUCCESS"
        assert a.figures()["spilled"] == 0
    finally:
        a.kill()
        b.kill()
    assert physical(small)["used"] == 0


def test_without_the_variable_stream_ordered_allocations_fail_as_before(small):
    a = Container(small, "a", CUDA_DEVICE_MEMORY_LIMIT="4g")
    b = Container(small, "b", CUDA_DEVICE_MEMORY_LIMIT="4g")
    try:
        assert a.ask("async 3072")["err"] == "CUDA_SUCCESS"
        assert b.ask("async 1024")["err"] == "CUDA_ERROR_OUT_OF_MEMORY"
        assert b.ask("pool 1024")["err"] == "CUDA_ERROR_OUT_OF_MEMORY"
        assert a.figures()["spilled"] == 0
        assert b.figures()["spilled"] == 0
    finally:
        a.kill()
        b.kill()


def test_racing_stream_ordered_allocations_and_sigkill_leave_nothing(small):
    """Two processes per container hold 1 GiB each from their pools (so
    each container asked for its guarantee), then all four allocate and
    free 256 MiB stream-ordered at once, spilling as the device fills, and
    are killed mid-way: the device never holds more than it has, each
    container keeps its guarantee there all along, and everything comes
    back to 0."""
    cs = [Container(small, name, **OVER) for name in ("a", "b")]
    race_and_kill(small, cs, "async 1024")


def test_graph_allocations_do_not_spill(small):
    """A graph's allocation node is made by the driver at launch, from the
    device's graph pool: with the device full it is refused as without the
    variable (docs/oversubscription.md lists it), and nothing is spilled;
    with room on the device it runs."""
    a = Container(small, "a", **OVER)
    b = Container(small, "b", **OVER)
    try:
        assert b.ask("async 2048")["err"] == "CUDA_SUCCESS"
        assert a.ask("async 2048")["err"] == "CUDA_SUCCESS"
        check_guarantees(small, a, b)
        before = a.figures()
        assert a.ask("graph 512")["err"] == "CUDA_ERROR_OUT_OF_MEMORY"
        assert a.figures() == before
        assert physical(small)["used"] <= DEVICE
        assert a.ask("freeasync")["err"] == "CUDA_SUCCESS"
        assert a.ask("graph 512")["err"] == "CUDA_SUCCESS"
        assert a.figures()["spilled"] == 0
    finally:
        a.kill()
        b.kill()
    assert physical(small)["used"] == 0


def test_a_growth_the_driver_refuses_is_spilled_whole(small):
    """A process without the library holds 3.5 GiB of the 4 GiB device, so
    the rules' room (A's own guarantee) is not there: the driver refuses
    the pool's growth, and the allocation is served from host memory,
    all of it (nothing prefetched to a device that has no room), so the
    region's resident bytes stay the driver's own count."""
    outsider = start_ready(WORKER, small.env)
    try:
        assert json.loads(ask_raw(outsider, "async 3584"))["err"] == "CUDA_SUCCESS"
        a = Container(small, "a", **OVER)
        try:
            assert a.ask("async 512")["err"] == "CUDA_SUCCESS"
            fig = a.figures()
            assert fig["spilled"] == 512 * (1 << 20), fig
            assert fig["resident"] == a.on_device(physical(small)) == SIM_CONTEXT, fig
            assert a.ask("touch")["err"] == "CUDA_SUCCESS"
            assert a.ask("freeasync")["err"] == "CUDA_SUCCESS"
            assert a.figures()["spilled"] == 0
        finally:
            a.kill()
    finally:
        outsider.send_signal(signal.SIGKILL)
        outsider.wait(timeout=10)
    assert physical(small)["used"] == 0


def ask_raw(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline()
