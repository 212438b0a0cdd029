"""Memory oversubscription (CUDA_OVERSUBSCRIBE=true, docs/oversubscription.md).

Two containers (two region files) share one simulated 4 GiB device and the
node directory; each has a 4 GiB quota and S = 2, so each is guaranteed
2 GiB of device memory.  The witness is the simulated driver's own
per-process figure of device memory (NVML, read without the library): it
never counts more than the device holds.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests import helpers_oversub
from tests.helpers import GiB, SimNode, run_cli, run_json, run_py
from tests.helpers_oversub import (
    OVER,
    SIM_CONTEXT,
    check_guarantees,
    nothing_left,
    physical,
    race_and_kill,
    worker,
)

# A container's process: a primary context, then it obeys lines on stdin:
# "alloc N" (cuMemAlloc of N MiB, answers the result), "pitch W H",
# "managed N", "free" (the last allocation), "info" (cuMemGetInfo), "touch"
# (memset and copy on every live allocation), "loop N" (N rounds of
# allocating and freeing 256 MiB, for the SIGKILL test).
WORKER = worker(
    """
def alloc(mib):
    return keep(*call(cu.cuMemAlloc, int(mib) * MiB), int(mib) * MiB)
def pitch(w, h):
    w, h = int(w), int(h)
    err, v = call(cu.cuMemAllocPitch, w, h, 4)
    out = {}
    if err == SUCCESS:
        held.append((v[0], v[1] * h))
        out = {"pitch": int(v[1])}
    out["err"] = err.name
    return out
def managed(mib):
    flags = cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL
    return keep(*call(cu.cuMemAllocManaged, int(mib) * MiB, flags), int(mib) * MiB)
def info():
    free, total = mem_info()
    return {"free": free, "total": total}
def loop(n):
    for _ in range(int(n)):
        err, p = call(cu.cuMemAlloc, 256 * MiB)
        if err == SUCCESS:
            ok(cu.cuMemFree, p)
    return {"err": "CUDA_SUCCESS"}
COMMANDS = {"alloc": alloc, "pitch": pitch, "managed": managed, "free": free, "info": info,
            "touch": touch, "loop": loop}
"""
)


class Container(helpers_oversub.Container):
    """One container: its own region file, WORKER processes."""

    def __init__(self, node: SimNode, name: str, **env: str) -> None:
        super().__init__(node, name, WORKER, **env)


def test_two_containers_each_get_three_gib_and_their_guarantee(small):
    a = Container(small, "a", **OVER)
    b = Container(small, "b", **OVER)
    try:
        asked = {a.pid: 0, b.pid: 0}
        assert a.ask("alloc 3072")["err"] == "CUDA_SUCCESS"
        asked[a.pid] = 3 * GiB
        check_guarantees(small, a, b, asked=asked)
        assert b.ask("alloc 3072")["err"] == "CUDA_SUCCESS"
        asked[b.pid] = 3 * GiB
        check_guarantees(small, a, b, asked=asked)
        # The quota is the device's size, and nothing short of it is refused.
        info = a.ask("info")
        assert info["total"] == 4 * GiB
        assert info["free"] == 4 * GiB - 3 * GiB - SIM_CONTEXT
        assert a.ask("alloc 992")["err"] == "CUDA_SUCCESS"
        assert a.ask("alloc 2")["err"] == "CUDA_ERROR_OUT_OF_MEMORY"
        # Kernels and copies (here: memset and copies) work on spilled memory.
        assert a.ask("touch")["err"] == "CUDA_SUCCESS"
        assert b.ask("touch")["err"] == "CUDA_SUCCESS"
        fa, fb = a.figures(), b.figures()
        assert fa["used"] == 4 * GiB, fa
        assert fb["used"] == 3 * GiB + SIM_CONTEXT, fb
        assert fa["spilled"] > 0, fa
        assert fb["spilled"] > 0, fb
        check_guarantees(small, a, b, asked=asked)
        # gpuvisor status shows the spilled part apart.
        status_env = dict(small.env, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(a.region))
        proc = run_cli("status", "--json", "--sample", "0", env=status_env)
        assert proc.returncode == 0, proc.stderr
        dev = json.loads(proc.stdout)["devices"][0]
        assert dev["memory_used"] == 4 * GiB
        assert dev["memory_spilled"] == fa["spilled"]
        assert dev["memory_guarantee"] == 2 * GiB
        table = run_cli("status", "--sample", "0", env=status_env).stdout.splitlines()
        head = next(i for i, line in enumerate(table) if line.startswith("DEV "))
        assert table[head].split()[:4] == ["DEV", "UUID", "USED", "SPILLED"], table
        assert table[head + 1].split()[2:6] == ["4.0", "GiB", "2.0", "GiB"], table
        # Frees give back the spilled part as well.
        assert a.ask("free")["err"] == "CUDA_SUCCESS"
        assert a.ask("free")["err"] == "CUDA_SUCCESS"
        fa = a.figures()
        assert fa == {
            "used": SIM_CONTEXT,
            "spilled": 0,
            "resident": SIM_CONTEXT,
            "guarantee": 2 * GiB,
        }, fa
    finally:
        a.kill()
        b.kill()
    nothing_left(small, (a, b))


def test_a_container_that_comes_later_still_gets_its_guarantee(small):
    """A borrowed the whole device while B was idle (B's context claimed
    its guarantee): A may hold beyond its guarantee only what B's unclaimed
    guarantee does not need, so B's 3 GiB still get 2 GiB on the device."""
    a = Container(small, "a", **OVER)
    b = Container(small, "b", **OVER)
    try:
        assert a.ask("alloc 1024")["err"] == "CUDA_SUCCESS"
        assert a.ask("alloc 1024")["err"] == "CUDA_SUCCESS"
        assert a.ask("alloc 1024")["err"] == "CUDA_SUCCESS"
        # A's third GiB is beyond its guarantee: B's unclaimed 2 GiB (less
        # its context) must stay free, so it was spilled.
        assert a.figures()["spilled"] >= 1 * GiB - SIM_CONTEXT
        for _ in range(3):
            assert b.ask("alloc 1024")["err"] == "CUDA_SUCCESS"
        check_guarantees(small, a, b, asked={a.pid: 3 * GiB, b.pid: 3 * GiB})
    finally:
        a.kill()
        b.kill()


