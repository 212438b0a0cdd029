"""`gpuvisor run` on the simulated node: the shim is preloaded with the
limits given, every bad value stops it before the workload starts, the
node agent being away never holds the workload up, and a (fake) agent gets
periodic and final reports and steers the container through its acks.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import psutil
import pytest
from gpuvisor.supervisor.protocol import (
    Instructions,
    Report,
    ack_message,
    decode,
    encode,
    error_message,
    parse_report,
)

from tests.helpers import CU_SPIN_PRELUDE, REPO_ROOT, RUN, GiB, SimNode, run_cmd, start_cmd

MEMINFO = """
import json
from tests.cuclient import init, mem_info
init()
print(json.dumps(mem_info()))
"""

# Launches 200 us kernels until the file argv[1] exists.
LAUNCHER = (
    CU_SPIN_PRELUDE
    + """
import os, sys, time
print("launching", flush=True)
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    for _ in range(20):
        launch(200)
chk(cu.cuStreamSynchronize(s))
"""
)

READ_SM = """
import json, sys
from gpuvisor.shim import Region
r = Region.attach(sys.argv[1])
s = r.sm(0)
print(json.dumps({"limit": s.limit, "share": s.share, "launches": s.launches,
                  "uuid": r.device_uuid(0), "mem_limit": r.get_limit(0)}))
"""


def run(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_cmd([*RUN, *args], env, timeout)


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def read_region(node: SimNode, code: str) -> str:
    """The output of code run with node's region file as its argument."""
    return subprocess.run(
        [*py(code), str(node.region)],
        env=node.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        cwd=REPO_ROOT,
    ).stdout


def read_sm(node: SimNode) -> dict[str, object]:
    result: dict[str, object] = json.loads(read_region(node, READ_SM))
    return result


@pytest.fixture
def env(node: SimNode) -> dict[str, str]:
    """The simulated node's env (simulator on LD_LIBRARY_PATH), no agent."""
    e = dict(node.env)
    e["GPUVISOR_NODE_SOCKET"] = str(node.dir / "no-agent.sock")
    return e


def test_memory_option_is_the_device_size(node, env):
    env.pop("LD_LIBRARY_PATH")  # --simulate puts the simulator there
    proc = run(env, "--simulate", "--memory", "4g", "--", *py(MEMINFO))
    assert proc.returncode == 0, proc.stderr
    free, total = json.loads(proc.stdout.splitlines()[-1])
    assert total == 4 * GiB
    assert 0 < free < total


def test_oversubscribe_option_lets_the_quota_pass_the_device(node, env):
    """--oversubscribe: a 20 GiB quota on a 16 GiB device is the device's
    size for the workload; --memory-scaling reaches it as
    GPUVISOR_MEMORY_SCALING.  Without the option, the device's 16 GiB."""
    code = MEMINFO + "import os\nprint(os.environ.get('GPUVISOR_MEMORY_SCALING'))\n"
    proc = run(env, "--memory", "20g", "--oversubscribe", "--memory-scaling", "2", "--", *py(code))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert json.loads(lines[-2])[1] == 20 * GiB
    assert lines[-1] == "2"
    proc = run(env, "--memory", "20g", "--", *py(MEMINFO))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])[1] == 16 * GiB


def test_injected_environment_is_used(node, env):
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "2g"
    env["CUDA_DEVICE_MEMORY_LIMIT_0"] = "3g"
    proc = run(env, "--", *py(MEMINFO))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])[1] == 3 * GiB


def test_region_option(node, env, tmp_path):
    region = tmp_path / "other.shr"
    proc = run(env, "--memory", "1g", "--region", str(region), "--", *py(MEMINFO))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])[1] == GiB
    assert region.exists()


BAD = [
    (["--memory", "12q"], {}, "--memory", "12q"),
    (["--memory", "150%"], {}, "--memory", "150%"),
    (["--cores", "101"], {}, "--cores", "101"),
    (["--cores", "abc"], {}, "--cores", "abc"),
    (["--policy", "fair"], {}, "--policy", "fair"),
    (["--priority", "2"], {}, "--priority", "2"),
    (["--report-interval", "0"], {}, "--report-interval", "0"),
    (["--report-interval", "nan"], {}, "--report-interval", "nan"),
    (["--grace", "-1"], {}, "--grace", "-1"),
    (["--memory-scaling", "0"], {}, "--memory-scaling", "0"),
    (["--memory-scaling", "1e3"], {}, "--memory-scaling", "1e3"),
    ([], {"CUDA_OVERSUBSCRIBE": "maybe"}, "CUDA_OVERSUBSCRIBE", "maybe"),
    ([], {"GPUVISOR_MEMORY_SCALING": "-2"}, "GPUVISOR_MEMORY_SCALING", "-2"),
    (["--oversubscribe"], {"GPUVISOR_MEMORY_SCALING": "x"}, "GPUVISOR_MEMORY_SCALING", "x"),
    (["--socket", "/" + "s" * 200], {}, "--socket", "sss"),
    ([], {"CUDA_DEVICE_MEMORY_LIMIT": "abc"}, "CUDA_DEVICE_MEMORY_LIMIT", "abc"),
    ([], {"CUDA_DEVICE_MEMORY_LIMIT_0": "0"}, "CUDA_DEVICE_MEMORY_LIMIT_0", "0"),
    ([], {"CUDA_DEVICE_MEMORY_LIMIT_x": "1g"}, "CUDA_DEVICE_MEMORY_LIMIT_x", "1g"),
    ([], {"CUDA_DEVICE_SM_LIMIT": "abc"}, "CUDA_DEVICE_SM_LIMIT", "abc"),
    ([], {"CUDA_DEVICE_SM_LIMIT_1": "12.5"}, "CUDA_DEVICE_SM_LIMIT_1", "12.5"),
    ([], {"GPUVISOR_SM_POLICY": "x"}, "GPUVISOR_SM_POLICY", "x"),
    ([], {"GPU_CORE_UTILIZATION_POLICY": "x"}, "GPU_CORE_UTILIZATION_POLICY", "x"),
    ([], {"CUDA_TASK_PRIORITY": "7"}, "CUDA_TASK_PRIORITY", "7"),
    ([], {"GPUVISOR_NODE_SOCKET": "/" + "s" * 200}, "GPUVISOR_NODE_SOCKET", "sss"),
    ([], {"GPUVISOR_REPORT_INTERVAL": "0"}, "GPUVISOR_REPORT_INTERVAL", "0"),
    ([], {"GPUVISOR_KILL_GRACE": "soon"}, "GPUVISOR_KILL_GRACE", "soon"),
    ([], {"GPUVISOR_KILL_GRACE": "1_0"}, "GPUVISOR_KILL_GRACE", "1_0"),  # float() took it as 10
    ([], {"GPUVISOR_REPORT_INTERVAL": "\u0661"}, "GPUVISOR_REPORT_INTERVAL", "\u0661"),
    # Bytes that are not UTF-8 (the surrogate escapes Python gives them).
    (["--memory", "4\udcffg"], {}, "--memory", "4"),
    ([], {"CUDA_DEVICE_MEMORY_LIMIT": "4\udcffg"}, "CUDA_DEVICE_MEMORY_LIMIT", "4"),
    ([], {"GPUVISOR_SM_POLICY": "\udce9"}, "GPUVISOR_SM_POLICY", '"'),
    # An option is checked together with the environment it ends up in.
    (["--memory", "4g"], {"CUDA_DEVICE_MEMORY_LIMIT_1": "?"}, "CUDA_DEVICE_MEMORY_LIMIT_1", "?"),
]


