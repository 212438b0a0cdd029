"""MIG on the simulated node, through nvidia-ml-py: profiles and placements as
NVIDIA documents them, and the lifecycle of instances, with a process running
inside one under a memory quota (CUDA_VISIBLE_DEVICES=MIG-..., the library
preloaded).  Each step runs in a process of its own: the node's state is
shared as on a real node."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Holder, SimNode, missing_build_outputs, run_json, run_py, start_piped
from tests.topohelp import topo_node

pytestmark = pytest.mark.skipif(bool(missing_build_outputs()), reason="run make first")

GiB = 1 << 30
MiB = 1 << 20

# Runs `steps` (Python statements) with helpers; prints one JSON line of `out`.
NVML = """
import ctypes, json, sys
import pynvml as n
n.nvmlInit()
out = {}
def dev(i):
    return n.nvmlDeviceGetHandleByIndex(i)
def name(e):
    return type(e).__name__.removeprefix("NVMLError_")
def attempt(f, *a):
    try:
        return f(*a)
    except n.NVMLError as e:
        return "error: " + name(e)
def gi_by_id(i, gid):
    return n.nvmlDeviceGetGpuInstanceById(dev(i), gid)
def create(i, pid, start=None):
    if start is None:
        gi = attempt(n.nvmlDeviceCreateGpuInstance, dev(i), pid)
    else:
        size = n.nvmlDeviceGetGpuInstanceProfileInfoById(dev(i), pid).sliceCount
        prof = [p for p in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT)
                if not isinstance(attempt(n.nvmlDeviceGetGpuInstanceProfileInfo, dev(i), p), str)
                and n.nvmlDeviceGetGpuInstanceProfileInfo(dev(i), p).id == pid]
        cnt = ctypes.c_uint(0)
        n.nvmlDeviceGetGpuInstancePossiblePlacements(dev(i), pid, None, ctypes.byref(cnt))
        arr = (n.c_nvmlGpuInstancePlacement_t * cnt.value)()
        n.nvmlDeviceGetGpuInstancePossiblePlacements(dev(i), pid, arr, ctypes.byref(cnt))
        size = arr[0].size
        pl = n.c_nvmlGpuInstancePlacement_t(start, size)
        gi = attempt(n.nvmlDeviceCreateGpuInstanceWithPlacement, dev(i), pid, ctypes.byref(pl))
    if isinstance(gi, str):
        return gi
    return n.nvmlGpuInstanceGetInfo(gi).id
def mig_devices(i):
    found = []
    for k in range(n.nvmlDeviceGetMaxMigDeviceCount(dev(i))):
        m = attempt(n.nvmlDeviceGetMigDeviceHandleByIndex, dev(i), k)
        if isinstance(m, str):
            continue
        found.append({
            "uuid": n.nvmlDeviceGetUUID(m), "name": n.nvmlDeviceGetName(m),
            "gi": n.nvmlDeviceGetGpuInstanceId(m), "ci": n.nvmlDeviceGetComputeInstanceId(m),
            "total": n.nvmlDeviceGetMemoryInfo(m).total, "used": n.nvmlDeviceGetMemoryInfo(m).used,
            "is_mig": n.nvmlDeviceIsMigDeviceHandle(m).value,
            "parent": n.nvmlDeviceGetUUID(n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)),
            "procs": [[p.pid, p.gpuInstanceId, p.computeInstanceId]
                      for p in n.nvmlDeviceGetComputeRunningProcesses(m)],
        })
    return found
def remaining(i):
    return {p.name.decode() if isinstance(p.name, bytes) else p.name:
            n.nvmlDeviceGetGpuInstanceRemainingCapacity(dev(i), p.id)
            for p in profiles(i)}
def profiles(i):
    got = []
    for p in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT):
        info = attempt(n.nvmlDeviceGetGpuInstanceProfileInfo, dev(i), p)
        if not isinstance(info, str):
            got.append(info)
    return got
