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

import shutil
from pathlib import Path

import pytest

from tests.helpers import LIBRARY, MiB, SimNode, run_json

CLIENT = """
import json
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
