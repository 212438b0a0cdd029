"""The node agent's view of the other containers reaches the launch gate.

burst-share and best-effort lend what the other containers leave.  The shim
reads the others' use from NVML; the node agent also knows it (every
container reports its share) and sends each container, in its ack, what the
other containers used on each of its devices.  The supervisor writes that
into the region, where the gate takes the larger of the two while it is
fresh.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from gpuvisor.supervisor.agent.config import AgentConfig
from gpuvisor.supervisor.agent.state import AgentState
from gpuvisor.supervisor.identity import PeerCred
from gpuvisor.supervisor.protocol import (
    ContainerId,
    Instructions,
    Report,
    ack_message,
    decode,
    parse_ack,
)

from tests.helpers import REPO_ROOT, RUN, SimNode
from tests.test_agent import GPU_A as GPU_X
from tests.test_agent import device
from tests.test_supervisor_run import FakeAgent, py


def test_ack_carries_and_parses_others_share() -> None:
    msg = ack_message(7, Instructions(others_share={"GPU-a": 42.5}))
    assert msg["others"] == {"GPU-a": 42.5}
    assert parse_ack(
        decode(b'{"v":1,"type":"ack","seq":7,"others":{"GPU-a":42.5}}')
    ).others_share == {"GPU-a": 42.5}


def _pod(pod: str, share: float, sm_limit: int | None, policy: str = "fixed-share") -> Report:
    return Report(
        seq=1,
        ts=0.0,
        container=ContainerId(cgroup=f"/kubepods/{pod}", pod=pod),
        policy=policy,
        priority=1,
        devices=[device(uuid=GPU_X, share=share, sm_limit=sm_limit)],
    )


def _cgroups_of(pid: int) -> frozenset[str]:
    return frozenset({{1: "/kubepods/a", 2: "/kubepods/b"}[pid]})


PEER = PeerCred(pid=1, uid=0, gid=0)


def test_agent_tells_each_container_what_the_others_use() -> None:
    """What the others claim, as the agent's NVML reading shows them
    working (pids 1 and 2: containers a and b)."""
    state = AgentState(AgentConfig(active_window=1.0))
    t = 100.0

    def others(r: Report, at: float) -> float:
        return float(state.accept_report(r, PEER, at).others_share[GPU_X])

    state.accept_report(_pod("a", 30.0, 30), PEER, t)
    state.accept_report(_pod("b", 20.0, 60), PEER, t)
    state.note_process_use({GPU_X: {1: 30.0, 2: 20.0}}, _cgroups_of, t)
    assert others(_pod("b", 20.0, 60), t) == 30.0
    # B uses 20 % but, active, claims its 60 % limit: a starved container
    # still gets its guarantee back from burst-share lenders.
    assert others(_pod("a", 30.0, 30), t) == 60.0
    # An active container without an SM limit claims the whole device.
    state.accept_report(_pod("b", 20.0, None), PEER, t)
    assert others(_pod("a", 30.0, 30), t) == 100.0
    # Idle containers claim nothing; one that left is forgotten.
    state.accept_report(_pod("b", 0.0, 60), PEER, t)
    assert others(_pod("a", 30.0, 30), t) == 0.0
    state.accept_report(replace(_pod("b", 20.0, 60), final=True), PEER, t)
    assert others(_pod("a", 30.0, 30), t) == 0.0


def test_a_best_effort_container_claims_nothing() -> None:
    """Best-effort has no guarantee: its SM limit only turns its gate on
    (its floor is 1 %), and it yields to the others, so it claims nothing
    whatever it uses (the lenders see its use in NVML's figures, and take
    it back when they need it).  Its limit counted as a claim: a
    best-effort newcomer took its limit from a burst-share container that
    was using the idle GPU, as the lender was told the others claim it."""
    state = AgentState(AgentConfig(active_window=1.0))
    t = 100.0
    a = _pod("a", 90.0, 30, "burst-share")
    state.accept_report(a, PEER, t)
    state.accept_report(_pod("b", 5.0, 50, "best-effort"), PEER, t)
    state.note_process_use({GPU_X: {1: 90.0, 2: 5.0}}, _cgroups_of, t)
    b = _pod("b", 5.0, 50, "best-effort")
    assert state.accept_report(b, PEER, t).others_share == {GPU_X: 90.0}
    assert state.accept_report(a, PEER, t).others_share == {GPU_X: 0.0}
    state.accept_report(_pod("b", 70.0, 50, "best-effort"), PEER, t)
    state.note_process_use({GPU_X: {1: 20.0, 2: 70.0}}, _cgroups_of, t)
    a = _pod("a", 20.0, 30, "burst-share")
    assert state.accept_report(a, PEER, t).others_share == {GPU_X: 0.0}


READ_OTHERS = """
import json, sys
from gpuvisor.shim.region import Region
r = Region.attach(sys.argv[1])
print(json.dumps(r.sm_others(0)))
"""


def start_supervised(
    node: SimNode, agent: FakeAgent, region: Path, interval: str, seconds: float
) -> subprocess.Popen[str]:
    """gpuvisor run (burst-share, 30 %) reporting to agent, whose workload
    uses CUDA and then sleeps."""
    env = dict(node.env, GPUVISOR_NODE_SOCKET=str(agent.path))
    workload = f"from tests.cuclient import *\ninit()\nimport time\ntime.sleep({seconds})\n"
    return subprocess.Popen(
        [
            *RUN,
            "--region",
            str(region),
            "--report-interval",
            interval,
            "--cores",
            "30",
            "--policy",
            "burst-share",
            "--",
            *py(workload),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )


def read_others(node: SimNode, region: Path) -> str:
    """Region.sm_others(0) of region, as JSON: [percent, age in s]."""
    return subprocess.run(
        [sys.executable, "-c", READ_OTHERS, str(region)],
        env=node.env,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
    ).stdout.strip()


def test_supervisor_passes_the_view_to_the_gate(node: SimNode) -> None:
    agent = FakeAgent(node.dir / "agent.sock")
    try:
        region = node.dir / "c.shr"
        sup = start_supervised(node, agent, region, "0.1", 2.0)
        report = agent.wait_for(lambda r: bool(r.devices))
        agent.instructions = Instructions(others_share={report.devices[0].uuid: 64.0})
        deadline = time.monotonic() + 5
        seen = None
        while time.monotonic() < deadline:
            seen = read_others(node, region)
            if seen.startswith("[64.0"):
                break
            time.sleep(0.1)
        sup.communicate(timeout=30)
        assert seen is not None
        assert seen.startswith("[64.0"), seen
        assert sup.returncode == 0
    finally:
        agent.close()


def test_the_view_stays_fresh_between_reports_far_apart(node: SimNode) -> None:
    """The gate uses the agent's others' share only while it is under 2 s
    old.  With reports 2.5 s apart the supervisor wrote it once per ack, so
    it lapsed for most of each interval (its age reached 2.3 s here); it is
    now written at every tick while the agent answers."""
    agent = FakeAgent(node.dir / "agent.sock")
    agent.instructions = Instructions(others_share={})
    try:
        region = node.dir / "c.shr"
        sup = start_supervised(node, agent, region, "2.5", 30)
        try:
            first = agent.wait_for(lambda r: bool(r.devices), timeout=20)
            agent.instructions = Instructions(others_share={first.devices[0].uuid: 64.0})
            n = len(agent.reports)
            agent.wait_for(lambda r: len(agent.reports) > n, timeout=20)  # acked with the view
            time.sleep(2.3)  # before the next report is due
            share, age = json.loads(read_others(node, region))
        finally:
            sup.terminate()
            sup.communicate(timeout=30)
        assert share == 64.0
        assert age is not None
        assert age < 1.0, age
    finally:
        agent.close()