"""


def nvml(node: SimNode, steps: str) -> Any:
    return run_json(NVML + steps + "\nprint(json.dumps(out))", node.env)


A100_40 = {"gpus": [{"model": "NVIDIA A100-SXM4-40GB"}, {"model": "NVIDIA A30", "mig": True}]}

# (profile index, id, name, memory MiB, compute slices, instances, placements' starts, size)
A100_40_PROFILES = [
    (0, 19, "MIG 1g.5gb", 4864, 1, 7, [0, 1, 2, 3, 4, 5, 6], 1),
    (1, 14, "MIG 2g.10gb", 9856, 2, 3, [0, 2, 4], 2),
    (2, 9, "MIG 3g.20gb", 20096, 3, 2, [0, 4], 4),
    (3, 5, "MIG 4g.20gb", 20096, 4, 1, [0], 4),
    (4, 0, "MIG 7g.40gb", 40320, 7, 1, [0], 8),
    (7, 20, "MIG 1g.5gb+me", 4864, 1, 1, [0, 1, 2, 3, 4, 5, 6], 1),
    (9, 15, "MIG 1g.10gb", 9856, 1, 4, [0, 2, 4, 6], 2),
]
A30_PROFILES = [
    (0, 14, "MIG 1g.6gb", 5952, 1, 4, [0, 1, 2, 3], 1),
    (1, 5, "MIG 2g.12gb", 12160, 2, 2, [0, 2], 2),
    (3, 0, "MIG 4g.24gb", 24320, 4, 1, [0], 4),
    (7, 21, "MIG 1g.6gb+me", 5952, 1, 1, [0, 1, 2, 3], 1),
    (8, 6, "MIG 2g.12gb+me", 12160, 2, 1, [0, 2], 2),
]

PROFILE_TABLE = """
for i in (0, 1):
    rows = []
    for p in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT):
        v1 = attempt(n.nvmlDeviceGetGpuInstanceProfileInfo, dev(i), p, 1)
        v2 = attempt(n.nvmlDeviceGetGpuInstanceProfileInfo, dev(i), p, 2)
        if isinstance(v2, str):
            rows.append([p, v2, v1])
            continue
        assert v1.id == v2.id and v1.memorySizeMB == v2.memorySizeMB, p
        by_id = n.nvmlDeviceGetGpuInstanceProfileInfoById(dev(i), v2.id)
        assert by_id.name == v2.name
        cnt = ctypes.c_uint(0)
        n.nvmlDeviceGetGpuInstancePossiblePlacements(dev(i), v2.id, None, ctypes.byref(cnt))
        arr = (n.c_nvmlGpuInstancePlacement_t * cnt.value)()
        n.nvmlDeviceGetGpuInstancePossiblePlacements(dev(i), v2.id, arr, ctypes.byref(cnt))
        small = ctypes.c_uint(1)
        short = attempt(n.nvmlDeviceGetGpuInstancePossiblePlacements, dev(i), v2.id,
                        (n.c_nvmlGpuInstancePlacement_t * 1)(), ctypes.byref(small))
        pname = v2.name.decode() if isinstance(v2.name, bytes) else v2.name
        rows.append([p, v2.id, pname, v2.memorySizeMB, v2.sliceCount, v2.instanceCount,
                     [a.start for a in arr], arr[0].size,
                     short if cnt.value > 1 else None, small.value])
    out[i] = rows
    out[f"mode{i}"] = n.nvmlDeviceGetMigMode(dev(i))
    out[f"max{i}"] = n.nvmlDeviceGetMaxMigDeviceCount(dev(i))
