"""The node agent (gpuvisor node-agent): protocol, identity, bad clients, metrics."""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import re
import select
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
from gpuvisor.supervisor.agent.config import AgentConfig, admin_socket_for
from gpuvisor.supervisor.agent.server import send_admin
from gpuvisor.supervisor.agent.state import AgentState
from gpuvisor.supervisor.identity import (
    PeerCred,
    accepted_cgroups,
    claim_matches,
    container_cgroup,
    parse_cgroup,
)
from gpuvisor.supervisor.protocol import (
    MAX_MESSAGE_BYTES,
    ContainerId,
    DeviceReport,
    ProtocolError,
    Report,
    decode,
    encode,
    parse_ack,
    parse_report,
    report_message,
)
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import (
    CLI,
    SimNode,
    clean_env,
    run_cli,
    run_py,
    start_cmd,
    stop_process,
)

GiB = 1 << 30
# Device UUIDs in NVML's form (the agent takes no other)
GPU_A = "GPU-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa"
GPU_B = "GPU-bbbbbbbb-bbbb-bbbb-bbbb-bbbbbbbbbbbb"


@pytest.fixture
def sock_path() -> Iterator[str]:
    # Short: sun_path is limited to 108 bytes, pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="gva-", dir="/tmp")
    yield os.path.join(d, "run", "node.sock")
    shutil.rmtree(d, ignore_errors=True)


class AgentProc:
    """A node agent in a child process, on its own socket and a free port."""

    def __init__(self, sock: str, *args: str, env: Mapping[str, str] | None = None) -> None:
        self.sock = sock
        # A container a test made report once lives until the test ends,
        # unless the test tests expiry: at load 19 two `set-limit` commands
        # (a Python start each) took longer than the default 10 s, and the
        # container had expired before the second.
        self.args = list(args) if "--expire-after" in args else [*args, "--expire-after", "300"]
        self.env = dict(env) if env is not None else clean_env()
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in __exit__)
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    def start(self) -> AgentProc:
        self.proc = start_cmd(
            [
                *CLI,
                "node-agent",
                "--socket",
                self.sock,
                "--metrics-host",
                "127.0.0.1",
                "--metrics-port",
                "0",
                *self.args,
            ],
            self.env,
            stderr=self.stderr,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("gpuvisor node-agent ready "):
            self.proc.kill()
            self.proc.wait()
            self.stderr.seek(0)
            raise AssertionError(f"agent did not start: {line!r}\n{self.stderr.read()}")
        self.port = json.loads(line.split("ready ", 1)[1])["metrics_port"]
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> AgentProc:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.stderr.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=5) as resp:
            return str(resp.read().decode())

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.get("/status"))
        return data

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        out = []
        for fam in text_string_to_metric_families(self.get("/metrics")):
            for s in fam.samples:
                out.append((s.name, dict(s.labels), float(s.value)))
        return out

    def rss(self) -> int:
        assert self.proc is not None
        return int(psutil.Process(self.proc.pid).memory_info().rss)


def find(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> list[float]:
    return [
        v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())
    ]


def device(
    uuid: str = GPU_A,
    index: int = 0,
    used: int = GiB,
    limit: int | None = 4 * GiB,
    share: float = 0.0,
    sm_limit: int | None = None,
) -> DeviceReport:
    return DeviceReport(
        uuid=uuid,
        index=index,
        memory_used=used,
        memory_limit=limit,
        memory_physical=16 * GiB,
        oom_refusals=0,
        sm_share=share,
        sm_limit=sm_limit,
        sm_enforced=100.0,
        throttled=False,
    )


class Client:
    """A fake supervisor speaking supervisor.protocol."""

    def __init__(
        self,
        sock: str,
        pod: str = "pod-a",
        namespace: str = "ns",
        container: str = "main",
        cgroup: str | None = None,
        priority: int = 0,
        policy: str = "fixed-share",
    ) -> None:
        self.path = sock
        self.cid = ContainerId(
            cgroup=cgroup if cgroup is not None else container_cgroup(),
            pod=pod,
            namespace=namespace,
            container=container,
        )
        self.priority = priority
        self.policy = policy
        self.pids: list[int] | None = None  # None: this process's
        self.seq = 0
        self.sock: socket.socket | None = None
        self.buf = b""
        self.connect()

    def connect(self) -> None:
        self.close()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(self.path)
        self.buf = b""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def send(self, data: bytes | dict[str, Any]) -> None:
        assert self.sock is not None
        self.sock.sendall(data if isinstance(data, bytes) else json.dumps(data).encode() + b"\n")

    def recv(self) -> dict[str, Any] | None:
        """The next reply, or None at EOF."""
        assert self.sock is not None
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        assert isinstance(msg, dict)
        return msg

    def report_msg(self, *devices: DeviceReport, final: bool = False) -> dict[str, Any]:
        self.seq += 1
        msg: dict[str, Any] = report_message(
            Report(
                seq=self.seq,
                ts=time.time(),
                container=self.cid,
                policy=self.policy,
                priority=self.priority,
                pids=[os.getpid()] if self.pids is None else self.pids,
                devices=list(devices) or [device()],
                final=final,
            )
        )
        return msg

    def report(self, *devices: DeviceReport, final: bool = False) -> dict[str, Any]:
        self.send(encode(self.report_msg(*devices, final=final)))
        reply = self.recv()
        assert reply is not None, "agent closed the connection"
        return reply


