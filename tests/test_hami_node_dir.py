"""The node-wide files in HAMi's /tmp/vgpulock (GPUVISOR_NODE_LOCK's
directory) mounted read-only: the library says once what it costs, for the
guarantee file of oversubscription (gpuvisor-mem-<uuid>, oversub.c) as for
the launch-order file (gpuvisor-sm-<uuid>, sm_arbiter.c), and the limits
still hold."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import SimNode

ALLOC = """
from gpuvisor.shim.driver import Driver
d = Driver()
d.init()
assert d.mem_alloc(64 << 20)[0] == 0
assert d.mem_alloc(64 << 20)[0] == 0
print("ok")
"""


def test_a_read_only_node_directory_is_told_once_for_the_guarantee_file(
    node: SimNode, tmp_path: Path
) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a read-only bind mount)")
    lockdir = tmp_path / "vgpulock"
    lockdir.mkdir()
    env = node.shimmed(
        CUDA_DEVICE_MEMORY_LIMIT="1g",
        CUDA_OVERSUBSCRIBE="true",
        GPUVISOR_NODE_LOCK=str(lockdir / "gpuvisor.lock"),
        LIBCUDA_LOG_LEVEL="1",
    )
    ro = (
        f"mount --bind {lockdir} {lockdir} && mount -o remount,bind,ro {lockdir} && "
        f'exec {sys.executable} -c "$0"'
    )
    told = subprocess.run(
        ["unshare", "--mount", "sh", "-c", ro, textwrap.dedent(ALLOC)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    print(told.stderr)
    if told.returncode != 0 and "unshare" in told.stderr:
        pytest.skip(f"no mount namespace here: {told.stderr.strip()}")
    assert told.stdout == "ok\n", told.stderr  # the limits still hold
    lines = [line for line in told.stderr.splitlines() if "gpuvisor-mem-" in line]
    assert len(lines) == 1, told.stderr  # once, whatever the number of allocations
    assert "node-wide file" in lines[0]
    assert "Read-only file system" in lines[0]
    assert "guarantee" in lines[0]
    assert not list(lockdir.iterdir())