def refused_before_the_workload(env: dict[str, str], tmp_path: Path, *args: str) -> str:
    """`gpuvisor run ARGS -- touch MARKER` exits 2 with a one-line error
    before the workload starts; that line."""
    marker = tmp_path / "started"
    proc = run(env, *args, "--", "sh", "-c", f"touch {marker}")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert not marker.exists()
    return lines[0]


@pytest.mark.parametrize(
    ("args", "variables", "name", "value"), BAD, ids=[f"{b[2]}={b[3]}"[:40] for b in BAD]
)
def test_bad_value_stops_before_the_workload(env, tmp_path, args, variables, name, value):
    env.update(variables)
    line = refused_before_the_workload(env, tmp_path, *args)
    assert name in line
    assert value in line


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--grace", "1_0"),  # float() took it as 10
        ("--report-interval", "1_0"),
        ("--report-interval", "\u0661"),  # float() took it as 1
        ("--grace", "\u0665"),
    ],
)
def test_seconds_options_are_read_as_their_variables(env, tmp_path, option, value):
    """GPUVISOR_KILL_GRACE=1_0 and GPUVISOR_REPORT_INTERVAL=\u0661 are
    refused (test_bad_value_stops_before_the_workload), but the options that
    override them took the same text through float(): --grace 1_0 ran with
    a 10 s grace period."""
    line = refused_before_the_workload(env, tmp_path, option, value)
    assert option in line
    assert value in line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--bogus", "--", "true"], "--bogus"),
        (["--memry", "4g", "--", "true"], "--memry"),
        (["--simulate=3", "--", "true"], "--simulate"),
    ],
)
def test_a_usage_error_is_one_line(env, args, says):
    """cli.md: usage errors come after the usage lines for every command
    but `gpuvisor run`, whose errors are one line (a container's log).  An
    unknown option printed 'Usage: ...', 'Try ...' and a blank line first."""
    proc = run(env, *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: ")
    assert says in lines[0]


def test_empty_variables_count_as_unset(node, env):
    """As in the library and the node agent: a variable set but empty means
    its default, not an error."""
    from gpuvisor.shim.region import default_region_path
    from gpuvisor.supervisor.entrypoint import config

    for name in ("GPUVISOR_NODE_SOCKET", "GPUVISOR_REPORT_INTERVAL", "GPUVISOR_KILL_GRACE"):
        env[name] = ""
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = ""
    cfg = config.build(config.RunOptions(), ["true"], env)
    assert cfg.socket == config.DEFAULT_SOCKET
    assert cfg.report_interval == config.DEFAULT_INTERVAL
    assert cfg.grace == config.DEFAULT_GRACE
    assert cfg.region == default_region_path() == cfg.env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
    # End to end, with a region of its own (the default path is global).
    proc = run(env, "--region", str(node.dir / "empty.shr"), "--", "sh", "-c", "exit 5")
    assert proc.returncode == 5, proc.stderr


def test_workload_gets_the_agents_context_lock(env, tmp_path, monkeypatch):
    """Where the node agent keeps context.lock beside its socket, the
    workload's library is told to use it (GPUVISOR_NODE_LOCK); a value the
    container sets itself, empty (off) included, is kept."""
    from gpuvisor.supervisor.entrypoint import config

    env["GPUVISOR_NODE_SOCKET"] = str(tmp_path / "node.sock")
    env.pop("GPUVISOR_NODE_LOCK", None)
    assert "GPUVISOR_NODE_LOCK" not in config.build(config.RunOptions(), ["true"], env).env
    (tmp_path / "context.lock").touch()
    cfg = config.build(config.RunOptions(), ["true"], env)
    assert cfg.env["GPUVISOR_NODE_LOCK"] == str(tmp_path / "context.lock")
    for own in ("", "/tmp/vgpulock/gpuvisor.lock"):
        cfg = config.build(config.RunOptions(), ["true"], {**env, "GPUVISOR_NODE_LOCK": own})
        assert cfg.env["GPUVISOR_NODE_LOCK"] == own
    # Under HAMi's device plugin (its lock directory mounted) the library's
    # default there is kept: containers started without gpuvisor run use it.
    monkeypatch.setattr(config, "HAMI_LOCK_DIR", str(tmp_path))
    assert "GPUVISOR_NODE_LOCK" not in config.build(config.RunOptions(), ["true"], env).env


@pytest.mark.parametrize("level", ["basic_format", "root", "verbose"])
def test_unknown_log_level_word_falls_back_to_warning(env, level):
    env["GPUVISOR_LOG_LEVEL"] = level
    proc = run(env, "--", "sh", "-c", "exit 3")
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr


def test_corrupt_region_stops_before_the_workload(env, tmp_path):
    region = tmp_path / "bad.shr"
    region.write_bytes(b"not a region" * 100)
    line = refused_before_the_workload(env, tmp_path, "--region", str(region))
    assert "CUDA_DEVICE_MEMORY_SHARED_CACHE" in line


def timed_workload(tmp: Path, sleep: float, code: int) -> list[str]:
    """A workload that writes the wall-clock time it started and ended to
    tmp/start and tmp/end, sleeps in between, and exits with code."""
    return [
        "sh",
        "-c",
        f"date +%s.%N > {tmp}/start; sleep {sleep}; date +%s.%N > {tmp}/end; exit {code}",
    ]


def stamp(path: Path) -> float:
    return float(path.read_text().strip())


# How long the supervisor may take to exit after its workload: the node
# socket's timeout (1 s) for an unanswered final report, plus slack for a
# loaded machine.  The workload is spawned before the reporter starts, so
# the supervisor's own start (Python, imports) is left out: on a loaded
# 2-core machine it alone took over 2.5 s, which failed these tests when
# they bounded the whole run.
EXIT_DELAY_S = 3.0


def test_no_agent_never_holds_the_workload_up(env, tmp_path):
    proc = run(env, "--report-interval", "0.1", "--", *timed_workload(tmp_path, 1.5, 6))
    ended = time.time()
    assert proc.returncode == 6, proc.stderr
    assert ended - stamp(tmp_path / "end") < EXIT_DELAY_S, proc.stderr


def test_silent_agent_never_holds_the_workload_up(env, node, tmp_path):
    # Accepts connections, never answers.
    path = node.dir / "silent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(16)
    server.settimeout(0.1)
    accepted: list[socket.socket] = []
    connected: list[float] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = server.accept()
                connected.append(time.time())
                accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    env["GPUVISOR_NODE_SOCKET"] = str(path)
    try:
        proc = run(env, "--report-interval", "0.1", "--", *timed_workload(tmp_path, 1, 0))
        ended = time.time()
    finally:
        done.set()
        thread.join()
        server.close()
        for conn in accepted:
            conn.close()
    assert proc.returncode == 0, proc.stderr
    assert connected, "the supervisor never connected to the node socket"
    # After the workload ended, the unanswered final report costs at most
    # the socket's timeout (measured: 1.2 s).
    assert ended - stamp(tmp_path / "end") < EXIT_DELAY_S, proc.stderr


class FakeAgent:
    """A node agent on a Unix socket: records reports, acks with instructions.

    reply_error: answer errors instead; silent: answer nothing; per_connection:
    answer that many reports on a connection, then close it (after the last
    reply, or, with close_on_next, when the next report comes, unanswered:
    an agent closing an idle connection just as the report arrives)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reports: list[Report] = []
        self.acked: list[Report] = []
        self.instructions = Instructions()
        self.reply_error: str | None = None
        self.silent = False
        self.per_connection: int | None = None
        self.close_on_next = False
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(16)
        self.server.settimeout(0.2)
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping:
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with self.lock:
            self.conns.append(conn)
        answered = 0
        with conn, conn.makefile("rb") as f:
            for line in f:
                report = parse_report(decode(line))
                with self.lock:
                    self.reports.append(report)
                    if self.per_connection is not None and answered >= self.per_connection:
                        return  # close_on_next: closed, the report unanswered
                    if self.silent:
                        continue
                    if self.reply_error:
                        reply = error_message(report.seq, self.reply_error)
                    else:
                        reply = ack_message(report.seq, self.instructions)
                        self.acked.append(report)
                conn.sendall(encode(reply))
                answered += 1
                if (
                    self.per_connection is not None
                    and answered >= self.per_connection
                    and not self.close_on_next
                ):
                    return

    def crash(self) -> None:
        """Go away as a crashed agent does: every connection and the socket."""
        self.close()
        with self.lock:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self.path.unlink(missing_ok=True)

    def wait_for(self, pred, timeout: float = 15) -> Report:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                for r in self.reports:
                    if pred(r):
                        return r
            time.sleep(0.05)
        raise AssertionError(f"no matching report in {timeout}s; got {self.reports[-3:]}")

    def close(self) -> None:
        self.stopping = True
        self.server.close()


@pytest.fixture
def agent(node: SimNode) -> Iterator[FakeAgent]:
    a = FakeAgent(node.dir / "agent.sock")
    yield a
    a.close()


@pytest.mark.parametrize("priority", [None, "", "0", "1"], ids=["unset", "empty", "0", "1"])
def test_priority_unset_is_reported_low(env, agent, priority):
    """CUDA_TASK_PRIORITY unset (or empty) means 1 (low), as in HAMi-core:
    the reports say so, and only 0 makes a container high."""
    env.pop("CUDA_TASK_PRIORITY", None)
    if priority is not None:
        env["CUDA_TASK_PRIORITY"] = priority
    env.update(POD_NAME="pod-p", GPUVISOR_NODE_SOCKET=str(agent.path))
    proc = run(env, "--report-interval", "0.1", "--", *py("import time; time.sleep(0.3)\n"))
    assert proc.returncode == 0, proc.stderr
    assert agent.reports
    assert {r.priority for r in agent.reports} == {0 if priority == "0" else 1}


def test_reports_and_final_report(env, agent):
    env.update(
        POD_NAME="pod-a",
        POD_NAMESPACE="ns-a",
        CONTAINER_NAME="ctr-a",
        GPUVISOR_NODE_SOCKET=str(agent.path),
    )
    proc = run(
        env,
        "--report-interval",
        "0.1",
        "--memory",
        "2g",
        "--priority",
        "1",
        "--policy",
        "burst-share",
        "--",
        *py(MEMINFO + "import time; time.sleep(0.8)\n"),
    )
    assert proc.returncode == 0, proc.stderr
    reports = agent.reports
    assert len(reports) >= 4
    assert [r.seq for r in reports] == sorted(r.seq for r in reports)
    assert reports[-1].final
    assert not any(r.final for r in reports[:-1])
    last = reports[-1]
    assert last.container.pod == "pod-a"
    assert last.container.namespace == "ns-a"
    assert last.container.container == "ctr-a"
    assert last.container.cgroup.startswith("/")
    assert last.policy == "burst-share"
    assert last.priority == 1
    with_dev = [r for r in reports if r.devices]
    assert with_dev, reports
    d = with_dev[0].devices[0]
    assert d.uuid.startswith("GPU-")
    assert d.memory_limit == 2 * GiB
    assert d.memory_physical == 16 * GiB
    # The device entry appears when the workload first touches the device,
    # a moment before its context and allocation: not every report has them.
    assert max(r.devices[0].memory_used for r in with_dev) > 0
    assert d.oom_refusals == 0
    assert any(r.pids for r in with_dev)


@pytest.mark.parametrize("core_policy", ["disable", "DISABLE"])
def test_disabled_core_policy_reports_the_policy_the_library_applies(env, agent, node, core_policy):
    """GPU_CORE_UTILIZATION_POLICY=disable ignores the SM limits: the
    library configures the device with no limit and fixed-share whatever
    GPUVISOR_SM_POLICY says, so the reports name fixed-share (as `gpuvisor
    status` reads the region), not the burst-share nothing applies."""
    env.update(GPUVISOR_NODE_SOCKET=str(agent.path), GPU_CORE_UTILIZATION_POLICY=core_policy)
    proc = run(
        env,
        "--report-interval",
        "0.1",
        "--cores",
        "50",
        "--policy",
        "burst-share",
        "--",
        *py(MEMINFO + "import time; time.sleep(0.3)\n"),
    )
    assert proc.returncode == 0, proc.stderr
    with_dev = [r for r in agent.reports if r.devices]
    assert with_dev, agent.reports
    assert {r.policy for r in agent.reports} == {"fixed-share"}
    assert all(d.sm_limit is None for r in with_dev for d in r.devices)
    region = read_region(node, READ_SM + "print(r.sm(0).policy)").splitlines()
    assert json.loads(region[0])["limit"] is None
    assert region[1] == "fixed-share"


def test_agent_error_reply_is_logged_once(env, agent):
    agent.reply_error = "container not admitted"
    env["GPUVISOR_NODE_SOCKET"] = str(agent.path)
    proc = run(env, "--report-interval", "0.1", "--", "sh", "-c", "sleep 0.6")
    assert proc.returncode == 0
    assert proc.stderr.count("container not admitted") == 1, proc.stderr
    assert len(agent.reports) >= 3


def start_run(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """`gpuvisor run ARGS`, its output piped."""
    return start_cmd([*RUN, *args], env)


def start_launcher(env: dict[str, str], stop: Path, *options: str) -> subprocess.Popen[str]:
    """`gpuvisor run OPTIONS -- LAUNCHER stop`, its output piped, once the
    launcher says it is launching (killed, and the test failed, otherwise)."""
    sup = start_run(env, *options, "--", *py(LAUNCHER), str(stop))
    assert sup.stdout is not None
    line = sup.stdout.readline()
    if line != "launching\n":
        sup.kill()
        _, err = sup.communicate()
        raise AssertionError(f"the launcher said {line!r}, not 'launching'\n{err}")
    return sup


def launcher_reporting(
    env: dict[str, str], agent: FakeAgent, node: SimNode, *options: str
) -> tuple[subprocess.Popen[str], Path]:
    """start_launcher with the fake agent's socket in env: the supervisor
    and the file whose creation stops the launcher (node.dir / "stop")."""
    env["GPUVISOR_NODE_SOCKET"] = str(agent.path)
    stop = node.dir / "stop"
    return start_launcher(env, stop, *options), stop


def test_agent_steers_yield_and_sm_limit_live(env, agent, node):
    sup, stop = launcher_reporting(env, agent, node, "--report-interval", "0.1", "--cores", "50")
    try:
        report = agent.wait_for(lambda r: any(d.sm_share > 0 for d in r.devices))
        dev = report.devices[0]
        assert dev.sm_limit == 50
        assert 0 < dev.sm_share <= 60
        uuid = dev.uuid
        agent.wait_for(lambda r: any(d.throttled for d in r.devices))

        # The agent asks the container to yield: its launches stop.
        with agent.lock:
            agent.instructions = Instructions(yield_devices={uuid: True})
        agent.wait_for(lambda r: any(d.sm_enforced == 0 for d in r.devices))
        first = read_sm(node)
        time.sleep(0.3)
        second = read_sm(node)
        assert first["share"] == 0
        assert second["launches"] == first["launches"]

        # ... then to resume under a lower SM limit and a new memory limit.
        with agent.lock:
            agent.instructions = Instructions(
                yield_devices={uuid: False},
                sm_limits={uuid: 20},
                memory_limits={uuid: 3 * GiB},
            )
        agent.wait_for(lambda r: any(d.sm_limit == 20 and d.sm_enforced > 0 for d in r.devices))
        state = read_sm(node)
        assert state["limit"] == 20
        assert state["mem_limit"] == 3 * GiB
        time.sleep(0.3)
        assert read_sm(node)["launches"] > state["launches"]  # type: ignore[operator]
        stop.touch()
        sup.communicate(timeout=30)
        assert sup.returncode == 0
        assert agent.reports[-1].final
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.communicate()


def test_an_ack_pushing_sm_limit_0_is_refused_and_the_limit_stands(env, agent, node):
    """An agent that pushes an SM limit of 0 (null is "no limit" in an ack)
    is broken: its ack is refused with one line naming the field and the
    value, and the container's limit is not lifted."""
    sup, stop = launcher_reporting(env, agent, node, "--report-interval", "0.1", "--cores", "50")
    try:
        uuid = agent.wait_for(lambda r: bool(r.devices)).devices[0].uuid
        with agent.lock:
            agent.instructions = Instructions(sm_limits={uuid: 0})
            pushed = len(agent.acked)
        deadline = time.monotonic() + 15
        while len(agent.acked) < pushed + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(agent.acked) >= pushed + 3  # three acks pushing 0 went out
        time.sleep(0.3)  # a few tuner ticks
        assert read_sm(node)["limit"] == 50
        assert all(d.sm_limit == 50 for r in agent.reports[-3:] for d in r.devices)
    finally:
        stop.touch()
        _, err = sup.communicate(timeout=30)
    assert sup.returncode == 0, err
    bad = [line for line in err.splitlines() if "bad ack" in line]
    assert bad == [
        f"gpuvisor run: bad ack from the node agent: limits.{uuid}.sm=0: "
        "expected an integer in [1, 100] or null (no limit)"
    ], err


def test_supervisor_cpu_at_10hz(env, agent, node):
    """The supervisor's own CPU time while tuning (10 Hz) and reporting."""
    sup, stop = launcher_reporting(env, agent, node, "--cores", "50")
    try:
        agent.wait_for(lambda r: bool(r.devices))
        p = psutil.Process(sup.pid)
        c0, t0 = p.cpu_times(), time.monotonic()
        time.sleep(3)
        c1, t1 = p.cpu_times(), time.monotonic()
        cpu = (c1.user + c1.system - c0.user - c0.system) / (t1 - t0) * 100
        print(f"supervisor CPU at 10 Hz: {cpu:.2f}% of one core")
        assert cpu < 2.0
    finally:
        stop.touch()
        sup.communicate(timeout=30)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0::/kubepods/pod1/ctr1\n", "/kubepods/pod1/ctr1"),
        (
            "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc-mem\n1:name=systemd:/x\n",
            "/docker/abc-mem",
        ),
        ("3:cpu,cpuacct:/docker/abc\n1:name=systemd:/x\n", "/docker/abc"),
        ("1:name=systemd:/x\n0::/unified\n", "/unified"),
    ],
)
def test_own_cgroup(tmp_path, text, expected):
    from gpuvisor.supervisor.entrypoint.reporter import own_cgroup

    f = tmp_path / "cgroup"
    f.write_text(text)
    assert own_cgroup(str(f)) == expected


