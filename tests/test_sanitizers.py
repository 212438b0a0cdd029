"""The interposer under AddressSanitizer + UndefinedBehaviorSanitizer.

`make asan` builds the library, the simulator and the C tests with
-fsanitize=address,undefined into build-asan/ (`make test` always does).
Any report makes the sanitized program exit non-zero.  The region code's
ThreadSanitizer runs are in test_region_native.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import CU_SPIN_PRELUDE, REPO_ROOT, SimNode

ASAN_DIR = REPO_ROOT / "build-asan"


def asan_runtime() -> str:
    out = subprocess.run(
        ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return out if out.startswith("/") else ""


@pytest.fixture
def asan_env(node: SimNode) -> dict[str, str]:
    if not (ASAN_DIR / "libgpuvisor.so").is_file():
        pytest.skip("build-asan/ missing: run `make asan` (make test does)")
    env = dict(node.env)
    env.update(
        LD_LIBRARY_PATH=str(ASAN_DIR / "sim"),
        LD_PRELOAD=str(ASAN_DIR / "libgpuvisor.so"),
        # The sanitized C programs load the runtime themselves, after the
        # preloaded library; that order is fine for a library that only
        # interposes driver symbols.
        ASAN_OPTIONS="verify_asan_link_order=0:abort_on_error=0:exitcode=86",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
        # Context creations take the node lock (node_lock.c) under the
        # sanitizers too.
        GPUVISOR_NODE_LOCK=str(node.dir / "node.lock"),
    )
    return env


def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=120, check=False, cwd=REPO_ROOT
    )


def python_asan_env(asan_env: dict[str, str], **extra: str) -> dict[str, str]:
    """asan_env for a Python client: Python itself is not sanitized, so the
    ASan runtime must be loaded first (skips when gcc has none)."""
    runtime = asan_runtime()
    if not runtime:
        pytest.skip("gcc has no libasan.so")
    env = dict(asan_env, **extra)
    env["LD_PRELOAD"] = f"{runtime}:{asan_env['LD_PRELOAD']}"
    env["ASAN_OPTIONS"] = "detect_leaks=0:exitcode=86"
    return env


def test_interception_paths_under_asan(asan_env: dict[str, str]) -> None:
    proc = run([str(ASAN_DIR / "tests" / "t_link_intercept")], asan_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR: AddressSanitizer" not in proc.stderr
    assert os.path.isfile(asan_env["GPUVISOR_NODE_LOCK"])  # its contexts took the lock


def test_threads_and_processes_under_asan(asan_env: dict[str, str]) -> None:
    churn = str(ASAN_DIR / "tests" / "t_link_churn")
    procs = [
        subprocess.Popen(
            [churn, "1", "4", "64", str(seed), "wait"],
            env=asan_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(4)
    ]
    # Every context exists before anyone allocates (contexts count too).
    for p in procs:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        out, err = p.communicate("go\n", timeout=120)
        assert p.returncode == 0, err
        assert "ok=" in out


def test_pool_free_racing_its_destroy_under_asan(asan_env: dict[str, str]) -> None:
    for mode in ("async", "sync"):
        proc = run([str(ASAN_DIR / "tests" / "t_link_pool_race"), "300", mode], asan_env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "low=0 leaked=0" in proc.stdout


CLIENT = """
from tests.cuclient import *
init()
for name, kind in ALLOCATORS.items():
    a = kind()
    base = used()
    err, h = a.alloc(64 * MiB)
    assert err == SUCCESS, (name, err)
    assert used() > base, name
    over, h2 = a.alloc(2 * GiB)
    assert over != SUCCESS, name
    a.free(h)
    assert used() == base, name
