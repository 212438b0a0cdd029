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
from pathlib import Path

from gpuvisor.supervisor.protocol import Instructions, ack_message, decode, parse_ack

from tests.helpers import REPO_ROOT, SimNode
from tests.test_agent import GPU_A as GPU_X
from tests.test_agent import AgentProc, Client, device, sock_path, wait_for  # noqa: F401
from tests.test_supervisor_run import RUN, FakeAgent, py


def test_ack_carries_and_parses_others_share() -> None:
    msg = ack_message(7, Instructions(others_share={"GPU-a": 42.5}))
    assert msg["others"] == {"GPU-a": 42.5}
    assert parse_ack(
        decode(b'{"v":1,"type":"ack","seq":7,"others":{"GPU-a":42.5}}')
    ).others_share == {"GPU-a": 42.5}


def test_agent_tells_each_container_what_the_others_use(sock_path: str) -> None:  # noqa: F811
    with AgentProc(sock_path) as agent:
        del agent
        a, b = Client(sock_path, pod="a"), Client(sock_path, pod="b")
        a.report(device(uuid=GPU_X, share=30.0, sm_limit=30))
        ack_b = b.report(device(uuid=GPU_X, share=20.0, sm_limit=60))
        ack_a = a.report(device(uuid=GPU_X, share=30.0, sm_limit=30))
        assert ack_b["others"] == {GPU_X: 30.0}
        # B uses 20 % but, active, claims its 60 % limit: a starved container
        # still gets its guarantee back from burst-share lenders.
        assert ack_a["others"] == {GPU_X: 60.0}
        # An active container without an SM limit claims the whole device.
        b.report(device(uuid=GPU_X, share=20.0, sm_limit=None))
        assert a.report(device(uuid=GPU_X, share=30.0, sm_limit=30))["others"] == {GPU_X: 100.0}
        # Idle containers claim nothing; one that left is forgotten.
        b.report(device(uuid=GPU_X, share=0.0, sm_limit=60))
        assert a.report(device(uuid=GPU_X, share=30.0, sm_limit=30))["others"] == {GPU_X: 0.0}
        b.report(device(uuid=GPU_X, share=20.0, sm_limit=60), final=True)
        assert a.report(device(uuid=GPU_X, share=30.0, sm_limit=30))["others"] == {GPU_X: 0.0}


def test_a_best_effort_container_claims_nothing(sock_path: str) -> None:  # noqa: F811
    """Best-effort has no guarantee: its SM limit only turns its gate on
    (its floor is 1 %), and it yields to the others, so it claims nothing
    whatever it uses (the lenders see its use in NVML's figures, and take
    it back when they need it).  Its limit counted as a claim: a
    best-effort newcomer took its limit from a burst-share container that
    was using the idle GPU, as the lender was told the others claim it."""
    with AgentProc(sock_path):
        a = Client(sock_path, pod="a", policy="burst-share")
        b = Client(sock_path, pod="b", policy="best-effort")
        a.report(device(uuid=GPU_X, share=90.0, sm_limit=30))
        assert b.report(device(uuid=GPU_X, share=5.0, sm_limit=50))["others"] == {GPU_X: 90.0}
        assert a.report(device(uuid=GPU_X, share=90.0, sm_limit=30))["others"] == {GPU_X: 0.0}
        b.report(device(uuid=GPU_X, share=70.0, sm_limit=50))
        assert a.report(device(uuid=GPU_X, share=20.0, sm_limit=30))["others"] == {GPU_X: 0.0}


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
