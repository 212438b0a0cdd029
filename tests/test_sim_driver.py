"""The simulated GPU driver (build/sim/libcuda.so.1, libnvidia-ml.so.1) as
real NVIDIA clients see it: cuda-python, nvidia-ml-py and raw ctypes, each
in a child process with its own state file."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.simhelp import (
    CTYPES_PRELUDE,
    T_LINK_SIM,
    T_SIM_BASIC,
    T_SIM_KILL,
    GiB,
    MiB,
    has_cuda_bindings,
    ok,
    run_c_test,
    run_py,
    sim_env,
    spawn_py,
)

needs_cuda_python = pytest.mark.skipif(not has_cuda_bindings(), reason="cuda-python missing")

H100_SPEC = (
    "2x80g:name=NVIDIA H100 80GB HBM3:sms=132,24g:uuid=GPU-12345678-1234-1234-1234-123456789abc"
)


def test_c_basic(tmp_path: Path) -> None:
    run_c_test(T_SIM_BASIC, tmp_path)
    assert not list(tmp_path.glob("gv-t-sim-basic-*")), "t_sim_basic left its state file"


def test_c_kill_stress(tmp_path: Path) -> None:
    """C workers SIGKILLed mid-call: no deadlock, no leaked usage."""
    run_c_test(T_SIM_KILL, tmp_path)


def test_c_linked_program(tmp_path: Path) -> None:
    """-lcuda -lnvidia-ml binds to the exported names; both libraries share state."""
    env = sim_env(tmp_path, "2g")
    cp = subprocess.run([str(T_LINK_SIM)], env=env, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert cp.stdout.strip() == "OK", cp.stdout + cp.stderr


@needs_cuda_python
def test_cuda_python_devices(tmp_path: Path) -> None:
    out = ok(
        run_py(
            """
            from cuda.bindings import driver as d
            R = d.CUresult.CUDA_SUCCESS
            assert d.cuDeviceGetCount()[0] == d.CUresult.CUDA_ERROR_NOT_INITIALIZED
            assert d.cuInit(0)[0] == R
            err, n = d.cuDeviceGetCount(); assert err == R
            print("count", n)
            for i in range(n):
                err, name = d.cuDeviceGetName(128, i); assert err == R
                err, tot = d.cuDeviceTotalMem(i); assert err == R
                err, u = d.cuDeviceGetUuid(i); assert err == R
                err, sms = d.cuDeviceGetAttribute(
                    d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, i)
                print(i, name.split(b"\\0")[0].decode(), tot, bytes(u.bytes).hex(), sms)
            """,
            sim_env(tmp_path, H100_SPEC),
        )
    )
    lines = out.splitlines()
    assert lines[0] == "count 3"
    assert lines[1].startswith("0 NVIDIA H100 80GB HBM3 85899345920 ")
    assert lines[1].endswith(" 132")
    assert lines[3] == ("2 gpuvisor simulated GPU 25769803776 12345678123412341234123456789abc 108")
    assert lines[1].split()[-2] != lines[2].split()[-2]  # default UUIDs differ


@needs_cuda_python
def test_cuda_python_alloc_free_oom_meminfo(tmp_path: Path) -> None:
    ok(
        run_py(
            f"""
            from cuda.bindings import driver as d
            R = d.CUresult.CUDA_SUCCESS
            assert d.cuInit(0)[0] == R
            assert d.cuMemGetInfo()[0] == d.CUresult.CUDA_ERROR_INVALID_CONTEXT
            err, ctx = d.cuCtxCreate(None, 0, 0); assert err == R, err
            err, free0, total = d.cuMemGetInfo(); assert err == R
            assert total == 4 * {GiB} and free0 == total - 32 * {MiB}, (free0, total)
            err, p = d.cuMemAlloc({GiB}); assert err == R
            err, free1, _ = d.cuMemGetInfo()
            assert free1 == free0 - {GiB}
            err, q = d.cuMemAlloc(free1 + 1)
            assert err == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY, err
            err, q = d.cuMemAlloc(1); assert err == R   # charges 2 MiB
            assert d.cuMemGetInfo()[1] == free1 - 2 * {MiB}
            assert d.cuMemFree(p)[0] == R and d.cuMemFree(q)[0] == R
            assert d.cuMemFree(p)[0] == d.CUresult.CUDA_ERROR_INVALID_VALUE
            assert d.cuMemGetInfo()[1] == free0
            # stream-ordered allocator: RESERVED_MEM_CURRENT is exact
            err, s = d.cuStreamCreate(0); assert err == R
            err, a = d.cuMemAllocAsync(3 * {MiB}, s); assert err == R
            err, pool = d.cuDeviceGetMemPool(0); assert err == R
            A = d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT
            assert int(d.cuMemPoolGetAttribute(pool, A)[1]) == 4 * {MiB}
            assert d.cuMemFreeAsync(a, s)[0] == R
            assert int(d.cuMemPoolGetAttribute(pool, A)[1]) == 4 * {MiB}
            assert d.cuStreamSynchronize(s)[0] == R
            assert int(d.cuMemPoolGetAttribute(pool, A)[1]) == 0
            assert d.cuCtxDestroy(ctx)[0] == R
            print("done")
            """,
            sim_env(tmp_path, "4g"),
        )
    )


@needs_cuda_python
def test_cuda_python_graph_memory_nodes(tmp_path: Path) -> None:
    """Graph allocations (captured cuMemAllocAsync/cuMemFreeAsync and explicit
    memory nodes) take device memory from the graph pool when the graph is
    launched or uploaded, keep it until cuDeviceGraphMemTrim, and fail the
    launch with CUDA_ERROR_OUT_OF_MEMORY when the device is full."""
    ok(
        run_py(
            f"""
            from cuda.bindings import driver as d
            R = d.CUresult.CUDA_SUCCESS
            A = d.CUgraphMem_attribute
            assert d.cuInit(0)[0] == R
            err, ctx = d.cuCtxCreate(None, 0, 0); assert err == R, err
            def attr(a):
                err, v = d.cuDeviceGetGraphMemAttribute(0, a); assert err == R, err
                return int(v)
            def pool():
                return (attr(A.CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT),
                        attr(A.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT))
            free0 = d.cuMemGetInfo()[1]
            err, s = d.cuStreamCreate(0); assert err == R
            # capture: allocate 3 MiB and free it inside the graph
            assert d.cuStreamBeginCapture(s, 0)[0] == R
            err, a = d.cuMemAllocAsync(3 * {MiB}, s); assert err == R, err
            assert d.cuMemFreeAsync(a, s)[0] == R
            err, g = d.cuStreamEndCapture(s); assert err == R, err
            err, nodes, n = d.cuGraphGetNodes(g, 2); assert err == R and n == 2
            types = [d.cuGraphNodeGetType(x)[1] for x in nodes]
            assert types == [d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEM_ALLOC,
                             d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEM_FREE], types
            err, prm = d.cuGraphMemAllocNodeGetParams(nodes[0]); assert err == R
            assert prm.bytesize == 3 * {MiB} and int(prm.dptr) == int(a)
            assert int(d.cuGraphMemFreeNodeGetParams(nodes[1])[1]) == int(a)
            assert pool() == (0, 0) and d.cuMemGetInfo()[1] == free0  # nothing yet
            err, e = d.cuGraphInstantiate(g, 0); assert err == R, err
            assert d.cuGraphLaunch(e, s)[0] == R
            assert pool() == (0, 4 * {MiB}), pool()               # freed, kept
            assert d.cuMemGetInfo()[1] == free0 - 4 * {MiB}
            assert d.cuGraphLaunch(e, s)[0] == R                  # reused
            assert pool() == (0, 4 * {MiB})
            assert d.cuDeviceGraphMemTrim(0)[0] == R
            assert pool() == (0, 0) and d.cuMemGetInfo()[1] == free0
            assert d.cuGraphUpload(e, s)[0] == R                  # upload reserves
            assert pool() == (0, 4 * {MiB})
            assert d.cuDeviceGraphMemTrim(0)[0] == R
            # explicit node left live after the launch: freed with cuMemFree
            err, g2 = d.cuGraphCreate(0); assert err == R
            p = d.CUDA_MEM_ALLOC_NODE_PARAMS()
            p.poolProps.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            p.poolProps.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            p.poolProps.location.id = 0
            p.bytesize = {GiB}
            err, node = d.cuGraphAddMemAllocNode(g2, None, 0, p); assert err == R, err
            err, e2 = d.cuGraphInstantiate(g2, 0); assert err == R
            assert d.cuGraphLaunch(e2, s)[0] == R
            assert pool() == ({GiB}, {GiB})
            assert attr(A.CU_GRAPH_MEM_ATTR_USED_MEM_HIGH) == {GiB}
            # still live: launching again is an error
            assert d.cuGraphLaunch(e2, s)[0] == d.CUresult.CUDA_ERROR_INVALID_VALUE
            assert d.cuMemFree(p.dptr)[0] == R
            assert pool() == (0, {GiB})
            # a graph larger than the device: out of memory, nothing taken
            assert d.cuDeviceGraphMemTrim(0)[0] == R
            err, g3 = d.cuGraphCreate(0); assert err == R
            p.bytesize = 5 * {GiB}
            assert d.cuGraphAddMemAllocNode(g3, None, 0, p)[0] == R
            err, e3 = d.cuGraphInstantiate(g3, 0); assert err == R
            assert d.cuGraphLaunch(e3, s)[0] == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
            assert pool() == (0, 0) and d.cuMemGetInfo()[1] == free0
            for x in (e, e2, e3):
                assert d.cuGraphExecDestroy(x)[0] == R
            for x in (g, g2, g3):
                assert d.cuGraphDestroy(x)[0] == R
            assert d.cuCtxDestroy(ctx)[0] == R
            print("done")
            """,
            sim_env(tmp_path, "4g"),
        )
    )


# The start of a cuda-python script about graph memory nodes: the driver with
# a context and a stream s, and alloc_graph(nbytes, free=True), a graph with one
# allocation node (p, its parameters) and, with free, the node that frees it.
GRAPH_SCRIPT = """
from cuda.bindings import driver as d
R = d.CUresult.CUDA_SUCCESS
INVAL = d.CUresult.CUDA_ERROR_INVALID_VALUE
assert d.cuInit(0)[0] == R
err, ctx = d.cuCtxCreate(None, 0, 0); assert err == R, err
err, s = d.cuStreamCreate(0); assert err == R
def alloc_graph(nbytes, free=True):
    err, g = d.cuGraphCreate(0); assert err == R
    p = d.CUDA_MEM_ALLOC_NODE_PARAMS()
    p.poolProps.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.poolProps.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.poolProps.location.id = 0
    p.bytesize = nbytes
    assert d.cuGraphAddMemAllocNode(g, None, 0, p)[0] == R
    if free:
        assert d.cuGraphAddMemFreeNode(g, None, 0, p.dptr)[0] == R
    return g, p