def wait_for(pred: Any, timeout: float = 2.0, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


# ---- identity -----------------------------------------------------------------------


def test_parse_cgroup_rules():
    assert parse_cgroup("0::/kubepods/pod1/ctr\n") == "/kubepods/pod1/ctr"
    v1 = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    assert parse_cgroup(v1) == "/docker/abc"
    assert parse_cgroup("3:cpu,cpuacct:/x\n") == "/x"
    assert parse_cgroup("") == "/"
    assert accepted_cgroups(v1) == frozenset({"/docker/abc", "/"})
    assert accepted_cgroups("0::/k/c\n") == frozenset({"/k/c"})


def test_claims_from_a_cgroup_namespace_match_by_whole_component_suffix():
    host = frozenset({"/kubepods.slice/pod1.slice/cri-abc.scope", "/"})
    # A supervisor in its own cgroup namespace sees "/" (or "/sub" below it).
    assert claim_matches("/", host) == "/kubepods.slice/pod1.slice/cri-abc.scope"
    assert claim_matches("/cri-abc.scope", host) == "/kubepods.slice/pod1.slice/cri-abc.scope"
    assert claim_matches("/pod1.slice/cri-abc.scope", host) is not None
    assert claim_matches("/kubepods.slice/pod1.slice/cri-abc.scope", host) is not None
    # Not a whole component, another container, relative or climbing paths.
    assert claim_matches("/abc.scope", host) is None
    assert claim_matches("/pod2.slice/cri-abc.scope", host) is None
    assert claim_matches("cri-abc.scope", host) is None
    assert claim_matches("/../pod1.slice/cri-abc.scope", host) is None
    assert claim_matches("/x/kubepods.slice/pod1.slice/cri-abc.scope", host) is None
    assert claim_matches("/", frozenset()) is None


def test_namespace_relative_claim_is_keyed_by_the_agents_view(sock_path):
    real = container_cgroup()
    parts = [p for p in real.split("/") if p]
    claim = "/" + parts[-1] if parts else "/"  # what a cgroup namespace shows
    with AgentProc(sock_path) as agent:
        c = Client(sock_path, pod="ns-relative", cgroup=claim)
        assert c.report()["type"] == "ack"
        root = Client(sock_path, pod="ns-root", cgroup="/")
        assert root.report()["type"] == "ack"
        status = agent.status()
        keys = {c["container"]["pod"]: c["container"]["cgroup"] for c in status["containers"]}
        assert keys == {"ns-relative": real, "ns-root": real}


# ---- reports, metrics, status, expiry ----------------------------------------------------


def test_spilled_bytes_are_a_metric_and_in_status(sock_path):
    """CUDA_OVERSUBSCRIBE: the part of a container's memory in host memory
    is gpuvisor_container_memory_spilled_bytes and memory_spilled in
    /status; a report without the field (an older supervisor) counts 0,
    and one claiming more spilled than used is refused, naming the field."""
    from dataclasses import replace

    with AgentProc(sock_path) as agent:
        a = Client(sock_path, pod="pod-a")
        b = Client(sock_path, pod="pod-b", container="side")
        assert a.report(replace(device(used=3 * GiB), memory_spilled=GiB))["type"] == "ack"
        old = b.report_msg(device(used=2 * GiB))
        del old["devices"][0]["memory_spilled"]
        b.send(encode(old))
        assert (b.recv() or {}).get("type") == "ack"

        def both() -> list[Any]:
            m = agent.metrics()
            spilled = "gpuvisor_container_memory_spilled_bytes"
            return m if find(m, spilled, podname="pod-b") else []

        m = wait_for(both)
        assert find(m, "gpuvisor_container_memory_spilled_bytes", podname="pod-a") == [GiB]
        assert find(m, "gpuvisor_container_memory_spilled_bytes", podname="pod-b") == [0.0]
        assert find(m, "gpuvisor_container_memory_used_bytes", podname="pod-a") == [3 * GiB]
        pods = {c["container"]["pod"]: c for c in agent.status()["containers"]}
        assert pods["pod-a"]["devices"][0]["memory_spilled"] == GiB
        bad = a.report_msg(device(used=GiB))
        bad["devices"][0]["memory_spilled"] = 2 * GiB
        a.send(encode(bad))
        reply = a.recv() or {}
        assert reply.get("type") == "error", reply
        assert "devices[0].memory_spilled=2147483648: more than memory_used" in reply["error"]
        a.close()
        b.close()


def test_two_clients_metrics_status_expiry(sock_path):
    with AgentProc(sock_path, "--expire-after", "1.0") as agent:
        a = Client(sock_path, pod="pod-a")
        b = Client(sock_path, pod="pod-b", container="side")
        ack = a.report(device(used=1 * GiB, share=40.0, sm_limit=50))
        assert ack["type"] == "ack"
        assert ack["seq"] == 1
        assert parse_ack(ack).yield_devices == {GPU_A: False}
        assert b.report(device(used=3 * GiB, limit=None))["type"] == "ack"
        t0 = time.monotonic()

        def both() -> list[Any]:
            m = agent.metrics()
            return m if find(m, "gpuvisor_container_memory_used_bytes", podname="pod-b") else []

        m = wait_for(both)
        assert time.monotonic() - t0 < 2
        lab = {"podnamespace": "ns", "deviceuuid": GPU_A, "deviceidx": "0"}
        assert find(
            m, "gpuvisor_container_memory_used_bytes", podname="pod-a", ctrname="main", **lab
        ) == [GiB]
        assert find(
            m, "gpuvisor_container_memory_used_bytes", podname="pod-b", ctrname="side", **lab
        ) == [3 * GiB]
        assert find(m, "gpuvisor_container_memory_limit_bytes", podname="pod-a") == [4 * GiB]
        assert find(m, "gpuvisor_container_memory_limit_bytes", podname="pod-b") == []
        assert find(m, "gpuvisor_container_sm_share_ratio", podname="pod-a") == [0.4]
        assert find(m, "gpuvisor_container_sm_limit_ratio", podname="pod-a") == [0.5]
        assert find(m, "gpuvisor_container_sm_enforced_ratio", podname="pod-a") == [1.0]
        assert find(m, "gpuvisor_container_throttled", podname="pod-a") == [0.0]
        assert find(m, "gpuvisor_container_oom_refusals_total", podname="pod-a") == [0.0]
        assert find(m, "gpuvisor_container_processes", podname="pod-a") == [1.0]
        assert find(m, "gpuvisor_container_last_report_timestamp_seconds", podname="pod-a")[0] > 0
        hami = {"namespace": "ns", "vdevice_index": "0", "device_uuid": GPU_A}
        assert find(m, "hami_vgpu_memory_used_bytes", pod="pod-a", container="main", **hami) == [
            GiB
        ]
        assert find(m, "hami_vgpu_memory_used_bytes", pod="pod-b", container="side", **hami) == [
            3 * GiB
        ]
        assert find(m, "hami_vgpu_memory_limit_bytes", pod="pod-a") == [4 * GiB]
        assert find(m, "hami_vgpu_memory_limit_bytes", pod="pod-b") == [16 * GiB]
        assert find(m, "hami_container_device_utilization_ratio", pod="pod-a") == [40.0]
        assert find(m, "gpuvisor_agent_reports_total") == [2.0]
        assert find(m, "gpuvisor_agent_connections") == [2.0]
        assert (
            find(m, "vGPU_device_memory_usage_in_bytes") == []
        )  # legacy names: only with the flag

        st = agent.status()
        pods = {c["container"]["pod"]: c for c in st["containers"]}
        assert set(pods) == {"pod-a", "pod-b"}
        assert pods["pod-a"]["devices"][0]["memory_used"] == GiB
        assert pods["pod-a"]["devices"][0]["memory_used_ratio"] == 0.25
        assert pods["pod-a"]["peer"]["pid"] == os.getpid()
        assert st["agent"]["reports_total"] == 2

        # b keeps reporting, a stops: a expires, b stays.
        deadline = time.monotonic() + 1.8
        while time.monotonic() < deadline:
            b.report(device(used=3 * GiB, limit=None))
            time.sleep(0.2)
        m = agent.metrics()
        assert find(m, "gpuvisor_container_memory_used_bytes", podname="pod-a") == []
        assert find(m, "hami_vgpu_memory_used_bytes", pod="pod-a") == []
        assert find(m, "gpuvisor_container_memory_used_bytes", podname="pod-b") == [3 * GiB]
        assert [c["container"]["pod"] for c in agent.status()["containers"]] == ["pod-b"]
        # A final report removes the container at once.
        assert b.report(device(), final=True)["type"] == "ack"
        assert agent.status()["containers"] == []
        a.close()
        b.close()


def test_every_page_answers_head_and_a_trailing_slash(sock_path):
    """Probes use HEAD, and people type "/metrics/": both used to fail (501
    Unsupported method, 404).  HEAD gives GET's status and headers, no body."""
    with AgentProc(sock_path) as agent:
        assert agent.get("/healthz/") == "ok\n"
        assert json.loads(agent.get("/status/")).keys() == agent.status().keys()
        names = {f.name for f in text_string_to_metric_families(agent.get("/metrics/"))}
        assert names == {f.name for f in text_string_to_metric_families(agent.get("/metrics"))}
        for page in ("/metrics", "/status", "/healthz"):
            conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=5)
            conn.request("HEAD", page)
            resp = conn.getresponse()
            assert resp.status == 200, page
            assert int(resp.getheader("Content-Length", "0")) > 0, page
            assert resp.read() == b"", page
            conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=5)
        conn.request("HEAD", "/nothing")
        assert conn.getresponse().status == 404
        conn.close()


def test_legacy_metrics_flag(sock_path):
    with AgentProc(sock_path, "--legacy-metrics") as agent:
        c = Client(sock_path, pod="legacy")
        c.report(device(used=2 * GiB))
        m = agent.metrics()
        lab = {
            "podnamespace": "ns",
            "podname": "legacy",
            "ctrname": "main",
            "vdeviceid": "0",
            "deviceuuid": GPU_A,
        }
        assert find(m, "vGPU_device_memory_usage_in_bytes", **lab) == [2 * GiB]
        assert find(m, "vGPU_device_memory_limit_in_bytes", **lab) == [4 * GiB]
        assert find(m, "Device_memory_desc_of_container", **lab) == [2 * GiB]
        assert find(m, "Device_utilization_desc_of_container", **lab) == [0.0]
        assert find(m, "hami_vgpu_memory_used_bytes", pod="legacy") == [2 * GiB]
        c.close()


def test_host_metrics_from_nvml(sock_path, node):
    with AgentProc(sock_path, env=node.env) as agent:
        m = agent.metrics()
        totals = find(m, "gpuvisor_device_memory_total_bytes")
        assert totals == [16 * GiB, 16 * GiB]
        assert len(find(m, "hami_host_gpu_memory_used_bytes")) == 2
        assert len(find(m, "hami_host_gpu_utilization_ratio")) == 2
        assert find(m, "HostGPUMemoryUsage") == []
        # No NODE_NAME, no --node-name: the host name, as HAMi's monitor.
        assert len(find(m, "hami_host_gpu_memory_used_bytes", node=socket.gethostname())) == 2


def test_a_failing_nvml_is_logged_once_not_at_every_poll(sock_path, node):
    """NVML failing on the node (nvmlDeviceGetCount, a driver in trouble):
    while a container without an SM limit reports, the agent reads NVML's
    per-process use every min(0.5, --active-window / 4) s, and it logged
    `NVML per-process query failed` at every read, two lines a second for
    as long as the failure lasted (and every scrape added one more)."""
    env = dict(node.env, GPUVISOR_SIM_NVML_FAIL="nvmlDeviceGetCount")
    with AgentProc(sock_path, env=env) as agent:
        c = Client(sock_path)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            c.report(device())  # no SM limit: its share comes from NVML
            agent.metrics()
            time.sleep(0.4)
        c.close()
        agent.stop()
        agent.stderr.seek(0)
        log = agent.stderr.read()
    failed = [line for line in log.splitlines() if "NVML" in line and "failed" in line]
    # Once for the host series, once for the per-process reading, once for
    # the node inventory.
    assert len(failed) == 3, log
    assert sum("NVML inventory failed" in line for line in failed) == 1, log


def test_host_metrics_carry_the_node_name(sock_path, node):
    """HAMi's dashboards select host panels by `node` (NODE_NAME, from the
    pod's spec.nodeName); the legacy series carry it as `nodeid`."""
    env = dict(node.env, NODE_NAME="gpu-node-7")
    with AgentProc(sock_path, "--legacy-metrics", env=env) as agent:
        m = agent.metrics()
        for name in ("hami_host_gpu_memory_used_bytes", "hami_host_gpu_utilization_ratio"):
            assert len(find(m, name, node="gpu-node-7")) == 2, name
        for name in ("HostGPUMemoryUsage", "HostCoreUtilization"):
            assert len(find(m, name, nodeid="gpu-node-7")) == 2, name
    with AgentProc(sock_path, "--node-name", "other", env=env) as agent:
        assert len(find(agent.metrics(), "hami_host_gpu_memory_used_bytes", node="other")) == 2


# ---- identity and bad clients -----------------------------------------------------------


def test_spoofed_identity_rejected_and_counted(sock_path):
    with AgentProc(sock_path) as agent:
        liar = Client(sock_path, pod="victim", cgroup="/kubepods/someone-else")
        reply = liar.report()
        assert reply["type"] == "error"
        assert "container.cgroup" in reply["error"]
        assert "/kubepods/someone-else" in reply["error"]
        assert reply["seq"] == 1
        m = agent.metrics()
        assert find(m, "gpuvisor_agent_rejected_reports_total", reason="identity") == [1.0]
        assert find(m, "gpuvisor_container_memory_used_bytes", podname="victim") == []
        # The same connection may still send honest reports.
        liar.cid = ContainerId(cgroup=container_cgroup(), pod="honest")
        assert liar.report()["type"] == "ack"
        liar.close()