def test_pitch_and_managed_spill_too(small):
    a = Container(small, "a", **OVER)
    b = Container(small, "b", **OVER)
    try:
        assert b.ask("alloc 2048")["err"] == "CUDA_SUCCESS"
        out = a.ask("pitch 1000 3000000")  # 1024 x 3e6: 2.86 GiB
        assert out["err"] == "CUDA_SUCCESS", out
        assert out["pitch"] % 512 == 0
        assert out["pitch"] >= 1000
        assert a.ask("managed 1024")["err"] == "CUDA_SUCCESS"
        assert a.ask("touch")["err"] == "CUDA_SUCCESS"
        fa = a.figures()
        assert fa["spilled"] > 0
        check_guarantees(small, a, b, asked={a.pid: 3 * GiB, b.pid: 2 * GiB})
        assert a.ask("free")["err"] == "CUDA_SUCCESS"
        assert a.ask("free")["err"] == "CUDA_SUCCESS"
        assert a.figures()["used"] == SIM_CONTEXT
    finally:
        a.kill()
        b.kill()


def test_racing_containers_and_sigkill_leave_nothing(small):
    """Two processes in each container hold 1 GiB each (so each container
    asked for its guarantee), then all four allocate and free 256 MiB at
    once and are killed mid-way: the device never holds more than it has,
    each container keeps at least its guarantee on it all along, and
    everything comes back to 0."""
    cs = [Container(small, name, **OVER) for name in ("a", "b")]
    race_and_kill(small, cs, "alloc 1024")


