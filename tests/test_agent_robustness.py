"""The node agent against awkward clients and options: messages that break
the JSON reader, trickled lines, stalled HTTP clients, slow reporters that
declare their interval, and out-of-range command-line values."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from gpuvisor.supervisor.agent import connection as connection_module
from gpuvisor.supervisor.agent.config import AgentConfig, admin_socket_for
from gpuvisor.supervisor.agent.connection import Connection
from gpuvisor.supervisor.agent.server import Agent, send_admin
from gpuvisor.supervisor.agent.state import AgentState
from gpuvisor.supervisor.identity import PeerCred
from gpuvisor.supervisor.protocol import (
    ContainerId,
    ProtocolError,
    Report,
    decode,
    encode,
    parse_report,
    report_message,
)

from tests.helpers import CLI, clean_env, run_cli
from tests.test_agent import GPU_A, GPU_B, AgentProc, Client, device, find, wait_for


@pytest.fixture
def sock_path() -> Iterator[str]:
    # Short: sun_path is limited to 108 bytes, pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="gvr-", dir="/tmp")
    yield os.path.join(d, "run", "node.sock")
    shutil.rmtree(d, ignore_errors=True)


# ---- messages the JSON reader cannot take ----------------------------------------------


def _rejected(agent: AgentProc) -> dict[str, float]:
    return {
        lab["reason"]: v
        for n, lab, v in agent.metrics()
        if n == "gpuvisor_agent_rejected_reports_total"
    }


def test_messages_that_break_the_reader_get_an_error_and_are_counted(sock_path):
    with AgentProc(sock_path) as agent:
        c = Client(sock_path)
        good = c.report_msg()
        line = encode(good)
        cases: list[tuple[bytes, str, str]] = [
            (b"[" * 50000 + b"\n", "not JSON", "malformed"),  # RecursionError in json
            (b'{"v":1,"type":"report","seq":' + b"1" * 5000 + b"}\n", "not JSON", "malformed"),
            (json.dumps({**good, "ts": 10**400}).encode() + b"\n", "ts=", "field"),
            (json.dumps({**good, "v": True}).encode() + b"\n", "v=True", "version"),
            (json.dumps({**good, "v": 1.0}).encode() + b"\n", "v=1.0", "version"),
            # An error naming a long value stays within the message size.
            (
                json.dumps({**good, "policy": "\u00e9" * 25000}, ensure_ascii=False).encode()
                + b"\n",
                "policy=",
                "field",
            ),
        ]
        for bad, text, _ in cases:
            c.send(bad + line)  # the good report behind it is still served
            r = c.recv()
            assert r is not None, text
            assert r["type"] == "error", r
            assert r["error"].startswith(text), r
            assert len(r["error"]) <= 1024
            ack = c.recv()
            assert ack is not None
            assert ack["type"] == "ack"
        rej = _rejected(agent)
        assert rej["malformed"] == 2
        assert rej["field"] == 2
        assert rej["version"] == 2
        assert find(agent.metrics(), "gpuvisor_agent_reports_total") == [float(len(cases))]
        agent.stderr.seek(0)
        assert "Traceback" not in agent.stderr.read()
        c.close()


def test_a_peer_that_keeps_sending_bad_messages_is_disconnected(sock_path):
    """Ten bad messages in a row (--max-errors, default 10): each gets its
    error, then one more error says why, and the connection is closed (the
    lines behind are not served).  A message served in between starts the
    count again."""
    with AgentProc(sock_path) as agent:
        c = Client(sock_path)
        good = c.report_msg()
        bad = [
            b"x\n",
            b"[]\n",
            json.dumps({**good, "v": 2}).encode() + b"\n",
            json.dumps({**good, "priority": "high"}).encode() + b"\n",
            json.dumps({**good, "type": "hello"}).encode() + b"\n",
            json.dumps({"v": 1, "type": "set-limit", "container": "c", "device": GPU_A}).encode()
            + b"\n",
            json.dumps(
                {**good, "container": {**good["container"], "cgroup": "/elsewhere"}}
            ).encode()
            + b"\n",
        ]
        lines = [bad[i % len(bad)] for i in range(9)]
        c.send(b"".join(lines) + encode(good))
        replies = [c.recv() for _ in range(10)]
        assert [r["type"] for r in replies if r is not None] == ["error"] * 9 + ["ack"]
        # Served: the count starts again, and the tenth bad one in a row ends it.
        c.send(b"".join(bad + lines[:3]) + encode(c.report_msg()))
        replies = [c.recv() for _ in range(11)]
        assert all(r is not None and r["type"] == "error" for r in replies), replies
        assert replies[-1] == {
            "v": 1,
            "type": "error",
            "seq": None,
            "error": "10 bad messages in a row: disconnecting",
        }
        assert c.recv() is None  # closed; the report behind was not served
        assert find(agent.metrics(), "gpuvisor_agent_disconnects_total", reason="errors") == [1.0]
        assert find(agent.metrics(), "gpuvisor_agent_reports_total") == [1.0]
        assert sum(_rejected(agent).values()) == 19
        # Other peers are not affected.
        assert Client(sock_path).report()["type"] == "ack"
        c.close()


def test_decode_rejects_non_integer_versions():
    for v in ("true", "1.0", '"1"'):
        with pytest.raises(ProtocolError, match=r"^v="):
            decode(b'{"v":%s,"type":"report"}' % v.encode())
    assert decode(b'{"v":1,"type":"report"}')["v"] == 1


class _Transport:
    """What Connection writes, for a connection driven without a socket."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


def test_any_exception_while_handling_is_a_malformed_error(sock_path, monkeypatch):
    agent = Agent(AgentConfig(socket_path=sock_path))
    try:
        conn = Connection(agent)
        transport = _Transport()
        conn.transport = transport

        def broken(obj: dict[str, Any]) -> Report:
            raise RuntimeError("a bug")

        monkeypatch.setattr(connection_module, "parse_report", broken)
        msg = report_message(_report(None))
        conn.data_received(encode(msg) + encode(msg))
        replies = [json.loads(x) for x in transport.written.splitlines()]
        assert [r["type"] for r in replies] == ["error", "error"]
        assert replies[0]["error"] == "message: could not be handled (RuntimeError)"
        assert not transport.closed
        assert agent.state.rejected["malformed"] == 2
    finally:
        agent.gpus.close()


# ---- lines that never end ----------------------------------------------------------------