def test_bad_messages_named_and_counted(sock_path):
    with AgentProc(sock_path) as agent:
        c = Client(sock_path)
        c.send(b"{not json\n")
        r = c.recv()
        assert r is not None
        assert r["type"] == "error"
        assert "not JSON" in r["error"]
        c.send(b"[1,2]\n")
        r = c.recv()
        assert r is not None
        assert "object" in r["error"]
        good = c.report_msg()
        c.send({**good, "v": 2})
        r = c.recv()
        assert r is not None
        assert r["error"].startswith("v=2")
        bad_dev = dict(good["devices"][0])
        del bad_dev["memory_used"]
        c.send({**good, "devices": [bad_dev]})
        r = c.recv()
        assert r is not None
        assert "devices[0].memory_used" in r["error"]
        assert r["seq"] == good["seq"]
        c.send({**good, "priority": "high"})
        r = c.recv()
        assert r is not None
        assert r["error"].startswith("priority=")
        c.send({**good, "devices": [{**bad_dev, "memory_used": 1, "sm_share": 300}]})
        r = c.recv()
        assert r is not None
        assert "devices[0].sm_share" in r["error"]
        c.send({"v": 1, "type": "hello"})
        r = c.recv()
        assert r is not None
        assert r["error"].startswith("type=")
        # Still served.
        assert c.report()["type"] == "ack"
        m = agent.metrics()
        rej = {lab["reason"]: v for n, lab, v in m if n == "gpuvisor_agent_rejected_reports_total"}
        assert rej["malformed"] == 2
        assert rej["version"] == 1
        assert rej["field"] == 3
        assert rej["type"] == 1
        assert find(m, "gpuvisor_agent_reports_total") == [1.0]
        c.close()


def test_a_lone_surrogate_is_refused_and_metrics_stay_served(sock_path):
    """JSON's \\ud800 escape decodes to a lone surrogate, which no UTF-8
    page can carry: a label holding one emptied /metrics for every
    container of the node for as long as its sender reported.  Now it is a
    field error, and the page is served."""
    with AgentProc(sock_path) as agent:
        bad = Client(sock_path, pod="p\ud800")
        r = bad.report()
        assert r["type"] == "error", r
        assert r["error"].startswith("container.pod="), r
        good = Client(sock_path, pod="pod-b")
        assert good.report()["type"] == "ack"
        m = agent.metrics()
        rej = {lab["reason"]: v for n, lab, v in m if n == "gpuvisor_agent_rejected_reports_total"}
        assert rej["field"] == 1
        assert any(lab.get("pod") == "pod-b" for _, lab, _ in m)
        bad.close()
        good.close()


def test_oversized_line_disconnects_and_others_are_served(sock_path):
    with AgentProc(sock_path) as agent:
        good = Client(sock_path, pod="good")
        big = Client(sock_path, pod="big")
        assert big.sock is not None
        with contextlib.suppress(OSError):  # the agent may close before we finish
            big.sock.sendall(b"x" * (MAX_MESSAGE_BYTES + 100))
        r = big.recv()
        assert r is not None
        assert r["type"] == "error"
        assert "longer than" in r["error"]
        assert big.recv() is None  # disconnected
        # A complete but too long line as well.
        big.connect()
        with contextlib.suppress(OSError):
            big.send(b'{"v":1,"pad":"' + b"y" * MAX_MESSAGE_BYTES + b'"}\n')
        r = big.recv()
        assert r is not None
        assert "longer than" in r["error"]
        assert big.recv() is None
        assert good.report()["type"] == "ack"
        m = agent.metrics()
        assert find(m, "gpuvisor_agent_rejected_reports_total", reason="oversize") == [2.0]
        assert find(m, "gpuvisor_agent_disconnects_total", reason="oversize") == [2.0]
        good.close()
        big.close()


def test_slow_client_disconnected_after_timeout(sock_path):
    with AgentProc(sock_path, "--read-timeout", "0.5") as agent:
        good = Client(sock_path, pod="good")
        slow = Client(sock_path, pod="slow")
        msg = encode(slow.report_msg())
        slow.send(msg[:20])  # a partial line, then nothing
        t0 = time.monotonic()
        r = slow.recv()
        elapsed = time.monotonic() - t0
        assert r is not None
        assert r["type"] == "error"
        assert "incomplete" in r["error"]
        assert slow.recv() is None
        assert 0.4 < elapsed < 2.0
        assert good.report()["type"] == "ack"
        assert find(agent.metrics(), "gpuvisor_agent_disconnects_total", reason="timeout") == [1.0]
        good.close()
        slow.close()


def test_flood_is_rate_limited_and_counted(sock_path):
    with AgentProc(sock_path, "--rate", "50", "--burst", "20") as agent:
        flood = Client(sock_path, pod="flood")
        n = 400
        flood.send(b"".join(encode(flood.report_msg()) for _ in range(n)))
        replies = [flood.recv() for _ in range(n)]
        assert all(r is not None for r in replies)
        errors = [r for r in replies if r is not None and r["type"] == "error"]
        acks = [r for r in replies if r is not None and r["type"] == "ack"]
        assert errors
        assert "rate limit" in errors[0]["error"]
        assert 20 <= len(acks) <= 60
        m = agent.metrics()
        assert find(m, "gpuvisor_agent_rejected_reports_total", reason="rate") == [
            float(len(errors))
        ]
        good = Client(sock_path, pod="good")
        assert good.report()["type"] == "ack"
        time.sleep(0.1)
        assert flood.report()["type"] == "ack"  # tokens refill
        flood.close()
        good.close()


def test_many_connections_capped_memory_bounded(sock_path):
    with AgentProc(sock_path, "--max-connections", "50", "--read-timeout", "30") as agent:
        rss0 = agent.rss()
        socks = []
        refused = 0
        for _ in range(80):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(sock_path)
            s.sendall(b'{"v":1,"type":"report","pad":"' + b"z" * 30000)  # partial lines
            socks.append(s)
        time.sleep(0.5)
        readable, _, _ = select.select(socks, [], [], 1.0)
        for s in readable:
            try:
                data = s.recv(4096)
            except OSError:
                continue
            if b"too many connections" in data:
                refused += 1
        assert refused == 30
        assert agent.status()["agent"]["connections"] == 50
        for s in socks[:10]:
            s.close()
        good = wait_for(lambda: _try_client(sock_path), timeout=3)
        assert good is not None
        assert good.report()["type"] == "ack"
        assert agent.rss() - rss0 < 30 * 2**20
        for s in socks:
            s.close()
        good.close()


def _is_dead(c: Client) -> bool:
    try:
        c.send(encode(c.report_msg()))
        return c.recv() is None
    except OSError:
        return True


def _try_client(sock_path: str) -> Client | None:
    c = Client(sock_path, pod="good")
    try:
        reply = c.report()
    except (OSError, AssertionError):
        c.close()
        return None
    if reply.get("type") != "ack":
        c.close()
        return None
    c.seq = reply["seq"]
    return c


# ---- restart, priority, pushed limits ------------------------------------------------------


def test_agent_restart_client_reconnects(sock_path):
    agent = AgentProc(sock_path).start()
    c = Client(sock_path)
    assert c.report()["type"] == "ack"
    agent.stop()
    agent2 = AgentProc(sock_path).start()
    try:
        assert _is_dead(c)  # the old connection: EOF or a reset
        c.connect()  # what the supervisor's reporter does
        assert c.report()["type"] == "ack"
        assert len(agent2.status()["containers"]) == 1
    finally:
        c.close()
        agent2.stop()
        agent.stderr.close()
        agent2.stderr.close()


def test_priority_low_yields_while_high_is_active():
    """A low-priority container yields a device while a high-priority one
    reports use there and the agent's NVML reading shows its processes
    working there (a report alone is not believed: tests/test_trust_priority.py)."""
    state = AgentState(AgentConfig(active_window=1.0))
    peer = PeerCred(pid=1, uid=0, gid=0)
    other = device(uuid=GPU_B, index=1)

    def cgroups_of(pid: int) -> frozenset[str]:
        return frozenset({{1: "/kubepods/high", 2: "/kubepods/low"}[pid]})

    high = pod_report("high", 0, [device(share=30.0)])
    low = pod_report("low", 1, [device(share=50.0), other])
    t = 100.0
    assert state.accept_report(low, peer, t).yield_devices == {GPU_A: False, GPU_B: False}
    assert state.accept_report(high, peer, t).yield_devices == {GPU_A: False}
    state.note_process_use({GPU_A: {1: 30.0, 2: 50.0}}, cgroups_of, t)
    ack = state.accept_report(low, peer, t + 0.1)
    assert ack.yield_devices == {GPU_A: True, GPU_B: False}
    # High goes idle: the low one may run again.
    state.accept_report(pod_report("high", 0, [device(share=0.2)]), peer, t + 0.2)
    state.note_process_use({GPU_A: {2: 50.0}}, cgroups_of, t + 0.2)
    ack = state.accept_report(low, peer, t + 1.5)
    assert ack.yield_devices == {GPU_A: False, GPU_B: False}