def _wait_sm(node: SimNode, pred: Any, timeout: float = 8) -> tuple[dict[str, Any], float]:
    """Poll the region until pred(state); the state and when the read that
    saw it started (time.monotonic(); the read takes a Python start-up)."""
    deadline = time.monotonic() + timeout
    while True:
        started = time.monotonic()
        state = read_sm(node)
        if pred(state) or started > deadline:
            return state, started


@pytest.mark.parametrize("how", ["crash", "errors", "silent"])
def test_yield_lapses_when_the_agent_goes_away(env, agent, node, how):
    """Without the agent there is no yield between containers: a yield it
    asked for is cleared when its connection drops, or when no ack has come
    for 3 report intervals (at least 2 s)."""
    sup, stop = launcher_reporting(env, agent, node, "--report-interval", "0.2", "--priority", "1")
    try:
        uuid = agent.wait_for(lambda r: bool(r.devices)).devices[0].uuid
        with agent.lock:
            agent.instructions = Instructions(yield_devices={uuid: True})
        agent.wait_for(lambda r: any(d.sm_enforced == 0 for d in r.devices))
        paused = read_sm(node)
        assert paused["share"] == 0

        t0 = time.monotonic()
        if how == "crash":
            agent.crash()
        elif how == "errors":
            with agent.lock:
                agent.reply_error = "container not admitted"
        else:
            agent.silent = True
        state, t1 = _wait_sm(node, lambda s: s["share"] > 0)
        assert state["share"] == 100, state
        elapsed = t1 - t0
        print(f"yield cleared {elapsed:.2f} s after the agent went away ({how})")
        if how == "crash":
            assert elapsed < 1.5, elapsed  # at once, not 2 s after the last ack
        elif how == "errors":
            assert 1.0 < elapsed < 5.0, elapsed  # 2 s after the last ack
        else:
            assert elapsed < 4.0, elapsed  # the report times out after 1 s
        # The workload works again: without an SM limit its launches are
        # no longer gated once the flag is cleared (the fast path), so NVML
        # is the witness, not the gate's count.
        from tests.helpers import shares_over

        deadline = time.monotonic() + 5
        while True:
            shares = shares_over(node, 0.3)
            if any(v >= 10 for v in shares.values()) or time.monotonic() > deadline:
                break
        assert any(v >= 10 for v in shares.values()), shares
    finally:
        stop.touch()
        sup.communicate(timeout=30)
    assert sup.returncode == 0