def test_a_trickled_incomplete_line_times_out(sock_path):
    with AgentProc(sock_path, "--read-timeout", "0.5") as agent:
        slow = Client(sock_path, pod="slow")
        assert slow.sock is not None
        slow.sock.settimeout(0.05)
        slow.send(b'{"v":1')
        t0 = time.monotonic()
        data = b""
        while b"\n" not in data and time.monotonic() - t0 < 5:
            try:
                slow.send(b" ")  # one byte every 0.1 s: the line never ends
            except OSError:
                break
            with contextlib.suppress(TimeoutError):
                data += slow.sock.recv(4096)
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        slow.sock.settimeout(5)
        slow.buf = data
        r = slow.recv()
        assert r is not None, f"still connected after {elapsed:.1f} s"
        assert "incomplete" in r["error"]
        assert elapsed < 2.0
        assert find(agent.metrics(), "gpuvisor_agent_disconnects_total", reason="timeout") == [1.0]
        slow.close()


def test_lines_that_come_in_pieces_but_end_are_served(sock_path):
    with AgentProc(sock_path, "--read-timeout", "0.5") as agent:
        c = Client(sock_path)
        for _ in range(4):  # 0.3 s per line, each incomplete for 0.15 s
            line = encode(c.report_msg())
            c.send(line[:30])
            time.sleep(0.15)
            c.send(line[30:])
            r = c.recv()
            assert r is not None
            assert r["type"] == "ack"
            time.sleep(0.15)
        assert find(agent.metrics(), "gpuvisor_agent_disconnects_total", reason="timeout") == [0.0]
        c.close()


# ---- HTTP clients that stall ---------------------------------------------------------------


def stall_http(agent: AgentProc, n: int) -> list[socket.socket]:
    """n HTTP clients that never finish their request."""
    stalled = []
    for i in range(n):
        # From several loopback addresses: one client address holds at most
        # 4 handlers (HttpServer.MAX_PER_CLIENT).
        source = (f"127.0.0.{2 + i // 4}", 0)
        s = socket.create_connection(("127.0.0.1", agent.port), timeout=5, source_address=source)
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        stalled.append(s)
    return stalled


def test_stalled_http_clients_are_disconnected(sock_path):
    with AgentProc(sock_path, "--http-timeout", "0.5") as agent:
        stalled = stall_http(agent, 8)
        t0 = time.monotonic()
        for s in stalled:
            assert s.recv(4096) == b""  # closed by the agent
            s.close()
        assert time.monotonic() - t0 < 4
        assert agent.get("/healthz") == "ok\n"
        agent.stderr.seek(0)
        assert "Traceback" not in agent.stderr.read()


def test_at_most_32_http_clients_are_served_at_once(sock_path):
    """32 stalled HTTP clients hold every handler: a 33rd connection is
    closed unanswered at once instead of adding a thread; once the stalled
    ones go, requests are served again."""
    with AgentProc(sock_path, "--http-timeout", "30") as agent:
        stalled = stall_http(agent, 32)
        # The agent accepts in order: once the 32nd is being handled, the
        # next connection finds no free handler.
        time.sleep(0.5)
        extra = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
        t0 = time.monotonic()
        extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert extra.recv(4096) == b""  # closed, not answered
        assert time.monotonic() - t0 < 4
        extra.close()
        for s in stalled:
            s.close()
        deadline = time.monotonic() + 10
        while True:  # the handlers notice their clients went away
            try:
                assert agent.get("/healthz") == "ok\n"
                break
            except OSError:
                assert time.monotonic() < deadline, "not served again"
                time.sleep(0.1)
        agent.stderr.seek(0)
        assert "Traceback" not in agent.stderr.read()


def test_a_trickled_http_request_is_cut_off_at_the_deadline(sock_path):
    """--http-timeout bounds the whole request: a client sending a byte of
    its request every 0.2 s (never stalling a read that long) is still
    disconnected, and the agent keeps answering others."""
    with AgentProc(sock_path, "--http-timeout", "1") as agent:
        s = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
        s.setblocking(False)
        t0 = time.monotonic()
        closed = False
        request = b"GET /metrics HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 200
        for byte in request:
            try:
                if s.recv(4096) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed = True
                break
            try:
                s.send(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.2)
        elapsed = time.monotonic() - t0
        s.close()
        assert closed
        assert elapsed < 3
        assert agent.get("/healthz") == "ok\n"


# ---- slow reporters -------------------------------------------------------------------------


def _report(interval: float | None, seq: int = 1) -> Report:
    return Report(
        seq=seq,
        ts=1.0,
        container=ContainerId(cgroup="/", pod=f"p{interval}"),
        policy="fixed-share",
        priority=0,
        interval=interval,
    )


def test_a_declared_interval_keeps_the_container_from_its_first_report():
    state = AgentState(AgentConfig(expire_after=10.0))
    peer = PeerCred(1, 0, 0)
    state.accept_report(_report(20.0), peer, now=100.0)
    state.accept_report(_report(None), peer, now=100.0)
    assert state.expire(now=115.0) == 1  # the one without an interval: 10 s
    assert [st.id.pod for st in state.containers.values()] == ["p20.0"]
    state.accept_report(_report(20.0, seq=2), peer, now=120.0)  # every 20 s: no flapping
    assert state.expire(now=179.0) == 0
    assert state.expire(now=181.0) == 1
    assert state.expired_total == 2


def test_report_interval_field_is_optional_and_checked():
    msg = report_message(_report(None))
    assert "interval" not in msg  # old agents are not sent an unknown field
    assert parse_report(msg).interval is None
    assert parse_report({**msg, "interval": 30}).interval == 30.0
    assert parse_report({**msg, "interval": None}).interval is None
    assert parse_report({**msg, "interval": 0}).interval is None
    for bad in (-1, 3601, "10", True, float("nan")):
        with pytest.raises(ProtocolError, match=r"^interval="):
            parse_report({**msg, "interval": bad})


def test_a_slow_reporter_is_not_expired_between_reports(sock_path):
    with AgentProc(sock_path, "--expire-after", "0.3") as agent:
        slow = Client(sock_path, pod="slow")
        old = Client(sock_path, pod="old")
        msg = slow.report_msg()
        slow.send({**msg, "interval": 1.0})
        r = slow.recv()
        assert r is not None
        assert r["type"] == "ack"
        assert old.report()["type"] == "ack"
        time.sleep(0.8)
        st = agent.status()
        assert [c["container"]["pod"] for c in st["containers"]] == ["slow"]
        assert st["containers"][0]["interval_s"] == 1.0
        assert st["agent"]["expired_total"] == 1
        slow.close()
        old.close()