def test_nvml_use_marks_a_high_priority_container_without_a_limit_active():
    """A high-priority container without an SM limit reports 0 % (nothing of
    it is measured); NVML's per-process use, attributed by cgroup (and, for
    containers sharing one, by their reported PIDs), makes it active."""
    state = AgentState(AgentConfig(active_window=1.0))
    peer = PeerCred(pid=1, uid=0, gid=0)

    def report(pod: str, cgroup: str, priority: int, pids: list[int]) -> Report:
        return Report(
            seq=1,
            ts=0.0,
            container=ContainerId(cgroup=cgroup, pod=pod),
            policy="fixed-share",
            priority=priority,
            pids=pids,
            devices=[device(share=0.0)],
        )

    high = report("high", "/kubepods/high", 0, [7])
    low = report("low", "/kubepods/low", 1, [7])
    twin = report("twin", "/kubepods/shared", 0, [30])
    twin2 = report("twin2", "/kubepods/shared", 0, [31])
    cgroups = {
        100: frozenset({"/kubepods/high"}),  # high's workload, by cgroup
        200: frozenset({"/kubepods/low"}),
        30: frozenset({"/kubepods/shared"}),  # shared cgroup: by PID
        31: frozenset({"/kubepods/shared"}),
        32: frozenset({"/kubepods/shared"}),  # in neither's PIDs: nobody's
    }

    def cgroups_of(pid: int) -> frozenset[str]:
        if pid not in cgroups:
            raise FileNotFoundError(pid)
        return cgroups[pid]

    t = 100.0
    limited_low = replace(low, devices=[device(share=0.0, sm_limit=50)])
    state.accept_report(limited_low, peer, t)
    assert not state.wants_process_use()  # its gate measures it
    # Without an SM limit a low-priority container is not gated either (it
    # keeps the launch fast path until it must yield): NVML is its figure.
    state.accept_report(low, peer, t)
    assert state.wants_process_use()
    state.accept_report(high, peer, t)
    assert state.wants_process_use()
    assert state.accept_report(low, peer, t).yield_devices == {GPU_A: False}
    # Only the low container's own use, an unknown PID and a use under the
    # threshold: nobody high is active.
    state.note_process_use({GPU_A: {200: 60.0, 999: 50.0, 100: 0.5}}, cgroups_of, t)
    assert state.accept_report(low, peer, t).yield_devices == {GPU_A: False}
    (ld,) = low.devices
    assert state.share_of(low.container.key, low, ld, t) == 60.0
    state.note_process_use({GPU_A: {100: 40.0}}, cgroups_of, t)
    assert state.accept_report(low, peer, t + 0.5).yield_devices == {GPU_A: True}
    # NVML's figure is also the share of a container whose gate measures
    # nothing (no SM limit, priority 0), not of one that measures itself.
    (hd,) = high.devices
    assert state.share_of(high.container.key, high, hd, t + 0.5) == 40.0
    assert state.share_of(high.container.key, high, hd, t + 1.5) == 0.0  # stale
    measured = replace(hd, sm_limit=50, sm_share=12.0)
    assert state.share_of(high.container.key, high, measured, t + 0.5) == 12.0
    # Its reports of 0 % do not undo what NVML saw; the window does.
    state.accept_report(high, peer, t + 0.6)
    assert state.accept_report(low, peer, t + 0.9).yield_devices == {GPU_A: True}
    state.expire(t + 1.2)
    assert state.accept_report(low, peer, t + 1.2).yield_devices == {GPU_A: False}

    # Two high-priority containers in one cgroup: told apart by PID.
    state.remove(high.container.key)
    state.accept_report(twin, peer, t)
    state.accept_report(twin2, peer, t)
    state.note_process_use({GPU_A: {32: 80.0}}, cgroups_of, t + 2)
    assert state.accept_report(low, peer, t + 2).yield_devices == {GPU_A: False}
    state.note_process_use({GPU_A: {31: 80.0}}, cgroups_of, t + 2)
    assert set(state.nvml_active[GPU_A]) == {twin2.container.key}
    assert state.accept_report(low, peer, t + 2).yield_devices == {GPU_A: True}
    # A high-priority container that leaves stops counting at once.
    state.remove(twin2.container.key)
    assert state.accept_report(low, peer, t + 2.1).yield_devices == {GPU_A: False}


LOW_LOW_HIGH = (("a", 1), ("b", 1), ("high", 0))


def test_two_low_priority_containers_without_limits_do_not_make_each_other_yield():
    """CUDA_TASK_PRIORITY unset means 1 (low), so most containers are low:
    two of them, both working without an SM limit (NVML sees them; their
    gates measure nothing), are each other's claims, but neither makes the
    device busy for the other.  A priority-0 one that starts does."""
    state = AgentState(AgentConfig(active_window=1.0))
    peer = PeerCred(pid=1, uid=0, gid=0)

    a, b, high = (pod_report(pod, prio, [device(share=0.0)]) for pod, prio in LOW_LOW_HIGH)

    def cgroups_of(pid: int) -> frozenset[str]:
        return frozenset({{1: "/kubepods/a", 2: "/kubepods/b", 3: "/kubepods/high"}[pid]})

    t = 100.0
    state.accept_report(a, peer, t)
    state.accept_report(b, peer, t)
    assert state.wants_process_use()
    state.note_process_use({GPU_A: {1: 50.0, 2: 45.0}}, cgroups_of, t)
    ia = state.accept_report(a, peer, t + 0.1)
    ib = state.accept_report(b, peer, t + 0.1)
    assert ia.yield_devices == ib.yield_devices == {GPU_A: False}
    assert ia.others_share[GPU_A] == ib.others_share[GPU_A] == 100.0  # each claims it
    state.accept_report(high, peer, t + 0.2)
    state.note_process_use({GPU_A: {1: 30.0, 2: 30.0, 3: 40.0}}, cgroups_of, t + 0.2)
    assert state.accept_report(a, peer, t + 0.3).yield_devices == {GPU_A: True}
    assert state.accept_report(b, peer, t + 0.3).yield_devices == {GPU_A: True}


def test_a_container_measuring_nothing_claims_the_device_while_nvml_sees_it_work():
    """burst-share lends what the other containers leave, and an active
    container without an SM limit claims the whole device.  Such a container
    (priority 0) is not gated, so its reports say 0 %: NVML's per-process
    use is what makes its claim, for as long as the active window."""
    state = AgentState(AgentConfig(active_window=1.0))
    peer = PeerCred(pid=1, uid=0, gid=0)

    def report(pod: str, sm_limit: int | None, share: float) -> Report:
        return Report(
            seq=1,
            ts=0.0,
            container=ContainerId(cgroup=f"/kubepods/{pod}", pod=pod),
            policy="burst-share",
            priority=0,
            pids=[],
            devices=[device(share=share, sm_limit=sm_limit)],
        )

    def others(at: float) -> float:
        return float(state.accept_report(lender, peer, at).others_share[GPU_A])

    free = report("free", None, 0.0)
    lender = report("lender", 30, 30.0)

    def cgroups_of(pid: int) -> frozenset[str]:
        return frozenset({{7: "/kubepods/free", 8: "/kubepods/lender"}[pid]})

    t = 100.0
    state.accept_report(free, peer, t)
    assert others(t) == 0.0  # idle as far as anybody knows
    state.note_process_use({GPU_A: {8: 30.0}}, cgroups_of, t)
    assert others(t) == 0.0  # the lender's own use is not another's
    state.note_process_use({GPU_A: {7: 60.0, 8: 30.0}}, cgroups_of, t)
    assert others(t) == 100.0
    # Its own reports keep saying 0 %: the claim stands until the window ends.
    state.accept_report(free, peer, t + 0.5)
    assert others(t + 0.9) == 100.0
    state.expire(t + 1.2)
    assert others(t + 1.2) == 0.0
    # Seen again, then gone: nothing is left claimed.
    state.note_process_use({GPU_A: {7: 60.0}}, cgroups_of, t + 2)
    assert others(t + 2) == 100.0
    state.remove(free.container.key)
    assert others(t + 2.1) == 0.0
    state.remove(lender.container.key)
    assert state.device_share == {}  # nothing claimed: no entry left
    # With an SM limit it measures itself: its report, not NVML, decides.
    limited = report("free", 40, 0.0)
    state.accept_report(limited, peer, t + 3)
    state.note_process_use({GPU_A: {7: 60.0}}, cgroups_of, t + 3)
    assert others(t + 3) == 0.0
    state.accept_report(replace(limited, devices=[device(share=35.0, sm_limit=40)]), peer, t + 3)
    assert others(t + 3) == 40.0


def test_per_device_tables_forget_devices_nobody_reports():
    """Device UUIDs are whatever reports say: the per-device tables keep no
    entry for a device once no container is on it (final report, expiry,
    an idle report), so made-up UUIDs cannot grow them."""
    state = AgentState(AgentConfig(active_window=1.0, expire_after=5.0, max_per_cgroup=100))
    peer = PeerCred(pid=1, uid=0, gid=0)
    t = 100.0
    cgroup = frozenset({"/kubepods/x"})
    for i in range(50):
        cid = ContainerId(cgroup="/kubepods/x", pod=f"p{i}")
        devs = [device(uuid=f"GPU-{i}-{j}", share=50.0) for j in range(4)]
        r = Report(
            seq=1,
            ts=0.0,
            container=cid,
            policy="fixed-share",
            priority=0,
            pids=[1000 + i],
            devices=devs,
        )
        state.accept_report(r, peer, t)
        state.note_process_use({f"GPU-{i}-0": {1000 + i: 50.0}}, lambda _: cgroup, t)
        if i % 3 == 0:
            state.accept_report(replace(r, final=True), peer, t)
        elif i % 3 == 1:  # idle, then gone by expiry
            idle = [replace(d, sm_share=0.0) for d in devs]
            state.accept_report(replace(r, devices=idle), peer, t)
    assert state.device_share
    assert state.high_active
    assert state.nvml_active
    state.expire(t + 10.0)
    assert state.containers == {}
    assert state.device_share == {}
    assert state.high_active == {}
    assert state.nvml_active == {}
    assert state.nvml_share == {}


def test_one_cgroup_holds_a_bounded_number_of_containers(sock_path):
    """Labels are the sender's word: a peer cycling through label sets from
    its one cgroup replaces its own least recently reported entries instead
    of adding one per set (and cannot touch another cgroup's)."""
    with AgentProc(sock_path, "--max-containers-per-cgroup", "3") as agent:
        c = Client(sock_path, pod="p0")
        for i in range(20):
            c.cid = replace(c.cid, pod=f"p{i}")
            assert c.report()["type"] == "ack"
        st = agent.status()
        assert sorted(x["container"]["pod"] for x in st["containers"]) == ["p17", "p18", "p19"]
        assert st["agent"]["replaced_total"] == 17
        assert find(agent.metrics(), "gpuvisor_agent_replaced_containers_total") == [17.0]
        # Reporting again keeps an entry the most recent: p17 stays, p18 goes.
        c.cid = replace(c.cid, pod="p17")
        c.report()
        c.cid = replace(c.cid, pod="p20")
        c.report()
        st = agent.status()
        assert sorted(x["container"]["pod"] for x in st["containers"]) == ["p17", "p19", "p20"]
        c.close()