# Launches 200 us kernels until the file argv[1] exists, then says so.
LAUNCH_UNTIL_DONE = LAUNCHER + 'print("done", flush=True)\n'


def _not_exited(proc: psutil.Process) -> bool:
    """Still running (a zombie has exited: an orphan's reaper may be slow)."""
    try:
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def test_a_killed_supervisor_never_leaves_the_workload_paused(env, agent, node):
    """A supervisor that is not PID 1, SIGKILLed while the agent has its
    workload yield: nothing clears the yield flag it set, and nothing kills
    the workload (the kernel does that only when PID 1 of a PID namespace
    dies).  The pause is a lease the supervisor renews at every tick: it
    ends within 2 s and the workload finishes its work."""
    env["GPUVISOR_NODE_SOCKET"] = str(agent.path)
    stop = node.dir / "stop"
    sup = start_run(
        env, "--report-interval", "0.2", "--priority", "1", "--", *py(LAUNCH_UNTIL_DONE), str(stop)
    )
    workload: list[psutil.Process] = []
    try:
        assert sup.stdout is not None
        assert sup.stdout.readline() == "launching\n"
        workload = psutil.Process(sup.pid).children(recursive=True)
        uuid = agent.wait_for(lambda r: bool(r.devices)).devices[0].uuid
        with agent.lock:
            agent.instructions = Instructions(yield_devices={uuid: True})
        agent.wait_for(lambda r: any(d.sm_enforced == 0 for d in r.devices))
        paused = read_sm(node)
        time.sleep(0.3)
        assert read_sm(node)["launches"] == paused["launches"]  # held at the gate

        sup.kill()
        assert sup.wait(timeout=10) == -signal.SIGKILL
        assert all(p.is_running() for p in workload)  # orphaned, not killed
        t0 = time.monotonic()
        stop.touch()
        state, t1 = _wait_sm(node, lambda s: s["share"] > 0)
        assert state["share"] == 100, state
        print(f"yield ended {t1 - t0:.2f} s after the supervisor was killed")
        assert t1 - t0 < 4.0
        ready, _, _ = select.select([sup.stdout], [], [], 15)
        assert ready, "the workload is still paused"
        assert sup.stdout.readline() == "done\n"
        deadline = time.monotonic() + 15
        while any(_not_exited(p) for p in workload) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_not_exited(p) for p in workload)
    finally:
        stop.touch()
        for p in workload:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if sup.poll() is None:
            sup.kill()
        sup.communicate(timeout=30)


