"""A region file on a filesystem without room for it: the space is reserved
when the file is made, so a full filesystem is one line (exit 2 from
`gpuvisor run`, CUDA_ERROR_NOT_PERMITTED in a workload), never a SIGBUS at
the first store into a page the filesystem cannot back.

The filesystem is a size-limited tmpfs mounted in a mount namespace of the
test's own (`unshare --map-root-user --mount`), so no privilege is needed
where unprivileged user namespaces are allowed; elsewhere the tests skip.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, RUN, SimNode, run_cmd

# Room for the region's first page, not for the rest of it (a few hundred KiB).
TMPFS_SIZE = "16k"


# A CUDA client: cuInit, a context and an allocation on every device.
CLIENT = """
from cuda.bindings import driver as cu
r = cu.cuInit(0)
print("cuInit", r[0].name, flush=True)
n = cu.cuDeviceGetCount()[1] if r[0] == cu.CUresult.CUDA_SUCCESS else 0
for i in range(n):
    ctx = cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(i)[1])
    print("ctx", i, ctx[0].name, flush=True)
    if ctx[0] == cu.CUresult.CUDA_SUCCESS:
        cu.cuCtxSetCurrent(ctx[1])
        print("alloc", i, cu.cuMemAlloc(1 << 20)[0].name, flush=True)
"""


def in_tiny_tmpfs(
    mount: Path, cmd: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """Run cmd with a TMPFS_SIZE tmpfs mounted on mount, in a mount namespace of its own."""
    script = f'mount -t tmpfs -o size={TMPFS_SIZE} gvfull "$0" && exec "$@"'
    return run_cmd(
        ["unshare", "--map-root-user", "--mount", "sh", "-c", script, str(mount), *cmd], env
    )


@pytest.fixture
def full(tmp_path: Path) -> Path:
    """A directory where a tiny tmpfs can be mounted (skips where it cannot)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    probe = in_tiny_tmpfs(mount, ["true"], {"PATH": "/usr/bin:/bin"})
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    return mount


def test_gpuvisor_run_on_a_full_filesystem_is_one_line_and_exit_2(node: SimNode, full: Path):
    env = dict(node.env)
    env["GPUVISOR_NODE_SOCKET"] = str(node.dir / "no-agent.sock")
    region = full / "region.shr"
    marker = node.dir / "started"
    proc = in_tiny_tmpfs(
        full,
        [*RUN, "--memory", "1g", "--region", str(region), "--", "sh", "-c", f"touch {marker}"],
        env,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "CUDA_DEVICE_MEMORY_SHARED_CACHE" in lines[0]
    assert "No space left on device" in lines[0]
    assert not marker.exists()


def test_a_workload_on_a_full_filesystem_gets_an_error_not_sigbus(node: SimNode, full: Path):
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g")
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(full / "region.shr")
    proc = in_tiny_tmpfs(full, [sys.executable, "-c", textwrap.dedent(CLIENT)], env)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "cuInit CUDA_ERROR_NOT_PERMITTED" in proc.stdout
    assert "No space left on device" in proc.stderr


def test_a_sparse_region_left_on_a_full_filesystem_is_an_error_not_sigbus(
    node: SimNode, full: Path, tmp_path: Path
):
    """A region file whose pages past the header were never allocated (a
    library before the space was reserved made it so) on a filesystem that
    has no room left for them."""
    made = tmp_path / "made.shr"
    subprocess.run(
        [sys.executable, "-c", f"from gpuvisor.shim import Region; Region.attach({str(made)!r})"],
        env=node.env,
        check=True,
        timeout=30,
        cwd=REPO_ROOT,
    )
    size = made.stat().st_size
    header = made.read_bytes()[:4096]
    sparse = full / "region.shr"
    make_sparse = (
        f"f = open({str(sparse)!r}, 'wb'); f.write({header!r}); f.truncate({size}); f.close()\n"
        + textwrap.dedent(CLIENT)
    )
    env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g")
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(sparse)
    proc = in_tiny_tmpfs(full, [sys.executable, "-c", make_sparse], env)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "cuInit CUDA_ERROR_NOT_PERMITTED" in proc.stdout
    assert "No space left on device" in proc.stderr
