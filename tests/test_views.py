"""gpuvisor status (inside a container) and gpuvisor top (on the node)."""

from __future__ import annotations

import json
import subprocess
import textwrap
import time

import pytest

from tests.helpers import CLI, GiB, Holder, clean_env, run_cli, run_py, start_cmd
from tests.test_agent import AgentProc, Client, device, sock_path  # noqa: F401 (fixture)


def gpuvisor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the gpuvisor CLI with args (in a clean environment unless env)."""
    return run_cli(*args, env=env, timeout=60)


def test_status_json_reads_the_region(node):
    proc = run_py(
        f"""
        from gpuvisor.shim import Region
        r = Region.attach({str(node.region)!r})
        r.register_device("GPU-00000000-0000-0000-0000-000000000000", 16 * {GiB}, 4 * {GiB})
        r.register_device("GPU-11111111-1111-1111-1111-111111111111", 16 * {GiB}, None)
        """,
        node.env,
    )
    assert proc.returncode == 0, proc.stderr
    out = gpuvisor("status", "--json", "--sample", "0.05", env=node.env)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["region"] == str(node.region)
    devs = {d["uuid"]: d for d in info["devices"]}
    assert devs["GPU-00000000-0000-0000-0000-000000000000"]["memory_limit"] == 4 * GiB
    assert devs["GPU-00000000-0000-0000-0000-000000000000"]["memory_used"] == 0
    assert devs["GPU-11111111-1111-1111-1111-111111111111"]["memory_limit"] is None
    assert devs["GPU-00000000-0000-0000-0000-000000000000"]["sm_limit"] is None
    assert devs["GPU-00000000-0000-0000-0000-000000000000"]["processes"] == []
    # The table form names the devices too.
    out = gpuvisor("status", "--region", str(node.region), "--sample", "0")
    assert out.returncode == 0, out.stderr
    assert "GPU-00000000-0000-0000-0000-000000000000" in out.stdout
    assert "4.0 GiB" in out.stdout


def test_top_once_json_and_table(sock_path):  # noqa: F811
    with AgentProc(sock_path) as agent:
        c = Client(sock_path, pod="topped", namespace="ns1")
        c.report(device(used=2 * GiB))
        out = gpuvisor("top", "--once", "--json", "--url", agent.url + "/status")
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert [x["container"]["pod"] for x in data["containers"]] == ["topped"]
        assert data["containers"][0]["devices"][0]["memory_used"] == 2 * GiB
        out = gpuvisor("top", "--once", "--url", agent.url + "/status")
        assert out.returncode == 0, out.stderr
        assert "ns1/topped/main" in out.stdout
        assert "2.0 GiB" in out.stdout
        c.close()


def test_top_once_unreachable_agent_fails_cleanly():
    out = gpuvisor("top", "--once", "--url", "http://127.0.0.1:1/status")
    assert out.returncode != 0
    assert "cannot read" in out.stderr


def test_status_survives_a_process_that_leaves_while_listed(node):
    """status lists the region's PIDs, then asks each one's usage: a process
    that exits in between (it gives its slot back at exit) made the whole
    command fail with "pid N is not registered".  The child stands a
    listed-but-gone PID in for that moment."""
    code = f"""