@pytest.mark.parametrize("close_on_next", [False, True], ids=["after-reply", "on-next-report"])
def test_no_report_is_lost_when_the_agent_closes_connections(env, agent, close_on_next):
    """An agent that closes connections (as for idleness, when reports come
    less often than --idle-timeout): the next report reconnects, or is sent
    again on a new connection, the final one included."""
    agent.per_connection = 1
    agent.close_on_next = close_on_next
    env["GPUVISOR_NODE_SOCKET"] = str(agent.path)
    proc = run(env, "--report-interval", "0.2", "--", "sh", "-c", "sleep 1.5")
    assert proc.returncode == 0, proc.stderr
    seqs = [r.seq for r in agent.acked]
    assert len(seqs) >= 5, seqs
    assert seqs == list(range(1, len(seqs) + 1))
    assert agent.acked[-1].final
    assert all(r.interval == 0.2 for r in agent.acked)


def test_missing_library_is_exit_1_with_a_memory_option(env, tmp_path):
    # Not a bad value (exit 2): the library is missing, exit 1 as documented.
    marker = tmp_path / "started"
    env["GPUVISOR_NATIVE_DIR"] = "/nonexistent-gpuvisor-native"
    for args in (["--memory", "4g"], []):
        proc = run(env, *args, "--", "sh", "-c", f"touch {marker}")
        assert not marker.exists()
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip() == (
            "Error: GPUVISOR_NATIVE_DIR='/nonexistent-gpuvisor-native' has no libgpuvisor.so"
        )


# Launches 100 kernels of 200 us and exits (a paused gate would hold it).
BRIEF_LAUNCHER = (
    CU_SPIN_PRELUDE
    + """
for _ in range(100):
    launch(200)
chk(cu.cuStreamSynchronize(s))
print("done", flush=True)
"""
)

SET_YIELD = """
import sys
from gpuvisor.shim import Region
Region.attach(sys.argv[1]).set_sm_yield(0, 60)  # the longest lease
"""