"""


def test_profile_tables_and_placements(tmp_path: Path) -> None:
    node = topo_node(tmp_path, A100_40)
    r = nvml(node, PROFILE_TABLE)
    for gpu, table in (("0", A100_40_PROFILES), ("1", A30_PROFILES)):
        supported = [row for row in r[gpu] if not isinstance(row[1], str)]
        assert [tuple(row[:8]) for row in supported] == table
        for row in supported:  # a short buffer: INSUFFICIENT_SIZE and the count needed
            if len(row[6]) > 1:
                assert row[8:] == ["error: InsufficientSize", len(row[6])]
        others = [row for row in r[gpu] if isinstance(row[1], str)]
        assert all(row[1:] == ["error: NotSupported"] * 2 for row in others)
    assert r["mode0"] == [0, 0]
    assert r["mode1"] == [1, 1]  # "mig": true
    assert r["max0"] == 7
    assert r["max1"] == 4


def test_h100_and_h200_tables(tmp_path: Path) -> None:
    node = topo_node(
        tmp_path, {"gpus": [{"model": "NVIDIA H100 80GB HBM3"}, {"model": "NVIDIA H200"}]}
    )
    r = nvml(node, PROFILE_TABLE)
    h100 = {row[2]: (row[1], row[3], row[6]) for row in r["0"] if not isinstance(row[1], str)}
    h200 = {row[2]: (row[1], row[3], row[6]) for row in r["1"] if not isinstance(row[1], str)}
    assert h100["MIG 1g.10gb"] == (19, 9984, [0, 1, 2, 3, 4, 5, 6])
    assert h100["MIG 3g.40gb"] == (9, 40448, [0, 4])
    assert h100["MIG 7g.80gb"] == (0, 81152, [0])
    assert sorted(h200) == sorted(
        ["MIG " + p for p in ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb")]
        + ["MIG 4g.71gb", "MIG 7g.141gb"]
    )
    assert h200["MIG 1g.35gb"][2] == [0, 2, 4, 6]


def test_mode_refused_while_a_process_uses_the_gpu(tmp_path: Path) -> None:
    node = topo_node(tmp_path, A100_40)
    code = "from tests.cuclient import *\ninit(0)\nhold()\n"
    env = dict(node.env, CUDA_VISIBLE_DEVICES="0")
    with Holder(code, env):
        r = nvml(node, "out['set'] = attempt(n.nvmlDeviceSetMigMode, dev(0), 1)")
        assert r["set"] == "error: InUse"
        r = nvml(node, "out['mode'] = n.nvmlDeviceGetMigMode(dev(0))")
        assert r["mode"] == [0, 0]
    r = nvml(node, "out['set'] = n.nvmlDeviceSetMigMode(dev(0), 1)")
    assert r["set"] == 0  # NVML_SUCCESS: applied
    r = nvml(node, "out['mode'] = n.nvmlDeviceGetMigMode(dev(0))")
    assert r["mode"] == [1, 1]


def test_placements_overlaps_and_capacity(tmp_path: Path) -> None:
    node = topo_node(tmp_path, A100_40)
    r = nvml(
        node,
        """
n.nvmlDeviceSetMigMode(dev(0), 1)
out["before"] = remaining(0)
out["3g@4"] = create(0, 9, 4)
out["2g@0"] = create(0, 14, 0)
out["1g@5"] = create(0, 19, 5)       # inside the 3g: overlaps
out["3g@2"] = create(0, 9, 2)        # not one of its placements
out["4g@0"] = create(0, 5, 0)        # overlaps the 2g
out["1g"] = create(0, 19)            # first free placement: 2
out["after"] = remaining(0)
infos = {}
for p in profiles(0):
    arr = (n.c_nvmlGpuInstance_t * p.instanceCount)()
    cnt = ctypes.c_uint(0)
    n.nvmlDeviceGetGpuInstances(dev(0), p.id, arr, ctypes.byref(cnt))
    for gi in arr[:cnt.value]:
        info = n.nvmlGpuInstanceGetInfo(gi)
        infos[info.id] = [info.profileId, info.placement.start, info.placement.size]
