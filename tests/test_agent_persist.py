"""Administrators' limits across a node agent restart (--state-file,
supervisor/agent/persist.py): an agent killed and started again on its
state file pushes them again; cleared ones stay cleared, expired ones are
dropped, and a file it cannot use stops it with one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from gpuvisor.supervisor.agent.config import AgentConfig, admin_socket_for
from gpuvisor.supervisor.agent.persist import (
    encode_state,
    read_state,
    state_file_for,
)
from gpuvisor.supervisor.agent.records import AdminLimits
from gpuvisor.supervisor.agent.state import AgentState
from gpuvisor.supervisor.identity import PeerCred
from gpuvisor.supervisor.protocol import ContainerId, Report, encode

from tests.helpers import CLI, REPO_ROOT, SimNode, run_cli
from tests.test_agent import (  # noqa: F401
    GPU_A,
    GPU_B,
    AgentProc,
    Client,
    GiB,
    device,
    set_limit,
    sock_path,
    wait_for,
)
from tests.test_end_to_end import kill_container, memory_limit, supervised


def state_file(sock: str) -> Path:
    return Path(state_file_for(admin_socket_for(sock)))


def saved(sock: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(state_file(sock).read_text())
    return doc


def crash(agent: AgentProc) -> None:
    """SIGKILL: no clean shutdown, the sockets are left behind."""
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(10)
    agent.stop()


def test_a_killed_agent_started_again_pushes_the_admins_limit_to_a_reconnecting_supervisor(
    sock_path,  # noqa: F811
):
    first = AgentProc(sock_path).start()
    c = Client(sock_path, pod="tenant", namespace="team")
    try:
        assert c.report(device(limit=8 * GiB))["limits"] == {}
        assert (
            set_limit(sock_path, "team/tenant/main", "--memory", "4g", "--cores", "30").returncode
            == 0
        )
        want = {GPU_A: {"memory": 4 * GiB, "sm": 30}}
        assert c.report(device(limit=8 * GiB))["limits"] == want
        (entry,) = saved(sock_path)["limits"]
        assert entry["labels"] == ["team", "tenant", "main"]
        assert entry["until"] is None  # the container was reporting
        assert entry["memory"] == {GPU_A: 4 * GiB}
        assert entry["sm"] == {GPU_A: 30}
        crash(first)
        with AgentProc(sock_path) as second:
            # The supervisor reconnects, its region configured from its
            # environment again (a restart while the agent was down).
            c.connect()
            assert c.report(device(limit=8 * GiB))["limits"] == want
            st = second.status()["containers"][0]
            assert st["admin_limits"] == {"memory": {GPU_A: 4 * GiB}, "sm": {GPU_A: 30}}
            # Applied: nothing more to push, and it is still the container's.
            assert c.report(device(limit=4 * GiB, sm_limit=30))["limits"] == {}
            (entry,) = saved(sock_path)["limits"]
            assert entry["until"] is None
            assert entry["memory"] == {GPU_A: 4 * GiB}
    finally:
        c.close()
        first.stderr.close()


def test_a_limit_taken_back_before_the_restart_stays_taken_back(sock_path):  # noqa: F811
    first = AgentProc(sock_path).start()
    c = Client(sock_path, pod="tenant", namespace="team")
    try:
        c.report(device(limit=8 * GiB))
        assert set_limit(sock_path, "team/tenant/main", "--memory", "4g").returncode == 0
        assert set_limit(sock_path, "team/tenant/main", "--memory", "env").returncode == 0
        assert saved(sock_path)["limits"][0]["restore"] == {GPU_A: ["memory"]}
        crash(first)
        with AgentProc(sock_path) as second:
            c.connect()
            ack = c.report(device(limit=8 * GiB))
            assert ack["limits"] == {}  # the admin's 4 GiB is not pushed again
            assert ack["restore"] == {GPU_A: ["memory"]}  # the container's own stays
            st = second.status()["containers"][0]
            assert st["admin_limits"] == {"memory": {GPU_A: "env"}, "sm": {}}
    finally:
        c.close()
        first.stderr.close()


def test_a_limit_whose_grace_ran_out_while_the_agent_was_down_is_dropped(sock_path):  # noqa: F811
    """A container's final report parks its admin's limits for
    --limit-grace seconds (wall clock in the file): an agent that comes
    back after that drops them, one that comes back before keeps them."""
    first = AgentProc(sock_path, "--limit-grace", "1").start()
    c = Client(sock_path, pod="gone", namespace="team")
    k = Client(sock_path, pod="kept", namespace="team")
    try:
        c.report(device(limit=8 * GiB))
        k.report(device(limit=8 * GiB))
        assert set_limit(sock_path, "team/gone/main", "--memory", "4g").returncode == 0
        assert set_limit(sock_path, "team/kept/main", "--memory", "2g").returncode == 0
        # kept reports again: on a loaded machine the two set-limit commands
        # took longer than --expire-after (10 s), and kept expired, which
        # parked its limit too
        k.report(device(limit=8 * GiB))
        assert c.report(device(limit=4 * GiB), final=True)["type"] == "ack"
        (parked,) = [e for e in saved(sock_path)["limits"] if e["until"] is not None]
        assert parked["labels"] == ["team", "gone", "main"]
        assert parked["until"] == pytest.approx(time.time() + 1, abs=1)
        crash(first)
        time.sleep(1.5)
        with AgentProc(sock_path, "--limit-grace", "1") as second:
            assert second.status()["agent"]["parked_limits"] == 1  # kept's, awaiting it
            assert [e["labels"][1] for e in saved(sock_path)["limits"]] == ["kept"]
            c.connect()
            assert c.report(device(limit=8 * GiB))["limits"] == {}
            k.connect()
            assert k.report(device(limit=8 * GiB))["limits"] == {GPU_A: {"memory": 2 * GiB}}
    finally:
        c.close()
        k.close()
        first.stderr.close()


BAD_FILES = [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"version": 2, "limits": []}', "version=2: this agent reads version 1"),
    (b'{"version": 1, "limits": {}}', "limits={}: expected a list"),
    (
        b'{"version": 1, "limits": [{"labels": ["a", "b", "c"], "scope": "/p", "until": null,'
        b' "memory": {"GPU-a": 1}, "sm": {}, "restore": {}}]}',
        "limits[0].memory.'GPU-a': not a device UUID",
    ),
    (
        b'{"version": 1, "limits": [{"labels": ["a", "b", "c"], "scope": "/p", "until": null,'
        b' "memory": {}, "sm": {"' + GPU_A.encode() + b'": 0}, "restore": {}}]}',
        f"limits[0].sm.{GPU_A}=0: expected null or an integer in [1, 100]",
    ),
    (b"\xff\xfe", "not UTF-8 text"),
]


@pytest.mark.parametrize(("content", "problem"), BAD_FILES)
def test_a_corrupt_state_file_stops_the_agent_with_one_line(sock_path, content, problem):  # noqa: F811
    path = state_file(sock_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    proc = run_cli("node-agent", "--socket", sock_path, "--metrics-port", "0")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"Error: state file {path}: {problem}"), lines[0]
    assert lines[0].endswith("delete it to start with none")
    assert not Path(sock_path).exists()  # nothing served
    assert path.read_bytes() == content  # left for the admin to look at
    # The way out: delete it.
    path.unlink()
    with AgentProc(sock_path) as agent:
        assert agent.status()["containers"] == []


@pytest.mark.parametrize("what", ["directory", "fifo"])
def test_an_unreadable_state_file_stops_the_agent_with_one_line(sock_path, what):  # noqa: F811
    """A directory or a FIFO where the file should be (a FIFO used to hang
    the agent's start, waiting for a writer)."""
    path = state_file(sock_path)
    path.parent.mkdir(parents=True)
    if what == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    proc = run_cli("node-agent", "--socket", sock_path, "--metrics-port", "0")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"Error: state file {path}: not a regular file; the administrators' "
        "limits it holds cannot be restored, so the agent does not start without them: "
        "repair the file, or delete it to start with none"
    ]