def test_a_declared_interval_keeps_a_container_at_most_max_expire():
    state = AgentState(AgentConfig(expire_after=10.0, max_expire=60.0))
    r = Report(
        seq=1,
        ts=0.0,
        container=ContainerId(cgroup="/x", pod="slow"),
        policy="fixed-share",
        priority=0,
        devices=[device()],
        interval=3600.0,
    )
    state.accept_report(r, PeerCred(pid=1, uid=0, gid=0), 0.0)
    assert state.expire(59.0) == 0
    assert state.expire(61.0) == 1
    # --max-expire below --expire-after: --expire-after wins.
    state = AgentState(AgentConfig(expire_after=10.0, max_expire=1.0))
    state.accept_report(r, PeerCred(pid=1, uid=0, gid=0), 0.0)
    assert state.expire(9.0) == 0


def set_limit(
    sock: str, container: str, *args: str, device: str = GPU_A
) -> subprocess.CompletedProcess[str]:
    """`gpuvisor node-agent set-limit` for device (GPU_A) of container."""
    return run_cli(
        "node-agent",
        "set-limit",
        "--socket",
        sock,
        "--container",
        container,
        "--device",
        device,
        *args,
    )


def test_pushed_limit_reaches_next_ack(sock_path):
    with AgentProc(sock_path) as agent:
        c = Client(sock_path, pod="tenant", namespace="team")
        ack = c.report(device(limit=8 * GiB))
        assert ack["limits"] == {}
        key = agent.status()["containers"][0]["key"]
        proc = set_limit(sock_path, key, "--memory", "4g", "--cores", "30")
        assert proc.returncode == 0, proc.stderr
        instr = parse_ack(c.report(device(limit=8 * GiB)))
        assert instr.memory_limits == {GPU_A: 4 * GiB}
        assert instr.sm_limits == {GPU_A: 30}
        # Repeated until the container's report shows it applied.
        instr = parse_ack(c.report(device(limit=4 * GiB, sm_limit=30)))
        assert instr.memory_limits == {}
        assert instr.sm_limits == {}
        # namespace/pod/container works as a name too; only the memory limit this time.
        proc = set_limit(sock_path, "team/tenant/main", "--memory", "none")
        assert proc.returncode == 0, proc.stderr
        ack = c.report(device(limit=4 * GiB, sm_limit=30))
        assert ack["limits"] == {GPU_A: {"memory": None}}
        # An unknown container is an error naming it.
        proc = set_limit(sock_path, "nope", "--cores", "10")
        assert proc.returncode != 0
        assert "nope" in proc.stderr
        c.close()


@pytest.mark.parametrize("before", [["--socket"], ["--admin-socket"], ["--rate", "7"]])
def test_agent_options_before_set_limit_are_refused(sock_path, before):
    """`gpuvisor node-agent --socket PATH set-limit ...`: the agent's own
    options, given before the subcommand, were silently ignored, so the
    change went to the default socket's agent (here none: 'cannot reach
    the node agent at /run/gpuvisor-admin/admin.sock', exit 1; on a node
    with an agent there, that agent) and never to the one named."""
    if before[0] == "--socket":
        before = [before[0], sock_path]
    elif before[0] == "--admin-socket":
        before = [before[0], admin_socket_for(sock_path)]
    with AgentProc(sock_path):
        c = Client(sock_path, pod="tenant", namespace="team")
        c.report(device(limit=8 * GiB))
        proc = run_cli(
            "node-agent", *before, "set-limit", "--container", "team/tenant/main",
            "--device", GPU_A, "--cores", "30",
        )  # fmt: skip
        assert c.report(device(limit=8 * GiB))["limits"] == {}
        c.close()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"Error: {before[0]} is an option of the node agent, not of set-limit: "
        "give set-limit's options after it"
    )


def test_an_admins_limit_outlives_a_supervisor_reconnect(sock_path):
    """An admin's limit stays the container's while the agent knows it: a
    supervisor that reconnects (or restarts, so its region is configured
    from the environment again) and reports another value gets it pushed
    again; it was forgotten once a report had shown it applied.  It goes
    with the container (a final report)."""
    with AgentProc(sock_path) as agent:
        c = Client(sock_path, pod="tenant", namespace="team")
        assert c.report(device(limit=8 * GiB))["limits"] == {}
        proc = set_limit(sock_path, "team/tenant/main", "--memory", "4g", "--cores", "30")
        assert proc.returncode == 0, proc.stderr
        want = {GPU_A: {"memory": 4 * GiB, "sm": 30}}
        assert c.report(device(limit=8 * GiB))["limits"] == want
        assert c.report(device(limit=4 * GiB, sm_limit=30))["limits"] == {}
        assert c.report(device(limit=4 * GiB, sm_limit=30))["limits"] == {}
        # The supervisor reconnects, as a restarted one, with its own limits.
        c.close()
        c.connect()
        assert c.report(device(limit=8 * GiB))["limits"] == want
        # Only what the report does not show is pushed.
        assert c.report(device(limit=4 * GiB))["limits"] == {GPU_A: {"sm": 30}}
        st = agent.status()["containers"][0]
        assert st["admin_limits"] == {"memory": {GPU_A: 4 * GiB}, "sm": {GPU_A: 30}}
        assert st["pending_limits"] == {"memory": {}, "sm": {GPU_A: 30}}
        # A later set-limit replaces that kind only; "none" is kept as well.
        assert set_limit(sock_path, "team/tenant/main", "--cores", "none").returncode == 0
        assert c.report(device(limit=4 * GiB, sm_limit=30))["limits"] == {GPU_A: {"sm": None}}
        assert c.report(device(limit=8 * GiB))["limits"] == {GPU_A: {"memory": 4 * GiB}}
        # Gone (its final report), the container's admin limits are parked
        # for --limit-grace: the same container starting again (a restart,
        # same labels and cgroup) gets them back.
        assert c.report(device(limit=8 * GiB), final=True)["type"] == "ack"
        assert agent.status()["containers"] == []
        assert c.report(device(limit=8 * GiB))["limits"] == {GPU_A: {"memory": 4 * GiB}}
        assert agent.status()["containers"][0]["admin_limits"] == {
            "memory": {GPU_A: 4 * GiB},
            "sm": {GPU_A: None},
        }
        c.close()


def test_with_limit_grace_0_a_final_report_forgets_the_admins_limits(sock_path):
    """--limit-grace 0: an administrator's limits go with the container's
    final report, a restarted container starts without them."""
    with AgentProc(sock_path, "--limit-grace", "0") as agent:
        c = Client(sock_path, pod="tenant", namespace="team")
        c.report(device(limit=8 * GiB))
        assert set_limit(sock_path, "team/tenant/main", "--memory", "4g").returncode == 0
        assert c.report(device(limit=8 * GiB))["limits"] == {GPU_A: {"memory": 4 * GiB}}
        assert c.report(device(limit=4 * GiB), final=True)["type"] == "ack"
        assert c.report(device(limit=8 * GiB))["limits"] == {}
        st = agent.status()
        assert st["containers"][0]["admin_limits"] is None
        assert st["agent"]["limit_grace_s"] == 0
        assert st["agent"]["parked_limits"] == 0
        c.close()
    proc = run_cli("node-agent", "--socket", sock_path, "--limit-grace", "-1")
    assert proc.returncode == 2
    assert "--limit-grace" in proc.stderr
    assert "-1" in proc.stderr


def test_set_limit_env_takes_an_admins_limit_back(sock_path):
    """`--memory env` / `--cores env` clear an administrator's limit of
    that kind: it is no longer pushed, and every ack asks the supervisor
    (restore) to put the container's own limit back, while the agent knows
    the container.  A new value replaces the clearing; clearing what was
    never set is accepted (the container's own limit stays)."""
    with AgentProc(sock_path) as agent:
        c = Client(sock_path, pod="tenant", namespace="team")
        c.report(device(limit=8 * GiB))
        name = "team/tenant/main"
        assert set_limit(sock_path, name, "--memory", "4g", "--cores", "30").returncode == 0
        assert c.report(device(limit=4 * GiB, sm_limit=30))["limits"] == {}
        proc = set_limit(sock_path, name, "--memory", "env")
        assert proc.returncode == 0, proc.stderr
        ack = c.report(device(limit=4 * GiB))
        assert ack["limits"] == {GPU_A: {"sm": 30}}
        assert ack["restore"] == {GPU_A: ["memory"]}
        instr = parse_ack(ack)
        assert instr.restore == {GPU_A: ("memory",)}
        assert instr.memory_limits == {}
        # Repeated: only the supervisor knows the container's own limit.
        ack = c.report(device(limit=8 * GiB, sm_limit=30))
        assert ack["limits"] == {}
        assert ack["restore"] == {GPU_A: ["memory"]}
        st = agent.status()["containers"][0]
        assert st["admin_limits"] == {"memory": {GPU_A: "env"}, "sm": {GPU_A: 30}}
        assert set_limit(sock_path, name, "--cores", "ENV").returncode == 0
        assert c.report(device(limit=8 * GiB, sm_limit=30))["restore"] == {GPU_A: ["memory", "sm"]}
        # A value again: pushed, and no longer restored.
        assert set_limit(sock_path, name, "--memory", "2g").returncode == 0
        ack = c.report(device(limit=8 * GiB, sm_limit=30))
        assert ack["limits"] == {GPU_A: {"memory": 2 * GiB}}
        assert ack["restore"] == {GPU_A: ["sm"]}
        # Clearing what was never set (another device) is accepted.
        proc = set_limit(sock_path, name, "--memory", "env", "--cores", "env")
        assert proc.returncode == 0, proc.stderr
        other = "GPU-bbbbbbbb-bbbb-bbbb-bbbb-bbbbbbbbbbbb"
        reply = send_admin(
            admin_socket_for(sock_path),
            {"v": 1, "type": "set-limit", "container": name, "device": other, "sm": "env"},
        )
        assert reply["type"] == "ack", reply
        ack = c.report(device(limit=2 * GiB))
        assert ack["restore"] == {GPU_A: ["memory", "sm"], other: ["sm"]}
        # Another word is an error naming the field and the value.
        reply = send_admin(
            admin_socket_for(sock_path),
            {"v": 1, "type": "set-limit", "container": name, "device": other, "sm": "own"},
        )
        assert reply["type"] == "error"
        assert reply["error"].startswith("sm='own': expected null, 'env' or an integer")
        proc = set_limit(sock_path, name, "--memory", "envy")
        assert proc.returncode == 2
        assert "'--memory'" in proc.stderr
        assert "envy" in proc.stderr
        c.close()