def test_yield_left_in_the_region_does_not_pause_the_next_run(env, node):
    """A region outlives its supervisor (a restarted container keeps its
    region file): a yield flag the previous supervisor set and never cleared
    (it was killed while the agent had the container yield) must not pause
    the next workload when no agent asks for it."""
    env["CUDA_TASK_PRIORITY"] = "1"
    first = run(env, "--", *py(BRIEF_LAUNCHER))
    assert first.returncode == 0, first.stderr
    subprocess.run(
        [*py(SET_YIELD), str(node.region)], env=node.env, check=True, timeout=30, cwd=REPO_ROOT
    )
    sup = start_run(env, "--", *py(BRIEF_LAUNCHER))
    try:
        out, err = sup.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        sup.terminate()  # forwarded to the paused workload
        sup.communicate(timeout=30)
        pytest.fail("the workload was still paused after 10 s")
    assert sup.returncode == 0, err
    assert out.strip().splitlines()[-1] == "done"


def test_first_report_counts_only_this_runs_gpu_time(env, agent, node):
    """The region's GPU-time counters are cumulative and the region outlives
    its supervisor: an idle restarted container must not report the previous
    run's GPU time as its share (the agent would take it for active)."""
    env["CUDA_DEVICE_SM_LIMIT"] = "50"
    first = run(env, "--", *py(BRIEF_LAUNCHER))
    assert first.returncode == 0, first.stderr
    assert read_sm(node)["launches"] == 100
    env["GPUVISOR_NODE_SOCKET"] = str(agent.path)
    proc = run(env, "--report-interval", "0.2", "--", "sh", "-c", "sleep 1")
    assert proc.returncode == 0, proc.stderr
    shares = [(d.sm_share, d.throttled) for r in agent.reports for d in r.devices]
    assert shares, agent.reports
    assert all(share == 0 and not throttled for share, throttled in shares), shares


def test_region_path_that_is_not_utf8(env, tmp_path):
    """A path is bytes: one that is not UTF-8 is used as it is."""
    region = str(tmp_path) + "/r\udcff.shr"
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = region
    proc = run(env, "--memory", "1g", "--", *py(MEMINFO))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])[1] == GiB
    assert (tmp_path / os.fsdecode(b"r\xff.shr")).exists()


# Queries NVML (which enters the device in the region), then, once argv[1]
# exists, starts CUDA on it; exits once argv[2] exists.
NVML_THEN_CUDA = """
import os, sys, time
import pynvml
pynvml.nvmlInit()
pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
print("nvml", flush=True)
def wait(path):
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
wait(sys.argv[1])
from tests.cuclient import init
init()
print("cuda", flush=True)
wait(sys.argv[2])
"""


def test_pushed_sm_limit_holds_when_the_workload_starts_cuda_later(env, agent, node):
    """The agent repeats a pushed limit until the reports show it: the tuner
    must apply it again when the region lost it (here the first CUDA use
    configures the device entry NVML had created, with the container's own
    limit), not take it for applied for good."""
    env["GPUVISOR_NODE_SOCKET"] = str(agent.path)
    env["CUDA_DEVICE_SM_LIMIT"] = "50"
    go, stop = node.dir / "go", node.dir / "stop"
    sup = start_run(env, "--report-interval", "0.1", "--", *py(NVML_THEN_CUDA), str(go), str(stop))
    try:
        assert sup.stdout is not None
        assert sup.stdout.readline() == "nvml\n"
        uuid = agent.wait_for(lambda r: bool(r.devices)).devices[0].uuid
        with agent.lock:
            agent.instructions = Instructions(sm_limits={uuid: 30})
        agent.wait_for(lambda r: bool(r.devices) and r.devices[0].sm_limit == 30)
        assert read_sm(node)["limit"] == 30
        go.touch()
        assert sup.stdout.readline() == "cuda\n"
        time.sleep(1.0)  # 10 reports, 10 ticks
        with agent.lock:
            last = agent.reports[-1]
        assert last.devices[0].sm_limit == 30, last
        assert read_sm(node)["limit"] == 30
    finally:
        stop.touch()
        sup.communicate(timeout=30)
    assert sup.returncode == 0


def test_labels_that_are_not_utf8_are_sent_as_valid_text():
    """A label's bytes that are not UTF-8 (Python's surrogate escapes) would
    reach the agent as lone surrogates, which no UTF-8 page can carry: the
    agent's /metrics then failed for every container of the node."""
    from gpuvisor.supervisor.entrypoint.reporter import container_identity

    ident = container_identity(
        {"POD_NAME": "p\udcff", "POD_NAMESPACE": "ns\udce9", "CONTAINER_NAME": "c"}
    )
    assert (ident.pod, ident.namespace, ident.container) == ("p\ufffd", "ns\ufffd", "c")
    ident.key.encode()


def _steady_sample(ts: float, busy_s: float) -> Any:
    """The tuner's sample at ts of a container that used busy_s of GPU time."""
    from gpuvisor.shim.region import DeviceUsage, SmState
    from gpuvisor.supervisor.entrypoint.tuner import DeviceSample, Sample

    usage = DeviceUsage(
        index=0, uuid="GPU-x", limit=None, used=0, physical_total=GiB, oom_count=0, context_cost=0
    )
    sm = SmState(
        limit=50,
        share=50.0,
        policy="fixed-share",
        priority=0,
        busy_ns=round(busy_s * 1e9),
        wait_ns=0,
        launches=0,
    )
    return Sample(ts=ts, devices=[DeviceSample(usage=usage, sm=sm, utilization=None)])


def test_sm_share_is_measured_over_the_samples_own_interval():
    """sm_share is the GPU time between two samples over the time between
    them, not over the time between two reports: a steady 50 % container
    reads 50 % whenever the tuner's sample was taken (its first tick comes
    late while NVML starts; a tick may miss a report)."""
    from gpuvisor.supervisor.entrypoint.reporter import Reporter
    from gpuvisor.supervisor.entrypoint.tuner import Sample
    from gpuvisor.supervisor.protocol import ContainerId

    now = [100.0]
    rep = Reporter(
        "/nonexistent.sock",
        1.0,
        cast(Any, None),  # build() does not use the tuner
        ContainerId(cgroup="/"),
        "fixed-share",
        0,
        clock=lambda: now[0],
        baseline=_steady_sample(100.0, 0.0),
    )
    shares = []
    # (report time, the sample it finds): empty until the first tick at 102.5,
    # then one 50 ms old, one fresh, and one the tuner had not renewed.
    for t, sample in [
        (101.0, Sample(ts=100.0)),
        (102.0, Sample(ts=100.0)),
        (103.0, _steady_sample(102.5, 1.25)),
        (104.0, _steady_sample(103.95, 1.975)),
        (105.0, _steady_sample(105.0, 2.5)),
        (106.0, _steady_sample(105.0, 2.5)),
        (107.0, _steady_sample(107.0, 3.5)),
    ]:
        now[0] = t
        shares += [d.sm_share for d in rep.build(sample).devices]
    assert shares == [50.0] * 5, shares


