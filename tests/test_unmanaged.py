"""Issue 35, 2: a GPU where a process not under gpuvisor runs is shown.

The containers' launch gates share a GPU between themselves; a process that
does not load the library takes what it wants.  The node agent finds it in
its own NVML reading of per-process utilisation (a PID no container
reports), exports gpuvisor_device_unmanaged_processes, lists it in /status
and logs it once; `gpuvisor top` prints a warning line for the GPU.

On the simulator: a supervised container (`gpuvisor run --cores 50`) and a
plain process launching kernels on the same simulated GPU without the
library (the simulated NVML lists it all the same).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
from gpuvisor.supervisor.agent.records import ContainerState
from gpuvisor.supervisor.agent.unmanaged import UnmanagedWatch
from gpuvisor.supervisor.identity import PeerCred
from gpuvisor.supervisor.protocol import ContainerId, Report

from tests.helpers import CLI, REPO_ROOT, SimNode, run_cmd, run_py
from tests.test_agent import AgentProc, device, find, sock_path, wait_for  # noqa: F401
from tests.test_end_to_end import SPIN, spinning, started

# Launching processes measured through NVML: one after another on one
# worker under --dist loadgroup, as tests/test_end_to_end.py's.
pytestmark = pytest.mark.xdist_group("e2e-shares")

METRIC = "gpuvisor_device_unmanaged_processes"

UUID0 = """
import pynvml
pynvml.nvmlInit()
print(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0)))
"""


@pytest.fixture
def managed(node: SimNode, sock_path: str) -> Iterator[subprocess.Popen[str]]:  # noqa: F811
    """A supervised container with an SM limit, launching 1 ms kernels on
    device 0 for up to 60 s."""
    p = spinning(node, sock_path, "managed", ["--cores", "50"], 60)
    try:
        started(p)
        yield p
    finally:
        p.kill()
        p.communicate()


def plain(node: SimNode) -> subprocess.Popen[str]:
    """The same workload without the library (no LD_PRELOAD, no supervisor)."""
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SPIN), "60"],
        env=node.env,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    started(p)
    return p


def unmanaged_count(agent: AgentProc, uuid: str) -> float | None:
    got = find(agent.metrics(), METRIC, deviceuuid=uuid)
    return got[0] if got else None


def top_once(agent: AgentProc, node: SimNode) -> str:
    r = run_cmd([*CLI, "top", "--once", "--url", agent.url + "/status"], node.env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def agent_log(agent: AgentProc) -> str:
    agent.stderr.seek(0)
    return agent.stderr.read()


def test_a_process_beside_a_container_without_the_library_is_shown(
    node: SimNode,
    sock_path: str,  # noqa: F811
    managed: subprocess.Popen[str],
) -> None:
    uuid = run_py(UUID0, node.env).stdout.strip()
    with AgentProc(sock_path, "--active-window", "1", env=node.env) as agent:
        # Read while the container alone works there: nothing to show.
        assert wait_for(lambda: unmanaged_count(agent, uuid) == 0.0, timeout=10.0)
        other = plain(node)
        try:
            t0 = time.monotonic()
            shown = wait_for(lambda: unmanaged_count(agent, uuid) == 1.0, timeout=10.0)
            assert shown, agent.get("/metrics")
            print(f"shown {time.monotonic() - t0:.2f} s after its first kernel")
            (gpu,) = [g for g in agent.status()["gpus"] if g["uuid"] == uuid]
            assert gpu == {"uuid": uuid, "unmanaged_pids": [other.pid], "managed_containers": 1}
            # The other simulated GPU: read, no process there.
            (idle,) = [g for g in agent.status()["gpus"] if g["uuid"] != uuid]
            assert idle["unmanaged_pids"] == []
            assert unmanaged_count(agent, idle["uuid"]) == 0.0
            text = top_once(agent, node)
            assert (
                f"WARNING {uuid}: 1 process not under gpuvisor (PID {other.pid}): "
                "its SM use is not limited"
            ) in text, text
            time.sleep(1.0)  # a few more readings: still one warning in the log
            log = agent_log(agent)
            assert log.count("not under gpuvisor") == 1, log
            assert f"GPU {uuid}: 1 process not under gpuvisor (PID {other.pid})" in log
        finally:
            other.kill()
            other.wait()
            if other.stdout is not None:
                other.stdout.close()
        # Gone: back to 0 within the active window (1 s) and a reading.
        t0 = time.monotonic()
        assert wait_for(lambda: unmanaged_count(agent, uuid) == 0.0, timeout=10.0)
        print(f"cleared {time.monotonic() - t0:.2f} s after it was killed")
        (gpu,) = [g for g in agent.status()["gpus"] if g["uuid"] == uuid]
        assert gpu["unmanaged_pids"] == []
        assert "WARNING" not in top_once(agent, node)
        assert "no process outside gpuvisor any more" in agent_log(agent)
        assert managed.poll() is None  # the container worked throughout


def test_managed_processes_are_not_flagged(
    node: SimNode,
    sock_path: str,  # noqa: F811
    managed: subprocess.Popen[str],
) -> None:
    """Two supervised containers on the GPU, one of them without an SM
    limit (it reports its PIDs all the same): no PID is unmanaged, over
    several readings."""
    uuid = run_py(UUID0, node.env).stdout.strip()
    with AgentProc(sock_path, "--active-window", "1", env=node.env) as agent:
        second = spinning(node, sock_path, "nolimit", ["--memory", "2g"], 60)
        try:
            started(second)
            assert wait_for(
                lambda: any(
                    g["uuid"] == uuid and g["managed_containers"] == 2
                    for g in agent.status()["gpus"]
                ),
                timeout=10.0,
            ), agent.status()
            counts = []
            for _ in range(8):
                counts.append(unmanaged_count(agent, uuid))
                time.sleep(0.25)
            assert counts == [0.0] * 8
            assert "WARNING" not in top_once(agent, node)
            assert "not under gpuvisor" not in agent_log(agent)
        finally:
            second.kill()
            second.communicate()


def _state(cgroup: str, pids: list[int], uuid: str) -> ContainerState:
    report = Report(
        seq=1,
        ts=0.0,
        container=ContainerId(cgroup=cgroup, pod="p"),
        policy="fixed-share",
        priority=1,
        pids=pids,
        devices=[device(uuid=uuid, sm_limit=50)],
    )
    return ContainerState(
        id=report.container,
        report=report,
        peer=PeerCred(1, 0, 0),
        first_seen=0.0,
        last_seen=0.0,
        last_wall=0.0,
    )


def test_a_pid_is_managed_only_by_a_container_of_its_cgroup_in_any_pid_namespace() -> None:
    """A container's PIDs are those of its own PID namespace (the innermost
    NSpid); a container cannot vouch for a process of another cgroup by
    listing its PID; a GPU with a region-file container is not judged."""
    uuid, other_uuid = "GPU-a", "GPU-b"
    ctrs = {
        "a": _state("/kubepods/a", [7], uuid),
        "liar": _state("/kubepods/liar", [100, 200], uuid),
    }
    groups = {100: frozenset({"/kubepods/a"}), 200: frozenset({"/kubepods/x"})}
    names = {100: frozenset({100, 7}), 200: frozenset({200})}
    watch = UnmanagedWatch(window=1.0)
    both = {uuid: {100: 50.0, 200: 30.0}, other_uuid: {}}
    watch.note(both, ctrs, groups.__getitem__, 0.0, names.__getitem__)
    # Unmanaged for less than a window: not shown yet (a container's first
    # kernels may come before its supervisor's first report lists them).
    assert watch.gpus[uuid].unmanaged_pids == ()
    watch.note(both, ctrs, groups.__getitem__, 1.0, names.__getitem__)
    # 100 is container a's PID 7; 200 is listed by "liar" but not in its cgroup.
    assert watch.view() == [
        {"uuid": uuid, "unmanaged_pids": [200], "managed_containers": 2},
        {"uuid": other_uuid, "unmanaged_pids": [], "managed_containers": 0},
    ]
    # Within the window it stays; past it, unseen, it is dropped.
    watch.note({uuid: {}, other_uuid: {}}, ctrs, groups.__getitem__, 1.5, names.__getitem__)
    assert watch.gpus[uuid].unmanaged_pids == (200,)
    watch.note({uuid: {}, other_uuid: {}}, ctrs, groups.__getitem__, 2.6, names.__getitem__)
    assert watch.gpus[uuid].unmanaged_pids == ()
    # Seen again for a window, then a container of its cgroup lists it: managed
    # at once, not a window later.
    for t in (3.0, 4.0):
        watch.note({uuid: {200: 30.0}}, ctrs, groups.__getitem__, t, names.__getitem__)
    assert watch.gpus[uuid].unmanaged_pids == (200,)
    ctrs["x"] = _state("/kubepods/x", [200], uuid)
    watch.note({uuid: {}}, ctrs, groups.__getitem__, 4.2, names.__getitem__)
    assert watch.gpus[uuid].unmanaged_pids == ()
    # A region-file container knows no PIDs: its GPU is not judged.
    ctrs["region"] = _state("region:/some/dir", [], uuid)
    watch.note({uuid: {200: 30.0}}, ctrs, groups.__getitem__, 5.0, names.__getitem__)
    assert watch.view() == [{"uuid": uuid, "unmanaged_pids": None, "managed_containers": 4}]
