"""The node agent learns of containers through their region files in HAMi's
per-container directories (docs/hami.md, "Metrics and the node agent";
supervisor/agent/region_dir.py): no `gpuvisor run`, the library loaded
through the environment alone (LD_PRELOAD here, /etc/ld.so.preload under
HAMi) with HAMi's variables.  The agent exports each container's memory
use under its pod UID and container name, and applies CUDA_TASK_PRIORITY:
a low-priority container yields while a high-priority one works.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid as uuidlib
from pathlib import Path

from tests.helpers import CU_SPIN_PRELUDE, DIE_WITH_PARENT, REPO_ROOT, MiB, SimNode, nvml_shares
from tests.test_agent import AgentProc, find, sock_path, wait_for  # noqa: F401

# Allocates 256 MiB, says so, then launches 1 ms kernels for argv[1] seconds.
WORKLOAD = (
    CU_SPIN_PRELUDE
    + """
import sys, time
chk(cu.cuMemAlloc(256 << 20))
print("allocated", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    launch(1000)
chk(cu.cuStreamSynchronize(s))
"""
)


def hami_container(
    node: SimNode, root: Path, pod_uid: str, name: str, env: dict[str, str], seconds: float
) -> subprocess.Popen[str]:
    """A container as HAMi sets it up: its directory
    <root>/<pod UID>_<name>/ holds the region file <random UUID>.cache
    (CUDA_DEVICE_MEMORY_SHARED_CACHE), the library is preloaded, and the
    limits and priority are HAMi's variables; no supervisor."""
    directory = root / f"{pod_uid}_{name}"
    directory.mkdir()
    cache = directory / f"{uuidlib.uuid4()}.cache"
    proc = subprocess.Popen(
        [sys.executable, "-c", DIE_WITH_PARENT + textwrap.dedent(WORKLOAD), str(seconds)],
        env=node.shimmed(CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "allocated", line + (proc.stderr.read() if proc.stderr else "")
    return proc


LOW_UID = "11111111-2222-3333-4444-555555555555"
HIGH_UID = "66666666-7777-8888-9999-000000000000"


def test_agent_exports_and_applies_priority_of_hami_containers_without_gpuvisor_run(
    node: SimNode,
    sock_path: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """L (CUDA_TASK_PRIORITY=1, SM limit 50) works alone at its share; the
    agent exports its memory use under its pod UID and container name.  H
    (priority 0, SM limit 40) starts: the agent sees H's GPU time in H's
    region and writes the yield into L's, so L's kernels stop while H
    works; H exits, and L resumes."""
    root = tmp_path / "containers"
    root.mkdir()

    def yielding(agent: AgentProc) -> list[float]:
        return find(agent.metrics(), "gpuvisor_container_yield", podname=LOW_UID)

    with AgentProc(
        sock_path, "--region-dir", str(root), "--active-window", "2", env=node.env
    ) as agent:
        hami = {"CUDA_DEVICE_MEMORY_LIMIT_0": "1024m"}
        low = hami_container(
            node,
            root,
            LOW_UID,
            "low",
            dict(hami, CUDA_DEVICE_SM_LIMIT="50", CUDA_TASK_PRIORITY="1"),
            60.0,
        )
        try:
            used = wait_for(
                lambda: find(
                    agent.metrics(),
                    "gpuvisor_container_memory_used_bytes",
                    podname=LOW_UID,
                    ctrname="low",
                ),
                timeout=10.0,
            )
            assert used and 256 * MiB <= used[0] <= 320 * MiB, used
            assert find(
                agent.metrics(),
                "hami_vgpu_memory_limit_bytes",
                pod=LOW_UID,
                container="low",
            ) == [1024 * MiB]
            assert wait_for(
                lambda: any(
                    v >= 0.25
                    for v in find(
                        agent.metrics(), "gpuvisor_container_sm_share_ratio", podname=LOW_UID
                    )
                ),
                timeout=20.0,
            )
            assert yielding(agent) == [0.0]
            high = hami_container(
                node,
                root,
                HIGH_UID,
                "high",
                dict(hami, CUDA_DEVICE_SM_LIMIT="40", CUDA_TASK_PRIORITY="0"),
                6.0,
            )
            try:
                assert wait_for(lambda: yielding(agent) == [1.0], timeout=5.0)
                time.sleep(1.0)  # L's queued kernels drain
                since = int(time.time() * 1e6)
                time.sleep(1.0)
                both = nvml_shares(node, since)
                assert high.poll() is None, "H ended before the reading"
            finally:
                high.communicate(timeout=60)
            # H's region stays (its directory is the pod's until HAMi
            # removes it) but measures no more GPU time: after the active
            # window L is let go.
            assert wait_for(lambda: yielding(agent) == [0.0], timeout=6.0)
            assert low.poll() is None, "L ended early"
        finally:
            low.kill()
            low.communicate(timeout=60)
    assert low.pid is not None
    print(f"with H: {both}")
    low_share = both.get(str(low.pid), 0)
    high_share = both.get(str(high.pid), 0)
    assert low_share <= 3, both
    assert 25 <= high_share <= 45, both