"""


@needs_cuda_python
def test_cuda_python_child_graphs_hold_memory_nodes_only_when_moved(tmp_path: Path) -> None:
    """As in CUDA 12.9+: a child graph cloned into its node
    (cuGraphAddChildGraphNode, cuGraphAddNode with _OWNERSHIP_CLONE) may hold
    no memory nodes (CUDA_ERROR_INVALID_VALUE), and none can be added to a
    graph a node owns (cuGraphChildGraphNodeGetGraph's); one moved into its
    node (_OWNERSHIP_MOVE) may, at any depth, and its memory nodes run when
    the parent is launched.  A moved graph can no longer be instantiated,
    destroyed or added elsewhere."""
    ok(
        run_py(
            GRAPH_SCRIPT
            + textwrap.dedent(f"""
            T = d.CUgraphNodeType
            O = d.CUgraphChildGraphNodeOwnership
            def reserved():
                A = d.CUgraphMem_attribute.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT
                err, v = d.cuDeviceGetGraphMemAttribute(0, A); assert err == R, err
                return int(v)
            def child(parent, g, ownership):
                prm = d.CUgraphNodeParams()
                prm.type = T.CU_GRAPH_NODE_TYPE_GRAPH
                prm.graph.graph = g
                prm.graph.ownership = ownership
                return d.cuGraphAddNode(parent, None, None, 0, prm)
            err, parent = d.cuGraphCreate(0); assert err == R
            inner, p = alloc_graph(1 * {GiB})
            # cloned: refused while the child has memory nodes
            assert d.cuGraphAddChildGraphNode(parent, None, 0, inner)[0] == INVAL
            assert child(parent, inner, O.CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE)[0] == INVAL
            # a clone of a graph without them: its graph takes none
            err, plain = d.cuGraphCreate(0); assert err == R
            assert d.cuGraphAddEmptyNode(plain, None, 0)[0] == R
            err, cn = d.cuGraphAddChildGraphNode(parent, None, 0, plain); assert err == R, err
            assert d.cuGraphNodeGetType(cn)[1] == T.CU_GRAPH_NODE_TYPE_GRAPH
            err, cg = d.cuGraphChildGraphNodeGetGraph(cn); assert err == R, err
            assert d.cuGraphAddMemAllocNode(cg, None, 0, p)[0] == INVAL
            assert d.cuGraphDestroy(cg)[0] == INVAL
            # moved, two levels down: allowed, and run by the parent's launch
            err, mid = d.cuGraphCreate(0); assert err == R
            err, mn = child(mid, inner, O.CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE); assert err == R, err
            assert child(parent, mid, O.CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE)[0] == R
            assert d.cuGraphInstantiate(inner, 0)[0] == INVAL
            assert d.cuGraphDestroy(inner)[0] == INVAL
            assert d.cuGraphAddChildGraphNode(plain, None, 0, inner)[0] == INVAL
            assert child(plain, mid, O.CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE)[0] == INVAL
            assert d.cuGraphAddMemAllocNode(inner, None, 0, p)[0] == INVAL
            err, got = d.cuGraphChildGraphNodeGetGraph(mn); assert err == R
            assert int(got) == int(inner)
            # a graph moved into one it holds
            err, loop = d.cuGraphCreate(0); assert err == R
            assert child(loop, loop, O.CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE)[0] == INVAL
            err, e = d.cuGraphInstantiate(parent, 0); assert err == R, err
            assert reserved() == 0
            assert d.cuGraphLaunch(e, s)[0] == R
            assert reserved() == {GiB}, reserved()
            assert d.cuGraphExecDestroy(e)[0] == R
            assert d.cuGraphDestroy(parent)[0] == R   # and the graphs it holds
            assert d.cuGraphDestroy(plain)[0] == R
            assert d.cuGraphDestroy(loop)[0] == R
            assert d.cuDeviceGraphMemTrim(0)[0] == R
            assert d.cuCtxDestroy(ctx)[0] == R
            print("done")
            """),
            sim_env(tmp_path, "4g"),
        )
    )


@needs_cuda_python
def test_a_graph_with_memory_nodes_has_one_instantiation_at_a_time(tmp_path: Path) -> None:
    """As CUDA documents for cuGraphInstantiate: a graph with allocation or
    free nodes (a moved child graph's included) can have at most one
    executable graph at a time; instantiating it again before
    cuGraphExecDestroy is an error (CUDA_ERROR_INVALID_VALUE here), and so
    is instantiating a graph that holds a graph already instantiated.  Once
    the executable graph is destroyed the graph instantiates again, and an
    executable graph outlives its graph's destruction.  A graph without
    memory nodes instantiates any number of times.  The simulator used to
    instantiate such a graph any number of times."""
    ok(
        run_py(
            GRAPH_SCRIPT
            + textwrap.dedent(f"""
            g, p = alloc_graph(64 * {MiB})
            err, e = d.cuGraphInstantiate(g, 0); assert err == R, err
            assert d.cuGraphInstantiate(g, 0)[0] == INVAL
            prm = d.CUDA_GRAPH_INSTANTIATE_PARAMS()
            assert d.cuGraphInstantiateWithParams(g, prm)[0] == INVAL
            assert prm.result_out != d.CUgraphInstantiateResult.CUDA_GRAPH_INSTANTIATE_SUCCESS
            assert d.cuGraphLaunch(e, s)[0] == R
            assert d.cuGraphExecDestroy(e)[0] == R
            err, e = d.cuGraphInstantiate(g, 0); assert err == R, err   # again
            # the executable graph outlives its graph
            assert d.cuGraphDestroy(g)[0] == R
            assert d.cuGraphLaunch(e, s)[0] == R
            assert d.cuGraphExecDestroy(e)[0] == R
            # a graph with only a free node (of another graph's allocation)
            a, pa = alloc_graph(64 * {MiB}, free=False)
            err, ea = d.cuGraphInstantiate(a, 0); assert err == R
            err, f = d.cuGraphCreate(0); assert err == R
            assert d.cuGraphAddMemFreeNode(f, None, 0, pa.dptr)[0] == R
            err, ef = d.cuGraphInstantiate(f, 0); assert err == R, err
            assert d.cuGraphInstantiate(f, 0)[0] == INVAL
            assert d.cuGraphLaunch(ea, s)[0] == R
            assert d.cuGraphLaunch(ef, s)[0] == R
            for x in (ea, ef):
                assert d.cuGraphExecDestroy(x)[0] == R
            # a moved child graph's memory nodes count for the parent
            inner, _ = alloc_graph(64 * {MiB})
            err, parent = d.cuGraphCreate(0); assert err == R
            prm = d.CUgraphNodeParams()
            prm.type = d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_GRAPH
            prm.graph.graph = inner
            O = d.CUgraphChildGraphNodeOwnership
            prm.graph.ownership = O.CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE
            assert d.cuGraphAddNode(parent, None, None, 0, prm)[0] == R
            err, ep = d.cuGraphInstantiate(parent, 0); assert err == R, err
            assert d.cuGraphInstantiate(parent, 0)[0] == INVAL
            assert d.cuGraphExecDestroy(ep)[0] == R
            # a graph already instantiated, then moved into another
            held, _ = alloc_graph(64 * {MiB})
            err, eh = d.cuGraphInstantiate(held, 0); assert err == R
            err, outer = d.cuGraphCreate(0); assert err == R
            prm.graph.graph = held
            assert d.cuGraphAddNode(outer, None, None, 0, prm)[0] == R
            assert d.cuGraphInstantiate(outer, 0)[0] == INVAL
            assert d.cuGraphExecDestroy(eh)[0] == R
            err, eo = d.cuGraphInstantiate(outer, 0); assert err == R, err
            assert d.cuGraphExecDestroy(eo)[0] == R
            # no memory nodes: any number
            err, k = d.cuGraphCreate(0); assert err == R
            assert d.cuGraphAddEmptyNode(k, None, 0)[0] == R
            ks = [d.cuGraphInstantiate(k, 0) for _ in range(3)]
            assert [x[0] for x in ks] == [R] * 3, ks
            for _, x in ks:
                assert d.cuGraphExecDestroy(x)[0] == R
            for x in (a, f, parent, outer, k):
                assert d.cuGraphDestroy(x)[0] == R
            assert d.cuDeviceGraphMemTrim(0)[0] == R
            assert d.cuCtxDestroy(ctx)[0] == R
            print("done")
            """),
            sim_env(tmp_path, "4g"),
        )
    )


def test_pynvml_basics_and_ignores_cuda_visible_devices(tmp_path: Path) -> None:
    out = ok(
        run_py(
            """
            import pynvml as n
            n.nvmlInit()
            print(n.nvmlDeviceGetCount())
            for i in range(n.nvmlDeviceGetCount()):
                h = n.nvmlDeviceGetHandleByIndex(i)
                m = n.nvmlDeviceGetMemoryInfo(h)
                m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
                print(n.nvmlDeviceGetName(h), n.nvmlDeviceGetUUID(h), m.total, m.used,
                      m2.total, m2.free, len(n.nvmlDeviceGetComputeRunningProcesses(h)))
            print(n.nvmlSystemGetDriverVersion())
            n.nvmlShutdown()
            try:
                n.nvmlDeviceGetCount()
            except n.NVMLError_Uninitialized:
                print("uninit")
            """,
            sim_env(tmp_path, H100_SPEC, CUDA_VISIBLE_DEVICES="1"),
        )
    )
    lines = out.splitlines()
    assert lines[0] == "3"
    assert lines[1].startswith("NVIDIA H100 80GB HBM3 GPU-")
    assert lines[1].endswith(" 85899345920 0 85899345920 85899345920 0")
    assert lines[3] == (
        "gpuvisor simulated GPU GPU-12345678-1234-1234-1234-123456789abc "
        "25769803776 0 25769803776 25769803776 0"
    )
    assert lines[-1] == "uninit"


HOLDER = (
    CTYPES_PRELUDE
    + """
c = ctx(int(os.environ.get("DEV", "0")))
rc, p = alloc(int(os.environ["HOLD"]))
chk(rc, "alloc")
print("READY", os.getpid(), flush=True)
sys.stdin.readline()
"""
)


def _nvml_snapshot(env: dict[str, str]) -> dict[str, object]:
    out = ok(
        run_py(
            """
            import json, pynvml as n
            n.nvmlInit()
            h = n.nvmlDeviceGetHandleByIndex(0)
            m = n.nvmlDeviceGetMemoryInfo(h)
            procs = {p.pid: p.usedGpuMemory for p in n.nvmlDeviceGetComputeRunningProcesses(h)}
            print(json.dumps({"used": m.used, "free": m.free, "procs": procs}))
            """,
            env,
        )
    )
    import json

    result: dict[str, object] = json.loads(out)
    return result


def test_two_processes_see_same_usage_and_nvml_lists_pids(tmp_path: Path) -> None:
    env = sim_env(tmp_path, "8g")
    a = spawn_py(HOLDER, {**env, "HOLD": str(GiB)})
    b = spawn_py(HOLDER, {**env, "HOLD": str(3 * MiB)})
    try:
        pa = int(a.stdout.readline().split()[1])  # type: ignore[union-attr]
        pb = int(b.stdout.readline().split()[1])  # type: ignore[union-attr]
        snap = _nvml_snapshot(env)
        assert snap["procs"] == {str(pa): 32 * MiB + GiB, str(pb): 32 * MiB + 4 * MiB}
        assert snap["used"] == 64 * MiB + GiB + 4 * MiB
        # a third process's cuMemGetInfo sees both, plus its own context
        out = ok(run_py(CTYPES_PRELUDE + "ctx(); print(*meminfo())", env))
        free, total = map(int, out.split())
        assert total == 8 * GiB
        assert free == total - (96 * MiB + GiB + 4 * MiB)
    finally:
        for p in (a, b):
            p.communicate("\n", timeout=30)
    assert a.returncode == 0
    assert b.returncode == 0
    assert _nvml_snapshot(env) == {"used": 0, "free": 8 * GiB, "procs": {}}


def test_sigkilled_process_memory_is_released(tmp_path: Path) -> None:
    env = sim_env(tmp_path, "4g")
    a = spawn_py(HOLDER, {**env, "HOLD": str(3 * GiB)})
    pid = int(a.stdout.readline().split()[1])  # type: ignore[union-attr]
    assert _nvml_snapshot(env)["procs"] == {str(pid): 3 * GiB + 32 * MiB}
    # while it lives, the device is full for others
    code = CTYPES_PRELUDE + "ctx(); print(alloc(1 << 30)[0])"
    assert ok(run_py(code, env)).strip() == "2"
    os.kill(pid, signal.SIGKILL)
    a.wait(timeout=30)
    assert _nvml_snapshot(env) == {"used": 0, "free": 4 * GiB, "procs": {}}
    assert ok(run_py(code, env)).strip() == "0"


def test_random_sigkill_inside_driver_never_leaks_or_deadlocks(tmp_path: Path) -> None:
    """Workers hammer alloc/free/meminfo; SIGKILL lands at random instructions."""
    env = sim_env(tmp_path, "2g")
    worker = (
        CTYPES_PRELUDE
        + """
c = ctx()
print("GO", flush=True)
live = []
while True:
    rc, p = alloc(3 << 20)
    if rc == 0:
        live.append(p)
    if len(live) > 20 or rc != 0:
        for q in live:
            chk(free(q), "free")
        live = []
    meminfo()
"""
    )
    rng = random.Random(1234)
    for _ in range(4):
        procs = [spawn_py(worker, env) for _ in range(4)]
        for p in procs:
            assert p.stdout.readline().strip() == "GO"  # type: ignore[union-attr]
        time.sleep(rng.uniform(0.02, 0.15))
        for p in procs:
            time.sleep(rng.uniform(0, 0.01))
            p.kill()
        for p in procs:
            p.wait(timeout=30)
            assert p.returncode == -signal.SIGKILL, p.stderr.read()  # type: ignore[union-attr]
            p.stdout.close()  # type: ignore[union-attr]
            p.stderr.close()  # type: ignore[union-attr]
            p.stdin.close()  # type: ignore[union-attr]
    # nobody is left: usage must be exactly zero, and the lock must be free
    assert _nvml_snapshot(env) == {"used": 0, "free": 2 * GiB, "procs": {}}
    out = ok(run_py(CTYPES_PRELUDE + "ctx(); print(alloc(1900 << 20)[0])", env, timeout=20))
    assert out.strip() == "0"


def test_concurrent_first_use_creates_one_state(tmp_path: Path) -> None:
    env = sim_env(tmp_path, "16g")
    code = HOLDER
    procs = [spawn_py(code, {**env, "HOLD": str(GiB)}) for _ in range(6)]
    try:
        for p in procs:
            assert p.stdout.readline().startswith("READY")  # type: ignore[union-attr]
        snap = _nvml_snapshot(env)
        assert len(snap["procs"]) == 6  # type: ignore[arg-type]
        assert snap["used"] == 6 * (GiB + 32 * MiB)
    finally:
        for p in procs:
            p.communicate("\n", timeout=30)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_fail_alloc_at_and_every(tmp_path: Path) -> None:
    code = CTYPES_PRELUDE + "ctx(); print(*[alloc(1 << 20)[0] for _ in range(6)])"
    out = ok(run_py(code, sim_env(tmp_path, "4g", GPUVISOR_SIM_FAIL_ALLOC_AT="3")))
    assert out.split() == ["0", "0", "2", "0", "0", "0"]
    out = ok(run_py(code, sim_env(tmp_path, "4g", GPUVISOR_SIM_FAIL_ALLOC_EVERY="2")))
    assert out.split() == ["0", "2", "0", "2", "0", "2"]


def test_nvml_fail_knob(tmp_path: Path) -> None:
    code = """
        import pynvml as n
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        print(n.nvmlDeviceGetName(h))
        for f in (lambda: n.nvmlDeviceGetMemoryInfo(h),
                  lambda: n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)):
            try:
                f(); print("ok")
            except n.NVMLError as e:
                print("err", e.value)
        """
    env = sim_env(tmp_path, GPUVISOR_SIM_NVML_FAIL="nvmlDeviceGetMemoryInfo")
    assert ok(run_py(code, env)).split("\n")[1:3] == ["err 999", "err 999"]
    env = sim_env(
        tmp_path,
        GPUVISOR_SIM_NVML_FAIL="nvmlDeviceGetMemoryInfo_v2,nvmlShutdown",
        GPUVISOR_SIM_NVML_FAIL_CODE="3",
    )
    assert ok(run_py(code, env)).split("\n")[1:3] == ["ok", "err 3"]
    env = sim_env(tmp_path, GPUVISOR_SIM_NVML_FAIL="all")
    cp = run_py("import pynvml as n\nn.nvmlInit()", env)
    assert cp.returncode != 0
    assert "Unknown Error" in cp.stderr


@needs_cuda_python
def test_cuda_fail_knob(tmp_path: Path) -> None:
    """GPUVISOR_SIM_CUDA_FAIL: the listed graph-memory queries return
    CUDA_ERROR_UNKNOWN, the others answer as usual; names of functions that
    do not honour it change nothing."""
    code = """
        from cuda.bindings import driver as d
        A = d.CUgraphMem_attribute.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT
        assert d.cuInit(0)[0] == 0
        err, ctx = d.cuCtxCreate(None, 0, 0); assert err == 0, err
        err, g = d.cuGraphCreate(0); assert err == 0, err
        err, node = d.cuGraphAddEmptyNode(g, None, 0); assert err == 0, err
        print(int(d.cuDeviceGetGraphMemAttribute(0, A)[0]), int(d.cuGraphGetNodes(g, 1)[0]),
              int(d.cuGraphNodeGetType(node)[0]), int(d.cuMemGetInfo()[0]))
        """
    env = sim_env(tmp_path, "4g", GPUVISOR_SIM_CUDA_FAIL="cuMemGetInfo,cuGraphGetNodes")
    assert ok(run_py(code, env)).split() == ["0", "999", "0", "0"]
    env = sim_env(tmp_path, "4g", GPUVISOR_SIM_CUDA_FAIL="cuDeviceGetGraphMemAttribute")
    assert ok(run_py(code, env)).split() == ["999", "0", "0", "0"]


def _one_line_error(stderr: str, *needles: str) -> None:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("gpuvisor-sim:")]
    assert len(lines) == 1, stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize(
    "spec",
    [
        "banana",
        "2x",
        "0g",
        "4g:sms=0",
        "4g:color=red",
        "17x1g",
        "4g,,4g",
        "2x4g:uuid=GPU-12345678-1234-1234-1234-123456789abc",
    ],
)
def test_malformed_spec_fails_init_with_one_line(tmp_path: Path, spec: str) -> None:
    env = sim_env(tmp_path, spec)
    cp = run_py(CTYPES_PRELUDE + "print(cu.cuInit(0))", env)
    assert cp.returncode == 0
    assert cp.stdout.strip() != "0"
    _one_line_error(cp.stderr, "GPUVISOR_SIM_DEVICES", spec)
    cp = run_py("import pynvml as n\nn.nvmlInit()", env)
    assert cp.returncode != 0
    assert "GPUVISOR_SIM_DEVICES" in cp.stderr


def test_empty_spec_means_the_default_node(tmp_path: Path) -> None:
    """GPUVISOR_SIM_DEVICES set but empty is the default node (1x16g), as
    unset: not a malformed spec (docs/environment.md)."""
    cp = run_py(CTYPES_PRELUDE + "ctx(); print(*meminfo())", sim_env(tmp_path, ""))
    assert ok(cp).split()[1] == str(16 * GiB)
    assert "gpuvisor-sim:" not in cp.stderr, cp.stderr
    out = ok(
        run_py(
            "import pynvml as n\nn.nvmlInit()\nprint(n.nvmlDeviceGetCount())", sim_env(tmp_path, "")
        )
    )
    assert out.strip() == "1"


def test_size_units_in_spec(tmp_path: Path) -> None:
    code = """
        import pynvml as n
        n.nvmlInit()
        print(*[n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(i)).total
                for i in range(n.nvmlDeviceGetCount())])
        """
    out = ok(run_py(code, sim_env(tmp_path, "1073741824,512MiB,2GB,1t,3k")))
    assert out.split() == [str(GiB), str(512 * MiB), str(2 * GiB), str(1 << 40), "3072"]


@pytest.mark.parametrize("var", ["GPUVISOR_SIM_FAIL_ALLOC_AT", "GPUVISOR_SIM_FAIL_ALLOC_EVERY"])
def test_malformed_knob_is_reported_and_ignored(tmp_path: Path, var: str) -> None:
    env = sim_env(tmp_path, "4g", **{var: "often"})
    cp = run_py(CTYPES_PRELUDE + "ctx(); print(*[alloc(1 << 20)[0] for _ in range(4)])", env)
    assert ok(cp).split() == ["0"] * 4
    _one_line_error(cp.stderr, var, "often")


@needs_cuda_python
def test_module_mib_makes_modules_take_device_memory(tmp_path: Path) -> None:
    """GPUVISOR_SIM_MODULE_MIB: a module loaded into a context takes that
    much device memory (not a library, which has no context), given back
    at cuModuleUnload or with its context, and a device that cannot supply
    it refuses the load."""
    code = f"""
        from cuda.bindings import driver as d
        R = d.CUresult.CUDA_SUCCESS
        def used():
            err, free, total = d.cuMemGetInfo(); assert err == R
            return (total - free) // {MiB}
        assert d.cuInit(0)[0] == R
        err, ctx = d.cuCtxCreate(None, 0, 0); assert err == R
        base = used()
        err, lib = d.cuLibraryLoadData(b"x", None, None, 0, None, None, 0); assert err == R
        err, m = d.cuModuleLoadData(b"x"); assert err == R
        loaded = used()
        assert d.cuModuleUnload(m)[0] == R
        unloaded = used()
        err, m = d.cuModuleLoadData(b"x"); assert err == R
        err, m2 = d.cuModuleLoadData(b"x"); assert err == R
        full = d.cuModuleLoadData(b"x")[0].name
        assert d.cuCtxDestroy(ctx)[0] == R
        err, ctx = d.cuCtxCreate(None, 0, 0); assert err == R
        after = used()
        assert d.cuModuleUnload(m)[0] == R   # its context is gone: nothing more back
        print(base, loaded, unloaded, full, after, used())
        """
    out = ok(run_py(code, sim_env(tmp_path, "4g", GPUVISOR_SIM_MODULE_MIB="1500")))
    assert out.split() == ["32", "1532", "32", "CUDA_ERROR_OUT_OF_MEMORY", "32", "32"], out


@pytest.mark.parametrize(("value", "slow"), [("300", True), ("soon", False)])
def test_ctx_create_ms_slows_context_creation(tmp_path: Path, value: str, slow: bool) -> None:
    """GPUVISOR_SIM_CTX_CREATE_MS: a new context takes that long, and NVML
    lists the process while it is being created; a bad value is named and
    ignored."""
    code = (
        CTYPES_PRELUDE
        + """