# ---- command-line values ---------------------------------------------------------------------


def _agent_cli(sock: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("node-agent", "--socket", sock, "--metrics-host", "127.0.0.1", *args)


def _error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--metrics-port", "70000"], "--metrics-port"),
        (["--metrics-port", "-1"], "--metrics-port"),
        (["--cpu", "-1"], "--cpu"),
        (["--cpu", str(max(os.sched_getaffinity(0)) + 1)], "--cpu"),
        (["--burst", "0"], "--burst"),
        (["--rate", "-1"], "--rate"),
        (["--expire-after", "nan"], "--expire-after"),
        (["--expire-after", "0"], "--expire-after"),
        (["--read-timeout", "-1"], "--read-timeout"),
        (["--idle-timeout", "inf"], "--idle-timeout"),
        (["--http-timeout", "0"], "--http-timeout"),
        (["--active-window", "-3"], "--active-window"),
        (["--max-connections", "0"], "--max-connections"),
    ],
)
def test_out_of_range_agent_options_are_named(sock_path, args, option):
    proc = _agent_cli(sock_path, "--metrics-port", "0", *args)
    assert proc.returncode == 2, proc.stderr
    assert option in _error_line(proc.stderr)
    assert not Path(sock_path).exists()


@pytest.mark.parametrize("option", ["--expire-after", "--rate", "--limit-grace"])
@pytest.mark.parametrize("value", ["1_0", "\u0661"])
def test_agent_durations_are_plain_decimals(sock_path, option, value):
    """float() takes "1_0" as 10 and non-ASCII digits: the agent's
    durations are read as gpuvisor run reads GPUVISOR_REPORT_INTERVAL."""
    proc = _agent_cli(sock_path, "--metrics-port", "0", option, value)
    assert proc.returncode == 2, proc.stderr
    line = _error_line(proc.stderr)
    assert option in line
    assert value in line
    assert not Path(sock_path).exists()


def test_a_taken_metrics_port_is_named_and_leaves_no_socket(sock_path):
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        proc = _agent_cli(sock_path, "--metrics-port", str(taken.getsockname()[1]))
    finally:
        taken.close()
    assert proc.returncode == 1, proc.stderr
    assert "--metrics-port" in _error_line(proc.stderr)
    assert not Path(sock_path).exists()


