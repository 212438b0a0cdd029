"""The node agent learns of containers through their region files in HAMi's
per-container directories (docs/hami.md, "Metrics and the node agent";
supervisor/agent/region_dir.py): no `gpuvisor run`, the library loaded
through the environment alone (LD_PRELOAD here, /etc/ld.so.preload under
HAMi) with HAMi's variables.  The agent exports each container's memory
use under its pod UID and container name, and applies CUDA_TASK_PRIORITY:
a low-priority container yields while a high-priority one works.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid as uuidlib
from pathlib import Path

from tests.helpers import (
    CU_SPIN_PRELUDE,
    DIE_WITH_PARENT,
    REPO_ROOT,
    MiB,
    SimNode,
    shares_over,
    start_cmd,
)
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
    proc = start_cmd(
        [sys.executable, "-c", DIE_WITH_PARENT + textwrap.dedent(WORKLOAD), str(seconds)],
        node.shimmed(CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), **env),
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
            assert used, used
            assert 256 * MiB <= used[0] <= 320 * MiB, used
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
                both = shares_over(node, 1.0)
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


GOOD_UID = "aaaaaaaa-0000-0000-0000-000000000001"
GPU_A = "GPU-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa"
HAMI_CORE_MAGIC = 19920718

MAKE_REGION = """
import sys
from gpuvisor.shim.region import Region
r = Region.attach(sys.argv[1])
r.register_device(sys.argv[2], 16 << 30, int(sys.argv[3]))
"""


def make_region(path: Path, uuid: str, limit: int) -> None:
    """A gpuvisor region at path with one device entry (uuid, limit), made
    by the library as a container's process makes it."""
    subprocess.run(
        [sys.executable, "-c", MAKE_REGION, str(path), uuid, str(limit)],
        check=True,
        cwd=REPO_ROOT,
        timeout=60,
    )


def bad_regions(root: Path, good: Path) -> dict[str, Path]:
    """Files a container may leave where its region file is expected, each
    in a directory of its own pod: name -> the file."""
    size = good.stat().st_size
    out: dict[str, Path] = {}
    for n, name in enumerate(["hamicore", "short", "link", "fifo", "junk", "big"], start=2):
        d = root / f"aaaaaaaa-0000-0000-0000-{n:012d}_{name}"
        d.mkdir()
        out[name] = d / "0c8f2c5e.cache"
    # HAMi-core's region (a container that ran HAMi-core before the swap)
    out["hamicore"].write_bytes(HAMI_CORE_MAGIC.to_bytes(4, "little") + bytes(1 << 20))
    # a gpuvisor region cut short, and one with more after it
    out["short"].write_bytes(good.read_bytes()[:4096])
    out["big"].write_bytes(good.read_bytes() + b"x" * 4096)
    # a link to another pod's region: its figures must not appear under this pod
    out["link"].symlink_to(good)
    os.mkfifo(out["fifo"])  # would block a reader that opened it plainly
    out["junk"].write_bytes(os.urandom(size))
    return out


def test_malformed_and_hostile_region_files_are_skipped_with_one_line_each(
    sock_path: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Beside a good container, directories whose region file is HAMi-core's,
    cut short, too long, random bytes, a FIFO, or a symbolic link to the good
    container's region, and a directory that is not <pod UID>_<container>:
    the agent exports the good container alone, under its own labels, logs
    one line per bad file over many scans, and keeps running."""
    root = tmp_path / "containers"
    root.mkdir()
    good_dir = root / f"{GOOD_UID}_good"
    good_dir.mkdir()
    good = good_dir / "1b4e28ba.cache"
    make_region(good, GPU_A, 3 << 30)
    bad = bad_regions(root, good)
    (root / "not-a-pod-directory").mkdir()
    with AgentProc(sock_path, "--region-dir", str(root), "--region-scan-interval", "0.1") as agent:
        limits = wait_for(
            lambda: find(agent.metrics(), "gpuvisor_container_memory_limit_bytes"), timeout=10.0
        )
        time.sleep(1.5)  # 15 scans
        samples = agent.metrics()
        pods = {lab.get("podname") for n, lab, _ in samples if n.startswith("gpuvisor_container_")}
        assert pods == {GOOD_UID}, pods
        assert limits == [3 << 30]
        assert find(samples, "gpuvisor_container_memory_limit_bytes", ctrname="good") == limits
        assert agent.proc is not None
        assert agent.proc.poll() is None
        agent.stderr.seek(0)
        log = agent.stderr.read()
    print(log)
    for name, path in bad.items():
        lines = [line for line in log.splitlines() if f"{path}: skipped" in line]
        assert len(lines) == 1, (name, lines)
    assert "HAMi-core's region file (magic 19920718)" in log
    assert "symbolic link" in log
    assert sum("not-a-pod-directory: skipped" in line for line in log.splitlines()) == 1


def test_a_socket_peer_cannot_take_the_labels_of_a_region_dir_container(
    sock_path: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The labels of a container read from --region-dir come from its
    directory's name, made on the host.  A supervisor (any process that can
    reach the socket) that reports under them first gives them up at the
    next scan; one that reports under them afterwards is refused as a
    conflict, and the series stay the region's."""
    from tests.test_agent import Client, device

    root = tmp_path / "containers"
    root.mkdir()
    with AgentProc(sock_path, "--region-dir", str(root), "--region-scan-interval", "0.1") as agent:
        forger = Client(sock_path, pod=GOOD_UID, namespace="", container="good")
        assert forger.report(device(limit=7 << 30))["type"] == "ack"
        assert find(agent.metrics(), "gpuvisor_container_memory_limit_bytes") == [7 << 30]
        good_dir = root / f"{GOOD_UID}_good"
        good_dir.mkdir()
        make_region(good_dir / "1b4e28ba.cache", GPU_A, 3 << 30)
        assert wait_for(
            lambda: find(agent.metrics(), "gpuvisor_container_memory_limit_bytes") == [3 << 30],
            timeout=10.0,
        ), agent.metrics()
        reply = forger.report(device(limit=7 << 30))
        assert reply["type"] == "error", reply
        assert "another live cgroup" in reply["error"], reply
        time.sleep(0.3)
        samples = agent.metrics()
        assert find(samples, "gpuvisor_container_memory_limit_bytes") == [3 << 30]
        assert find(samples, "gpuvisor_container_memory_limit_bytes", podname=GOOD_UID) == [3 << 30]
        forger.close()