@pytest.mark.parametrize("how", ["inside", "link"])
def test_the_state_file_may_not_be_in_the_reporting_sockets_directory(sock_path, how):  # noqa: F811
    """Not in it, nor through a link that leads into it."""
    inside = os.path.join(os.path.dirname(sock_path), "limits.json")
    given = inside
    if how == "link":
        given = os.path.dirname(sock_path) + "-link"
        os.makedirs(os.path.dirname(sock_path), exist_ok=True)
        os.symlink(inside, given)
    proc = run_cli("node-agent", "--socket", sock_path, "--state-file", given)
    assert proc.returncode == 2
    assert "'--state-file'" in proc.stderr
    assert "reporting socket's directory" in proc.stderr


def test_the_state_file_may_not_be_the_admin_socket(sock_path):  # noqa: F811
    """--state-file naming the admin socket's path (a slip between two
    options that sit in the same directory): the agent wrote its state
    file there, then failed to bind the admin socket with `Error: [Errno
    98] Address '...admin.sock' is already in use`, naming no option, and
    left a regular file where the socket goes."""
    admin = admin_socket_for(sock_path)
    proc = run_cli("node-agent", "--socket", sock_path, "--state-file", admin)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"Error: Invalid value for '--state-file': {admin}: the admin socket's path"
    )
    assert not os.path.lexists(admin)