# graph memory: captured allocation, launch, refusal, trim, destruction
base = used()
s = ok(cu.cuStreamCreate, 0)
ok(cu.cuStreamBeginCapture, s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
ok(cu.cuMemFreeAsync, ok(cu.cuMemAllocAsync, 64 * MiB, s), s)
g = ok(cu.cuStreamEndCapture, s)
e = ok(cu.cuGraphInstantiate, g, 0)
ok(cu.cuGraphLaunch, e, s)
assert used() == base + 64 * MiB
ok(cu.cuGraphLaunch, e, s)                                  # the pool holds it
ok(cu.cuDeviceGraphMemTrim, 0)
big = ok(cu.cuMemAlloc, mem_info()[0] - 32 * MiB)          # leaves 32 MiB
assert call(cu.cuGraphLaunch, e, s)[0] == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY
ok(cu.cuMemFree, big)
ok(cu.cuGraphExecDestroy, e)
ok(cu.cuGraphDestroy, g)
ok(cu.cuDeviceGraphMemTrim, 0)
assert used() == base
# a graph allocating on two devices: each pool locked, charged and settled
g, ptrs = ok(cu.cuGraphCreate, 0), []
for dev in (0, 1):
    dptr = add_alloc_node(g, 64 * MiB, dev)
    ptrs.append(dptr)
e = ok(cu.cuGraphInstantiate, g, 0)
ok(cu.cuGraphLaunch, e, s)
ok(cu.cuStreamSynchronize, s)
assert used() == base + 64 * MiB
ok(cu.cuGraphExecDestroy, e)
ok(cu.cuGraphDestroy, g)
for dev, ptr in enumerate(ptrs):
    ok(cu.cuMemFree, ptr)
    ok(cu.cuDeviceGraphMemTrim, dev)
assert used() == base
# memory nodes in child graphs (moved in, CUDA 12.9): read down to the
# interposer's depth, charged; one deeper refuses the instantiation
def nested(nbytes, depth):
    g = ok(cu.cuGraphCreate, 0)
    dptr = add_alloc_node(g, nbytes)
    ok(cu.cuGraphAddMemFreeNode, g, None, 0, dptr)
    for _ in range(depth):
        parent = ok(cu.cuGraphCreate, 0)
        ok(cu.cuGraphAddEmptyNode, parent, None, 0)
        prm = cu.CUgraphNodeParams()
        prm.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_GRAPH
        prm.graph.graph = g
        prm.graph.ownership = cu.CUgraphChildGraphNodeOwnership.CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE
        ok(cu.cuGraphAddNode, parent, None, None, 0, prm)
        g = parent
    return g
g = nested(64 * MiB, 3)
e = ok(cu.cuGraphInstantiate, g, 0)
ok(cu.cuGraphLaunch, e, s)
assert used() == base + 64 * MiB
ok(cu.cuGraphExecDestroy, e)
ok(cu.cuGraphDestroy, g)
g = nested(64 * MiB, 33)
assert call(cu.cuGraphInstantiate, g, 0)[0] == cu.CUresult.CUDA_ERROR_NOT_SUPPORTED
ok(cu.cuGraphDestroy, g)
ok(cu.cuDeviceGraphMemTrim, 0)
assert used() == base
# auto-free graphs: relaunches, frees of their live allocation (by
# cuMemFree, cuMemFreeAsync, another graph's free node), destruction while
# live, and a context destroyed with one live
AUTO = cu.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH
def left_live(nbytes):
    g = ok(cu.cuGraphCreate, 0)
    dptr = add_alloc_node(g, nbytes)
    return g, ok(cu.cuGraphInstantiate, g, AUTO), dptr
g, e, dptr = left_live(600 * MiB)
for _ in range(3):
    ok(cu.cuGraphLaunch, e, s)
assert used() == base + 600 * MiB
ok(cu.cuMemFree, dptr)
ok(cu.cuGraphLaunch, e, s)
ok(cu.cuMemFreeAsync, dptr, s)
ok(cu.cuGraphLaunch, e, s)
fg = ok(cu.cuGraphCreate, 0)
ok(cu.cuGraphAddMemFreeNode, fg, None, 0, dptr)
fe = ok(cu.cuGraphInstantiate, fg, 0)
ok(cu.cuGraphLaunch, fe, s)
ok(cu.cuGraphLaunch, e, s)
ok(cu.cuGraphExecDestroy, e)
ok(cu.cuGraphExecDestroy, fe)
ok(cu.cuMemFree, dptr)
ok(cu.cuDeviceGraphMemTrim, 0)
assert used() == base
primary = ok(cu.cuCtxGetCurrent)
ctx = ok(cu.cuCtxCreate, None, 0, ok(cu.cuDeviceGet, 0))
cs = ok(cu.cuStreamCreate, 0)
e = ok(cu.cuGraphInstantiate, g, AUTO)
ok(cu.cuGraphLaunch, e, cs)
ok(cu.cuGraphLaunch, e, cs)
ok(cu.cuCtxDestroy, ctx)
ok(cu.cuCtxSetCurrent, primary)
ok(cu.cuGraphExecDestroy, e)
ok(cu.cuGraphDestroy, g)
ok(cu.cuGraphDestroy, fg)
ok(cu.cuDeviceGraphMemTrim, 0)
assert used() == base
# memory the driver takes on its own (a device heap), charged from NVML
ok(cu.cuCtxSetLimit, cu.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE, 256 * MiB)
assert used() == base + 248 * MiB
ok(cu.cuCtxSetLimit, cu.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE, 8 * MiB)
assert used() == base
print("clean")
"""


def test_python_client_every_allocation_api_under_asan(asan_env: dict[str, str]) -> None:
    env = python_asan_env(asan_env)
    proc = run([sys.executable, "-c", textwrap.dedent(CLIENT)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("clean")


FAIL_CLOSED_GRAPHS = """
from tests.cuclient import *
import os
UNKNOWN = cu.CUresult.CUDA_ERROR_UNKNOWN
OOM = cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY
primary = init()
base = used()
def captured(nbytes):
    s = ok(cu.cuStreamCreate, 0)
    ok(cu.cuStreamBeginCapture, s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    ok(cu.cuMemFreeAsync, ok(cu.cuMemAllocAsync, nbytes, s), s)
    return ok(cu.cuStreamEndCapture, s), s
g, s = captured(64 * MiB)
fail = os.environ["GPUVISOR_SIM_CUDA_FAIL"]
if fail == "cuGraphChildGraphNodeGetGraph":
    # a child graph that cannot be read: the instantiation refused
    parent = ok(cu.cuGraphCreate, 0)
    prm = cu.CUgraphNodeParams()
    prm.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_GRAPH
    prm.graph.graph = captured(64 * MiB)[0]
    prm.graph.ownership = cu.CUgraphChildGraphNodeOwnership.CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE
    ok(cu.cuGraphAddNode, parent, None, None, 0, prm)
    assert call(cu.cuGraphInstantiate, parent, 0)[0] == UNKNOWN
    ok(cu.cuGraphDestroy, parent)
elif fail == "cuGraphNodeGetType":
    # a graph whose nodes cannot be read: destroyed, its instantiation refused
    assert call(cu.cuGraphInstantiate, g, 0)[0] == UNKNOWN
else:
    # a pool that cannot be read: each launch charged in full, kept
    e = ok(cu.cuGraphInstantiate, g, 0)
    ok(cu.cuGraphLaunch, e, s)
    ok(cu.cuGraphLaunch, e, s)
    assert used() == base + 128 * MiB
    ok(cu.cuGraphExecDestroy, e)
# an executable graph outliving its context, launched from another
ctx = ok(cu.cuCtxCreate, None, 0, ok(cu.cuDeviceGet, 0))
e2 = call(cu.cuGraphInstantiate, g, 0)[1]
ok(cu.cuCtxDestroy, ctx)
ok(cu.cuCtxSetCurrent, primary)
if e2 is not None and fail != "cuGraphNodeGetType":
    ok(cu.cuGraphLaunch, e2, s)
    ok(cu.cuGraphExecDestroy, e2)
ok(cu.cuGraphDestroy, g)
print("clean")
"""


@pytest.mark.parametrize(
    "query", ["cuGraphNodeGetType", "cuGraphChildGraphNodeGetGraph", "cuDeviceGetGraphMemAttribute"]
)
def test_graph_memory_failing_closed_under_asan(asan_env: dict[str, str], query: str) -> None:
    """The graph-memory paths that fail closed, sanitized: an instantiation
    refused (its executable graph destroyed, its record freed), launches on
    a pool that cannot be read, and a graph launched after its context."""
    env = python_asan_env(asan_env, GPUVISOR_SIM_CUDA_FAIL=query)
    proc = run([sys.executable, "-c", textwrap.dedent(FAIL_CLOSED_GRAPHS)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("clean")


LAUNCHES = (
    CU_SPIN_PRELUDE
    + """
for i in range(300):
    launch(50 + i)
chk(cu.cuStreamSynchronize(s))
print("clean")
"""
)


def test_sm_gate_and_meter_under_asan(asan_env: dict[str, str]) -> None:
    """Paced launches, the meter thread and its event handling, sanitized."""
    env = python_asan_env(asan_env, CUDA_DEVICE_SM_LIMIT="50")
    proc = run([sys.executable, "-c", textwrap.dedent(LAUNCHES)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("clean")


@pytest.mark.parametrize("how", ["destroy", "reset", "release"])
def test_a_context_destroyed_under_the_meter_under_asan(asan_env: dict[str, str], how: str) -> None:
    """Gated launches in flight when their context is destroyed (the
    simulator frees its events then, as a driver does): the handover to the
    meter and the meter's settling of that context's launches, sanitized
    (tests/test_sm_context_destroy.py has what the handover is for; ASan's
    quarantine keeps freed events' addresses from being reused, so the old
    defect does not show here)."""
    from tests.test_sm_context_destroy import PROGRAM

    env = python_asan_env(asan_env, CUDA_DEVICE_SM_LIMIT="50")
    proc = run([sys.executable, "-c", textwrap.dedent(PROGRAM), how, "2"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert '"errors": {}' in proc.stdout, proc.stdout


def test_stream_ordered_frees_pending_under_asan(asan_env: dict[str, str]) -> None:
    """cuMemFreeAsync of a cuMemAlloc block held until its stream gets there:
    the slot table, the event, the release at a synchronisation and with
    the stream's context (tests/test_race_kill.py has what each shows)."""
    prog = str(ASAN_DIR / "tests" / "t_link_free_async")
    for mode in ("event", "ptsz", "destroy"):
        proc = run([prog, mode], asan_env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.startswith("pending=2 "), proc.stdout
        assert proc.stdout.strip().endswith("after=0"), proc.stdout
    for mode in ("evquery", "procaddr_ptsz"):  # released by a query, then another process
        proc = run([prog, mode], asan_env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "take=0" in proc.stdout, proc.stdout
        assert "pending=2 during=800 synced=32 after=0 " in proc.stdout, proc.stdout
    proc = run([prog, "sdestroy"], asan_env)  # released by the stream's destruction
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "take=0" in proc.stdout, proc.stdout
    assert "pending=2 during=800 synced=32 after=0" in proc.stdout, proc.stdout
    proc = run([prog, "many"], asan_env)
    assert proc.stdout.strip() == "many blocked=1 used=32", proc.stdout + proc.stderr
    proc = run([prog, "threads"], asan_env)
    assert proc.stdout.strip() == "threads failed=0 used=32", proc.stdout + proc.stderr
    proc = run([prog, "devices"], dict(asan_env, GPUVISOR_SIM_MODULE_MIB="64"))
    assert proc.stdout.strip() == "devices failed=0 used=96,96", proc.stdout + proc.stderr


def test_frees_in_flight_under_asan(asan_env: dict[str, str]) -> None:
    """Frees in flight while another thread reads untracked memory."""
    env = dict(
        asan_env,
        CUDA_DEVICE_MEMORY_LIMIT="4g",
        GPUVISOR_SIM_DEVICES="2x16g:ctx=256m",
        GPUVISOR_SIM_FREE_MS="1000",
        GPUVISOR_SIM_ALLOC_MS="1500",
    )
    for mode in ("primary", "async"):
        proc = run([str(ASAN_DIR / "tests" / "t_link_free_race"), mode], env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "during=1344 after=1344" in proc.stdout, proc.stdout


def test_pool_shrunk_by_a_synchronisation_under_asan(asan_env: dict[str, str]) -> None:
    """A synchronisation shrinks a pool while another thread's allocations
    read untracked memory (tests/test_race_kill.py has what it shows)."""
    env = dict(asan_env, CUDA_DEVICE_MEMORY_LIMIT="4g", GPUVISOR_SIM_FREE_MS="1200")
    proc = run([str(ASAN_DIR / "tests" / "t_link_pool_sync_race"), "event"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = {k: int(v) for k, v in (item.split("=", 1) for item in proc.stdout.split())}
    assert out["synced_a"] == 1056, proc.stdout
    assert out["synced"] == out["after"] == 1056 + 2 * out["n"], proc.stdout
    assert out["low"] == 0, proc.stdout


def tsan_program(node: SimNode, name: str) -> tuple[Path, dict[str, str]]:
    """A C test program of build-tsan/ and the environment that runs it
    with the ThreadSanitizer builds of the library and the simulator
    (skips without them)."""
    tsan = REPO_ROOT / "build-tsan"
    prog = tsan / "tests" / name
    if not (tsan / "libgpuvisor.so").is_file() or not prog.is_file():
        pytest.skip("build-tsan/ missing: run `make tsan` (make test does)")
    env = dict(
        node.env,
        LD_LIBRARY_PATH=str(tsan / "sim"),
        LD_PRELOAD=str(tsan / "libgpuvisor.so"),
        TSAN_OPTIONS="exitcode=66:halt_on_error=1",
    )
    return prog, env


def test_stream_ordered_frees_pending_under_tsan(node: SimNode) -> None:
    """The table of pending frees is lock-free: four threads queue, reach
    and synchronise frees at once under ThreadSanitizer (`make tsan` builds
    the library, the simulator and this program into build-tsan/)."""
    prog, env = tsan_program(node, "t_link_free_async")
    env.update(
        CUDA_DEVICE_MEMORY_LIMIT="1g",
    )
    proc = run([str(prog), "threads"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "threads failed=0 used=32", proc.stdout + proc.stderr
    proc = run([str(prog), "destroy"], env)  # held, then released with the context
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "pending=2 during=832 synced=32 after=0", proc.stdout
    # two devices, each one's readings releasing (and reading again) the
    # other's frees; a 64 MiB module on each is memory only NVML shows
    proc = run([str(prog), "devices"], dict(env, GPUVISOR_SIM_MODULE_MIB="64"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "devices failed=0 used=96,96", proc.stdout + proc.stderr


@pytest.mark.parametrize("where", ["node", "region"])
def test_gated_launches_from_threads_under_tsan(node: SimNode, where: str) -> None:
    """Four threads launch kernels and graphs through the SM gate at once:
    the pacing clock, the enqueue word (the node directory's, or without
    one the region's) and the meter thread, under ThreadSanitizer."""
    prog, env = tsan_program(node, "t_link_sm_threads")
    env.update(CUDA_DEVICE_SM_LIMIT="60")
    if where == "region":
        env["GPUVISOR_NODE_LOCK"] = ""
    proc = run([str(prog)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "launched=400 failed=0", proc.stdout + proc.stderr


def test_policy_updates_beside_the_meter_under_tsan(node: SimNode) -> None:
    """Gated launches for 2.5 s, so that the policy thread's updates (every
    100 ms) and the calibration against NVML's samples (from 0.5 s of
    them) run beside the meter thread's settling, which shares the
    calibration state with them (sm_policy_thread.c, sm_calib.c), under
    ThreadSanitizer."""
    prog, env = tsan_program(node, "t_link_sm_threads")
    env.update(CUDA_DEVICE_SM_LIMIT="60")
    proc = run([str(prog), "2.5"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launched, failed = (int(w.split("=")[1]) for w in proc.stdout.split())
    assert failed == 0, proc.stdout + proc.stderr
    assert launched > 400, proc.stdout


def test_pool_shrunk_by_a_synchronisation_under_tsan(node: SimNode) -> None:
    """A pool settled by a synchronisation and by another thread's readings
    of untracked memory at once, under ThreadSanitizer."""
    prog, env = tsan_program(node, "t_link_pool_sync_race")
    env.update(
        CUDA_DEVICE_MEMORY_LIMIT="4g",
        GPUVISOR_SIM_FREE_MS="1200",
    )
    proc = run([str(prog), "ctx"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " low=0" in proc.stdout, proc.stdout
