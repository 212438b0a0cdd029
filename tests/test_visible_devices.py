"""CUDA_VISIBLE_DEVICES read without CUDA, as the driver reads it.

A process of a container that has used only NVML (nvidia-smi, a monitoring
agent, the supervisor's gv_env_device_limits) cannot ask the driver which
CUDA ordinal a device has: the library reads CUDA_VISIBLE_DEVICES itself
over NVML's list (native/shim/devices.c).  The ordinal decides which
CUDA_DEVICE_*_LIMIT_<i> a device gets, so a device read as another ordinal
would get another device's limit, and one the driver hides must get none.

Each check runs the same list of CUDA_VISIBLE_DEVICES values through the
driver (a process with nothing but ctypes: cuInit, cuDeviceGetCount,
cuDeviceGetUuid) and through the library's reading (gv_env_device_limits,
in a process that never initialises CUDA), and compares, device by device,
the ordinal each gives.  On the simulator; and, with the `gpu` marker, on a
real driver, where the library's reading rests on what NVIDIA documents and
this test is what checks it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from tests.helpers import SimNode, clean_env, run_py

# The driver's own list of visible devices, NVML's UUID form.
DRIVER_LIST = r"""
import ctypes, json
cu = ctypes.CDLL("libcuda.so.1")
out = []
n = ctypes.c_int(0)
if cu.cuInit(0) == 0 and cu.cuDeviceGetCount(ctypes.byref(n)) == 0:
    for i in range(n.value):
        d = ctypes.c_int(0)
        raw = (ctypes.c_ubyte * 16)()
        assert cu.cuDeviceGet(ctypes.byref(d), i) == 0
        assert cu.cuDeviceGetUuid(raw, d) == 0
        h = bytes(raw).hex()
        out.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
print(json.dumps(out))
"""

# The library's reading: the ordinal gv_env_device_limits finds for each
# NVML device under each value (None: the device is not visible).
LIBRARY_READING = r"""
import json, sys
import pynvml
from gpuvisor.shim.limits import env_device_limits
pynvml.nvmlInit()
uuids = []
for i in range(pynvml.nvmlDeviceGetCount()):
    u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
    uuids.append(u.decode() if isinstance(u, bytes) else u)
if sys.argv[1] == "uuids":
    print(json.dumps(uuids))
    raise SystemExit
out = {}
for cvd in json.loads(sys.argv[1]):
    env = {"CUDA_VISIBLE_DEVICES": cvd, "CUDA_DEVICE_SM_LIMIT": "50"}
    out[cvd] = {u: env_device_limits(env, u, 16 << 30).ordinal for u in uuids}
print(json.dumps(out))
"""


# What a real driver made of each value with one GPU (an H100, driver
# 580.159.04; `make gpu-check`, 2026-11-26): True where it listed the GPU.
# {u} stands for the GPU's UUID ("GPU-" and 36 characters), {u12} and {u8}
# for its first 12 and 8 characters, {hex} for it without "GPU-".
SEEN_ON_A_REAL_DRIVER = {
    "0": True, " 0 ": True, "0,0": False, "0,1": True, "1,0": False, "1": False,
    "-1": False, "": False, ",0": False, "0,": True, "00": True, "0x0": True,
    "0a": True, "0 1": True, "9": False, "0,9,1": True, "+0": True,
    "{u}": True, "{u12}": True, "{u8}": True, "GPU-": False, "{hex}": False,
    "{u}0": True, "{u},0": True, "0,{u}": True, "{u12},1": True, "{u} , 1": True,
}  # fmt: skip


def test_the_simulated_driver_reads_the_list_as_a_real_driver_did(tmp_path) -> None:
    """Index entries end at the first non-digit ("0a" is 0), a UUID may run on
    past its end but not stop at "GPU-", and an index given twice leaves no
    device, on the simulator as on the H100 (which the library's reading
    follows through the test below)."""
    node = SimNode.create(tmp_path, devices="16g:uuid=GPU-5c780be2-2c26-9481-0fec-15b04e6cc710")
    env = node.shimmed()
    del env["LD_PRELOAD"]
    u = "GPU-5c780be2-2c26-9481-0fec-15b04e6cc710"
    wrong = []
    for value, listed in SEEN_ON_A_REAL_DRIVER.items():
        cvd = value.format(u=u, u12=u[:12], u8=u[:8], hex=u[4:])
        drv = run_py(DRIVER_LIST, {**env, "CUDA_VISIBLE_DEVICES": cvd})
        assert drv.returncode == 0, drv.stderr
        got = json.loads(drv.stdout.strip().splitlines()[-1])
        if got != ([u] if listed else []):
            wrong.append(f"{cvd!r}: simulator {got}, real driver {'[u]' if listed else '[]'}")
    assert not wrong, "\n".join(wrong)


def values(uuids: list[str]) -> list[str]:
    """CUDA_VISIBLE_DEVICES values worth comparing, for NVML's devices."""
    u = uuids[0]
    out = [
        "0", " 0 ", "0,0", "0,1", "1,0", "1", "-1", "", ",0", "0,", "00", "0x0", "0a",
        "0 1", "9", "0,9,1", "+0", "0,0,1", "0,+0",
        u, u.upper(), u[:12], u[:8], u[:5], u[:4], u[:3], u[4:], u[4:12], u + "0",
        f"{u},0", f"0,{u}", f"{u[:12]},1", f"{u} , 1",
    ]  # fmt: skip
    if len(uuids) > 1:
        out += [f"{uuids[1]},{uuids[0]}", f"1,{uuids[0][:12]}"]
    return out


