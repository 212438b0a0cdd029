"""GPUVISOR_LIMITS_FILE: the limits a container gets from a file (the one
gpuvisor device-plugin writes for it) instead of its environment, in the
environment variables' grammar, failing closed when the file is missing,
malformed or empty."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import RUN, MiB, SimNode, run_cmd, run_py

NOT_PERMITTED = 800

# cuInit's code and, when it succeeds, device 0's and 1's totals through
# cuMemGetInfo (real client: cuda-python through the preloaded library).
PROBE = """
import json
from tests.cuclient import *
from cuda.bindings import driver as cu
err = cu.cuInit(0)[0]
out = {"init": int(err)}
if err == 0:
    for d in (0, 1):
        init(d)
        out[str(d)] = mem_info()[1]
print(json.dumps(out))
"""


def probe(node: SimNode, **env: str) -> tuple[dict[str, int], str]:
    proc = run_py(PROBE, node.shimmed(**env))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_limits_come_from_the_file_not_the_environment(node: SimNode, tmp_path: Path) -> None:
    """The file's limits apply (per ordinal, as the container sees it); the
    environment's own limit variables are ignored while the file is named."""
    f = tmp_path / "limits.env"
    f.write_text(
        "# written by gpuvisor device-plugin\n"
        "CUDA_DEVICE_MEMORY_LIMIT_0=3000m\n"
        "\n"
        "CUDA_DEVICE_MEMORY_LIMIT_1=1g\r\n"
        "CUDA_DEVICE_SM_LIMIT=30\n"
    )
    got, _ = probe(node, GPUVISOR_LIMITS_FILE=str(f), CUDA_DEVICE_MEMORY_LIMIT="8g")
    assert got == {"init": 0, "0": 3000 * MiB, "1": 1024 * MiB}
    # and without the file (another container: its own region), the
    # environment's limit is the one
    other = str(tmp_path / "other.shr")
    got, _ = probe(node, CUDA_DEVICE_MEMORY_LIMIT="8g", CUDA_DEVICE_MEMORY_SHARED_CACHE=other)
    assert got == {"init": 0, "0": 8192 * MiB, "1": 8192 * MiB}


BAD_FILES = [
    (None, "cannot open: no such file"),
    ("", "sets no limit"),
    ("# nothing\n\n", "sets no limit"),
    ("CUDA_DEVICE_MEMORY_LIMIT 3g\n", 'line 1: "CUDA_DEVICE_MEMORY_LIMIT 3g" is not NAME=value'),
    ("=3g\n", "is not NAME=value"),
    ("LD_PRELOAD=/x.so\n", "line 1: LD_PRELOAD is not a limit variable"),
    ("CUDA_DEVICE_MEMORY_LIMIT=1g\nCUDA_DEVICE_MEMORY_LIMIT=2g\n", "line 2: "),
    ("CUDA_DEVICE_MEMORY_LIMIT=2x\n", 'CUDA_DEVICE_MEMORY_LIMIT="2x": not a memory size'),
    ("CUDA_DEVICE_MEMORY_LIMIT_x=1g\n", "CUDA_DEVICE_MEMORY_LIMIT_x"),
    ("CUDA_DEVICE_SM_LIMIT=101\n", "not a whole percentage"),
    ("GPUVISOR_SM_POLICY=fair\n", "use fixed-share, burst-share or best-effort"),
    ("CUDA_TASK_PRIORITY=2\n", "use 0 (high) or 1 (low)"),
    ("CUDA_DEVICE_MEMORY_LIMIT=4g\nCUDA_OVERSUBSCRIBE=maybe\n", 'OVERSUBSCRIBE="maybe": not a'),
    ("CUDA_OVERSUBSCRIBE=true\nGPUVISOR_MEMORY_SCALING=0\n", 'SCALING="0": not a scaling'),
    ("GPUVISOR_MEMORY_SCALING=1e3\n", 'GPUVISOR_MEMORY_SCALING="1e3": not a scaling factor'),
    ("CUDA_DEVICE_MEMORY_LIMIT=1g\0\n", "has a NUL byte"),
    ("# " + "x" * 5000 + "\nCUDA_DEVICE_MEMORY_LIMIT=1g\n", "larger than 4096 bytes"),
]


@pytest.mark.parametrize(("text", "why"), BAD_FILES)
def test_a_bad_file_fails_closed_with_one_line(
    node: SimNode, tmp_path: Path, text: str | None, why: str
) -> None:
    f = tmp_path / "limits.env"
    if text is not None:
        f.write_bytes(text.encode())
    got, err = probe(node, GPUVISOR_LIMITS_FILE=str(f))
    assert got == {"init": NOT_PERMITTED}
    lines = [ln for ln in err.splitlines() if "CUDA_ERROR_NOT_PERMITTED" in ln]
    assert len(lines) == 1, err
    assert f'GPUVISOR_LIMITS_FILE="{f}": ' in lines[0], lines[0]
    assert why in lines[0], lines[0]


def test_a_relative_path_fails_closed(node: SimNode) -> None:
    got, err = probe(node, GPUVISOR_LIMITS_FILE="limits.env")
    assert got == {"init": NOT_PERMITTED}
    assert 'GPUVISOR_LIMITS_FILE="limits.env": not an absolute path' in err


CHECKS = """
import json, sys
from gpuvisor.shim.capi import GpuvisorError
from gpuvisor.shim.limits import env_device_limits, validate_environment
try:
    validate_environment()
    v = "ok"
except GpuvisorError as exc:
    v = str(exc)
uuid = sys.argv[1]
try:
    d = env_device_limits({"GPUVISOR_LIMITS_FILE": sys.argv[2]}, uuid, 16 << 30)
    e = [d.memory, d.sm]
except GpuvisorError as exc:
    e = str(exc)
print(json.dumps([v, e]))
"""