def test_without_the_variable_the_device_refuses_as_before(small):
    a = Container(small, "a", CUDA_DEVICE_MEMORY_LIMIT="4g")
    b = Container(small, "b", CUDA_DEVICE_MEMORY_LIMIT="4g")
    try:
        assert a.ask("alloc 3072")["err"] == "CUDA_SUCCESS"
        assert b.ask("alloc 3072")["err"] == "CUDA_ERROR_OUT_OF_MEMORY"
        assert a.figures()["spilled"] == 0
        assert a.figures()["guarantee"] == 0
        assert a.ask("info")["total"] == 4 * GiB
    finally:
        a.kill()
        b.kill()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CUDA_OVERSUBSCRIBE", "maybe"),
        ("CUDA_OVERSUBSCRIBE", "2"),
        ("GPUVISOR_MEMORY_SCALING", "0"),
        ("GPUVISOR_MEMORY_SCALING", "-1"),
        ("GPUVISOR_MEMORY_SCALING", "abc"),
        ("GPUVISOR_MEMORY_SCALING", "1e3"),
        ("GPUVISOR_MEMORY_SCALING", "101"),
        ("GPUVISOR_MEMORY_SCALING", "1.2345"),
        ("GPUVISOR_MEMORY_SCALING", "nan"),
    ],
)
def test_bad_values_fail_closed(small, name, value):
    env = small.shimmed(**{**OVER, name: value})
    proc = run_py(
        """
from tests.cuclient import *
print(call(cu.cuInit, 0)[0].name)
""",
        env,
    )
    assert proc.stdout.strip() == "CUDA_ERROR_NOT_PERMITTED", proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if name in line]
    assert len(said) == 1, proc.stderr
    assert f'{name}="{value}"' in said[0]


@pytest.mark.parametrize("value", ["1", "1.5", " 2 ", "0.5", "100"])
def test_good_scaling_values_run(small, value):
    env = small.shimmed(**{**OVER, "GPUVISOR_MEMORY_SCALING": value})
    proc = run_py("from tests.cuclient import *\ninit()\nprint(mem_info()[1])", env)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == 4 * GiB


def test_the_node_file_rows_of_dead_containers_do_not_count(small):
    """A container killed while it held nothing leaves a row behind whose
    lock went with it: the next container borrows as if it were not there."""
    b = Container(small, "b", **OVER)
    b.kill()
    a = Container(small, "a", **OVER)
    try:
        assert a.ask("alloc 3072")["err"] == "CUDA_SUCCESS"
        assert a.figures()["spilled"] == 0
    finally:
        a.kill()
    assert os.path.exists(small.dir / f"gpuvisor-mem-{uuid0(small)}")


def uuid0(node: SimNode) -> str:
    out = run_py(
        "import pynvml as n\nn.nvmlInit()\n"
        "print(n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(0)))",
        node.env,
    )
    return out.stdout.strip()


