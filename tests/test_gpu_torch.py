"""Real-GPU checks with PyTorch under the shim (skipped without a GPU).

Run on a machine with an NVIDIA GPU and PyTorch: `pytest -m gpu -s`.
Each check prints a `GPU-CHECK` line with its figures for the report.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import LIBRARY, REPO_ROOT, clean_env, run_py

pytestmark = pytest.mark.gpu

GiB = 1 << 30


def torch_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = clean_env()
    env.update(
        LD_PRELOAD=str(LIBRARY),
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "region.shr"),
        CUDA_VISIBLE_DEVICES="0",
    )
    env.update(extra)
    return env


def run_torch(code: str, env: dict[str, str], timeout: float = 300) -> dict[str, object]:
    proc = run_py(code, env, timeout)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines, proc.stderr
    result: dict[str, object] = json.loads(lines[-1])
    return result


@pytest.fixture(autouse=True)
def _needs_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("PyTorch is not installed")


MEM = """
import json, torch
free, total = torch.cuda.mem_get_info()
x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
free2, _ = torch.cuda.mem_get_info()
try:
    y = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
    err = None
except Exception as e:
    err = type(e).__name__
print(json.dumps({"free": free, "total": total, "free_after_2g": free2, "error": err}))
"""


def test_torch_sees_quota_and_gets_oom(tmp_path: Path) -> None:
    out = run_torch(MEM, torch_env(tmp_path, CUDA_DEVICE_MEMORY_LIMIT="4g"))
    print("GPU-CHECK memory:", json.dumps(out))
    assert out["total"] == 4 * GiB
    assert isinstance(out["free"], int)
    assert 3 * GiB < out["free"] < 4 * GiB
    assert isinstance(out["free_after_2g"], int)
    assert out["free_after_2g"] <= out["free"] - 2 * GiB
    assert out["error"] == "OutOfMemoryError"


# The holder takes 2.5 GiB of the 4 GiB quota.  Each process's context is
# charged too (about 0.5 GiB on an H200), so the second process's own context
# must still fit: with 3 GiB held, its first CUDA call failed with
# out-of-memory, as it would on a 4 GiB GPU.
HOLD = """
import json, sys, torch
x = torch.empty(5 * 2**29, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("READY", flush=True)
sys.stdin.readline()
"""

SECOND = """
import json, torch
free, total = torch.cuda.mem_get_info()
try:
    torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    big = None
except Exception as e:
    big = type(e).__name__
small = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
print(json.dumps({"free": free, "total": total, "big": big}))
"""


def test_two_processes_share_one_quota(tmp_path: Path) -> None:
    env = torch_env(tmp_path, CUDA_DEVICE_MEMORY_LIMIT="4g")
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLD)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "READY"
        out = run_torch(SECOND, env)
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=60)
    print("GPU-CHECK shared:", json.dumps(out))
    assert out["total"] == 4 * GiB
    assert isinstance(out["free"], int)
    assert out["free"] < 1 * GiB
    assert out["big"] == "OutOfMemoryError"


def test_nvidia_smi_shows_quota(tmp_path: Path) -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi not found")
    proc = subprocess.run(
        [smi, "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        env=torch_env(tmp_path, CUDA_DEVICE_MEMORY_LIMIT="4g"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    print("GPU-CHECK nvidia-smi:", proc.stdout.strip(), proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    total_mib = int(proc.stdout.split(",")[0])
    assert total_mib == 4096


def test_sm_limit_holds_on_the_gpu() -> None:
    """CUDA_DEVICE_SM_LIMIT=50 on a PyTorch matmul loop: NVML's per-process
    utilisation and the interposer's own meter both read 50 +- 5 points
    (measured on an H200: 50.0 and 50.0; docs/benchmarks.md)."""
    from tests.bench.torch_sm import batch_for, nvml_handle, run_together

    handle = nvml_handle()
    (r,) = run_together(LIBRARY, [50], 8192, batch_for(8192, 5.0), 1.5, 4.0, handle)
    print("GPU-CHECK sm 50:", json.dumps(r))
    assert isinstance(r["nvml_sm"], float)
    assert 45 <= r["nvml_sm"] <= 55
    assert isinstance(r["metered"], float)
    assert 45 <= r["metered"] <= 55