import os, threading, time, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
seen = []
def watch():
    time.sleep(0.15)
    seen.append([p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)])
t = threading.Thread(target=watch); t.start()
t0 = time.monotonic(); ctx(); took = time.monotonic() - t0
t.join()
print(took, int(os.getpid() in seen[0]))
"""
    )
    cp = run_py(code, sim_env(tmp_path, "4g", GPUVISOR_SIM_CTX_CREATE_MS=value))
    took, listed = ok(cp).split()
    if slow:
        assert float(took) >= 0.3
        assert listed == "1"  # listed before the creation returned
        assert "gpuvisor-sim:" not in cp.stderr
    else:
        assert float(took) < 0.3
        _one_line_error(cp.stderr, "GPUVISOR_SIM_CTX_CREATE_MS", value)


def test_malformed_nvml_fail_code(tmp_path: Path) -> None:
    env = sim_env(
        tmp_path, GPUVISOR_SIM_NVML_FAIL="nvmlDeviceGetCount", GPUVISOR_SIM_NVML_FAIL_CODE="x1"
    )
    cp = run_py("import pynvml as n\nn.nvmlInit()\nprint(n.nvmlDeviceGetCount())", env)
    assert cp.returncode != 0
    assert "Unknown Error" in cp.stderr
    _one_line_error(cp.stderr, "GPUVISOR_SIM_NVML_FAIL_CODE", "x1")


@pytest.mark.parametrize(("offset", "shift", "warned"), [("1000", 1000, False), ("-5", 0, True)])
def test_nvml_pid_offset_stands_for_a_pid_namespace(
    tmp_path: Path, offset: str, shift: int, warned: bool
) -> None:
    """GPUVISOR_SIM_NVML_PID_OFFSET: NVML lists this process as PID + N (a
    driver reports host PIDs inside a PID namespace); a bad value is named
    and ignored."""
    code = (
        CTYPES_PRELUDE
        + """