def mismatches(env: Mapping[str, str], cvds: list[str]) -> tuple[list[str], dict[str, object]]:
    """Compare the driver's and the library's ordinals for every value;
    the differences (one line each) and everything seen, for the report."""
    proc = run_py(LIBRARY_READING, env, args=[json.dumps(cvds)])
    assert proc.returncode == 0, proc.stderr
    ours: dict[str, dict[str, int | None]] = json.loads(proc.stdout.strip().splitlines()[-1])
    bad: list[str] = []
    seen: dict[str, object] = {}
    for cvd in cvds:
        drv = run_py(DRIVER_LIST, {**env, "CUDA_VISIBLE_DEVICES": cvd})
        assert drv.returncode == 0, drv.stderr
        listed = [u.lower() for u in json.loads(drv.stdout.strip().splitlines()[-1])]
        want = {u: listed.index(u.lower()) if u.lower() in listed else None for u in ours[cvd]}
        seen[cvd] = listed
        if ours[cvd] != want:
            bad.append(f"CUDA_VISIBLE_DEVICES={cvd!r}: driver {want}, library {ours[cvd]}")
    return bad, seen


def test_nvml_only_reading_of_cuda_visible_devices_matches_the_simulated_driver(
    tmp_path, build_dir
) -> None:
    """Two devices whose UUIDs share a prefix, every value of values()."""
    node = SimNode.create(
        tmp_path,
        devices="16g:uuid=GPU-aaaa0000-0000-0000-0000-000000000000,"
        "16g:uuid=GPU-aaaa1111-0000-0000-0000-000000000000",
    )
    env = node.shimmed()
    del env["LD_PRELOAD"]
    proc = run_py(LIBRARY_READING, env, args=["uuids"])
    assert proc.returncode == 0, proc.stderr
    uuids = json.loads(proc.stdout)
    # The second device's own prefix too: aaaa1 is not ambiguous.
    cvds = [*values(uuids), "GPU-aaaa1,0", "GPU-aaaa"]
    bad, _ = mismatches(env, cvds)
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
def test_nvml_only_reading_of_cuda_visible_devices_matches_the_real_driver() -> None:
    """The same values on the real driver.  Prints a GPU-CHECK line with
    every value's list; fails with one line per value read otherwise."""
    env = clean_env()
    proc = run_py(LIBRARY_READING, env, args=["uuids"])
    assert proc.returncode == 0, proc.stderr
    uuids = json.loads(proc.stdout)
    bad, seen = mismatches(env, [*values(uuids), "GPU-" + uuids[0][4:].upper()])
    print("GPU-CHECK visible:", json.dumps({"nvml": uuids, "driver": seen, "differ": bad}))
    assert not bad, "\n".join(bad)