@pytest.mark.parametrize("per_device", [False, True], ids=["env", "per-device"])
def test_a_restore_puts_the_containers_own_limits_back(env, agent, node, per_device):
    """An ack's `restore` (an administrator cleared their limit): the
    supervisor stops applying the limit it was pushed for that kind and
    puts the container's own back, and keeps it there: its environment's
    (CUDA_DEVICE_MEMORY_LIMIT, CUDA_DEVICE_SM_LIMIT), or, with per-device
    variables (they name CUDA ordinals, which the region does not record),
    the region's value before the first pushed limit."""
    env["GPUVISOR_NODE_SOCKET"] = str(agent.path)
    suffix = "_0" if per_device else ""
    env["CUDA_DEVICE_MEMORY_LIMIT" + suffix] = "2g"
    env["CUDA_DEVICE_SM_LIMIT" + suffix] = "50"
    stop = node.dir / "stop"
    sup = start_launcher(env, stop, "--report-interval", "0.1")

    def shows(memory: int, sm: int):
        return lambda r: any(d.memory_limit == memory and d.sm_limit == sm for d in r.devices)

    def then(instructions: Instructions, pred) -> int:
        return _then(agent, instructions, pred)

    try:
        uuid = agent.wait_for(shows(2 * GiB, 50)).devices[0].uuid
        then(Instructions(memory_limits={uuid: GiB}, sm_limits={uuid: 20}), shows(GiB, 20))
        restore = Instructions(restore={uuid: ("memory", "sm")})
        then(restore, shows(2 * GiB, 50))
        state = read_sm(node)
        assert state["limit"] == 50
        assert state["mem_limit"] == 2 * GiB
        # It stays: the limits pushed before are not applied again.
        with agent.lock:
            base = agent.reports[-1].seq
        seen = then(restore, lambda r: r.seq >= base + 5)
        with agent.lock:
            assert all(shows(2 * GiB, 50)(r) for r in agent.reports[seen:])
        stop.touch()
        sup.communicate(timeout=30)
        assert sup.returncode == 0
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.communicate()


@pytest.mark.parametrize(
    ("env", "memory", "sm"),
    [
        ({}, (True, None), (True, None)),
        (
            {"CUDA_DEVICE_MEMORY_LIMIT": "2g", "CUDA_DEVICE_SM_LIMIT": " 30 "},
            (True, 2 * GiB),
            (True, 30),
        ),
        (
            {"CUDA_DEVICE_MEMORY_LIMIT": "25%", "CUDA_DEVICE_SM_LIMIT": "0"},
            (True, 2 * GiB),
            (True, None),
        ),
        (
            {"CUDA_DEVICE_SM_LIMIT": "30", "GPU_CORE_UTILIZATION_POLICY": "Disable"},
            (True, None),
            (True, None),
        ),
        (
            {"CUDA_DEVICE_MEMORY_LIMIT": "2g", "CUDA_DEVICE_MEMORY_LIMIT_1": "1g"},
            (False, None),
            (True, None),
        ),
        (
            {"CUDA_DEVICE_MEMORY_LIMIT_0": "", "CUDA_DEVICE_SM_LIMIT_0": "20"},
            (True, None),
            (False, None),
        ),
    ],
)
def test_the_containers_own_limits_are_read_as_the_library_reads_them(env, memory, sm):
    """What a supervisor puts back on `restore`: CUDA_DEVICE_MEMORY_LIMIT (a
    percentage of the device's memory, here 8 GiB), CUDA_DEVICE_SM_LIMIT (0:
    none; none at all under GPU_CORE_UTILIZATION_POLICY=disable); unknown
    (the tuner falls back on the region) with a per-device variable of
    that kind set, since it names a CUDA ordinal the region does not record."""
    from gpuvisor.supervisor.entrypoint.config import env_limits

    limits = env_limits(env)
    assert limits.memory(8 * GiB) == memory
    assert (limits.sm_known, limits.sm) == sm


def test_a_refused_ack_counts_apart_from_the_acks_taken(tmp_path):
    """An ack the supervisor refuses for a bad field ("sm": 0) is not one it
    took: it counts in refused_acks, not acked, and reaches no tuner; a good
    ack afterwards counts in acked.  A real agent socket answers both."""
    from gpuvisor.supervisor.entrypoint.reporter import Reporter
    from gpuvisor.supervisor.entrypoint.tuner import Sample
    from gpuvisor.supervisor.protocol import ContainerId

    path = tmp_path / "agent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    acks = [{"GPU-a": {"sm": 0}}, {"GPU-a": {"sm": 30}}]

    def serve() -> None:
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as f:
            for line, limits in zip(f, acks, strict=False):
                seq = parse_report(decode(line)).seq
                conn.sendall(encode({"v": 1, "type": "ack", "seq": seq, "limits": limits}))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    class Tuner:
        def __init__(self) -> None:
            self.submitted: list[Instructions] = []

        def submit(self, instructions: Instructions) -> None:
            self.submitted.append(instructions)

    tuner = Tuner()
    rep = Reporter(str(path), 1.0, cast(Any, tuner), ContainerId(cgroup="/"), "fixed-share", 0)
    try:
        assert rep.send(rep.build(Sample(ts=time.monotonic())))
        assert (rep.sent, rep.acked) == (1, 0)
        assert rep.refused_acks == 1
        assert tuner.submitted == []
        assert rep.send(rep.build(Sample(ts=time.monotonic())))
        assert (rep.sent, rep.acked, rep.refused_acks) == (2, 1, 1)
        assert [i.sm_limits for i in tuner.submitted] == [{"GPU-a": 30}]
    finally:
        rep._close()
        server.close()
        thread.join(2)


# NVML first (every device's memory: a preloaded process enters the devices
# it sees in the region, keyed by UUID), CUDA on ordinal 0 once argv[1]
# exists, then wait for argv[2].
NVML_ALL_THEN_CUDA = NVML_THEN_CUDA.replace(
    "pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))",
    "for i in range(pynvml.nvmlDeviceGetCount()):\n"
    "    pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))",
)
assert NVML_ALL_THEN_CUDA != NVML_THEN_CUDA


def _then(agent: FakeAgent, instructions: Instructions, pred: Any) -> int:
    """Ack with instructions from now on; wait for a later report matching
    pred; the number of reports before it."""
    with agent.lock:
        agent.instructions = instructions
        seen = len(agent.reports)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with agent.lock:
            if any(pred(r) for r in agent.reports[seen:]):
                return seen
        time.sleep(0.05)
    with agent.lock:
        raise AssertionError(f"no matching report; got {agent.reports[-2:]}")