import os, pynvml as n
ctx(); alloc(1 << 20)
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
print(os.getpid(), *[p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)])
"""
    )
    cp = run_py(code, sim_env(tmp_path, "4g", GPUVISOR_SIM_NVML_PID_OFFSET=offset))
    me, *listed = (int(x) for x in ok(cp).split())
    assert listed == [me + shift]
    if warned:
        _one_line_error(cp.stderr, "GPUVISOR_SIM_NVML_PID_OFFSET", offset)
    else:
        assert "gpuvisor-sim:" not in cp.stderr


def test_later_process_with_other_spec_warns_and_uses_file(tmp_path: Path) -> None:
    code = "import pynvml as n\nn.nvmlInit()\nprint(n.nvmlDeviceGetCount())"
    cp = run_py(code, sim_env(tmp_path, "3x8g"))
    assert ok(cp).strip() == "3"
    assert cp.stderr == ""
    cp = run_py(code, sim_env(tmp_path, "1x4g"))
    assert ok(cp).strip() == "3"
    _one_line_error(cp.stderr, "GPUVISOR_SIM_DEVICES", "1x4g")
    cp = run_py(code, sim_env(tmp_path, None))  # unset: silently the file's
    assert ok(cp).strip() == "3"
    assert cp.stderr == ""


def test_default_is_one_16g_device(tmp_path: Path) -> None:
    code = """
        import pynvml as n
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        print(n.nvmlDeviceGetCount(), n.nvmlDeviceGetMemoryInfo(h).total, n.nvmlDeviceGetName(h))
        """
    assert ok(run_py(code, sim_env(tmp_path, None))).strip() == (
        f"1 {16 * GiB} gpuvisor simulated GPU"
    )


def test_corrupt_state_file_fails_init_naming_file(tmp_path: Path) -> None:
    env = sim_env(tmp_path)
    Path(env["GPUVISOR_SIM_STATE"]).write_bytes(b"not a state file" * 100)
    cp = run_py(CTYPES_PRELUDE + "print(cu.cuInit(0))", env)
    assert ok(cp).strip() == "304"  # CUDA_ERROR_OPERATING_SYSTEM
    _one_line_error(cp.stderr, env["GPUVISOR_SIM_STATE"])


def test_cuda_visible_devices_orders_and_filters(tmp_path: Path) -> None:
    code = (
        CTYPES_PRELUDE
        + """
