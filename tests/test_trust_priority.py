"""Issue 36, defect 4: a container's priority and claims are checked, not believed.

A report is the container's own word.  Its priority-0 `sm_share` made the
agent pause low-priority neighbours on that GPU even when the container
did not use it, and its claim (its use, or its limit while "active") told
burst-share neighbours to keep off.  Now what a report says of a device
counts toward a neighbour only while the agent's own NVML reading of the
container's processes shows them working there, and a container's
priority and policy are those of its first report, for its life.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from gpuvisor.supervisor.agent.config import AgentConfig
from gpuvisor.supervisor.agent.state import AgentState
from gpuvisor.supervisor.identity import PeerCred
from gpuvisor.supervisor.protocol import ContainerId, Report, parse_ack

from tests.helpers import CU_SPIN_PRELUDE, REPO_ROOT, SimNode, run_py
from tests.test_agent import (  # noqa: F401 (sock_path is a fixture)
    GPU_A,
    AgentProc,
    Client,
    device,
    pod_report,
    sock_path,
    wait_for,
)

PEER = PeerCred(pid=1, uid=0, gid=0)

UUID0 = """
import pynvml
pynvml.nvmlInit()
print(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0)))
"""

SPIN_FOREVER = CU_SPIN_PRELUDE + "\nprint('spinning', flush=True)\nwhile True:\n    launch(1000)\n"


@pytest.fixture
def spinner(node: SimNode) -> Iterator[subprocess.Popen[str]]:
    """A process keeping the simulated device 0 busy (1 ms kernels back to
    back), seen by NVML's per-process utilisation."""
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SPIN_FOREVER)],
        env=node.env,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "spinning"
        yield p
    finally:
        p.kill()
        p.wait()


def test_a_container_not_using_a_gpu_cannot_pause_or_crowd_a_neighbour_there(
    node: SimNode,
    sock_path: str,  # noqa: F811
    spinner: subprocess.Popen[str],
) -> None:
    """The issue's case: a report of priority 0 and sm_share 50 (limit 50)
    for a GPU the container does not use paused a low-priority neighbour's
    kernels (yield) and told it the others claim 50 %.  Through the agent
    with the simulated NVML: the squatter's processes are not on the GPU,
    so the neighbour neither yields nor sees a claim; a priority-0
    container whose process does work there (the spinner) still makes it
    yield."""
    uuid = run_py(UUID0, node.env).stdout.strip()
    with AgentProc(sock_path, "--active-window", "1", env=node.env) as agent:
        low = Client(sock_path, pod="low", priority=1, policy="burst-share")
        squatter = Client(sock_path, pod="squatter", priority=0)
        mine = device(uuid=uuid, share=40.0, sm_limit=40)
        claimed = device(uuid=uuid, share=50.0, sm_limit=50)
        low.report(mine)
        deadline = time.monotonic() + 3.0
        acks = []
        while time.monotonic() < deadline:  # NVML read every 0.25 s meanwhile
            squatter.report(claimed)
            acks.append(parse_ack(low.report(mine)))
            time.sleep(0.2)
        assert [a.yield_devices[uuid] for a in acks] == [False] * len(acks)
        assert {a.others_share[uuid] for a in acks} == {0.0}
        (lowst,) = [c for c in agent.status()["containers"] if c["container"]["pod"] == "low"]
        assert lowst["devices"][0]["yield"] is False

        # A priority-0 container whose process works on the GPU: it yields.
        high = Client(sock_path, pod="high", priority=0)
        high.pids = [spinner.pid]

        def yields() -> bool:
            high.report(device(uuid=uuid, share=50.0, sm_limit=None))
            squatter.report(claimed)
            return bool(parse_ack(low.report(mine)).yield_devices[uuid])

        assert wait_for(yields, timeout=5.0)
        # It claims the whole device (no limit); the squatter still nothing.
        assert low.report(mine)["others"] == {uuid: 100.0}
        for c in (low, squatter, high):
            c.close()