out["infos"] = infos
out["by_id"] = attempt(n.nvmlDeviceGetGpuInstanceById, dev(0), 12) # no 1g at 5
""",
    )
    assert r["before"] == {
        "MIG 1g.5gb": 7,
        "MIG 2g.10gb": 3,
        "MIG 3g.20gb": 2,
        "MIG 4g.20gb": 1,
        "MIG 7g.40gb": 1,
        "MIG 1g.5gb+me": 1,
        "MIG 1g.10gb": 4,
    }
    assert r["3g@4"] == 2  # the second half
    assert r["2g@0"] == 3  # the first quarter
    assert r["1g@5"] == "error: InsufficientResources"
    assert r["3g@2"] == "error: InvalidArgument"
    assert r["4g@0"] == "error: InsufficientResources"
    assert r["1g"] == 9  # the eighth at slice 2
    # left: slice 3 (1g), and compute 7 - 3 - 2 - 1 = 1
    assert r["after"] == {
        "MIG 1g.5gb": 1,
        "MIG 2g.10gb": 0,
        "MIG 3g.20gb": 0,
        "MIG 4g.20gb": 0,
        "MIG 7g.40gb": 0,
        "MIG 1g.5gb+me": 1,
        "MIG 1g.10gb": 0,
    }
    assert r["infos"] == {"2": [9, 4, 4], "3": [14, 0, 2], "9": [19, 2, 1]}
    assert r["by_id"] == "error: NotFound"


QUOTA_CLIENT = """
import json, os
from tests.cuclient import *
from cuda.bindings import driver as cu
ctx = init(0)
free, total = ok(cu.cuMemGetInfo)
name = ok(cu.cuDeviceGetName, 64, 0).split(b"\\0")[0].decode()
uuid = bytes(ok(cu.cuDeviceGetUuid, 0).bytes).hex()
big = call(cu.cuMemAlloc, 2 * GiB)[0].name
held = ok(cu.cuMemAlloc, 512 * MiB)
hold(free=free, total=total, name=name, uuid=uuid, big=big, pid=os.getpid())
"""


def test_mig_lifecycle_with_a_process_under_a_quota(tmp_path: Path) -> None:
    node = topo_node(tmp_path, A100_40)
    r = nvml(
        node,
        """
n.nvmlDeviceSetMigMode(dev(0), 1)
out["gi"] = create(0, 9, 0)
gi = gi_by_id(0, out["gi"])
ci_info = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gi, n.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 0)
out["ci_prof"] = [ci_info.sliceCount, ci_info.instanceCount, ci_info.multiprocessorCount]
small = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gi, n.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 0)
out["ci_small"] = [small.sliceCount, small.instanceCount, small.multiprocessorCount]
out["ci_4"] = attempt(n.nvmlGpuInstanceGetComputeInstanceProfileInfo,
                      gi, n.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, 0)
ci = n.nvmlGpuInstanceCreateComputeInstance(gi, n.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
info = n.nvmlComputeInstanceGetInfo(ci)
out["ci"] = [info.id, info.profileId, info.placement.start, info.placement.size]
out["ci_again"] = attempt(n.nvmlGpuInstanceCreateComputeInstance, gi, 0)
out["ci_left"] = n.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, 0)
out["devices"] = mig_devices(0)
out["gpu_uuid"] = n.nvmlDeviceGetUUID(dev(0))
""",
    )
    assert r["gi"] == 1
    assert r["ci_prof"] == [3, 1, 42]
    assert r["ci_small"] == [1, 3, 14]
    assert r["ci_4"] == "error: NotSupported"
    assert r["ci"] == [0, 2, 0, 3]
    assert r["ci_again"] == "error: InsufficientResources"
    assert r["ci_left"] == 0
    [mig] = r["devices"]
    assert mig["uuid"].startswith("MIG-")
    assert len(mig["uuid"]) == 40
    assert mig["name"] == "NVIDIA A100-SXM4-40GB MIG 3g.20gb"
    assert [mig["gi"], mig["ci"], mig["is_mig"]] == [1, 0, 1]
    assert mig["total"] == 20096 * MiB
    assert mig["parent"] == r["gpu_uuid"]
    assert mig["procs"] == []

    # CUDA sees the instance as a device when CUDA_VISIBLE_DEVICES names it:
    # its memory, under the library's quota
    env = node.shimmed(CUDA_VISIBLE_DEVICES=mig["uuid"], CUDA_DEVICE_MEMORY_LIMIT="1g")
    with Holder(QUOTA_CLIENT, env) as held:
        assert held["name"] == "NVIDIA A100-SXM4-40GB MIG 3g.20gb"
        assert held["uuid"] == mig["uuid"][4:].replace("-", "")
        assert held["total"] == GiB
        assert held["big"] == "CUDA_ERROR_OUT_OF_MEMORY"
        busy = nvml(
            node,
            """