rc = cu.cuInit(0)
n = ctypes.c_int(-1)
cu.cuDeviceGetCount(ctypes.byref(n))
bus = []
for i in range(max(n.value, 0)):
    v = ctypes.c_int()
    chk(cu.cuDeviceGetAttribute(ctypes.byref(v), 33, i))
    bus.append(v.value)
print(rc, n.value, *bus)
"""
    )
    spec = "3x1g,1g:uuid=GPU-abcdef00-1234-1234-1234-123456789abc"
    cases = {
        "3,1": "0 2 3 1",
        "GPU-abc": "0 1 3",
        "2,x,0": "0 1 2",
        "": "100 -1",
        "9": "100 -1",
    }
    for value, want in cases.items():
        out = ok(run_py(code, sim_env(tmp_path, spec, CUDA_VISIBLE_DEVICES=value)))
        assert out.strip() == want, (value, out)


def test_a_child_forked_after_cuinit_cannot_use_cuda(tmp_path: Path) -> None:
    """A real driver cannot be used in a child forked after the parent's
    cuInit: cuInit and every call that needs it return
    CUDA_ERROR_NOT_INITIALIZED (3), so the child takes no memory and is no
    process NVML lists.  cuDriverGetVersion needs no cuInit and still works;
    the parent goes on as before.  A child forked before cuInit (the fork
    start method done right) initialises on its own."""
    code = (
        CTYPES_PRELUDE
        + """