@pytest.mark.parametrize("cores", ["+30", "3_0", "\u0663\u0660", "0x1e", "101", "", " "])
def test_set_limit_takes_the_sm_limit_as_the_library_reads_it(sock_path, cores):
    """--cores is read by the library's parser for CUDA_DEVICE_SM_LIMIT:
    Python's int() also took "+30", "3_0" and Arabic-Indic digits, which
    the library refuses.  Refused before the agent is asked (none runs here)."""
    proc = set_limit(sock_path, "any", "--cores", cores)
    assert proc.returncode == 2, proc.stderr
    assert "expected a percent 1-100 (0, none or unlimited: no limit)" in proc.stderr, proc.stderr
    assert repr(cores) in proc.stderr, proc.stderr


def test_set_limit_values_mean_what_the_variables_mean(sock_path):
    """--cores " 30" and "030" are 30 %, as CUDA_DEVICE_SM_LIMIT reads them,
    and "00" no limit as "0"; --memory "00", "0g", " 0 " and "0.0GiB" are
    zero bytes as "0" is: no limit.  "0x" stays refused, naming the value."""
    with AgentProc(sock_path) as agent:
        c = Client(sock_path, pod="tenant", namespace="team")
        c.report(device(limit=8 * GiB))
        name = "team/tenant/main"
        for cores, want in ((" 30", 30), ("030\t", 30), ("00", None), (" 0", None)):
            proc = set_limit(sock_path, name, "--cores", cores)
            assert proc.returncode == 0, (cores, proc.stderr)
            ack = c.report(device(limit=8 * GiB, sm_limit=50))
            assert ack["limits"][GPU_A]["sm"] == want, cores
        for memory in ("00", "0g", " 0 ", "0.0GiB", "0"):
            assert set_limit(sock_path, name, "--memory", "4g").returncode == 0
            assert c.report(device(limit=8 * GiB))["limits"][GPU_A]["memory"] == 4 * GiB
            proc = set_limit(sock_path, name, "--memory", memory)
            assert proc.returncode == 0, (memory, proc.stderr)
            assert c.report(device(limit=8 * GiB))["limits"][GPU_A]["memory"] is None, memory
        proc = set_limit(sock_path, name, "--memory", "0x")
        assert proc.returncode == 2
        assert "'--memory': '0x': " in proc.stderr, proc.stderr
        c.close()
        assert agent.proc is not None
        assert agent.proc.poll() is None


@pytest.mark.parametrize(
    ("memory", "says"),
    [
        ("4x", "'4x': not a memory size (use bytes or a number with k/m/g/t)"),
        ("50%", "'50%': a percentage is not taken here (the device's total is not known)"),
        ("99999999999t", "'99999999999t': too large (more than 2^64-1 bytes)"),
    ],
)
def test_set_limit_names_a_bad_memory_value_in_its_own_terms(sock_path, memory, says):
    """A --memory value the library refuses is one line naming the option
    and the value, without the library's prefix and error code, and without
    its hint to give a percentage, which set-limit does not take (it said
    'or a percentage like 50%' to '4x', and refused '50%' next).  Refused
    before the agent is asked (none runs here)."""
    proc = set_limit(sock_path, "any", "--memory", memory)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"Error: Invalid value for '--memory': {says}"), line
    assert "GV_EINVAL" not in line, line
    assert "gpuvisor:" not in line, line


@pytest.mark.parametrize(
    ("field", "value"),
    [("sm", 0), ("sm", 101), ("sm", True), ("sm", 50.0), ("memory", 0), ("memory", 2**64)],
)
def test_an_ack_pushing_a_limit_out_of_range_is_refused(field, value):
    """In an ack "no limit" is null alone: an SM limit of 0 (what the
    environment variable and the region use for none) is out of the range
    set-limit sends, 1-100, and is refused with the field and the value."""
    ack = {"v": 1, "type": "ack", "seq": 1, "limits": {"GPU-a": {field: value}}}
    with pytest.raises(ProtocolError) as exc:
        parse_ack(decode(encode(ack)))
    lo, hi = (1, 100) if field == "sm" else (1, 2**64 - 1)
    assert str(exc.value) == (
        f"limits.GPU-a.{field}={value!r}: expected an integer in [{lo}, {hi}] or null (no limit)"
    )
    ok = {"GPU-a": {"sm": None, "memory": None}, "GPU-b": {"sm": 1}, "GPU-c": {"sm": 100}}
    instr = parse_ack({"v": 1, "type": "ack", "seq": 1, "limits": ok})
    assert instr.sm_limits == {"GPU-a": None, "GPU-b": 1, "GPU-c": 100}
    assert instr.memory_limits == {"GPU-a": None}


@pytest.mark.parametrize(
    ("restore", "error"),
    [
        ("memory", "restore='memory': expected an object"),
        ({"GPU-a": "memory"}, "restore.GPU-a='memory': expected a list of limit kinds"),
        ({"GPU-a": [1]}, "restore.GPU-a=[1]: expected a list of limit kinds"),
        ({"GPU-a": ["sm"]}, "restore.GPU-a=['sm']: sm is in limits too"),
    ],
)
def test_an_ack_with_a_bad_restore_is_refused(restore, error):
    """An ack's restore (uuid -> limit kinds) is checked as the rest: a bad
    one refuses the ack whole, naming the field and the value; so does a
    kind both restored and pushed on one device, which no agent sends.  A
    kind the supervisor does not know is skipped (a later agent's)."""
    ack = {"v": 1, "type": "ack", "seq": 1, "limits": {"GPU-a": {"sm": 30}}, "restore": restore}
    with pytest.raises(ProtocolError) as exc:
        parse_ack(decode(encode(ack)))
    assert str(exc.value) == error
    ok = {"GPU-a": ["sm", "memory", "future"], "GPU-b": ["future"]}
    instr = parse_ack({"v": 1, "type": "ack", "seq": 1, "restore": ok})
    assert instr.restore == {"GPU-a": ("memory", "sm")}


def test_set_limit_is_refused_on_the_reporting_socket(sock_path):
    """The reporting socket is mounted into every workload: a set-limit
    there is refused whatever the peer's uid (this test may run as root or
    as the agent's own uid) and changes nothing."""
    with AgentProc(sock_path) as agent:
        c = Client(sock_path, pod="tenant", namespace="team")
        c.report(device(limit=8 * GiB))
        c.send(
            {
                "v": 1,
                "type": "set-limit",
                "seq": 9,
                "container": "team/tenant/main",
                "device": GPU_A,
                "memory": None,
                "sm": None,
            }
        )
        err = c.recv()
        assert err is not None
        assert err["type"] == "error"
        assert err["seq"] == 9
        assert "admin socket" in err["error"]
        assert c.report(device(limit=8 * GiB))["limits"] == {}
        assert find(
            agent.metrics(), "gpuvisor_agent_rejected_reports_total", reason="unauthorized"
        ) == [1.0]
        c.close()


def test_admin_socket_is_private_and_takes_only_set_limit(sock_path):
    admin = Path(sock_path).parent.parent / "run-admin" / "admin.sock"
    with AgentProc(sock_path) as agent:
        assert admin.is_socket()
        assert admin.stat().st_mode & 0o777 == 0o600
        assert admin.parent.stat().st_mode & 0o777 == 0o700
        c = Client(sock_path, pod="tenant", namespace="team")
        c.report(device(limit=8 * GiB))
        msg = {
            "v": 1,
            "type": "set-limit",
            "seq": 3,
            "container": "team/tenant/main",
            "device": GPU_A,
            "sm": 20,
        }
        reply = send_admin(str(admin), msg)
        assert reply["type"] == "ack"
        assert reply["seq"] == 3
        assert c.report(device(limit=8 * GiB))["limits"] == {GPU_A: {"sm": 20}}
        # A report on the admin socket is not taken.
        reply = send_admin(str(admin), c.report_msg())
        assert reply["type"] == "error"
        assert "admin socket" in reply["error"]
        assert len(agent.status()["containers"]) == 1
        c.close()
    assert not admin.exists()