def test_two_rapid_set_limits_leave_the_file_consistent(sock_path):  # noqa: F811
    """Two set-limits pipelined on one admin connection, then two CLIs at
    once: every write replaces the file whole (no temporary file left),
    and the file holds the last values, which a restarted agent pushes."""
    path = Path(os.path.dirname(sock_path) + "-state", "s.json")
    first = AgentProc(sock_path, "--state-file", str(path)).start()
    c = Client(sock_path, pod="tenant", namespace="team")
    try:
        c.report(device(), device(GPU_B, 1))
        msgs = [
            {
                "v": 1,
                "type": "set-limit",
                "seq": i,
                "container": "team/tenant/main",
                "device": GPU_A,
                "memory": mem,
            }
            for i, mem in ((1, 3 * GiB), (2, 2 * GiB))
        ]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(admin_socket_for(sock_path))
            s.sendall(b"".join(encode(m) for m in msgs))
            data = b""
            while data.count(b"\n") < 2:
                chunk = s.recv(65536)
                assert chunk
                data += chunk
        assert [json.loads(line)["type"] for line in data.splitlines()] == ["ack", "ack"]
        procs = [
            subprocess.Popen(
                [
                    *CLI,
                    "node-agent",
                    "set-limit",
                    "--socket",
                    sock_path,
                    "--container",
                    "team/tenant/main",
                    "--device",
                    GPU_B,
                    "--cores",
                    str(pct),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO_ROOT,
            )
            for pct in (10, 20)
        ]
        for p in procs:
            p.communicate(timeout=30)
            assert p.returncode == 0
        (entry,) = json.loads(path.read_text())["limits"]
        assert entry["memory"] == {GPU_A: 2 * GiB}
        assert entry["sm"][GPU_B] in (10, 20)
        assert sorted(os.listdir(path.parent)) == ["s.json"]  # no temporary file left
        assert path.stat().st_mode & 0o777 == 0o600
        last = entry["sm"][GPU_B]
        crash(first)
        with AgentProc(sock_path, "--state-file", str(path)):
            c.connect()
            ack = c.report(device(limit=8 * GiB), device(GPU_B, 1))
            assert ack["limits"] == {GPU_A: {"memory": 2 * GiB}, GPU_B: {"sm": last}}
    finally:
        c.close()
        first.stderr.close()


def test_saved_limits_round_trip_and_wall_clock_expiry():
    """AgentState.saved_limits -> the file -> restore_saved: a reporting
    container's limits wait restore_window from the start, a parked one
    its wall-clock end, and a past end is dropped."""
    cfg = AgentConfig(limit_grace=100.0, max_expire=300.0)
    state = AgentState(cfg)

    def report(pod: str) -> Report:
        return Report(
            seq=1,
            ts=0.0,
            container=ContainerId(f"/kubepods/pod-{pod}/c", pod, "ns", "main"),
            policy="fixed-share",
            priority=0,
            pids=[1],
            devices=[device()],
        )

    peer = PeerCred(pid=1, uid=0, gid=0)
    for pod in ("live", "left"):
        state.accept_report(report(pod), peer, 10.0)
        state.set_limit(f"/kubepods/pod-{pod}/c|ns|{pod}|main", GPU_A, {"memory": GiB, "sm": "env"})
    state.remove("/kubepods/pod-left/c|ns|left|main", park=10.0)
    entries = state.saved_limits()
    assert [(e.labels[1], e.scope, e.until) for e in entries] == [
        ("live", "/kubepods/pod-live", None),
        ("left", "/kubepods/pod-left", round(110.0 + state.wall_offset, 3)),
    ]
    assert entries[0].restore == {GPU_A: ("sm",)}
    path = Path(f"/tmp/gva-roundtrip-{os.getpid()}.json")
    try:
        path.write_bytes(encode_state(entries, time.time()))
        back = read_state(str(path))
    finally:
        path.unlink()
    assert back == entries
    fresh = AgentState(cfg)
    wall = entries[1].until - 50  # 50 s before the parked one's end
    assert fresh.restore_saved(back, 1000.0, wall) == 0
    assert fresh.parked[("ns", "live", "main")].until == 1000.0 + 400.0
    assert fresh.parked[("ns", "live", "main")].awaiting
    assert fresh.parked[("ns", "left", "main")].until == pytest.approx(1050.0)
    assert fresh.parked[("ns", "left", "main")].limits == AdminLimits(
        memory={GPU_A: GiB}, restore={GPU_A: {"sm"}}
    )
    later = AgentState(cfg)
    assert later.restore_saved(back, 1000.0, entries[1].until + 1) == 1
    assert list(later.parked) == [("ns", "live", "main")]
    # The restarted container of the same pod takes them back.
    later.accept_report(report("live"), peer, 1001.0)
    assert later.admin_limits["/kubepods/pod-live/c|ns|live|main"].memory == {GPU_A: GiB}


def test_an_agent_restart_reapplies_an_admins_limit_through_a_real_supervisor(
    node: SimNode,
    sock_path: str,  # noqa: F811
) -> None:
    """On the simulator: the admin lowers a supervised container to 1 GiB;
    the agent is killed, and so is the container (its supervisor and
    workload, as a restart of both would), which starts again from its
    environment (4 GiB) while the agent is down.  The agent, started again
    on its state file, pushes 1 GiB and the new supervisor applies it."""
    first = AgentProc(sock_path, env=node.env).start()
    sup = supervised(node, sock_path, node.dir / "p1.shr", "pod-p", "4g", "0", 64, 30)
    try:
        assert sup.stdout is not None
        assert sup.stdout.readline().strip() == "allocated"
        assert wait_for(lambda: memory_limit(first, "pod-p") == [4 * GiB], timeout=5.0)
        uuid = first.status()["containers"][0]["devices"][0]["uuid"]
        proc = run_cli(
            "node-agent",
            "set-limit",
            "--socket",
            sock_path,
            "--container",
            "e2e/pod-p/main",
            "--device",
            uuid,
            "--memory",
            "1g",
        )
        assert proc.returncode == 0, proc.stderr
        assert wait_for(lambda: memory_limit(first, "pod-p") == [GiB], timeout=5.0)
        crash(first)
        kill_container(sup)
    finally:
        sup.kill()
        sup.communicate(timeout=30)
        first.stderr.close()
    again = supervised(node, sock_path, node.dir / "p2.shr", "pod-p", "4g", "0", 64, 30)
    try:
        assert again.stdout is not None
        assert again.stdout.readline().strip() == "allocated"
        with AgentProc(sock_path, env=node.env) as second:
            assert wait_for(lambda: memory_limit(second, "pod-p") == [GiB], timeout=10.0), (
                memory_limit(second, "pod-p")
            )
    finally:
        again.kill()
        again.communicate(timeout=30)


def test_a_state_file_that_cannot_be_written_is_a_warning_and_the_limit_still_holds(
    sock_path,  # noqa: F811
):
    """The state file's directory is replaced by a plain file while the
    agent runs: set-limit still sets the limit, and says on stderr that it
    will not survive a restart; the agent saves again once it can."""
    directory = Path(os.path.dirname(sock_path) + "-state")
    path = directory / "s.json"
    with AgentProc(sock_path, "--state-file", str(path)):
        c = Client(sock_path, pod="tenant", namespace="team")
        try:
            c.report(device(limit=8 * GiB))
            path.unlink()
            directory.rmdir()
            directory.write_text("not a directory\n")
            proc = set_limit(sock_path, "team/tenant/main", "--memory", "4g")
            assert proc.returncode == 0
            assert proc.stdout.startswith("limit change queued for ")
            assert proc.stderr.splitlines() == [
                f"Warning: cannot save {path} (Not a directory): "
                "the limit will not survive an agent restart"
            ]
            assert c.report(device(limit=8 * GiB))["limits"] == {GPU_A: {"memory": 4 * GiB}}
            directory.unlink()
            directory.mkdir()
            assert wait_for(path.exists, timeout=5.0)  # the sweep saves it
            assert json.loads(path.read_text())["limits"][0]["memory"] == {GPU_A: 4 * GiB}
        finally:
            c.close()