import json, pynvml as n
ctx()
rc, p = alloc(1 << 20); chk(rc, "alloc")
def child_codes():
    v, c = ctypes.c_int(), ctypes.c_int()
    cur, p2 = ctypes.c_void_p(), ctypes.c_ulonglong()
    return {"init": cu.cuInit(0), "count": cu.cuDeviceGetCount(ctypes.byref(c)),
            "current": cu.cuCtxGetCurrent(ctypes.byref(cur)),
            "alloc": cu.cuMemAlloc_v2(ctypes.byref(p2), ctypes.c_size_t(1 << 20)),
            "free": cu.cuMemFree_v2(ctypes.c_ulonglong(p)),
            "create": cu.cuCtxCreate_v2(ctypes.byref(cur), 0, 0),
            "version": cu.cuDriverGetVersion(ctypes.byref(v))}
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, json.dumps(child_codes()).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 4096))
os.waitpid(pid, 0)
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
pids = [q.pid for q in n.nvmlDeviceGetComputeRunningProcesses(h)]
print(json.dumps({"child": child, "pids": pids, "me": os.getpid(), "free": free(p)}))
"""
    )
    import json

    out = json.loads(ok(run_py(code, sim_env(tmp_path, "4g"))))
    not_init = 3  # CUDA_ERROR_NOT_INITIALIZED
    assert out["child"] == {
        "init": not_init,
        "count": not_init,
        "current": not_init,
        "alloc": not_init,
        "free": not_init,
        "create": not_init,
        "version": 0,
    }, out
    assert out["pids"] == [out["me"]], out
    assert out["free"] == 0, out


@needs_cuda_python
def test_a_destroyed_context_still_current_is_context_is_destroyed(tmp_path: Path) -> None:
    """cuCtxDestroy documents that a context destroyed while current to
    other threads stays current to them, and that using it there gives
    CUDA_ERROR_CONTEXT_IS_DESTROYED; so does a current primary context
    released to zero (not initialised) until it is retained again."""
    out = ok(
        run_py(
            """
            import threading
            from cuda.bindings import driver as d
            R = d.CUresult.CUDA_SUCCESS
            assert d.cuInit(0)[0] == R
            err, ctx = d.cuCtxCreate(None, 0, 0); assert err == R
            t = threading.Thread(target=lambda: print("destroy", d.cuCtxDestroy(ctx)[0].name))
            t.start(); t.join()
            err, cur = d.cuCtxGetCurrent(); assert err == R
            print("current", int(cur) == int(ctx))
            print("alloc", d.cuMemAlloc(1 << 20)[0].name)
            print("sync", d.cuCtxSynchronize()[0].name)
            print("device", d.cuCtxGetDevice()[0].name)
            assert d.cuCtxPopCurrent()[0] == R
            err, p = d.cuDevicePrimaryCtxRetain(0); assert err == R
            assert d.cuCtxSetCurrent(p)[0] == R
            assert d.cuDevicePrimaryCtxRelease(0)[0] == R
            print("released", d.cuMemAlloc(1 << 20)[0].name)
            err, p2 = d.cuDevicePrimaryCtxRetain(0); assert err == R
            print("retained", d.cuMemAlloc(1 << 20)[0].name, int(p2) == int(p))
            """,
            sim_env(tmp_path, "4g"),
        )
    )
    assert out.split("\n")[:-1] == [
        "destroy CUDA_SUCCESS",
        "current True",
        "alloc CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "sync CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "device CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "released CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "retained CUDA_SUCCESS True",
    ], out


@needs_cuda_python
def test_a_destroyed_contexts_events_are_gone(tmp_path: Path) -> None:
    """Destroying a context destroys its events, as a real driver does:
    every call on one is then CUDA_ERROR_INVALID_HANDLE, and its memory is
    freed, so events made later may get the same handles (glibc reuses the
    chunks).  So for a created context, a primary context reset and one
    released to zero references; events of other contexts live on."""
    out = ok(
        run_py(
            """
            import json
            from cuda.bindings import driver as d
            R = d.CUresult.CUDA_SUCCESS
            def chk(r):
                assert r[0] == R, r
                return r[1] if len(r) == 2 else None
            chk(d.cuInit(0))
            keep = chk(d.cuCtxCreate(None, 0, 0))
            other = chk(d.cuEventCreate(0))
            def events(n):
                evs = [chk(d.cuEventCreate(0)) for _ in range(n)]
                for e in evs:
                    chk(d.cuEventRecord(e, None))
                return evs
            def calls(e, e2):
                return [
                    d.cuEventQuery(e)[0].name,
                    d.cuEventSynchronize(e)[0].name,
                    d.cuEventRecord(e, None)[0].name,
                    d.cuEventElapsedTime(e, e2)[0].name,
                    d.cuEventDestroy(e)[0].name,
                ]
            out = {}
            for how in ("destroy", "reset", "release"):
                if how == "destroy":
                    ctx = chk(d.cuCtxCreate(None, 0, 0))
                else:
                    ctx = chk(d.cuDevicePrimaryCtxRetain(0))
                    chk(d.cuCtxPushCurrent(ctx))
                old = events(8)
                gone = {int(e) for e in old}
                if how == "destroy":
                    chk(d.cuCtxDestroy(ctx))
                else:
                    chk(d.cuCtxPopCurrent())
                    if how == "reset":
                        chk(d.cuDevicePrimaryCtxReset(0))
                    chk(d.cuDevicePrimaryCtxRelease(0))   # (after a reset: to zero)
                chk(d.cuCtxSetCurrent(keep))
                stale = calls(old[0], old[1])     # before any handle is reused
                new = events(8)
                out[how] = {
                    "old": stale,
                    "reused": len(gone & {int(e) for e in new}),
                    "new": [d.cuEventSynchronize(e)[0].name for e in new],
                    "other": d.cuEventQuery(other)[0].name,
                }
                for e in new:
                    chk(d.cuEventDestroy(e))
            print(json.dumps(out))
            """,
            sim_env(tmp_path, "4g"),
        )
    )
    got = json.loads(out.strip().splitlines()[-1])
    for how in ("destroy", "reset", "release"):
        assert got[how]["old"] == ["CUDA_ERROR_INVALID_HANDLE"] * 5, got
        assert got[how]["reused"] > 0, got
        assert got[how]["new"] == ["CUDA_SUCCESS"] * 8, got
        assert got[how]["other"] == "CUDA_SUCCESS", got


@needs_cuda_python
def test_launch_limits_are_reported_and_are_the_ones_enforced(tmp_path: Path) -> None:
    """A client sizes its launches from cuDeviceGetAttribute, so the
    simulated compute capability 9.0 device reports the limits CUDA lists
    for it (block 1024 x 1024 x 64 and 1024 threads, grid 2^31-1 x 65535 x
    65535, 48 KiB static / 227 KiB opt-in shared memory per block, 2048
    threads and 32 blocks per SM, 64 KiB constant memory and registers per
    block), and a launch at a limit runs while one past it is
    CUDA_ERROR_INVALID_VALUE (cooperative: COOPERATIVE_LAUNCH_TOO_LARGE)."""
    out = ok(
        run_py(
            """
            import ctypes, json
            from cuda.bindings import driver as d
            A = d.CUdevice_attribute
            R = d.CUresult.CUDA_SUCCESS
            assert d.cuInit(0)[0] == R
            err, ctx = d.cuCtxCreate(None, 0, 0); assert err == R
            def attr(name):
                err, v = d.cuDeviceGetAttribute(getattr(A, "CU_DEVICE_ATTRIBUTE_" + name), 0)
                assert err == R, (name, err)
                return v
            names = ["MAX_BLOCK_DIM_X", "MAX_BLOCK_DIM_Y", "MAX_BLOCK_DIM_Z",
                     "MAX_GRID_DIM_X", "MAX_GRID_DIM_Y", "MAX_GRID_DIM_Z",
                     "MAX_THREADS_PER_BLOCK", "MAX_SHARED_MEMORY_PER_BLOCK",
                     "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", "MAX_THREADS_PER_MULTIPROCESSOR",
                     "MAX_BLOCKS_PER_MULTIPROCESSOR", "TOTAL_CONSTANT_MEMORY",
                     "MAX_REGISTERS_PER_BLOCK", "WARP_SIZE"]
            a = {n: attr(n) for n in names}
            sms = attr("MULTIPROCESSOR_COUNT")
            err, mod = d.cuModuleLoadData(b"image"); assert err == R
            err, f = d.cuModuleGetFunction(mod, b"k"); assert err == R
            def launch(g, b, shmem=0, coop=False):
                if coop:
                    return d.cuLaunchCooperativeKernel(f, *g, *b, shmem, 0, 0)[0].name
                return d.cuLaunchKernel(f, *g, *b, shmem, 0, 0, 0)[0].name
            res = {
                "block_x": launch((1, 1, 1), (a["MAX_BLOCK_DIM_X"], 1, 1)),
                "block_y": launch((1, 1, 1), (1, a["MAX_BLOCK_DIM_Y"], 1)),
                "block_z": launch((1, 1, 1), (1, 1, a["MAX_BLOCK_DIM_Z"])),
                "block_z_over": launch((1, 1, 1), (1, 1, a["MAX_BLOCK_DIM_Z"] + 1)),
                "threads_over": launch((1, 1, 1), (a["MAX_THREADS_PER_BLOCK"] + 1, 1, 1)),
                "grid_x": launch((a["MAX_GRID_DIM_X"], 1, 1), (1, 1, 1)),
                "grid_x_over": launch((a["MAX_GRID_DIM_X"] + 1, 1, 1), (1, 1, 1)),
                "grid_y": launch((1, a["MAX_GRID_DIM_Y"], 1), (1, 1, 1)),
                "grid_y_over": launch((1, a["MAX_GRID_DIM_Y"] + 1, 1), (1, 1, 1)),
                "grid_z_over": launch((1, 1, a["MAX_GRID_DIM_Z"] + 1), (1, 1, 1)),
                "shmem_optin": launch((1, 1, 1), (1, 1, 1), a["MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"]),
                "shmem_over": launch((1, 1, 1), (1, 1, 1),
                                     a["MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"] + 1),
            }
            per_sm = min(a["MAX_BLOCKS_PER_MULTIPROCESSOR"],
                         a["MAX_THREADS_PER_MULTIPROCESSOR"] // 32)
            res["coop"] = launch((sms * per_sm, 1, 1), (32, 1, 1), coop=True)
            res["coop_over"] = launch((sms * per_sm + 1, 1, 1), (32, 1, 1), coop=True)
            print(json.dumps({"attr": a, "launch": res}))
            """,
            sim_env(tmp_path, "4g:sms=4"),
        )
    )
    import json

    got = json.loads(out)
    assert got["attr"] == {
        "MAX_BLOCK_DIM_X": 1024,
        "MAX_BLOCK_DIM_Y": 1024,
        "MAX_BLOCK_DIM_Z": 64,
        "MAX_GRID_DIM_X": 2**31 - 1,
        "MAX_GRID_DIM_Y": 65535,
        "MAX_GRID_DIM_Z": 65535,
        "MAX_THREADS_PER_BLOCK": 1024,
        "MAX_SHARED_MEMORY_PER_BLOCK": 48 * 1024,
        "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 227 * 1024,
        "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
        "MAX_BLOCKS_PER_MULTIPROCESSOR": 32,
        "TOTAL_CONSTANT_MEMORY": 64 * 1024,
        "MAX_REGISTERS_PER_BLOCK": 65536,
        "WARP_SIZE": 32,
    }, got
    good, bad = "CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE"
    assert got["launch"] == {
        "block_x": good,
        "block_y": good,
        "block_z": good,
        "block_z_over": bad,
        "threads_over": bad,
        "grid_x": good,
        "grid_x_over": bad,
        "grid_y": good,
        "grid_y_over": bad,
        "grid_z_over": bad,
        "shmem_optin": good,
        "shmem_over": bad,
        "coop": good,
        "coop_over": "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
    }, got


def test_nvml_pci_info_v1_fills_only_the_v1_struct(tmp_path: Path) -> None:
    """nvmlDeviceGetPciInfo (no suffix) is the entry point of binaries built
    before NVML's PCI struct grew (busId[16] .. pciSubSystemId, reserved0-3:
    52 bytes); _v2/_v3 take the 68-byte struct with busIdLegacy and a 32-byte
    busId.  Each must be filled in its own layout: the v1 call must not
    write past 52 bytes of its caller's struct."""
    code = """
        import ctypes as C, json
        n = C.CDLL("libnvidia-ml.so.1")
        assert n.nvmlInit_v2() == 0
        h = C.c_void_p()
        assert n.nvmlDeviceGetHandleByIndex_v2(1, C.byref(h)) == 0
        class V1(C.Structure):
            _fields_ = [("busId", C.c_char * 16), ("domain", C.c_uint), ("bus", C.c_uint),
                        ("device", C.c_uint), ("pciDeviceId", C.c_uint),
                        ("pciSubSystemId", C.c_uint), ("reserved", C.c_uint * 4)]
        class V3(C.Structure):
            _fields_ = [("busIdLegacy", C.c_char * 16), ("domain", C.c_uint), ("bus", C.c_uint),
                        ("device", C.c_uint), ("pciDeviceId", C.c_uint),
                        ("pciSubSystemId", C.c_uint), ("busId", C.c_char * 32)]
        assert C.sizeof(V1) == 52 and C.sizeof(V3) == 68
        buf = (C.c_ubyte * 128)(*([0xAB] * 128))
        rc = n.nvmlDeviceGetPciInfo(h, buf)
        v1 = V1.from_buffer(buf)
        v3 = V3()
        rc3 = n.nvmlDeviceGetPciInfo_v3(h, C.byref(v3))
        print(json.dumps({"rc": rc, "rc3": rc3, "tail": list(buf[52:]),
                          "v1": [v1.busId.decode(), v1.domain, v1.bus, v1.device,
                                 v1.pciDeviceId, list(v1.reserved)],
                          "v3": [v3.busIdLegacy.decode(), v3.busId.decode(), v3.bus,
                                 v3.pciDeviceId]}))
        """
    import json

    out = json.loads(ok(run_py(code, sim_env(tmp_path, "2x4g"))))
    assert out["rc"] == 0, out
    assert out["rc3"] == 0, out
    assert out["tail"] == [0xAB] * (128 - 52), "nvmlDeviceGetPciInfo wrote past the v1 struct"
    assert out["v1"] == ["0000:01:00.0", 0, 1, 0, out["v3"][3], [0, 0, 0, 0]], out
    assert out["v3"][:3] == ["0000:01:00.0", "00000000:01:00.0", 1], out