def test_an_admin_socket_in_the_reporting_directory_is_refused(sock_path):
    inside = os.path.join(os.path.dirname(sock_path), "sub", "admin.sock")
    proc = run_cli(
        "node-agent",
        "--socket",
        sock_path,
        "--admin-socket",
        inside,
        "--metrics-port",
        "0",
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error: ")]
    assert "--admin-socket" in line
    assert inside in line
    assert not Path(sock_path).exists()
    assert not Path(inside).exists()


def _agent_exit(*args: str) -> tuple[int | None, str]:
    """Start `gpuvisor node-agent args`; its exit status and stderr, or
    None when it started instead (then stopped: it should not have)."""
    proc = start_cmd(
        [*CLI, "node-agent", "--metrics-host", "127.0.0.1", "--metrics-port", "0", *args],
        clean_env(),
    )
    try:
        _, err = proc.communicate(timeout=10)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
        return None, err


def test_an_admin_socket_in_a_shared_directory_is_refused(sock_path):
    """--admin-socket /tmp/admin.sock (or one in /run): the agent made the
    directory mode 0700 as it makes its own admin directory, locking every
    other user out of /tmp (or every unprivileged daemon out of /run)."""
    shared = Path(sock_path).parent.parent / "shared"
    shared.mkdir(parents=True)
    shared.chmod(0o1777)
    (shared / "someone-elses-file").write_text("x")
    admin = str(shared / "admin.sock")
    code, err = _agent_exit("--socket", sock_path, "--admin-socket", admin)
    assert shared.stat().st_mode & 0o7777 == 0o1777
    assert code == 2, err
    assert err.splitlines()[-1] == (
        f"Error: Invalid value for '--admin-socket': {admin}: {shared} holds other files "
        "(someone-elses-file): the admin socket needs a directory of its own, which the "
        "agent makes mode 0700"
    )
    assert not os.path.lexists(admin)


def test_the_reporting_sockets_existing_directory_keeps_its_mode(sock_path):
    """--socket in a directory that holds other files (/root/node.sock, say):
    the agent opened it to every user (go+rx), where the docs say only that
    the directory is created and the socket made 0666.  A directory that
    holds nothing but the agent's files is still opened for containers."""
    private = Path(sock_path).parent
    private.mkdir(parents=True)
    private.chmod(0o700)
    (private / "secret").write_text("x")
    with AgentProc(sock_path):
        assert private.stat().st_mode & 0o777 == 0o700
    (private / "secret").unlink()
    with AgentProc(sock_path):  # every uid creates the library's files; sticky
        assert private.stat().st_mode & 0o7777 == 0o1777


def test_socket_created_with_directory_and_open_mode(sock_path):
    with AgentProc(sock_path):
        assert Path(sock_path).is_socket()
        assert Path(sock_path).stat().st_mode & 0o777 == 0o666
    assert not Path(sock_path).exists()


def test_context_lock_kept_beside_the_socket(sock_path):
    """The file containers' libraries flock while they measure a new context
    (tests/test_context_race.py): created readable by any uid, kept when
    the agent stops, and never truncated by a restarted agent."""
    lock = Path(sock_path).parent / "context.lock"
    with AgentProc(sock_path):
        assert lock.is_file()
        assert lock.stat().st_mode & 0o777 == 0o644
    assert lock.is_file()
    lock.write_text("held")
    with lock.open("r") as held:
        fcntl.flock(held, fcntl.LOCK_SH)  # a library holding it across the restart
        with AgentProc(sock_path):
            assert lock.read_text() == "held"


def pod_report(
    pod: str,
    priority: int,
    devices: list[DeviceReport],
    interval: float | None = None,
    policy: str = "fixed-share",
) -> Report:
    """A report of the container of pod (cgroup /kubepods/<pod>)."""
    return Report(
        seq=1,
        ts=0.0,
        container=ContainerId(cgroup=f"/kubepods/{pod}", pod=pod),
        policy=policy,
        priority=priority,
        devices=devices,
        interval=interval,
    )


def test_a_device_gone_from_a_high_priority_report_is_no_longer_busy():
    """A high-priority container whose report no longer lists a device (a
    restarted container given another GPU) is not active there: the
    low-priority containers on that device stop yielding at their next
    report, as when it reports the device idle, not an active window later."""
    state = AgentState(AgentConfig(active_window=3.0))
    peer = PeerCred(pid=1, uid=0, gid=0)

    def report(pod: str, priority: int, *devices: DeviceReport) -> Report:
        return pod_report(pod, priority, list(devices))

    a, b = device(uuid=GPU_A, share=50.0, sm_limit=50), device(uuid=GPU_B, share=50.0)
    low = report("low", 1, replace(a, sm_share=20.0))
    t = 100.0
    state.accept_report(report("high", 0, a), peer, t)
    # NVML shows high's processes (pid 1) working on A: its report counts.
    state.note_process_use({GPU_A: {1: 50.0}}, lambda pid: frozenset({"/kubepods/high"}), t)
    assert state.accept_report(low, peer, t).yield_devices == {GPU_A: True}
    state.accept_report(report("high", 0, replace(b, sm_limit=50)), peer, t + 0.5)
    assert state.accept_report(low, peer, t + 0.6).yield_devices == {GPU_A: False}
    assert GPU_A not in state.high_active


def test_a_high_priority_container_reporting_seldom_keeps_its_device_busy():
    """A high-priority container reporting every 10 s that said "active"
    keeps its device busy while NVML's reading (every 0.5 s in the agent)
    shows its processes working, not only for --active-window (3 s) after
    its report: the low-priority container beside it must not run 7 s of
    every 10 beside it.  Its report alone holds nothing: once NVML no
    longer sees it work, the yield ends within the window, whatever its
    report's interval (tests/test_trust_priority.py)."""
    state = AgentState(AgentConfig(active_window=3.0))
    peer = PeerCred(pid=1, uid=0, gid=0)

    def report(pod: str, priority: int, share: float, interval: float | None) -> Report:
        return pod_report(pod, priority, [device(share=share, sm_limit=50)], interval)

    def seen(at: float, pct: float = 50.0) -> None:
        state.note_process_use({GPU_A: {1: pct}}, lambda pid: frozenset({"/kubepods/high"}), at)

    low = report("low", 1, 20.0, 1.0)
    t = 100.0
    state.accept_report(report("high", 0, 50.0, 10.0), peer, t)
    for dt in (1.0, 5.0, 9.5, 19.0):
        seen(t + dt)
        state.expire(t + dt)
        assert state.accept_report(low, peer, t + dt).yield_devices == {GPU_A: True}, dt
    # NVML no longer sees it work: its report of 50 % (due for 20 s) holds nothing.
    state.accept_report(report("high", 0, 50.0, 10.0), peer, t + 20.0)
    seen(t + 20.0, 0.0)
    state.expire(t + 23.5)
    assert state.accept_report(low, peer, t + 23.5).yield_devices == {GPU_A: False}
    # Seen working again, and it reports active: busy at once.
    seen(t + 24.0)
    assert state.accept_report(low, peer, t + 24.0).yield_devices == {GPU_A: True}


def test_a_memory_limit_of_2_64_minus_1_is_pushed_as_no_limit():
    """2^64-1 bytes is the library's "unlimited" (GV_UNLIMITED; set-limit
    --memory 18446744073709551615 passes it): the container then reports
    no limit (null), so a pushed 2^64-1 never showed applied and was
    repeated in every ack for good (the tuner set it again every tick).
    It is pushed as null, and settles."""
    state = AgentState(AgentConfig())
    peer = PeerCred(pid=1, uid=0, gid=0)
    r = pod_report("t", 0, [device(limit=4 * GiB)])
    state.accept_report(r, peer, 1.0)
    state.set_limit(r.container.key, GPU_A, {"memory": 2**64 - 1})
    assert state.accept_report(r, peer, 2.0).memory_limits == {GPU_A: None}
    applied = replace(r, devices=[device(limit=None)])
    assert state.accept_report(applied, peer, 3.0).memory_limits == {}
    assert state.status()["containers"][0]["pending_limits"]["memory"] == {}


def test_an_admin_sets_limits_on_at_most_16_devices_of_a_container():
    """Admin limits are kept while the container is: bounded like a
    region's devices (16), a 17th device is an error naming it."""
    state = AgentState(AgentConfig())
    peer = PeerCred(pid=1, uid=0, gid=0)
    r = pod_report("t", 0, [device(limit=4 * GiB)])
    state.accept_report(r, peer, 1.0)
    key = r.container.key
    uuids = [f"GPU-{i:08x}-0000-4000-8000-000000000000" for i in range(17)]
    for u in uuids[:16]:
        state.set_limit(key, u, {"sm": 10})
    state.set_limit(key, uuids[0], {"memory": GiB})  # a device it has: fine
    with pytest.raises(ValueError, match=rf"^device='{uuids[16]}': the container has limits"):
        state.set_limit(key, uuids[16], {"sm": 10})
    assert len(state.admin_limits[key].devices()) == 16


def test_a_device_nvml_cannot_read_does_not_hide_the_others():
    """A GPU that fails its NVML queries (fallen off the bus: GPU_IS_LOST)
    leaves the host series of the other GPUs in place."""
    from gpuvisor.supervisor.agent.metrics import Fresh, HostGpus

    class LostError(Exception):
        pass

    class Mem:
        used, total = GiB, 16 * GiB

    class Util:
        gpu = 40

    class FakeNvml:
        NVMLError = LostError

        @staticmethod
        def nvmlDeviceGetCount() -> int:
            return 3

        @staticmethod
        def nvmlDeviceGetHandleByIndex(i: int) -> int:
            return i

        @staticmethod
        def nvmlDeviceGetUUID(h: int) -> str:
            if h == 1:
                raise LostError("GPU is lost")
            return f"GPU-{h}"

        @staticmethod
        def nvmlDeviceGetProcessUtilization(h: int, since: int) -> list[Any]:
            return [type("Sample", (), {"pid": 700 + h, "smUtil": 30})()]

        @staticmethod
        def nvmlDeviceGetName(h: int) -> str:
            return "Fake"

        @staticmethod
        def nvmlDeviceGetMemoryInfo(h: int) -> Mem:
            return Mem()

        @staticmethod
        def nvmlDeviceGetUtilizationRates(h: int) -> Util:
            return Util()

    gpus = HostGpus.__new__(HostGpus)  # without loading NVML
    gpus._lock = threading.Lock()
    gpus._nvml = FakeNvml()
    gpus._cache = Fresh(gpus._lock, [])
    gpus._problems = {}
    assert [(g.index, g.uuid) for g in gpus.read()] == [(0, "GPU-0"), (2, "GPU-2")]
    assert gpus.process_use(1.0) == {"GPU-0": {700: 30.0}, "GPU-2": {702: 30.0}}


def test_adopted_limits_for_a_device_the_new_container_never_lists_end_with_the_grace(
    sock_path,
):
    """A restarted container takes the limits parked for its pod
    (--limit-grace); one on a device its reports have not listed when the
    grace ends is dropped: no longer pushed in every ack, nor in
    pending_limits, nor counted toward the 16-device cap.  One on a device
    it did list stays its own."""
    with AgentProc(sock_path, "--limit-grace", "1.5") as agent:
        c = Client(sock_path, pod="tenant", namespace="team")
        name = "team/tenant/main"
        c.report(device(limit=8 * GiB), device(GPU_B, index=1, limit=8 * GiB))
        assert set_limit(sock_path, name, "--memory", "4g").returncode == 0
        proc = run_cli(
            "node-agent", "set-limit", "--socket", sock_path, "--container", name,
            "--device", GPU_B, "--memory", "2g",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert c.report(device(limit=4 * GiB), final=True)["type"] == "ack"
        # The restarted container has GPU_A only: within the grace both are pushed.
        c.close()
        c.connect()
        start = time.monotonic()
        ack = c.report(device(limit=8 * GiB))
        assert ack["limits"] == {GPU_A: {"memory": 4 * GiB}, GPU_B: {"memory": 2 * GiB}}
        st = agent.status()["containers"][0]
        assert st["pending_limits"]["memory"] == {GPU_A: 4 * GiB, GPU_B: 2 * GiB}
        time.sleep(max(0.0, start + 2.0 - time.monotonic()))
        # The grace is over: GPU_B's is dropped, GPU_A's (listed) stays.
        assert c.report(device(limit=4 * GiB))["limits"] == {}
        assert c.report(device(limit=8 * GiB))["limits"] == {GPU_A: {"memory": 4 * GiB}}
        st = agent.status()["containers"][0]
        assert st["admin_limits"] == {"memory": {GPU_A: 4 * GiB}, "sm": {}}
        assert st["pending_limits"] == {"memory": {GPU_A: 4 * GiB}, "sm": {}}
        c.close()


GPU_C = "GPU-cccccccc-cccc-cccc-cccc-cccccccccccc"


def test_adopted_limits_on_a_device_the_container_can_see_outlive_the_grace() -> None:
    """A restarted container that has not used a GPU within --limit-grace
    keeps the administrator's limit on it while its reports name it
    `visible` (it would otherwise run there under its own limit once it
    uses it): for as long as it lives, and parked again when it leaves.
    A limit on a device it cannot see still goes with the grace, and so
    does one on a device it has not used when its reports do not say what
    it can see (a supervisor older than `visible`)."""
    peer = PeerCred(pid=1, uid=0, gid=0)

    def report(
        cgroup: str, visible: list[str] | None, final: bool = False, uuid: str = GPU_A
    ) -> Report:
        cid = ContainerId(cgroup=cgroup, pod="web-0", namespace="ns", container="main")
        return Report(
            seq=1, ts=0.0, container=cid, policy="fixed-share", priority=0,
            devices=[device(uuid, limit=8 * GiB)], final=final, visible=visible,
        )  # fmt: skip

    def restarted(visible: list[str] | None) -> tuple[AgentState, str]:
        state = AgentState(AgentConfig(limit_grace=300.0))
        first = report("/kubepods/pod-1/ctr-a", [GPU_A, GPU_B])
        state.accept_report(first, peer, 0.0)
        for uuid in (GPU_A, GPU_B, GPU_C):
            state.set_limit(first.container.key, uuid, {"memory": GiB})
        state.accept_report(report("/kubepods/pod-1/ctr-a", None, final=True), peer, 1.0)
        second = report("/kubepods/pod-1/ctr-b", visible)
        state.accept_report(second, peer, 2.0)
        return state, second.container.key

    state, key = restarted([GPU_A, GPU_B])
    # A report past the grace (adopted_until, 301.0):
    instr = state.accept_report(report("/kubepods/pod-1/ctr-b", [GPU_A, GPU_B]), peer, 400.0)
    assert instr.memory_limits == {GPU_A: GiB, GPU_B: GiB}  # GPU_B unused, still pushed
    assert state.admin_limits[key].memory == {GPU_A: GiB, GPU_B: GiB}
    assert state.status()["containers"][0]["visible"] == sorted([GPU_A, GPU_B])
    # It leaves: parked with GPU_B's, for the next restart, which uses it.
    state.accept_report(report("/kubepods/pod-1/ctr-b", None, final=True), peer, 401.0)
    instr = state.accept_report(report("/kubepods/pod-1/ctr-c", None, uuid=GPU_B), peer, 402.0)
    assert instr.memory_limits == {GPU_A: GiB, GPU_B: GiB}

    # A later report without `visible` does not forget what an earlier said.
    state, key = restarted([GPU_A, GPU_B])
    instr = state.accept_report(report("/kubepods/pod-1/ctr-b", None), peer, 400.0)
    assert instr.memory_limits == {GPU_A: GiB, GPU_B: GiB}

    # A supervisor that does not say: only the devices it listed stay.
    state, key = restarted(None)
    instr = state.accept_report(report("/kubepods/pod-1/ctr-b", None), peer, 400.0)
    assert instr.memory_limits == {GPU_A: GiB}
    assert state.status()["containers"][0]["visible"] is None


def test_a_reports_visible_devices_are_uuids_each_once() -> None:
    """`visible` is optional (missing or null: not known, and not sent when
    not known); when given, a list of at most 64 device UUIDs, each once."""
    base = report_message(
        Report(seq=1, ts=0.0, container=ContainerId(cgroup="/c"), policy="fixed-share", priority=0)
    )
    assert "visible" not in base
    assert parse_report(base).visible is None
    assert parse_report(dict(base, visible=None)).visible is None
    assert parse_report(dict(base, visible=[GPU_B, GPU_A])).visible == [GPU_B, GPU_A]
    sent = Report(
        seq=1, ts=0.0, container=ContainerId(cgroup="/c"), policy="fixed-share", priority=0,
        visible=[GPU_A],
    )  # fmt: skip
    assert report_message(sent)["visible"] == [GPU_A]
    for bad, why in (
        ("GPU-0", "visible[0]='GPU-0': expected a device UUID"),
        ([GPU_A, "gpu-0"], "visible[1]='gpu-0': expected a device UUID"),
        ([GPU_A, GPU_A], f"visible[1]={GPU_A!r}: the same device as visible[0]"),
        ([f"GPU-00000000-0000-0000-0000-{i:012x}" for i in range(65)], "at most 64"),
    ):
        if isinstance(bad, str):
            why = "visible: expected a list"
        with pytest.raises(ProtocolError, match=re.escape(why)):
            parse_report(dict(base, visible=bad))


VISIBLE_DEVICES = """
import json, sys
from gpuvisor.shim.loader import SIM_NVML_NAME, simulator_dir
from gpuvisor.supervisor.entrypoint.config import EnvLimits, env_limits
from gpuvisor.supervisor.entrypoint.tuner import open_nvml, visible_devices
nvml = open_nvml(str(simulator_dir() / SIM_NVML_NAME))
assert nvml is not None
out = {"node": [u for u, _ in nvml.devices()]}
for name, env in json.loads(sys.argv[1]).items():
    out[name] = visible_devices(nvml, env_limits(env))
out["unknown"] = visible_devices(nvml, EnvLimits())
print(json.dumps(out))
"""


def test_a_supervisor_reports_the_devices_its_workload_can_see(node: SimNode) -> None:
    """visible_devices: the node's devices (NVML) the library maps to a CUDA
    ordinal through the workload's CUDA_VISIBLE_DEVICES (not the
    supervisor's own), in ordinal order; None when the environment is not
    known."""
    envs = {
        "all": {},
        "one": {"CUDA_VISIBLE_DEVICES": "1"},
        "reordered": {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_MEMORY_LIMIT_0": "25%"},
        "none": {"CUDA_VISIBLE_DEVICES": ""},
    }
    caller = dict(node.env, CUDA_VISIBLE_DEVICES="0")
    proc = run_py(VISIBLE_DEVICES, caller, args=[json.dumps(envs)])
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    a, b = got["node"]
    assert got["all"] == [a, b]
    assert got["one"] == [b]
    assert got["reordered"] == [b, a]
    assert got["none"] == []
    assert got["unknown"] is None


def test_parked_admin_limits_go_to_the_same_pods_next_container_within_the_grace():
    """An administrator's limits outlive a container that left (final
    report or expiry) for --limit-grace seconds, for the next container
    with its labels whose cgroup is under the same parent (its pod's,
    under Kubernetes): not for a pod recreated with the same name (another
    pod cgroup), nor after the grace."""
    peer = PeerCred(pid=1, uid=0, gid=0)

    def report(cgroup: str, final: bool = False) -> Report:
        cid = ContainerId(cgroup=cgroup, pod="web-0", namespace="ns", container="main")
        return Report(
            seq=1,
            ts=0.0,
            container=cid,
            policy="fixed-share",
            priority=0,
            devices=[device(limit=8 * GiB)],
            final=final,
        )

    def left(state: AgentState, how: str) -> None:
        first = report("/kubepods/pod-1/ctr-a")
        state.accept_report(first, peer, 0.0)
        state.set_limit(first.container.key, GPU_A, {"memory": GiB, "sm": "env"})
        if how == "final":
            state.accept_report(report("/kubepods/pod-1/ctr-a", final=True), peer, 1.0)
        else:
            assert state.expire(100.0) == 1
        assert state.containers == {}
        assert len(state.parked) == 1

    for how in ("final", "expiry"):
        # The pod's restarted container (a new cgroup in the same pod).
        state = AgentState(AgentConfig(limit_grace=300.0))
        left(state, how)
        instr = state.accept_report(report("/kubepods/pod-1/ctr-b"), peer, 200.0)
        assert instr.memory_limits == {GPU_A: GiB}
        assert instr.restore == {GPU_A: ("sm",)}
        assert state.parked == {}
        # Another pod of the same name: not its limits.
        state = AgentState(AgentConfig(limit_grace=300.0))
        left(state, how)
        instr = state.accept_report(report("/kubepods/pod-2/ctr-c"), peer, 200.0)
        assert instr.memory_limits == {}
        assert instr.restore == {}
        # After the grace: forgotten.
        state = AgentState(AgentConfig(limit_grace=300.0))
        left(state, how)
        state.expire(1000.0)
        assert state.parked == {}
        instr = state.accept_report(report("/kubepods/pod-1/ctr-b"), peer, 1000.0)
        assert instr.memory_limits == {}
        assert instr.restore == {}