out["devices"] = mig_devices(0)
gi = gi_by_id(0, 1)
ci = n.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
out["destroy_ci"] = attempt(n.nvmlComputeInstanceDestroy, ci)
out["destroy_gi"] = attempt(n.nvmlGpuInstanceDestroy, gi)
out["disable"] = attempt(n.nvmlDeviceSetMigMode, dev(0), 0)
out["gpu_used"] = n.nvmlDeviceGetMemoryInfo(dev(0)).used
out["gpu_procs"] = [[p.pid, p.gpuInstanceId, p.computeInstanceId]
                    for p in n.nvmlDeviceGetComputeRunningProcesses(dev(0))]
""",
        )
        [dev] = busy["devices"]
        assert dev["procs"] == [[held["pid"], 1, 0]]
        assert dev["used"] >= 512 * MiB
        assert busy["gpu_used"] == dev["used"]
        assert busy["gpu_procs"] == [[held["pid"], 1, 0]]
        assert busy["destroy_ci"] == "error: InUse"
        assert busy["destroy_gi"] == "error: InUse"
        assert busy["disable"] == "error: InUse"
    # the process is gone: the instance is free, and goes
    r = nvml(
        node,
        """
gi = gi_by_id(0, 1)
out["destroy_gi"] = attempt(n.nvmlGpuInstanceDestroy, gi)   # its CI first
out["destroy_ci"] = n.nvmlComputeInstanceDestroy(n.nvmlGpuInstanceGetComputeInstanceById(gi, 0))
out["destroy_gi2"] = n.nvmlGpuInstanceDestroy(gi)
out["devices"] = mig_devices(0)
out["disable"] = n.nvmlDeviceSetMigMode(dev(0), 0)
""",
    )
    assert r["destroy_gi"] == "error: InUse"
    assert r["destroy_ci"] == 0
    assert r["destroy_gi2"] == 0
    assert r["devices"] == []
    assert r["disable"] == 0


def test_a_destroyed_instance_is_no_cuda_device(tmp_path: Path) -> None:
    node = topo_node(tmp_path, A100_40)
    r = nvml(
        node,
        """
n.nvmlDeviceSetMigMode(dev(0), 1)
gi = gi_by_id(0, create(0, 19, 6))
n.nvmlGpuInstanceCreateComputeInstance(gi, 0)
out["uuid"] = mig_devices(0)[0]["uuid"]
""",
    )
    cuda = """
import json
from cuda.bindings import driver as cu
print(cu.cuInit(0)[0].name)
n = cu.cuDeviceGetCount()[1]
print(json.dumps([n, [cu.cuDeviceTotalMem(i)[1] >> 20 for i in range(n)]]))
"""
    seen = run_json(cuda, dict(node.env, CUDA_VISIBLE_DEVICES=r["uuid"]))
    assert seen == [1, [4864]]
    # without CUDA_VISIBLE_DEVICES: the MIG device, then the A30's (none: no instances)
    assert run_json(cuda, node.env) == [1, [4864]]
    nvml(
        node,
        """