def test_the_supervisor_checks_read_the_file_too(node: SimNode, tmp_path: Path) -> None:
    """gpuvisor run's check (validate_environment) and the supervisor's
    per-device limits (env_device_limits, a workload environment passed as
    an array) read the same file as the library."""
    good = tmp_path / "good.env"
    good.write_text("CUDA_DEVICE_MEMORY_LIMIT=25%\nCUDA_DEVICE_SM_LIMIT=40\n")
    uuid = "GPU-00000000-1111-2222-3333-444444444444"
    env = dict(node.env, GPUVISOR_LIMITS_FILE=str(good))
    proc = run_py(CHECKS, env, args=[uuid, str(good)])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["ok", [4 << 30, 40]]
    missing = tmp_path / "missing.env"
    env = dict(node.env, GPUVISOR_LIMITS_FILE=str(missing))
    proc = run_py(CHECKS, env, args=[uuid, str(missing)])
    assert proc.returncode == 0, proc.stderr
    v, e = json.loads(proc.stdout)
    for message in (v, e):
        assert f'GPUVISOR_LIMITS_FILE="{missing}": cannot open: no such file' in message


MEMINFO = [
    sys.executable,
    "-c",
    "import json; from tests.cuclient import *; init(0); print(json.dumps(mem_info()))",
]


def gpuvisor_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_cmd([*RUN, *args], env)


def test_gpuvisor_run_with_a_limits_file(node: SimNode, tmp_path: Path) -> None:
    """`gpuvisor run` in a container the device plugin set up: the workload
    gets the file's limits; an option that would be ignored, and a missing
    file, stop it before the workload starts (status 2, one line)."""
    f = tmp_path / "limits.env"
    f.write_text("CUDA_DEVICE_MEMORY_LIMIT=3000m\n")
    env = dict(node.env, GPUVISOR_LIMITS_FILE=str(f))
    env["GPUVISOR_NODE_SOCKET"] = str(tmp_path / "no-agent.sock")
    proc = gpuvisor_run(env, "--", *MEMINFO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])[1] == 3000 * MiB
    proc = gpuvisor_run(env, "--memory", "4g", "--", "true")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"Error: --memory: the limits come from GPUVISOR_LIMITS_FILE='{f}' (gpuvisor "
        "device-plugin's), which the library reads instead of the options"
    )
    env["GPUVISOR_LIMITS_FILE"] = str(tmp_path / "missing.env")
    marker = tmp_path / "started"
    proc = gpuvisor_run(env, "--", "touch", str(marker))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f'Error: GPUVISOR_LIMITS_FILE="{tmp_path / "missing.env"}": cannot open: no such file'
    )
    assert not marker.exists()


# A 5 GiB allocation under a 6 GiB quota on a 4 GiB device, and the total
# cuMemGetInfo shows (real client through the preloaded library).
OVERSUBSCRIBED = """
import json
from tests.cuclient import *
init()
err, p = call(cu.cuMemAlloc, 5 * GiB)
print(json.dumps({"err": err.name, "total": mem_info()[1]}))
"""


def test_oversubscription_comes_from_the_file(tmp_path: Path, build_dir: Path) -> None:
    """CUDA_OVERSUBSCRIBE and GPUVISOR_MEMORY_SCALING are read from the file
    (the grant says whether a quota may pass the device's memory): with
    them there, 5 GiB of a 6 GiB quota are granted on a 4 GiB device; the
    environment's own CUDA_OVERSUBSCRIBE is ignored while a file is named."""
    small = SimNode.create(tmp_path, devices="1x4g")
    f = tmp_path / "limits.env"
    f.write_text(
        "CUDA_DEVICE_MEMORY_LIMIT=6g\nCUDA_OVERSUBSCRIBE=true\nGPUVISOR_MEMORY_SCALING=1.5\n"
    )
    proc = run_py(OVERSUBSCRIBED, small.shimmed(GPUVISOR_LIMITS_FILE=str(f)))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"err": "CUDA_SUCCESS", "total": 6 << 30}
    plain = tmp_path / "plain.env"
    plain.write_text("CUDA_DEVICE_MEMORY_LIMIT=6g\n")
    env = small.shimmed(
        GPUVISOR_LIMITS_FILE=str(plain),
        CUDA_OVERSUBSCRIBE="true",
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "plain.shr"),
    )
    proc = run_py(OVERSUBSCRIBED, env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"err": "CUDA_ERROR_OUT_OF_MEMORY", "total": 4 << 30}


def test_gpuvisor_run_refuses_oversubscription_options_beside_a_file(
    node: SimNode, tmp_path: Path
) -> None:
    f = tmp_path / "limits.env"
    f.write_text("CUDA_DEVICE_MEMORY_LIMIT=3000m\n")
    env = dict(node.env, GPUVISOR_LIMITS_FILE=str(f))
    env["GPUVISOR_NODE_SOCKET"] = str(tmp_path / "no-agent.sock")
    for option in (["--oversubscribe"], ["--memory-scaling", "2"]):
        proc = gpuvisor_run(env, *option, "--", "true")
        assert proc.returncode == 2
        assert proc.stderr.strip() == (
            f"Error: {option[0]}: the limits come from GPUVISOR_LIMITS_FILE='{f}' (gpuvisor "
            "device-plugin's), which the library reads instead of the options"
        )
