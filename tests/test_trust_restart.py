"""Issue 36, defect 3 (and 4) across an agent restart.

Labels were bound to the pod cgroup that first reported them in the agent's
memory only: after an agent restart the first pod to report a name took
it, and a fast poller of another pod won that race while the owner's
reporter was reconnecting.  The bindings (and the priority and policy
each container first reported) now go to the agent's state file and come
back with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from gpuvisor.supervisor.agent import connection as connection_module
from gpuvisor.supervisor.agent import server as server_module
from gpuvisor.supervisor.agent.config import AgentConfig
from gpuvisor.supervisor.agent.persist import read_state_file
from gpuvisor.supervisor.agent.server import Agent
from gpuvisor.supervisor.protocol import ContainerId, Report

from tests.test_agent import device, sock_path  # noqa: F401 (a fixture)
from tests.test_agent_robustness import report_from

LIVE: dict[int, frozenset[str]] = {}
PODS: set[str] = set()


def _cgroups_of(pid: int) -> frozenset[str]:
    if pid not in LIVE:
        raise FileNotFoundError(pid)
    return LIVE[pid]


@pytest.fixture
def node_view(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Peers and pod cgroups as the tests say (the agent reads /proc and
    /sys/fs/cgroup); identity saved at once (not at most once a second)."""
    LIVE.clear()
    PODS.clear()
    monkeypatch.setattr(connection_module, "peer_cgroups", _cgroups_of)
    monkeypatch.setattr(connection_module, "cgroup_exists", lambda path: path in PODS)
    monkeypatch.setattr(server_module, "IDENTITY_SAVE_S", 0.0)
    yield
    LIVE.clear()
    PODS.clear()


def _send(agent: Agent, pid: int, priority: int = 1, policy: str = "burst-share") -> dict[str, Any]:
    report = Report(
        seq=1,
        ts=1.0,
        container=ContainerId(cgroup="/"),
        policy=policy,
        priority=priority,
        devices=[device()],
    )
    return report_from(agent, pid, _cgroups_of(pid), report)


def _started(sock: str) -> Agent:
    agent = Agent(AgentConfig(socket_path=sock))
    agent.load_state()
    return agent


def test_labels_stay_bound_to_their_pod_across_an_agent_restart(
    sock_path: str,  # noqa: F811
    node_view: None,
) -> None:
    """The owner's container and the agent restart together: a container
    of another pod that reports the owner's labels first still gets
    `conflict`, and the owner's restarted container takes them."""
    LIVE.update(
        {
            101: frozenset({"/kubepods/podA/c1"}),
            202: frozenset({"/kubepods/podB/c9"}),
            301: frozenset({"/kubepods/podA/c2"}),
        }
    )
    PODS.update({"/kubepods/podA", "/kubepods/podB"})
    first = _started(sock_path)
    try:
        assert _send(first, 101)["type"] == "ack"
    finally:
        first.gpus.close()
    saved = read_state_file(first.config.state_file_path)
    assert [(b.labels, b.scope) for b in saved.bindings] == [
        (("ns", "pod-v", "main"), "/kubepods/podA")
    ]

    del LIVE[101]  # the owner's reporter is gone while the agent restarts
    second = _started(sock_path)
    try:
        squat = _send(second, 202)
        assert squat["type"] == "error", squat
        assert "is reported by another live cgroup" in squat["error"]
        assert _send(second, 301)["type"] == "ack"  # the owner's restarted container
        assert list(second.state.containers) == ["/kubepods/podA/c2|ns|pod-v|main"]
    finally:
        second.gpus.close()

    PODS.discard("/kubepods/podA")  # the pod is deleted: its name is free
    del LIVE[301]
    third = _started(sock_path)
    try:
        assert _send(third, 202)["type"] == "ack"
    finally:
        third.gpus.close()


def test_first_reported_terms_survive_an_agent_restart(
    sock_path: str,  # noqa: F811
    node_view: None,
) -> None:
    LIVE[404] = frozenset({"/kubepods/podC/c4"})
    PODS.add("/kubepods/podC")
    first = _started(sock_path)
    try:
        assert _send(first, 404, priority=1, policy="burst-share")["type"] == "ack"
    finally:
        first.gpus.close()
    second = _started(sock_path)
    try:
        assert _send(second, 404, priority=0, policy="fixed-share")["type"] == "ack"
        (st,) = second.state.containers.values()
        assert (st.report.priority, st.report.policy) == (1, "burst-share")
        assert second.state.terms_ignored_total == 1
    finally:
        second.gpus.close()


def test_a_state_file_with_bad_bindings_stops_the_agent(sock_path: str) -> None:  # noqa: F811
    """The bindings are read as strictly as the limits: a file that does
    not hold their shape stops the agent, naming the field."""
    agent = Agent(AgentConfig(socket_path=sock_path))
    try:
        path = agent.config.state_file_path
        agent.load_state()  # makes the directory
        with open(path, "w") as f:
            json.dump({"version": 1, "limits": [], "bindings": [{"labels": ["a"]}]}, f)
        with pytest.raises(RuntimeError, match=r"bindings\[0\]\.labels=\['a'\]: expected 3"):
            Agent(AgentConfig(socket_path=sock_path)).load_state()
        with open(path, "w") as f:
            terms = [{"cgroup": "/x", "labels": ["", "", "/x"], "priority": 2, "policy": "x"}]
            json.dump({"version": 1, "limits": [], "terms": terms}, f)
        with pytest.raises(RuntimeError, match=r"terms\[0\]\.priority=2: expected 0 or 1"):
            Agent(AgentConfig(socket_path=sock_path)).load_state()
    finally:
        agent.gpus.close()