def _shows(uuid: str, memory: int | None, sm: int | None) -> Any:
    return lambda r: any(
        d.uuid == uuid and d.memory_limit == memory and d.sm_limit == sm for d in r.devices
    )


def test_a_restore_puts_back_the_per_device_limits_of_the_devices_cuda_index(env, agent, node):
    """Per-device variables name CUDA ordinals (after CUDA_VISIBLE_DEVICES):
    here node device 1 is ordinal 0.  NVML entered it in the region before
    any CUDA call, so its SM limit was not configured yet, and the
    administrator's limit came before the container's first CUDA use (which
    then keeps it).  Taking the administrator's limits back must put back
    exactly what that first CUDA use would have applied, the _0 values: the
    region's value before the first pushed limit (no SM limit) left the
    container unlimited."""
    env["GPUVISOR_NODE_SOCKET"] = str(agent.path)
    env["CUDA_VISIBLE_DEVICES"] = "1"
    env.update(
        CUDA_DEVICE_MEMORY_LIMIT_0="2g",
        CUDA_DEVICE_SM_LIMIT_0="50",
        CUDA_DEVICE_MEMORY_LIMIT_1="3g",  # a wrong map (NVML index 1) would give these
        CUDA_DEVICE_SM_LIMIT_1="10",
    )
    go, stop = node.dir / "go", node.dir / "stop"
    sup = start_run(
        env, "--report-interval", "0.1", "--", *py(NVML_ALL_THEN_CUDA), str(go), str(stop)
    )
    try:
        assert sup.stdout is not None
        assert sup.stdout.readline() == "nvml\n"
        report = agent.wait_for(lambda r: bool(r.devices))
        assert len(report.devices) == 1
        uuid = report.devices[0].uuid
        assert uuid.endswith("1"), uuid  # node device 1
        agent.wait_for(_shows(uuid, 2 * GiB, None))  # NVML's entry: no SM limit yet
        _then(
            agent,
            Instructions(memory_limits={uuid: GiB}, sm_limits={uuid: 20}),
            _shows(uuid, GiB, 20),
        )
        go.touch()
        assert sup.stdout.readline() == "cuda\n"
        state = read_sm(node)
        assert (state["mem_limit"], state["limit"]) == (GiB, 20)  # the first CUDA use kept it
        restore = Instructions(restore={uuid: ("memory", "sm")})
        _then(agent, restore, _shows(uuid, 2 * GiB, 50))
        state = read_sm(node)
        assert (state["mem_limit"], state["limit"]) == (2 * GiB, 50)
        time.sleep(0.5)  # it stays
        with agent.lock:
            assert _shows(uuid, 2 * GiB, 50)(agent.reports[-1]), agent.reports[-1]
    finally:
        stop.touch()
        go.touch()
        _, err = sup.communicate(timeout=30)
    assert sup.returncode == 0, err
    assert "not known" not in err, err


REGISTER = """
import sys
from gpuvisor.shim import Region
Region.attach(sys.argv[1]).register_device(sys.argv[2], 16 << 30, None)
"""

WAIT_FOR = """
import os, sys, time
print("waiting", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.02)
"""


def test_a_restore_on_a_device_whose_cuda_index_is_not_known_fails_closed(env, agent, node):
    """A region entry whose UUID the library cannot map to a CUDA ordinal
    (not in NVML's list through CUDA_VISIBLE_DEVICES): with per-device
    variables, its own limit cannot be known, and taking the
    administrator's limit back puts back the strictest limit the
    environment gives any device, with one line naming the device and the
    variable; never no limit."""
    fake = "GPU-00000000-1111-2222-3333-444444444444"
    proc = run_cmd([*py(REGISTER), str(node.region), fake], node.env, 30)
    assert proc.returncode == 0, proc.stderr
    env["GPUVISOR_NODE_SOCKET"] = str(agent.path)
    env.update(
        CUDA_DEVICE_MEMORY_LIMIT_0="3g",
        CUDA_DEVICE_MEMORY_LIMIT_1="2g",
        CUDA_DEVICE_SM_LIMIT_0="30",
        CUDA_DEVICE_SM_LIMIT_1="50",
    )
    stop = node.dir / "stop"
    sup = start_run(env, "--report-interval", "0.1", "--", *py(WAIT_FOR), str(stop))
    try:
        assert sup.stdout is not None
        assert sup.stdout.readline() == "waiting\n"
        agent.wait_for(_shows(fake, None, None))
        _then(
            agent,
            Instructions(memory_limits={fake: GiB}, sm_limits={fake: 20}),
            _shows(fake, GiB, 20),
        )
        _then(agent, Instructions(restore={fake: ("memory", "sm")}), _shows(fake, 2 * GiB, 30))
        time.sleep(0.5)  # it stays
        with agent.lock:
            assert _shows(fake, 2 * GiB, 30)(agent.reports[-1]), agent.reports[-1]
    finally:
        stop.touch()
        _, err = sup.communicate(timeout=30)
    assert sup.returncode == 0, err
    lines = [line for line in err.splitlines() if fake in line and "not known" in line]
    assert len(lines) == 2, err  # one per kind, once
    assert any("CUDA_DEVICE_SM_LIMIT_<i>" in line and line.endswith(", 30") for line in lines), err
    assert any(
        "CUDA_DEVICE_MEMORY_LIMIT_<i>" in line and line.endswith(f", {2 * GiB}") for line in lines
    ), err


KEEP_WITHOUT_ENV = """
import json, logging, os, sys
from gpuvisor.shim import Region
from gpuvisor.supervisor.protocol import Instructions
from gpuvisor.supervisor.entrypoint.tuner import Tuner
logging.basicConfig(level=logging.WARNING, format="%(message)s")
uuid = "GPU-00000000-1111-2222-3333-444444444444"
r = Region.attach(sys.argv[1])
i = r.register_device(uuid, 16 << 30, 1 << 30)
r.set_sm_limit(i, 20)
tuner = Tuner(r, os.getpid())
tuner.submit(Instructions(restore={uuid: ("memory", "sm")}))
for _ in range(3):
    tuner.tick()
print(json.dumps([r.get_limit(i), r.sm(i).limit]))
"""


def test_a_restore_without_the_workloads_environment_keeps_the_regions_limit(tmp_path):
    """A tuner not told the workload's environment (the default) cannot
    know the container's own limit: a `restore` keeps the region's limits
    as they are, with one warning per kind, and never lifts them."""
    proc = run_cmd([*py(KEEP_WITHOUT_ENV), str(tmp_path / "region.shr")], os.environ, 30)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [GiB, 20]
    lines = proc.stderr.splitlines()
    assert len(lines) == 2, proc.stderr
    assert all("environment is not known" in line and "keeping" in line for line in lines)