gi = gi_by_id(0, 13)
n.nvmlComputeInstanceDestroy(n.nvmlGpuInstanceGetComputeInstanceById(gi, 0))
n.nvmlGpuInstanceDestroy(gi)
""",
    )
    cp_env = dict(node.env, CUDA_VISIBLE_DEVICES=r["uuid"])
    cp = run_py("from cuda.bindings import driver as cu\nprint(cu.cuInit(0)[0].name)", cp_env)
    assert cp.stdout.strip() == "CUDA_ERROR_NO_DEVICE"


def test_racing_processes_share_the_slices(tmp_path: Path) -> None:
    """Eight processes create 1g.5gb instances at once: seven fit, each at its own placement."""
    node = topo_node(tmp_path, {"gpus": [{"model": "NVIDIA A100-SXM4-40GB", "mig": True}]})
    code = (
        NVML
        + """
import os
sys.stdin.readline()                     # all start together
got = []
while True:
    gid = create(0, 19)
    if isinstance(gid, str):
        break
    got.append(gid)
out = {"got": got, "last": gid}
print(json.dumps(out))
"""
    )
    procs = [start_piped(code, node.env) for _ in range(8)]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    ids = sorted(g for r in results for g in r["got"])
    assert ids == list(range(7, 14))  # the eighths at slices 0-6, each once
    assert {r["last"] for r in results} == {"error: InsufficientResources"}
    r = nvml(node, "out['left'] = remaining(0)['MIG 1g.5gb']")
    assert r["left"] == 0


ASAN_SIM = Path(__file__).resolve().parent.parent / "build-asan" / "sim"

HOSTILE = [
    '{"gpus": [{"model": "' + "x" * 5000 + '"}]}',
    "[" * 40 + "]" * 40,
    '{"gpus": [{"model": "NVIDIA A30", "model": "NVIDIA A30"}]}',
    '{"gpus": [{"model": "\\u0000"}]}',
    '{"gpus": [{"model": "NVIDIA A30"}], "nvlink": [[0, 0, 99999999999999999999]]}',
    '{"gpus": [{"model": "NVIDIA A30", "numa": 9223372036854775807}]}',
    '"\\',
    "",
]


def test_topology_and_mig_under_asan(tmp_path: Path) -> None:
    """The JSON reader on hostile files and the MIG calls, in the sanitized simulator."""
    import subprocess

    if not (ASAN_SIM / "libnvidia-ml.so.1").is_file():
        pytest.skip("build-asan/ missing: run `make asan` (make test does)")
    runtime = subprocess.run(
        ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=False
    ).stdout.strip()
    if not runtime.startswith("/"):
        pytest.skip("gcc has no libasan.so")
    node = topo_node(tmp_path, A100_40)
    env = dict(
        node.env,
        LD_LIBRARY_PATH=str(ASAN_SIM),
        LD_PRELOAD=runtime,
        ASAN_OPTIONS="detect_leaks=0:exitcode=86",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87",
    )
    steps = (
        PROFILE_TABLE
        + """
n.nvmlDeviceSetMigMode(dev(0), 1)
for pid, start in ((9, 4), (14, 0), (19, 5), (19, None), (15, 2)):
    create(0, pid, start)
gi = gi_by_id(0, 2)
for p in range(n.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
    attempt(n.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, p, 0)
    attempt(n.nvmlGpuInstanceCreateComputeInstance, gi, p)
out["devices"] = len(mig_devices(0))
out["left"] = remaining(0)
"""
    )
    cp = run_py(NVML + steps + "\nprint(json.dumps(out))", env)
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert json.loads(cp.stdout.splitlines()[-1])["devices"] == 1  # 1c.3g at 0 takes the 2c place
    for i, text in enumerate(HOSTILE):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(text)
        bad_env = dict(env, GPUVISOR_SIM_TOPOLOGY=str(bad), GPUVISOR_SIM_STATE=str(bad) + ".st")
        cp = run_py("import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept Exception: pass", bad_env)
        assert cp.returncode == 0, (text[:80], cp.stderr[-3000:])
        assert f"GPUVISOR_SIM_TOPOLOGY={bad}: " in cp.stderr