def _report(pod: str, priority: int, share: float, sm_limit: int | None) -> Report:
    return pod_report(pod, priority, [device(share=share, sm_limit=sm_limit)], policy="burst-share")


def test_a_claim_is_what_nvml_shows_of_it() -> None:
    """A burst-share lender lends what the others do not claim.  A
    neighbour's claim counts only while NVML shows its processes working
    there, and its use above its limit only up to NVML's figure: reporting
    100 % while using 20 % claimed the whole device."""
    state = AgentState(AgentConfig(active_window=1.0))
    cgroups = {1: "/kubepods/lender", 2: "/kubepods/greedy"}

    def cgroups_of(pid: int) -> frozenset[str]:
        return frozenset({cgroups[pid]})

    lender = _report("lender", 1, 30.0, 30)
    greedy = _report("greedy", 1, 100.0, 20)

    def others(at: float) -> float:
        return float(state.accept_report(lender, PEER, at).others_share[GPU_A])

    t = 100.0
    state.accept_report(greedy, PEER, t)
    assert not state.wants_process_use()  # alone on its device: no neighbour to affect
    assert others(t) == 0.0  # no reading yet: nothing believed
    assert state.wants_process_use()  # two containers on one device
    state.note_process_use({GPU_A: {1: 30.0}}, cgroups_of, t)
    assert others(t) == 0.0  # NVML sees none of the greedy one's processes
    state.note_process_use({GPU_A: {1: 30.0, 2: 25.0}}, cgroups_of, t + 0.1)
    assert others(t + 0.1) == 25.0  # its use as NVML saw it, not its 100 %
    state.note_process_use({GPU_A: {1: 30.0, 2: 10.0}}, cgroups_of, t + 0.2)
    assert others(t + 0.2) == 20.0  # a starved container still claims its limit
    state.expire(t + 1.5)  # the reading is stale: nothing claimed
    assert others(t + 1.5) == 0.0


def test_priority_and_policy_are_those_of_the_first_report(sock_path: str) -> None:  # noqa: F811
    """A container that first reported priority 1 and later says 0 (or
    another policy) keeps priority 1: logged once, counted in /status; also
    after a final report (the cgroup still exists)."""
    with AgentProc(sock_path) as agent:
        c = Client(sock_path, pod="p", priority=1, policy="burst-share")
        assert c.report(device(share=10.0, sm_limit=30))["type"] == "ack"
        c.priority, c.policy = 0, "fixed-share"
        for _ in range(3):
            assert c.report(device(share=10.0, sm_limit=30))["type"] == "ack"
        st = agent.status()
        (cst,) = st["containers"]
        assert (cst["priority"], cst["policy"]) == (1, "burst-share")
        assert st["agent"]["terms_ignored_total"] == 3
        c.report(device(), final=True)
        assert agent.status()["containers"] == []
        c.report(device())
        (cst,) = agent.status()["containers"]
        assert (cst["priority"], cst["policy"]) == (1, "burst-share")
        c.close()
        agent.stop()
        agent.stderr.seek(0)
        log = agent.stderr.read()
    lines = [line for line in log.splitlines() if "its first report said" in line]
    assert len(lines) == 1, log
    assert "priority=0 policy=fixed-share" in lines[0]
    assert "priority=1 policy=burst-share" in lines[0]


def test_terms_per_cgroup_are_bounded_and_cost_only_that_cgroup() -> None:
    """A cgroup cycling through label sets records at most 64 terms: its
    own least recent one that no container holds is forgotten, never
    another cgroup's."""
    state = AgentState(AgentConfig(max_per_cgroup=4))
    other = replace(_report("other", 1, 0.0, None), container=ContainerId("/kubepods/o", pod="o"))
    state.accept_report(other, PEER, 0.0)
    for i in range(200):
        r = replace(_report("x", 0, 0.0, None), container=ContainerId("/kubepods/x", pod=f"p{i}"))
        state.accept_report(r, PEER, 0.0)
    assert len(state.terms["/kubepods/x"]) == 64
    assert state.terms["/kubepods/o"] == {("", "o", ""): (1, "burst-share")}