@pytest.mark.parametrize("which", ["--socket", "--admin-socket"])
def test_a_socket_path_too_long_for_sun_path_is_named_before_anything_is_made(tmp_path, which):
    """A Unix socket path holds at most 107 bytes: past that the agent said
    only `Error: AF_UNIX path too long` (exit 1), after it had made both
    directories and written its state file."""
    top = tmp_path / "gvl"
    long_dir = top / ("d" * 110)
    sock = str(top / "run" / "node.sock")
    args = ["--metrics-port", "0", "--state-file", str(tmp_path / "limits.json")]
    if which == "--socket":
        sock = str(long_dir / "node.sock")
        # The admin socket's default would be as long: give a short one.
        args += ["--admin-socket", str(top / "adm" / "admin.sock")]
    else:
        args += ["--admin-socket", str(long_dir / "admin.sock")]
    bad = str(long_dir / ("node.sock" if which == "--socket" else "admin.sock"))
    proc = _agent_cli(sock, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _error_line(proc.stderr)
    assert f"'{which}'" in line
    assert bad in line
    assert "107 bytes" in line
    assert not top.exists()
    assert not (tmp_path / "limits.json").exists()


@pytest.mark.parametrize("command", [[], ["set-limit", "--container", "c", "--cores", "30"]])
def test_an_empty_socket_path_is_a_usage_error(tmp_path, command):
    """`--socket ''` made the agent create '<cwd's parent>-admin' (the admin
    directory beside an empty path) and a context.lock in the working
    directory, then fail with `Error: . exists and is not a socket`, naming
    neither the option nor the value; gpuvisor run refuses it by name."""
    cwd = tmp_path / "work" / "here"
    cwd.mkdir(parents=True)
    args = ["node-agent", *command, "--socket", ""]
    if command:
        args += ["--device", GPU_A]
    else:
        args += ["--metrics-host", "127.0.0.1", "--metrics-port", "0"]
    proc = subprocess.run(
        [*CLI, *args], env=clean_env(), capture_output=True, text=True, cwd=cwd, timeout=30
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _error_line(proc.stderr)
    assert "'--socket'" in line
    assert "''" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["here"]
    assert list(cwd.iterdir()) == []


def test_a_default_admin_socket_too_long_is_named(tmp_path):
    """--socket fits, but the admin socket beside it ('<dir>-admin/admin.sock',
    longer) does not: named, with its path, before anything is made."""
    top = tmp_path / "gvl"
    # node.sock in a directory whose -admin sibling's admin.sock passes 107 bytes
    sock = top / ("d" * (107 - len(os.fsencode(str(top))) - len("/node.sock") - 1)) / "node.sock"
    assert len(os.fsencode(str(sock))) <= 107
    admin = admin_socket_for(str(sock))
    assert len(os.fsencode(admin)) > 107
    proc = _agent_cli(str(sock), "--metrics-port", "0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _error_line(proc.stderr)
    assert "'--admin-socket'" in line
    assert admin in line
    assert not top.exists()


@contextlib.contextmanager
def _fake_admin_socket(path: str, reply: bytes) -> Iterator[None]:
    """A Unix socket at path that reads one request, writes reply and closes:
    another daemon's socket, or an agent that stops before it answers."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = srv.accept()
                with conn:
                    conn.recv(65536)
                    if reply:
                        conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield
    finally:
        srv.close()


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        (b"", "closed the connection without a reply"),
        (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", "not a gpuvisor node agent"),
        (b"[1]\n", "not a gpuvisor node agent"),
        (b'{"v": 1, "type": "error"}\n', "not a gpuvisor node agent"),
    ],
)
def test_set_limit_names_a_socket_that_gives_no_agents_reply(tmp_path, reply, says):
    """set-limit against a socket that is not the agent's admin socket (an
    HTTP daemon's, a typo), or an agent that stops before it answers: a
    traceback (JSONDecodeError, AttributeError) or `Error: {}` before."""
    admin = str(tmp_path / "admin.sock")
    args = ["--container", "c", "--device", GPU_A, "--cores", "30", "--admin-socket", admin]
    with _fake_admin_socket(admin, reply):
        proc = run_cli("node-agent", "set-limit", *args)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = _error_line(proc.stderr)
    assert admin in line
    assert says in line
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["top", "--interval", "-1"], "--interval"),
        (["top", "--interval", "nan"], "--interval"),
        (["status", "--sample", "-1"], "--sample"),
        (
            ["node-agent", "set-limit", "--container", "c", "--device", "d", "--cores", "150"],
            "--cores",
        ),
        (
            ["node-agent", "set-limit", "--container", "c", "--device", "d", "--memory", "4q"],
            "--memory",
        ),
        (
            ["node-agent", "set-limit", "--container", "c", "--device", "GPU-a", "--cores", "30"],
            "--device",
        ),
    ],
)
def test_out_of_range_view_options_are_named(args, option):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert option in _error_line(proc.stderr)


# ---- peers that do not read their replies ----------------------------------------------


def _flood_unread(sock: str, lines: int, seconds: float) -> socket.socket:
    """A peer that sends `lines` one-byte requests, as many as the agent
    takes within `seconds`, and never reads a reply."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock)
    s.setblocking(False)
    data = memoryview(b"x\n" * lines)
    deadline = time.monotonic() + seconds
    while data and time.monotonic() < deadline:
        try:
            data = data[s.send(data) :]
        except BlockingIOError:
            time.sleep(0.01)
    return s


def test_unread_replies_stay_bounded_per_connection(sock_path):
    """Each line of a read gets a reply; a peer that pipelines a read's worth
    of one-byte lines and never reads must not make the agent buffer a reply
    for every one of them (protocol.md: 256 KiB of unread replies).  With
    --max-errors 0, so that those bad lines do not end the connection."""
    with AgentProc(sock_path, "--read-timeout", "60", "--max-errors", "0") as agent:
        time.sleep(0.3)
        before = agent.rss()
        peers = [_flood_unread(sock_path, 131072, 0.2) for _ in range(30)]
        time.sleep(1.0)
        grown = agent.rss() - before
        assert grown < 64 << 20, f"agent RSS grew by {grown >> 20} MiB"
        # The agent still serves everyone else.
        c = Client(sock_path)
        assert c.report()["type"] == "ack"
        c.close()
        for p in peers:
            p.close()


def test_a_pipelining_peer_gets_every_reply_in_order(sock_path):
    """Lines held while the peer's replies are unread are served once it
    reads: none lost, none reordered (--max-errors 0: the junk lines do
    not end the connection)."""
    n = 50000
    with AgentProc(sock_path, "--rate", "0", "--max-errors", "0") as agent:
        c = Client(sock_path)
        reports = b"".join(encode(c.report_msg()) for _ in range(50))
        junk = b"x\n" * n
        sender = threading.Thread(target=c.send, args=(junk + reports,), daemon=True)
        sender.start()
        replies = [c.recv() for _ in range(n + 50)]
        sender.join(10)
        assert all(r is not None and r["type"] == "error" for r in replies[:n])
        assert [r["seq"] for r in replies[n:] if r is not None] == list(range(1, 51))
        assert _rejected(agent)["malformed"] == n
        c.close()


# ---- labels are not an identity ----------------------------------------------------------


def test_labels_another_live_cgroup_reports_under_are_refused(sock_path, monkeypatch):
    """A container cannot publish metrics under another pod's labels (nor so
    hide the victim from set-limit by name): a report whose
    namespace/pod/container another cgroup holds is refused while that
    cgroup's reporter lives, and taken over once it is gone."""
    live = {101: frozenset({"/kubepods/victim"}), 202: frozenset({"/kubepods/intruder"})}

    def cgroups_of(pid: int) -> frozenset[str]:
        if pid not in live:
            raise FileNotFoundError(pid)
        return live[pid]

    monkeypatch.setattr(connection_module, "peer_cgroups", cgroups_of)
    agent = Agent(AgentConfig(socket_path=sock_path))
    try:

        def connect(pid: int) -> tuple[Connection, _Transport]:
            conn = Connection(agent)
            transport = _Transport()
            conn.transport = transport
            conn.cred = PeerCred(pid, 0, 0)
            conn.cgroups = cgroups_of(pid)
            return conn, transport

        def send(conn: Connection, t: _Transport, cgroup: str) -> dict[str, Any]:
            cid = ContainerId(cgroup=cgroup, pod="pod-v", namespace="ns", container="main")
            t.written = b""
            conn.data_received(encode(report_message(replace(_report(None), container=cid))))
            reply: dict[str, Any] = json.loads(t.written)
            return reply

        victim, vt = connect(101)
        intruder, it = connect(202)
        assert send(victim, vt, "/kubepods/victim")["type"] == "ack"
        err = send(intruder, it, "/kubepods/intruder")
        assert err["type"] == "error"
        assert err["error"] == (
            "container: namespace/pod/container 'ns/pod-v/main' is reported by another live cgroup"
        )
        assert agent.state.rejected["conflict"] == 1
        victim_key = agent.state.find_container("ns/pod-v/main")
        assert victim_key is not None
        assert victim_key.startswith("/kubepods/victim|")
        assert len(agent.state.containers) == 1
        # The victim's reporter is gone (a restarted container): taken over.
        del live[101]
        assert send(intruder, it, "/kubepods/intruder")["type"] == "ack"
        assert list(agent.state.containers) == ["/kubepods/intruder|ns|pod-v|main"]
    finally:
        agent.gpus.close()


def test_a_device_twice_in_one_report_is_refused(sock_path):
    with AgentProc(sock_path) as agent:
        c = Client(sock_path)
        reply = c.report(device(uuid=GPU_A), device(uuid=GPU_B), device(uuid=GPU_A))
        assert reply["type"] == "error"
        assert reply["error"] == f"devices[2].uuid={GPU_A!r}: the same device as devices[0]"
        assert _rejected(agent)["field"] == 1
        assert agent.status()["containers"] == []
        c.close()


def test_a_label_set_naming_an_unlabelled_container_is_refused(sock_path, monkeypatch):
    """A container that sends no labels is exported with its cgroup as
    ctrname: another cgroup reporting container=<that path> would publish
    series under the very same labels (duplicates in /metrics), so it is
    refused as a conflict, like any label set another live cgroup holds.
    Explicitly empty labels are no label: two such cgroups do not clash."""
    live = {101: frozenset({"/kubepods/plain"}), 202: frozenset({"/kubepods/intruder"})}
    monkeypatch.setattr(connection_module, "peer_cgroups", lambda pid: live[pid])
    agent = Agent(AgentConfig(socket_path=sock_path))
    try:

        def send(pid: int, cid: ContainerId) -> dict[str, Any]:
            conn = Connection(agent)
            t = _Transport()
            conn.transport = t
            conn.cred = PeerCred(pid, 0, 0)
            conn.cgroups = live[pid]
            report = replace(_report(None), container=cid, devices=[device()])
            conn.data_received(encode(report_message(report)))
            reply: dict[str, Any] = json.loads(t.written)
            return reply

        assert send(101, ContainerId(cgroup="/kubepods/plain"))["type"] == "ack"
        err = send(202, ContainerId(cgroup="/kubepods/intruder", container="/kubepods/plain"))
        assert err["type"] == "error", err
        assert err["error"] == (
            "container: namespace/pod/container '///kubepods/plain' "
            "is reported by another live cgroup"
        )
        body = agent.metrics_payload(None)[0].decode()
        used = [ln for ln in body.splitlines() if ln.startswith("gpuvisor_container_memory_used")]
        assert len(used) == 1, used
        # A cgroup's own path is its name before anyone else's: taken first
        # by another cgroup, it is given back when the unlabelled one reports.
        agent.state.remove(agent.state.find_container("/kubepods/plain|||") or "")
        squat = ContainerId(cgroup="/kubepods/intruder", container="/kubepods/plain")
        assert send(202, squat)["type"] == "ack"
        assert send(101, ContainerId(cgroup="/kubepods/plain"))["type"] == "ack"
        assert list(agent.state.containers) == ["/kubepods/plain|||"]
        assert send(202, squat)["type"] == "error"
        # Empty strings export as the cgroup, as no labels do: no clash.
        empty = ContainerId(cgroup="/kubepods/plain", pod="", namespace="", container="")
        other = ContainerId(cgroup="/kubepods/intruder", pod="", namespace="", container="")
        assert send(101, empty)["type"] == "ack"
        assert send(202, other)["type"] == "ack"
    finally:
        agent.gpus.close()


# ---- device UUIDs: one form, a bounded set per container --------------------------------

UUID_ERROR = "expected a device UUID, GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (lowercase hex)"


def _uuid(i: int) -> str:
    return f"GPU-{i:08x}-0000-4000-8000-000000000000"


def _uuid_labels(agent: AgentProc) -> set[str]:
    """Every device UUID a container series of /metrics carries."""
    return {
        lab.get("deviceuuid") or lab["device_uuid"]
        for n, lab, _ in agent.metrics()
        if "deviceuuid" in lab or "device_uuid" in lab
    }


def test_device_uuids_must_have_nvml_form(sock_path):
    """A report's device UUID becomes a label of every series of the
    device: one that is not NVML's form (as the library writes it) is
    refused, naming the field and the value, and exports nothing."""
    bad = [
        "GPU-a",
        "GPU-" + GPU_A[4:].upper(),
        "MIG-" + GPU_A[4:],
        GPU_A + "0",
        " " + GPU_A,
        GPU_A + "\n",
        GPU_A.replace("-", "", 2),
    ]
    with AgentProc(sock_path) as agent:
        c = Client(sock_path)
        for uuid in bad:
            reply = c.report(device(uuid=uuid))
            assert reply["type"] == "error", uuid
            assert reply["error"] == f"devices[0].uuid={uuid!r}: {UUID_ERROR}"
            assert c.report(device(uuid=GPU_A))["type"] == "ack"
        assert _rejected(agent)["field"] == len(bad)
        assert _uuid_labels(agent) == {GPU_A}
        # set-limit names a device the same way.
        admin = Path(sock_path).parent.parent / "run-admin" / "admin.sock"
        msg = {"v": 1, "type": "set-limit", "container": "ns/pod-a/main", "sm": 20}
        reply = send_admin(str(admin), {**msg, "device": "GPU-a"})
        assert reply["type"] == "error"
        assert reply["error"] == f"device='GPU-a': {UUID_ERROR}"
        assert send_admin(str(admin), {**msg, "device": GPU_A})["type"] == "ack"
        c.close()


def test_a_container_names_at_most_16_devices(sock_path):
    """A region holds at most 16 devices and never changes them: a
    container whose reports go on naming new UUIDs (made up, or a buggy
    supervisor) is refused the 17th, so it cannot grow /metrics series
    without end; the devices it named stay accepted."""
    with AgentProc(sock_path) as agent:
        c = Client(sock_path)
        for first in range(0, 16, 4):
            devs = [device(uuid=_uuid(i), index=i - first) for i in range(first, first + 4)]
            assert c.report(*devs)["type"] == "ack"
            # Only the devices of the latest report are exported.
            assert _uuid_labels(agent) == {_uuid(i) for i in range(first, first + 4)}
        reply = c.report(device(uuid=_uuid(3)), device(uuid=_uuid(16), index=1))
        assert reply["type"] == "error"
        assert reply["error"].startswith(f"devices[1].uuid={_uuid(16)!r}: a device more than")
        assert _rejected(agent)["devices"] == 1
        assert _uuid_labels(agent) == {_uuid(i) for i in range(12, 16)}
        assert c.report(device(uuid=_uuid(0)), device(uuid=_uuid(15), index=1))["type"] == "ack"
        assert _uuid_labels(agent) == {_uuid(0), _uuid(15)}
        # Another container has a budget of its own.
        other = Client(sock_path, pod="pod-b")
        assert other.report(device(uuid=_uuid(16)))["type"] == "ack"
        # Gone (a final report), the container's series and budget go too.
        assert c.report(device(uuid=_uuid(0)), final=True)["type"] == "ack"
        assert _uuid_labels(agent) == {_uuid(16)}
        assert c.report(device(uuid=_uuid(17)))["type"] == "ack"
        c.close()
        other.close()


def test_a_containers_series_are_those_of_its_latest_report(sock_path):
    """Already so before UUIDs were checked (the collector reads each
    container's latest report at scrape time): a device a container no
    longer reports has no series left, and a container that expired or
    sent its final report has none at all."""
    with AgentProc(sock_path, "--expire-after", "0.5") as agent:
        a = Client(sock_path, pod="pod-a")
        b = Client(sock_path, pod="pod-b")
        assert a.report(device(uuid=GPU_A), device(uuid=GPU_B, index=1))["type"] == "ack"
        assert b.report(device(uuid=_uuid(1)))["type"] == "ack"
        assert _uuid_labels(agent) == {GPU_A, GPU_B, _uuid(1)}
        assert a.report(device(uuid=GPU_B))["type"] == "ack"
        assert _uuid_labels(agent) == {GPU_B, _uuid(1)}
        assert a.report(device(uuid=GPU_B), final=True)["type"] == "ack"
        assert _uuid_labels(agent) == {_uuid(1)}
        # b stops reporting: it expires, and its series with it.
        assert wait_for(lambda: not _uuid_labels(agent), timeout=5.0)
        assert agent.status()["containers"] == []
        a.close()
        b.close()


def test_a_node_socket_that_cannot_be_bound_leaves_no_admin_socket(tmp_path, monkeypatch):
    """The admin socket is bound first: when the node socket's bind then
    failed, the agent exited with the admin socket left on disk.  Now it
    unlinks what it bound, and only that (a socket it failed to bind may be
    another agent's)."""
    sock = tmp_path / "run" / "node.sock"
    admin = tmp_path / "adm" / "admin.sock"
    config = AgentConfig(
        socket_path=str(sock),
        admin_socket=str(admin),
        metrics_host="127.0.0.1",
        metrics_port=0,
        state_file=str(tmp_path / "limits.json"),
    )
    real = asyncio.SelectorEventLoop.create_unix_server  # the Unix loop asyncio.run uses

    async def refuse_the_node_socket(
        self: asyncio.SelectorEventLoop, factory: Any, path: str | None = None, **kw: Any
    ) -> Any:
        if path == str(sock):
            sock.write_text("someone else's")  # what a failed bind must not remove
            raise OSError(98, "Address already in use")
        return await real(self, factory, path, **kw)

    monkeypatch.setattr(asyncio.SelectorEventLoop, "create_unix_server", refuse_the_node_socket)
    with pytest.raises(OSError, match="Address already in use"):
        asyncio.run(Agent(config).run())
    assert not admin.exists()
    assert sock.read_text() == "someone else's"


def test_pages_are_read_on_the_event_loop_while_set_limit_runs(sock_path, monkeypatch):
    """Reports and admin messages change the agent's tables on its event
    loop; /metrics and /status used to read them on the HTTP thread, and a
    scrape during a set-limit could see a table change size under it (one
    read in about 6,000 failed with set-limit running flat out).  Each page
    is now read on the loop: checked where the status is made, then with
    set-limit churning on the loop while two threads scrape both pages."""
    top = Path(sock_path).parent.parent
    config = AgentConfig(
        socket_path=sock_path,
        admin_socket=str(top / "adm" / "admin.sock"),
        metrics_host="127.0.0.1",
        metrics_port=0,
        state_file=str(top / "limits.json"),
    )
    agent = Agent(config)
    ports: list[int] = []
    ready = threading.Event()

    async def serve() -> None:  # Agent.run less its signal handlers (main thread only)
        await agent.start()
        ports.append(agent.start_http())
        ready.set()
        assert agent.stopping is not None
        await agent.stopping.wait()
        agent.close()

    runner = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    runner.start()
    assert ready.wait(30)
    loop = agent.loop
    assert loop is not None
    url = f"http://127.0.0.1:{ports[0]}"
    try:
        seen: list[int] = []
        status = agent.state.status

        def spied() -> dict[str, Any]:
            seen.append(threading.get_ident())
            result: dict[str, Any] = status()
            return result

        monkeypatch.setattr(agent.state, "status", spied)
        with urllib.request.urlopen(url + "/status", timeout=5) as resp:
            assert resp.status == 200
        assert seen == [runner.ident]

        report = _report(None)
        peer = PeerCred(pid=1, uid=0, gid=0)
        agent.on_loop(lambda: agent.state.accept_report(report, peer, time.monotonic()))
        key = next(iter(agent.state.containers))
        gpus = [f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(8)]

        async def churn(seconds: float) -> int:
            cycles = 0
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                for value in (50, "env"):
                    for gpu in gpus:
                        agent.state.set_limit(key, gpu, {"memory": 1 << 30, "sm": value})
                agent.state.admin_limits.pop(key, None)
                cycles += 1
                await asyncio.sleep(0.001)  # the GIL for the HTTP threads too
            return cycles

        failures: list[str] = []
        reads = [0]

        def scrape(page: str) -> None:
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                try:
                    with urllib.request.urlopen(url + page, timeout=5) as resp:
                        body = resp.read()
                    if page == "/status":
                        json.loads(body)
                    reads[0] += 1
                except Exception as exc:  # an HTTP error, a cut connection, bad JSON
                    failures.append(f"{page}: {exc!r}")

        work = asyncio.run_coroutine_threadsafe(churn(2.0), loop)
        scrapers = [threading.Thread(target=scrape, args=(p,)) for p in ("/metrics", "/status")]
        for t in scrapers:
            t.start()
        for t in scrapers:
            t.join()
        cycles = work.result(timeout=10)
        print(f"{reads[0]} pages read during {cycles} set-limit cycles")
        assert not failures, failures[:5]
        assert reads[0] > 10
        assert cycles > 10
    finally:
        loop.call_soon_threadsafe(lambda: agent.stopping and agent.stopping.set())
        runner.join(10)


def test_nan_and_infinity_are_malformed_not_a_version():
    """JSON has no NaN: a message holding one (in `v` or anywhere) is not
    JSON, so refused as malformed, never as another version."""
    for text in (b'{"v":NaN,"type":"report"}', b'{"v":1,"type":"report","ts":-Infinity}'):
        with pytest.raises(ProtocolError, match=r"^not JSON: ") as info:
            decode(text)
        assert connection_module._classify(info.value) == "malformed"


def test_a_byte_order_mark_before_a_report_is_refused():
    line = b'{"v":1,"type":"report"}'
    assert decode(line)["v"] == 1
    with pytest.raises(ProtocolError, match=r"^not JSON: a UTF-8 byte-order mark"):
        decode(b"\xef\xbb\xbf" + line)


def test_an_admin_socket_directory_linked_into_the_socket_directory_names_admin_socket(sock_path):
    """The admin socket's directory is a symlink to the reporting socket's
    (mounted into every workload): refused, and the option named is the
    one given, --admin-socket (the default state file beside it followed
    the link too, and --state-file was blamed)."""
    base = os.path.dirname(os.path.dirname(sock_path))
    os.makedirs(os.path.dirname(sock_path))
    link = os.path.join(base, "adm")
    os.symlink(os.path.dirname(sock_path), link)
    proc = _agent_cli(
        sock_path, "--metrics-port", "0", "--admin-socket", os.path.join(link, "admin.sock")
    )
    assert proc.returncode == 2, proc.stderr
    line = _error_line(proc.stderr)
    assert "--admin-socket" in line, line
    assert "--state-file" not in line, line
    assert not Path(sock_path).exists()


@pytest.mark.parametrize("char", ["\r", "\x00", "\x1b", "\u2028", "\n", "\u202e"])
def test_control_characters_in_labels_are_refused_and_never_reach_metrics(sock_path, char):
    """A pod, namespace or container name with a character that is not
    printable (line-based tools split /metrics on \\r or U+2028) is refused
    naming the field; none reaches /metrics."""
    with AgentProc(sock_path) as agent:
        c = Client(sock_path)
        good = c.report_msg()
        for field in ("pod", "namespace", "container"):
            bad = {**good, "container": {**good["container"], field: f"x{char}y"}}
            c.send(json.dumps(bad).encode() + b"\n")
            r = c.recv()
            assert r is not None, field
            assert r["type"] == "error", r
            assert r["error"].startswith(f"container.{field}="), r
            assert "printable" in r["error"], r
        assert _rejected(agent)["field"] == 3
        with urllib.request.urlopen(f"{agent.url}/metrics", timeout=10) as resp:
            body = resp.read().decode()
        assert "x" + char not in body
        if char != "\n":
            assert char not in body
        c.close()


def test_a_cgroup_named_container_has_its_unprintable_characters_escaped_in_metrics():
    """A container named by its (verified) cgroup, whose path holds a
    character that is not printable: /metrics shows it escaped."""
    from gpuvisor.supervisor.agent.metrics import AgentCollector, HostGpus, render

    state = AgentState(AgentConfig())
    cid = ContainerId(cgroup="/kubepods/a\rb\u2028c")
    state.accept_report(replace(_report(None), container=cid), PeerCred(1, 0, 0), time.monotonic())
    gpus = HostGpus(None, "n")
    try:
        body, _ = render(AgentCollector(state, gpus, legacy=False, node="n"), None)
    finally:
        gpus.close()
    text = body.decode()
    assert "\r" not in text
    assert "\u2028" not in text
    assert 'ctrname="/kubepods/a\\\\rb\\\\u2028c"' in text


def test_blank_lines_count_against_the_peers_own_budget(sock_path):
    """A flood of blank lines is not free: each takes one of the peer's
    messages (--rate/--burst), past them each counts as a bad message, and
    --max-errors of them in a row disconnect the peer.  Its neighbours are
    served meanwhile."""
    with AgentProc(sock_path, "--rate", "10", "--burst", "20") as agent:
        flooder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        flooder.connect(sock_path)
        flooder.settimeout(10)
        with contextlib.suppress(OSError):
            flooder.sendall(b"\n" * 5000)
        # Closed: a read ends (EOF or reset) instead of waiting for more.
        with contextlib.suppress(ConnectionResetError):
            while flooder.recv(65536):
                pass
        flooder.close()
        assert find(agent.metrics(), "gpuvisor_agent_disconnects_total", reason="errors") == [1.0]
        assert Client(sock_path).report()["type"] == "ack"


def test_blank_lines_do_not_keep_an_idle_peer_connected(sock_path):
    with AgentProc(sock_path, "--idle-timeout", "1") as agent:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock_path)
        deadline = time.monotonic() + 6
        closed = False
        while time.monotonic() < deadline and not closed:
            try:
                s.sendall(b"\n")
            except OSError:
                closed = True
            time.sleep(0.2)
        s.close()
        assert closed
        assert find(agent.metrics(), "gpuvisor_agent_disconnects_total", reason="idle") == [1.0]


class _SockTransport(asyncio.Transport):
    """A transport for connection_made: its peer is set by the test."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


def greedy_and_other_peers(
    monkeypatch: pytest.MonkeyPatch, agent: Agent
) -> Callable[[int], tuple[Connection, _SockTransport]]:
    """connect(pid) opens a connection to agent whose peer is pid: 101 is
    in cgroup /kubepods/greedy, 202 in /kubepods/other."""
    peers = {101: frozenset({"/kubepods/greedy"}), 202: frozenset({"/kubepods/other"})}
    next_pid: list[int] = [101]
    monkeypatch.setattr(connection_module, "peer_cred", lambda sock: PeerCred(next_pid[0], 0, 0))
    monkeypatch.setattr(connection_module, "peer_cgroups", lambda pid: peers[pid])

    def connect(pid: int) -> tuple[Connection, _SockTransport]:
        next_pid[0] = pid
        conn, t = Connection(agent), _SockTransport()
        conn.connection_made(t)
        return conn, t

    return connect


def test_one_cgroup_holding_connections_locks_only_itself_out(sock_path, monkeypatch):
    """--max-connections-per-cgroup: a greedy container's processes get
    'too many connections' past their cgroup's share; a process of another
    cgroup still connects (the global pool used to be one container's)."""
    agent = Agent(AgentConfig(socket_path=sock_path, max_connections_per_cgroup=8))
    connect = greedy_and_other_peers(monkeypatch, agent)
    try:
        greedy = [connect(101) for _ in range(8)]
        assert not any(t.closed for _, t in greedy)
        _, t = connect(101)
        assert t.closed
        assert json.loads(t.written)["error"] == (
            "too many connections from cgroup ['/kubepods/greedy']: "
            "at most 8 (--max-connections-per-cgroup)"
        )
        _, ot = connect(202)
        assert not ot.closed
        assert len(agent.conns) == 9
        assert agent.state.disconnects["too-many"] == 1
        # One of the greedy ones closes: its cgroup may connect once more.
        greedy[0][0].connection_lost(None)
        _, t = connect(101)
        assert not t.closed
    finally:
        agent.gpus.close()


def test_cgroups_filling_the_global_pool_give_connections_up_to_another(sock_path, monkeypatch):
    """--max-connections is shared: where cgroups together hold all of it
    (each within its own share), a peer of another cgroup used to get
    'too many connections'.  Now the cgroup holding the most gives up its
    least recently active connection to it (told why); a peer of that
    cgroup itself is refused, so a greedy container locks only itself out."""
    agent = Agent(AgentConfig(socket_path=sock_path, max_connections=8))
    connect = greedy_and_other_peers(monkeypatch, agent)
    try:
        greedy = [connect(101) for _ in range(8)]
        for i, (conn, _) in enumerate(greedy):
            conn.last_activity = float(i)  # the first is the least recently active
        assert not any(t.closed for _, t in greedy)
        _, t = connect(101)
        assert t.closed  # its own cgroup holds the most: refused
        assert json.loads(t.written)["error"] == "too many connections to the node agent"
        _, ot = connect(202)
        assert not ot.closed
        assert greedy[0][1].closed
        assert [t.closed for _, t in greedy[1:]] == [False] * 7
        assert "gives one up to another" in json.loads(greedy[0][1].written)["error"]
        greedy[0][0].connection_lost(None)
        assert len(agent.conns) == 8
        _, t = connect(101)
        assert t.closed  # 7 against the other's 1: still its own loss
        _, ot2 = connect(202)
        assert not ot2.closed  # 7 against 1: the greedy one gives up another
        assert agent.state.disconnects["too-many"] == 4
    finally:
        agent.gpus.close()


def report_from(agent: Agent, pid: int, cgroups: frozenset[str], report: Report) -> dict[str, Any]:
    """report, sent on a new connection from pid in cgroups (one cgroup: the
    container pod-v/main of namespace ns there); the agent's reply."""
    conn, t = Connection(agent), _Transport()
    conn.transport = t
    conn.cred = PeerCred(pid, 0, 0)
    conn.cgroups = cgroups
    (cgroup,) = cgroups
    cid = ContainerId(cgroup=cgroup, pod="pod-v", namespace="ns", container="main")
    conn.data_received(encode(report_message(replace(report, container=cid))))
    reply: dict[str, Any] = json.loads(t.written)
    return reply


def test_another_pods_container_never_takes_a_live_pods_labels(sock_path, monkeypatch):
    """Labels are bound to the pod's cgroup (the scope of the first cgroup
    that reported them): while it exists, a container of another pod gets
    `conflict`, also while the owner's reporter is gone (a container
    restart), and the owner's restarted container takes its labels back.
    Once the pod's cgroup is gone, the name is free."""
    live = {
        101: frozenset({"/kubepods/podA/c1"}),
        202: frozenset({"/kubepods/podB/c9"}),
        303: frozenset({"/kubepods/podA/c2"}),
    }
    pods = {"/kubepods/podA", "/kubepods/podB"}

    def cgroups_of(pid: int) -> frozenset[str]:
        if pid not in live:
            raise FileNotFoundError(pid)
        return live[pid]

    monkeypatch.setattr(connection_module, "peer_cgroups", cgroups_of)
    monkeypatch.setattr(
        connection_module, "cgroup_exists", lambda path: path in pods, raising=False
    )
    agent = Agent(AgentConfig(socket_path=sock_path))
    try:

        def send(pid: int) -> dict[str, Any]:
            return report_from(agent, pid, cgroups_of(pid), _report(None))

        assert send(101)["type"] == "ack"
        del live[101]  # the owner's container restarts: its reporter is gone a while
        err = send(202)
        assert err["type"] == "error", err
        assert "is reported by another live cgroup" in err["error"]
        assert send(303)["type"] == "ack"  # the restarted container of the same pod
        assert list(agent.state.containers) == ["/kubepods/podA/c2|ns|pod-v|main"]
        del live[303]
        pods.discard("/kubepods/podA")  # the pod is deleted: its name is free
        assert send(202)["type"] == "ack"
        assert list(agent.state.containers) == ["/kubepods/podB/c9|ns|pod-v|main"]
    finally:
        agent.gpus.close()


@pytest.mark.parametrize(
    ("client", "public", "served"),
    [
        (("127.0.0.1", 5000), False, True),
        (("::1", 5000, 0, 0), False, True),
        (("10.1.2.3", 5000), False, False),
        (("::ffff:10.1.2.3", 5000, 0, 0), False, False),
        (("10.1.2.3", 5000), True, True),
    ],
)
def test_status_is_served_beyond_the_node_only_when_asked(client, public, served):
    """/status hands out every container's labels, cgroups, PIDs and uids:
    by default only to loopback clients (404 to others, as for a page that
    does not exist); --status-public serves it to any client.  /metrics
    and /healthz are served to all."""
    from gpuvisor.supervisor.agent.http import HttpHandler

    class Pages:
        def metrics_payload(self, accept: str | None) -> tuple[bytes, str]:
            return b"m\n", "text/plain"

        def status_payload(self) -> bytes:
            return b"{}"

    handler = type("H", (HttpHandler,), {"agent": Pages(), "status_public": public})
    h: Any = object.__new__(handler)
    h.client_address = client
    h.headers = {}
    assert (h._page("/status") is not None) is served
    assert h._page("/metrics") == (b"m\n", "text/plain")
    assert h._page("/healthz") is not None


def test_scrapes_are_served_under_64_idle_reconnecting_clients(sock_path):
    """64 idle HTTP clients of one address, each reconnecting as soon as it
    is cut off, hold at most 4 handlers (HttpServer.MAX_PER_CLIENT):
    another client's scrapes are all answered (46 of 46 failed when one
    address could take all 32)."""
    with AgentProc(sock_path, "--http-timeout", "2") as agent:
        stop = threading.Event()

        def idle_client() -> None:
            while not stop.is_set():
                try:
                    with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as s:
                        s.recv(1)  # until the agent cuts it off
                except OSError:
                    time.sleep(0.01)

        threads = [threading.Thread(target=idle_client, daemon=True) for _ in range(64)]
        for t in threads:
            t.start()
        try:
            time.sleep(1)
            answered = 0
            for _ in range(20):
                s = socket.create_connection(
                    ("127.0.0.1", agent.port), timeout=5, source_address=("127.0.0.2", 0)
                )
                with s:
                    s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                    if s.recv(64).startswith(b"HTTP/1.0 200"):
                        answered += 1
                time.sleep(0.1)
            assert answered == 20
        finally:
            stop.set()
            for t in threads:
                t.join(10)