def test_the_spill_benchmark_rows(tmp_path, build_dir):
    """make bench's oversubscribed rows run, direct and through libgpuvisor
    (no timing asserted; what spills is checked by the tests above)."""
    import fcntl

    from tests.helpers import BUILD_DIR, REPO_ROOT, clean_env

    bench = BUILD_DIR / "bench" / "bench_memory"
    bench.parent.mkdir(parents=True, exist_ok=True)
    with open(bench.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(
            ["make", "-s", "-C", str(REPO_ROOT), "build/bench/bench_memory"],
            check=True,
            capture_output=True,
            timeout=120,
        )
    env = clean_env()
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.run(
        [
            str(bench),
            "--procs",
            "1",
            "--ops",
            "oversub-device,oversub-spilled",
            "--batches",
            "3",
            "--iters",
            "20",
            "--callgrind",
            "0",
            "--no-pin",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 2, proc.stdout
    assert "within the guarantee" in rows[0]
    assert "spilled" in rows[1]


QUOTA_VIEW = """
from tests.cuclient import *
import pynvml as n
init()
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
before = mem_info()
err, p = call(cu.cuMemAlloc, 5 * GiB)
m = n.nvmlDeviceGetMemoryInfo(h)
emit(before=before, err=err.name, after=mem_info(),
     devtotal=int(ok(cu.cuDeviceTotalMem, ok(cu.cuDeviceGet, 0))),
     nvml=[m.total, m.used, m.free])
"""


def test_programs_see_the_quota_as_the_device(small):
    """A 6 GiB quota on a 4 GiB device: cuMemGetInfo, cuDeviceTotalMem and
    NVML (nvidia-smi's source) say 6 GiB, and 5 GiB are granted; without
    the variable the device's 4 GiB are shown and the driver refuses."""
    over = run_json(
        QUOTA_VIEW,
        small.shimmed(
            CUDA_DEVICE_MEMORY_LIMIT="6g", CUDA_OVERSUBSCRIBE="true", GPUVISOR_MEMORY_SCALING="1"
        ),
    )
    assert over["before"] == [6 * GiB - SIM_CONTEXT, 6 * GiB]
    assert over["err"] == "CUDA_SUCCESS"
    assert over["after"] == [1 * GiB - SIM_CONTEXT, 6 * GiB]
    assert over["devtotal"] == 6 * GiB
    assert over["nvml"] == [6 * GiB, 5 * GiB + SIM_CONTEXT, 1 * GiB - SIM_CONTEXT]
    assert physical(small)["used"] == 0
    plain = run_json(QUOTA_VIEW, small.shimmed(CUDA_DEVICE_MEMORY_LIMIT="6g"))
    assert plain["before"][1] == 4 * GiB
    assert plain["devtotal"] == 4 * GiB
    assert plain["err"] == "CUDA_ERROR_OUT_OF_MEMORY"


def test_destroying_a_context_gives_back_its_spilled_memory(small):
    out = run_json(
        """
from tests.cuclient import *
from gpuvisor.shim.region import Region
import os
ctx = init(create=True)
err, p = call(cu.cuMemAlloc, 5 * GiB)
r = Region.attach(os.environ["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
held = r.device(0)
ok(cu.cuCtxDestroy, ctx)
gone = r.device(0)
emit(err=err.name, held=[held.used, held.spilled], gone=[gone.used, gone.spilled])
""",
        small.shimmed(CUDA_DEVICE_MEMORY_LIMIT="6g", CUDA_OVERSUBSCRIBE="true"),
    )
    assert out["err"] == "CUDA_SUCCESS"
    assert out["held"][0] == 5 * GiB + SIM_CONTEXT
    assert out["held"][1] >= 1 * GiB
    assert out["gone"] == [0, 0]


SPILL_UNDER_ASAN = """
from tests.cuclient import *
from gpuvisor.shim.region import Region
import os
ctx = init(create=True)
r = Region.attach(os.environ["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
base = used()
p = ok(cu.cuMemAlloc, 512 * MiB)                       # straddles the guarantee
q, pitch = ok(cu.cuMemAllocPitch, 1000, 300000, 4)
m = ok(cu.cuMemAllocManaged, 64 * MiB, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL)
assert r.device(0).spilled > 0
ok(cu.cuMemsetD8, q, 1, pitch * 300000)
s = ok(cu.cuStreamCreate, 0)
spilled = r.device(0).spilled
a = ok(cu.cuMemAllocAsync, 64 * MiB, s)                # the pool may not grow: spilled
assert r.device(0).spilled == spilled + 64 * MiB, (spilled, r.device(0))
ok(cu.cuMemFreeAsync, a, s)
ok(cu.cuMemFreeAsync, p, s)                            # a spilled block, stream-ordered
ok(cu.cuMemFree, m)
assert used() == base + -(-pitch * 300000 // (2 * MiB)) * 2 * MiB   # rounded up to 2 MiB
ok(cu.cuCtxDestroy, ctx)                               # takes the pitched one with it
assert (r.device(0).used, r.device(0).spilled) == (0, 0), r.device(0)
print("clean")
"""


def test_spilling_paths_under_asan(node):
    """Straddling, pitched, managed, stream-ordered (allocated and freed),
    a stream-ordered free of a spilled block and a context destroyed with
    one, through the ASan build.  No
    node directory: nothing is borrowed beyond the 256 MiB guarantee."""
    from tests.test_sanitizers import ASAN_DIR, asan_runtime

    if not (ASAN_DIR / "libgpuvisor.so").is_file():
        pytest.skip("build-asan/ missing: run `make asan` (make test does)")
    runtime = asan_runtime()
    if not runtime:
        pytest.skip("gcc has no libasan.so")
    env = dict(node.env)
    env.update(
        LD_LIBRARY_PATH=str(ASAN_DIR / "sim"),
        LD_PRELOAD=f"{runtime}:{ASAN_DIR / 'libgpuvisor.so'}",
        ASAN_OPTIONS="detect_leaks=0:exitcode=86",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87",
        CUDA_DEVICE_MEMORY_LIMIT="1g",
        CUDA_OVERSUBSCRIBE="true",
        GPUVISOR_MEMORY_SCALING="4",
        GPUVISOR_NODE_LOCK="",
    )
    proc = run_py(SPILL_UNDER_ASAN, env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("clean")