def test_mem_get_info_answers_either_figure_alone(tmp_path: Path) -> None:
    """As the real driver: programs call cudaMemGetInfo(&free, NULL) and
    cudaMemGetInfo(NULL, &total), and the runtime passes the NULL on."""
    out = ok(
        run_py(
            CTYPES_PRELUDE
            + """
ctx()
P = ctypes.POINTER(ctypes.c_size_t)
f, t = ctypes.c_size_t(), ctypes.c_size_t()
assert cu.cuMemGetInfo_v2(ctypes.byref(f), P()) == 0
assert cu.cuMemGetInfo_v2(P(), ctypes.byref(t)) == 0
assert cu.cuMemGetInfo_v2(P(), P()) == 1  # CUDA_ERROR_INVALID_VALUE
U = ctypes.POINTER(ctypes.c_uint)
f1, t1 = ctypes.c_uint(), ctypes.c_uint()
assert cu.cuMemGetInfo(ctypes.byref(f1), U()) == 0
assert cu.cuMemGetInfo(U(), ctypes.byref(t1)) == 0
print(f.value, t.value, f1.value, t1.value)
""",
            sim_env(tmp_path, "4g"),
        )
    )
    free, total, free32, total32 = map(int, out.split())
    assert total == 4 * GiB
    assert free == total - 32 * MiB
    assert free32 == free
    assert total32 == 2**32 - 1  # 4 GiB does not fit the v1 ABI's 32 bits


