"""The HAMi drop-in (docs/hami.md): libgpuvisor.so installed as HAMi's
libvgpu.so and preloaded by the node, plus the copy `gpuvisor run` preloads.

One process then maps the library twice, under two paths.  Only the first
copy in symbol order interposes (it calls the real driver through its own
handle, never through the second copy), so the quota is charged once and the
process holds one region slot.  HAMi's way of writing the limits
(CUDA_DEVICE_MEMORY_LIMIT_<i> in MiB with an `m`, a *.cache region file)
applies unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpuvisor.shim.limits import env_sm_settings

from tests.helpers import LIBRARY, MiB, SimNode, run_json

CLIENT = """
import json
import os
from gpuvisor.shim.driver import Driver
from gpuvisor.shim.region import Region
d = Driver()
d.init()
first = d.mem_alloc(1 << 30)[0]
second = d.mem_alloc(1 << 30)[0]
free, total = d.mem_get_info()
r = Region.attach()
print(json.dumps({"first": first, "second": second, "total": total,
                  "used": r.device(0).used, "procs": len(r.processes())}))
"""


@pytest.fixture
def hami_env(node: SimNode, tmp_path: Path) -> dict[str, str]:
    env = dict(node.env)
    env["CUDA_DEVICE_MEMORY_LIMIT_0"] = "2048m"
    env["CUDA_DEVICE_SM_LIMIT"] = "25"
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(tmp_path / "0c8f2c5e.cache")
    return env


def test_two_copies_charge_the_quota_once(hami_env: dict[str, str], tmp_path: Path) -> None:
    vgpu = tmp_path / "usr-local-vgpu" / "libvgpu.so"
    vgpu.parent.mkdir()
    shutil.copy2(LIBRARY, vgpu)
    single = run_json(CLIENT, dict(hami_env, LD_PRELOAD=str(vgpu)))
    hami_env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] += ".2"
    double = run_json(CLIENT, dict(hami_env, LD_PRELOAD=f"{LIBRARY} {vgpu}"))
    print(f"one copy: {single}\ntwo copies: {double}")
    for result in (single, double):
        assert result["total"] == 2048 * MiB
        assert result["first"] == 0  # CUDA_SUCCESS
        assert result["second"] == 2  # CUDA_ERROR_OUT_OF_MEMORY: context + 2 GiB > 2 GiB
        assert result["procs"] == 1
    assert double["used"] == single["used"]
    assert 1024 * MiB < double["used"] <= 1024 * MiB + 64 * MiB


HAMI_CORE_MAGIC = 19920718


def _own_pid_namespace() -> list[str]:
    """A command prefix that runs a program in a PID namespace of its own, as
    a container's processes run: the library looks through /proc for
    processes that map the old file, and counts one whose maps it cannot
    read (the host's init here) as one that might."""
    for prefix in (
        ["unshare", "--pid", "--fork", "--mount-proc"],
        ["unshare", "--map-root-user", "--pid", "--fork", "--mount-proc"],
    ):
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
        except OSError:
            continue
        if ok.returncode == 0:
            return prefix
    pytest.skip("no PID namespace of its own (unshare)")


IN_CONTAINER = """
import subprocess, sys
holder = None
if sys.argv[1] == "hold":
    holder = subprocess.Popen([sys.executable, "-c",
        "import mmap, sys; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0);"
        " print('mapped', flush=True); sys.stdin.read()", sys.argv[2]],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "mapped\\n"
for _ in range(int(sys.argv[3])):
    subprocess.run([sys.executable, "-c", sys.argv[4]])
if holder is not None:
    holder.kill()
"""


def _run_in_container(
    env: dict[str, str], code: str, *, hold: bool = False, runs: int = 1
) -> subprocess.CompletedProcess[str]:
    cache = env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
    args = ["hold" if hold else "-", cache, str(runs), code]
    return subprocess.run(
        [*_own_pid_namespace(), sys.executable, "-c", IN_CONTAINER, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


ALLOC = """
import json
import os
from gpuvisor.shim.driver import Driver, CudaError
d = Driver()
try:
    d.init()
    print(json.dumps({"first": d.mem_alloc(1 << 30)[0], "second": d.mem_alloc(1 << 30)[0]}))
except CudaError as e:
    print(json.dumps({"error": str(e)}))
"""


def _hami_core_file(path: Path) -> None:
    """A region file as HAMi-core leaves it: its 32-bit magic first."""
    path.write_bytes(HAMI_CORE_MAGIC.to_bytes(4, "little") + bytes(64 * 1024))


def test_restart_in_place_replaces_hami_cores_region(hami_env: dict[str, str]) -> None:
    cache = Path(hami_env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    _hami_core_file(cache)
    proc = _run_in_container(dict(hami_env, LD_PRELOAD=str(LIBRARY)), ALLOC, runs=2)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    # the 2048m quota holds in both runs: context + 2 GiB > 2 GiB
    assert results == [{"first": 0, "second": 2}] * 2
    # replaced once, by the first run, with one line
    assert proc.stderr.count("replaced HAMi-core's region file") == 1
    assert int.from_bytes(cache.read_bytes()[:8], "little") == 0x31485356504756


def test_hami_cores_region_mapped_by_a_live_process_stays(
    hami_env: dict[str, str],
) -> None:
    cache = Path(hami_env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    _hami_core_file(cache)
    before = cache.read_bytes()
    proc = _run_in_container(dict(hami_env, LD_PRELOAD=str(LIBRARY)), ALLOC, hold=True)
    print(proc.stdout, proc.stderr)
    assert json.loads(proc.stdout) == {"error": "cuInit failed: CUDA_ERROR_NOT_PERMITTED"}
    assert f"HAMi-core's region file (magic {HAMI_CORE_MAGIC}), in use by process" in proc.stderr
    assert cache.read_bytes() == before


@pytest.mark.parametrize(
    ("extra", "policy"),
    [
        ({}, "fixed-share"),  # gpuvisor's own default, no HAMi variable
        ({"GPU_CORE_UTILIZATION_POLICY": "default"}, "burst-share"),
        ({"GPU_CORE_UTILIZATION_POLICY": "DEFAULT"}, "burst-share"),
        # HAMi's webhook leaves the switch out when it is default: the
        # region in HAMi's per-container directory says HAMi set it up
        ({"CUDA_DEVICE_MEMORY_SHARED_CACHE": "/usr/local/vgpu/0c8f2c5e.cache"}, "burst-share"),
        (
            {"GPU_CORE_UTILIZATION_POLICY": "default", "GPUVISOR_SM_POLICY": "fixed-share"},
            "fixed-share",
        ),
        (
            {"GPU_CORE_UTILIZATION_POLICY": "default", "GPUVISOR_SM_POLICY": "best-effort"},
            "best-effort",
        ),
        ({"GPU_CORE_UTILIZATION_POLICY": "force"}, "fixed-share"),
        ({"CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/vgpu/r.cache"}, "fixed-share"),
    ],
)
def test_hamis_default_core_policy_keeps_its_meaning(extra: dict[str, str], policy: str) -> None:
    env = {"CUDA_DEVICE_SM_LIMIT": "25", **extra}
    assert env_sm_settings(env).policy == policy


SM_POLICY = """
import json
import os
from gpuvisor.shim.driver import Driver
from gpuvisor.shim.region import Region
d = Driver()
d.init()
print(json.dumps({"policy": Region.attach().sm(0).policy}))
"""


def test_hamis_default_core_policy_in_a_container(hami_env: dict[str, str]) -> None:
    env = dict(hami_env, LD_PRELOAD=str(LIBRARY), GPU_CORE_UTILIZATION_POLICY="default")
    assert run_json(SM_POLICY, env) == {"policy": "burst-share"}


CONTEXT = """
import json, time
from gpuvisor.shim.driver import Driver
d = Driver()
t = time.monotonic()
d.init()
print(json.dumps({"seconds": time.monotonic() - t}))
"""


@pytest.fixture
def lock_env(hami_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    vgpulock = tmp_path / "vgpulock"  # HAMi's /tmp/vgpulock, mounted from the host
    vgpulock.mkdir()
    return dict(
        hami_env,
        LD_PRELOAD=str(LIBRARY),
        GPUVISOR_NODE_LOCK=str(vgpulock / "gpuvisor.lock"),
        GPUVISOR_HAMI_LOCK=str(vgpulock / "lock"),
    )


def test_hami_cores_lock_is_held_while_a_context_is_created(lock_env: dict[str, str]) -> None:
    lock = Path(lock_env["GPUVISOR_HAMI_LOCK"])
    env = dict(lock_env, GPUVISOR_SIM_CTX_CREATE_MS="1500")
    client = subprocess.Popen(
        [sys.executable, "-c", CONTEXT], env=env, stdout=subprocess.PIPE, text=True
    )
    seen = False
    while client.poll() is None and not seen:
        seen = lock.exists()
    client.communicate(timeout=60)
    assert client.returncode == 0
    assert seen  # created exclusively while the context was made...
    assert not lock.exists()  # ...and removed after, as HAMi-core gives it back


def test_hami_cores_lock_held_elsewhere_is_waited_for_a_bounded_time(
    lock_env: dict[str, str],
) -> None:
    lock = Path(lock_env["GPUVISOR_HAMI_LOCK"])
    lock.write_text("")  # a HAMi-core process holds it (and may have been killed)
    proc = subprocess.run(
        [sys.executable, "-c", CONTEXT], env=lock_env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert 2 <= json.loads(proc.stdout)["seconds"] < 10
    assert proc.stderr.count("HAMi-core's lock held for over 2 s") == 1
    assert lock.exists()  # not ours: left alone


def test_hami_cores_lock_left_by_a_killed_holder_is_removed(lock_env: dict[str, str]) -> None:
    lock = Path(lock_env["GPUVISOR_HAMI_LOCK"])
    lock.write_text("")
    old = time.time() - 120
    os.utime(lock, (old, old))
    proc = subprocess.run(
        [sys.executable, "-c", CONTEXT], env=lock_env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["seconds"] < 2
    assert "left for over 60 s by a holder that is gone; removed" in proc.stderr
    assert not lock.exists()