import sys
from gpuvisor.shim import Region
from gpuvisor.supervisor.cli import main
r = Region.attach()
r.register_device("GPU-00000000-0000-0000-0000-000000000000", 16 * {GiB}, 4 * {GiB})
listed = Region.processes
Region.processes = lambda self: listed(self) + [999999]  # exited after the listing
main(sys.argv[1:])
"""
    proc = run_py(code, node.env, args=["status", "--json", "--sample", "0"])
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert [d["processes"] for d in info["devices"]] == [[]]


class _JsonServer:
    """An HTTP server on 127.0.0.1 that answers every GET with body."""

    def __init__(self, body: bytes) -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/status"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self) -> _JsonServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


NOT_STATUS = [
    b"[1, 2]",
    b'"ok"',
    b'{"agent": "x", "containers": []}',
    b'{"agent": {}, "containers": {}}',
    b'{"agent": {}, "containers": [{"x": 1}]}',
    b'{"agent": {}, "containers": [{"container": {}, "devices": [{"uuid": 7}]}]}',
    b"[" * 100_000,  # nested past the JSON parser's recursion limit: a traceback
]


@pytest.mark.parametrize(
    ("body", "as_json"),
    [(b, False) for b in NOT_STATUS] + [(b, True) for b in NOT_STATUS[:4]],
)
def test_top_once_names_a_document_that_is_not_an_agents_status(body, as_json):
    """A URL that answers JSON of another form (another service on the port,
    a proxy's error object, a list): `top --once` ended in a Python
    traceback (AttributeError, KeyError) instead of one line."""
    with _JsonServer(body) as server:
        out = gpuvisor("top", "--once", "--url", server.url, *(["--json"] if as_json else []))
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"Error: cannot read {server.url}: ")
    assert "not a gpuvisor node agent's /status document" in lines[0]
    assert out.stdout == ""


@pytest.mark.parametrize("page", ["/metrics", "/healthz"])
def test_top_once_names_a_page_that_is_not_json(sock_path, page):  # noqa: F811
    """--url pointed at the agent's /metrics (or /healthz) instead of its
    /status, a likely slip: `top --once` said only `cannot read URL:
    Expecting value: line 1 column 1 (char 0)`, the JSON parser's words,
    where docs/cli.md promises `not a gpuvisor node agent's /status
    document (...)`."""
    with AgentProc(sock_path) as agent:
        url = agent.url + page
        out = gpuvisor("top", "--once", "--url", url)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"Error: cannot read {url}: not a gpuvisor node agent's /status")
    assert out.stdout == ""


class _RawServer:
    """A TCP server on 127.0.0.1 that answers every connection with reply
    (whatever it is, HTTP or not) and closes it."""

    def __init__(self, reply: bytes) -> None:
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/status"

        def serve() -> None:
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(65536)
                    conn.sendall(reply)

        threading.Thread(target=serve, daemon=True).start()

    def __enter__(self) -> _RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    ("reply", "url", "says"),
    [
        (None, "http://127.0.0.1:abc/status", "InvalidURL: nonnumeric port: 'abc'"),
        (None, "http://local host/status", "InvalidURL: URL can't contain control characters"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", None, "BadStatusLine: SSH-2.0-OpenSSH_9.6"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{}", None, "IncompleteRead"),
    ],
    ids=["port", "space", "not-http", "short-body"],
)
def test_top_once_names_a_url_it_cannot_read_in_one_line(reply, url, says):
    """A mistyped --url (a port that is not a number, a blank), or a port
    that does not answer HTTP (an SSH server) or cuts its body short:
    http.client's exceptions are neither OSError nor ValueError, and `top`
    ended in a Python traceback."""
    with _RawServer(reply or b"") as server:
        url = url or server.url
        out = gpuvisor("top", "--once", "--url", url)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"Error: cannot read {url}: {says}"), lines[0]


def test_top_keeps_refreshing_past_a_document_that_is_not_an_agents_status():
    """Without --once, such an answer is shown as one line and retried, as
    an unreachable agent is: it used to end `top` with a traceback."""
    with _JsonServer(b'{"agent": {}, "containers": [{"x": 1}]}') as server:
        proc = start_cmd(
            [*CLI, "top", "--interval", "0.1", "--url", server.url],
            clean_env(),
        )
        try:
            time.sleep(3)
            assert proc.poll() is None, proc.communicate()
        finally:
            proc.terminate()
            out, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err
    shown = [line for line in out.splitlines() if line.startswith("cannot read ")]
    assert len(shown) >= 2, out + err
    assert all("not a gpuvisor node agent's /status document" in line for line in shown)


def test_top_names_a_container_without_labels_by_its_cgroup(sock_path):  # noqa: F811
    """A container whose supervisor has no POD_NAME, POD_NAMESPACE or
    CONTAINER_NAME (plain docker) is named by its cgroup path, in /metrics
    (ctrname) as in protocol.md: `top` showed it as '-/-/-', the same for
    every such container on the node."""
    with AgentProc(sock_path) as agent:
        c = Client(sock_path, pod="", namespace="", container="")
        c.report(device(used=GiB))
        out = gpuvisor("top", "--once", "--url", agent.url + "/status")
        c.close()
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "1.0 GiB" in line]
    assert len(rows) == 1, out.stdout
    assert rows[0].split()[0] == "-/-/" + c.cid.cgroup, out.stdout


def test_top_shows_control_characters_in_labels_escaped(sock_path):  # noqa: F811
    """Labels are whatever a report says, and any process of a container
    can report for its cgroup over the socket mounted into it: `top`
    printed them raw on the administrator's terminal, so a label could
    retitle or clear that terminal (escape sequences) or forge rows of the
    table (a newline).  The agent now refuses such names (issue 36, 11);
    top still escapes whatever a /status gives it (an older agent's)."""
    from gpuvisor.supervisor.views import render_top

    with AgentProc(sock_path) as agent:
        c = Client(sock_path, pod="evil\x1b]0;pwned\x07", namespace="ns\nfake/row/x")
        reply = c.report(device(used=GiB))
        c.close()
        assert reply["type"] == "error", reply
        status = agent.status()
    assert status["containers"] == []
    status["containers"] = [
        {
            "container": {
                "namespace": "ns\nfake/row/x",
                "pod": "evil\x1b]0;pwned\x07",
                "container": "main",
                "cgroup": "/x",
            },
            "devices": [],
            "priority": 1,
            "age_s": 0.0,
        }
    ]
    out = render_top(status)
    assert "\x1b" not in out, repr(out)
    assert "\x07" not in out, repr(out)
    rows = [line for line in out.splitlines() if "fake" in line or "evil" in line]
    assert len(rows) == 1, out
    assert rows[0].split()[0] == "ns\\nfake/row/x/evil\\x1b]0;pwned\\x07/main", rows


@pytest.mark.parametrize("command", [["status", "--sample", "0"], ["shim-info"]])
def test_process_names_are_shown_with_control_characters_escaped(node, command):
    """A process names itself (prctl PR_SET_NAME): status, and shim-info,
    which an administrator may run on the node against a container's
    region, printed the name raw, so a workload could retitle or drive the
    terminal of whoever looked at its region."""
    holder = """
        import ctypes
        from tests.cuclient import *
        init()
        p = ok(cu.cuMemAlloc, 64 * MiB)
        ctypes.CDLL(None).prctl(15, b"\\x1b]0;pwned\\x07", 0, 0, 0)  # PR_SET_NAME
        hold()
        """
    with Holder(textwrap.dedent(holder), node.shimmed()):
        out = gpuvisor(*command, env=node.env)
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout, repr(out.stdout)
    assert "\x07" not in out.stdout, repr(out.stdout)
    assert "\\x1b]0;pwned\\x07" in out.stdout, out.stdout


def test_status_sample_0_measures_nothing(node):
    """--sample 0 is documented as "not measured": status gave the SM
    share over the microseconds between two reads instead (0 %, or 100 %
    when a kernel's time landed in them), for a device with an SM limit."""
    proc = run_py(
        f"""
        from gpuvisor.shim import Region
        r = Region.attach({str(node.region)!r})
        dev = r.register_device("GPU-00000000-0000-0000-0000-000000000000", 16 * {GiB}, None)
        r.set_sm_limit(dev, 30)
        """,
        node.env,
    )
    assert proc.returncode == 0, proc.stderr
    run = ["status", "--region", str(node.region), "--sample", "0"]
    out = gpuvisor(*run, "--json", env=node.env)
    assert out.returncode == 0, out.stderr
    [dev] = json.loads(out.stdout)["devices"]
    assert dev["sm_limit"] == 30
    assert dev["sm_achieved"] is None
    out = gpuvisor(*run, env=node.env)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[1:3]

    def cell(name: str) -> str:
        return row[header.index(name) :].split()[0]

    assert cell("SM-LIMIT") == "30%"
    assert cell("SM-ACHIEVED") == "-"


@pytest.mark.parametrize(
    ("how", "value", "says"),
    [
        ("option", "rel.shr", "Invalid value for '--region': 'rel.shr': not an absolute path"),
        ("option", "", "Invalid value for '--region': '': not a usable path"),
        (
            "variable",
            "rel.shr",
            "Invalid value for 'CUDA_DEVICE_MEMORY_SHARED_CACHE': 'rel.shr': not an absolute path",
        ),
    ],
)
def test_status_refuses_a_relative_region_as_the_library_does(tmp_path, how, value, says):
    """The library refuses a relative CUDA_DEVICE_MEMORY_SHARED_CACHE (the
    container's processes in other directories would each get a region, and
    the whole quota, of their own); `status` attached it, creating an empty
    region in its working directory and showing nothing."""
    env = clean_env()
    args = ["status", "--sample", "0"]
    if how == "option":
        args += ["--region", value]
    else:
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = value
    out = subprocess.run(
        [*CLI, *args], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1] == f"Error: {says}" + (
        " (the library refuses one: processes in other directories would not share the region)"
        if value
        else ""
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("how", ["option", "variable"])
def test_status_never_creates_a_region(tmp_path, how):
    """`status` attached the region, which creates it: where none existed it
    left a 281 KiB world-writable file behind and showed an empty table."""
    region = tmp_path / "absent.shr"
    env = clean_env()
    args = ["status", "--sample", "0"]
    if how == "option":
        args += ["--region", str(region)]
    else:
        env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(region)
    out = run_cli(*args, env=env, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [
        f"Error: no region at {region}: no process of this container has used the GPU "
        "through the library yet (status creates none)"
    ]
    assert not region.exists()