@needs_cuda_python
@pytest.mark.parametrize(("flags", "depth"), [(1, 40), (4, 6)], ids=["layered", "cubemap"])
def test_a_layered_mipmapped_array_has_every_layer_at_every_level(
    tmp_path: Path, flags: int, depth: int
) -> None:
    """Depth counts the layers (a cubemap's six faces): the levels halve
    width and height only."""
    out = ok(
        run_py(
            f"""
            from cuda.bindings import driver as d
            R = d.CUresult.CUDA_SUCCESS
            assert d.cuInit(0)[0] == R
            err, ctx = d.cuCtxCreate(None, 0, 0); assert err == R, err
            free0 = d.cuMemGetInfo()[1]
            desc = d.CUDA_ARRAY3D_DESCRIPTOR()
            desc.Width = desc.Height = 1024
            desc.Depth = {depth}
            desc.Format = d.CUarray_format.CU_AD_FORMAT_UNSIGNED_INT8
            desc.NumChannels = 4
            desc.Flags = {flags}
            err, m = d.cuMipmappedArrayCreate(desc, 3); assert err == R, err
            print(free0 - d.cuMemGetInfo()[1])
            """,
            sim_env(tmp_path, "4g"),
        )
    )
    # 4 MiB a layer at level 0, 1 MiB at 1, 256 KiB at 2; rounded to 2 MiB.
    expect = depth * (4 * MiB + MiB + MiB // 4)
    assert int(out) == -(-expect // (2 * MiB)) * 2 * MiB


@needs_cuda_python
def test_a_mipmapped_arrays_level_count_is_clamped(tmp_path: Path) -> None:
    """As CUDA documents: levels past 1 + floor(log2(max(width, height,
    depth))) are not made (a 1024 x 1024 array has 11), however many are
    asked for."""
    out = ok(
        run_py(
            """
            from cuda.bindings import driver as d
            R = d.CUresult.CUDA_SUCCESS
            assert d.cuInit(0)[0] == R
            err, ctx = d.cuCtxCreate(None, 0, 0); assert err == R, err
            desc = d.CUDA_ARRAY3D_DESCRIPTOR()
            desc.Width = desc.Height = 1024
            desc.Format = d.CUarray_format.CU_AD_FORMAT_UNSIGNED_INT8
            desc.NumChannels = 4
            charged = []
            for levels in (11, 2**32 - 1):
                free0 = d.cuMemGetInfo()[1]
                err, m = d.cuMipmappedArrayCreate(desc, levels); assert err == R, err
                charged.append(free0 - d.cuMemGetInfo()[1])
                assert d.cuMipmappedArrayDestroy(m)[0] == R
            print(*charged)
            """,
            sim_env(tmp_path, "4g"),
            timeout=30,
        )
    )
    full, asked_more = map(int, out.split())
    assert full == 6 * MiB  # 4 MiB + 1 MiB + ... + 4 bytes, rounded up to 2 MiB
    assert asked_more == full


def test_nvml_error_strings(tmp_path: Path) -> None:
    """nvmlErrorString names each code the simulator returns as the real
    library does (the device plugin's MIG messages quote it); an unknown
    code reads "Unknown Error"."""
    code = """
        import pynvml as n
        n.nvmlInit()
        for c in (n.NVML_ERROR_IN_USE, n.NVML_ERROR_INSUFFICIENT_RESOURCES,
                  n.NVML_ERROR_NOT_FOUND, 12345):
            print(n.nvmlErrorString(c))
        """
    out = ok(run_py(code, sim_env(tmp_path, ""))).splitlines()
    assert out == [
        "In use by another client",
        "Ran out of critical resources, other than memory",
        "Not Found",
        "Unknown Error",
    ]


@needs_cuda_python
@pytest.mark.parametrize(("timeslice", "preempts"), [(None, 0), ("2048", 1)])
def test_compute_preemption_is_reported_by_mode(
    tmp_path: Path, timeslice: str | None, preempts: int
) -> None:
    """CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED says what the
    simulated device does: the time-slicing mode preempts a running kernel
    for another context's slice (as every GPU since Pascal), the
    launch-order timeline runs each kernel to its end.  The interposer takes
    the turn between containers only on a device that preempts
    (sm_arbiter.c)."""
    env = sim_env(tmp_path, "1g")
    if timeslice:
        env["GPUVISOR_SIM_TIMESLICE_US"] = timeslice
    out = ok(
        run_py(
            """
            from cuda.bindings import driver as d
            A = d.CUdevice_attribute
            assert d.cuInit(0)[0] == d.CUresult.CUDA_SUCCESS
            err, v = d.cuDeviceGetAttribute(
                A.CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED, 0)
            print(err.name, v)
            """,
            env,
        )
    )
    assert out.split() == ["CUDA_SUCCESS", str(preempts)]
