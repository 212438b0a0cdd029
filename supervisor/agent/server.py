"""The node agent (`gpuvisor node-agent`): collects the supervisors' reports.

One process, one asyncio loop: a Unix-socket server speaking
supervisor/protocol.py (docs/protocol.md), plus a small HTTP server thread
for /metrics (Prometheus, metrics.py) and /status (JSON).
The connections are in connection.py, the HTTP server in http.py, what
the agent knows in state.py.

Defences against bad clients, all with bounded memory:
- a line longer than MAX_MESSAGE_BYTES: error reply, then disconnect (the
  partial line is never buffered beyond that bound);
- a per-connection token bucket (default 50 messages/s, burst 100): excess
  messages get an error reply and are counted, not processed;
- a peer whose unread replies pass WRITE_HIGH (256 KiB) is neither
  answered nor read from until they drain: the lines of a read it
  pipelined wait in its buffer instead of each adding a reply;
- a line that stays incomplete for --read-timeout seconds from its first
  byte (however it trickles in), or a reader that leaves our replies
  unread that long: disconnect;
- a connection silent for --idle-timeout seconds: disconnect;
- at most --max-connections connections, and --max-connections-per-cgroup
  from the processes of one cgroup: more are told so and closed, except
  that with the global pool full the cgroup holding the most gives up its
  least recently active connection to a peer of a cgroup holding fewer;
- device UUIDs are taken in NVML's form only, at most MAX_DEVICES distinct
  ones per container while the agent knows it (so reports cannot churn
  metric series);
- every malformed message gets an error naming the field and is counted;
  a message that cannot be handled for any other reason (an exception)
  gets a `malformed` error too, never a dropped connection by itself;
- a peer whose messages are refused --max-errors times in a row (any
  reason but rate and conflict; an ack starts the count again) gets one
  more error and is disconnected;
- HTTP clients of /metrics and /status are disconnected --http-timeout
  seconds after they connected, however slowly they send or read (and
  sooner if they stall that long); at most 32 are served at once, at most
  4 of them from one client address; more are closed unanswered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..identity import peer_cgroups
from ..paths import context_lock_path
from ..protocol import MAX_MESSAGE_BYTES, encode, error_message
from .config import (
    AgentConfig,
    admin_dir_problem,
    admin_socket_problem,
    socket_dir_is_own,
)
from .connection import Connection
from .http import HttpHandler, HttpServer
from .persist import encode_state, read_state_file, state_file_problem, write_state
from .region_dir import RegionScanner
from .state import AgentState

if TYPE_CHECKING:
    from .metrics import InventoryReader

T = TypeVar("T")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


log = logging.getLogger("gpuvisor.agent")

# Label bindings and first-reported terms are saved at most this often (s).
IDENTITY_SAVE_S = 1.0


def _clear_stale(path: Path) -> None:
    """Remove a socket left by an agent that is gone; refuse a live one."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise RuntimeError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # stale: the previous agent is gone
    else:
        raise RuntimeError(f"another node agent is listening on {path}")
    finally:
        probe.close()


class Agent:
    def __init__(self, config: AgentConfig, inventory: InventoryReader | None = None) -> None:
        """inventory: reads the node inventory (docs/inventory.md) for /status
        and the inventory series; None leaves them out."""
        from .metrics import AgentCollector, HostGpus  # prometheus_client, pynvml

        self.config = config
        self.state = AgentState(config)
        self.conns: set[Connection] = set()  # on the reporting socket
        self.admin_conns: set[Connection] = set()  # on the admin socket
        self.rate_error = encode(
            error_message(None, f"rate limit exceeded: at most {config.rate:g} messages/s")
        )
        self.gpus = HostGpus(inventory, config.node_name)
        self.collector = AgentCollector(
            self.state, self.gpus, legacy=config.legacy_metrics, node=config.node_name
        )
        self.server: asyncio.AbstractServer | None = None
        self.admin_server: asyncio.AbstractServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self.bound: list[str] = []  # socket paths this agent bound, to unlink at close
        self.http: ThreadingHTTPServer | None = None
        self.stopping: asyncio.Event | None = None
        self.sweeper: asyncio.Task[None] | None = None
        self.watcher: asyncio.Task[None] | None = None
        self.scanner: RegionScanner | None = None
        self.scanning: asyncio.Task[None] | None = None
        self.logged_errors: set[str] = set()  # exception types handle_safely logged
        self.saved_gen = -1  # state.limits_gen last written to the state file
        self.saved_identity = -1  # state.identity_gen last written there
        self.saved_at = -1e9  # time.monotonic() of that write
        self.save_problem: str | None = None  # why the last save failed (logged once)

    def conns_of(self, admin: bool) -> set[Connection]:
        return self.admin_conns if admin else self.conns

    def metrics_payload(self, accept: str | None) -> tuple[bytes, str]:
        from .metrics import render

        self.gpus.read()  # NVML off the event loop: the collector gets it cached
        self.gpus.inventory()
        return self.on_loop(lambda: render(self.collector, accept))

    def status_payload(self) -> bytes:
        inventory = self.gpus.inventory()  # NVML off the event loop

        def page() -> bytes:
            status = self.state.status()
            status["inventory"] = inventory
            return json.dumps(status).encode()

        return self.on_loop(page)

    def on_loop(self, fn: Callable[[], T]) -> T:
        """fn's result, computed on the event loop's thread, where reports
        and admin messages change the state: a page read on the HTTP thread
        meanwhile could see a table change size under it and fail (one
        scrape in about 6,000 with set-limit running flat out).  Without a
        running loop (tests, shutdown) fn runs here.  TimeoutError when the
        loop does not get to it within --http-timeout."""
        loop = self.loop
        if loop is None or loop.is_closed() or not loop.is_running() or _running_loop() is loop:
            return fn()  # no loop to wait for, or already on it
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def call() -> None:
            if not done.set_running_or_notify_cancel():
                return  # the HTTP thread gave up waiting
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)

        loop.call_soon_threadsafe(call)
        try:
            return done.result(timeout=self.config.http_timeout)
        except concurrent.futures.TimeoutError:
            done.cancel()
            raise TimeoutError("the agent's event loop did not answer in time") from None

    # ---- the state file (persist.py) ----------------------------------------------

    def load_state(self) -> None:
        """Take back the administrators' limits the state file holds (at
        start, before anything is served).  StateFileError (a RuntimeError):
        the file cannot be read or used; the agent does not start."""
        path = self.config.state_file_path
        admin = self.config.admin_socket_path
        problem = admin_socket_problem(self.config.socket_path, admin)
        if problem is not None:  # the default state file lies beside it: blame the cause
            raise RuntimeError(f"--admin-socket {problem}")
        problem = state_file_problem(self.config.socket_path, path, admin)
        if problem is not None:
            raise RuntimeError(f"--state-file {problem}")
        saved = read_state_file(path)
        entries = saved.limits
        dropped = self.state.restore_saved(entries, time.monotonic(), time.time())
        self.state.restore_identity(saved.bindings, saved.terms)
        if entries:
            log.info(
                "%s: %d container(s)' administrator's limits restored, %d expired meanwhile",
                path,
                len(entries) - dropped,
                dropped,
            )
        with contextlib.suppress(OSError):
            Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)

    def save_state(self) -> str | None:
        """Write the administrators' limits to the state file if they
        changed since the last write, and the label bindings and
        first-reported terms (identity) if they changed and the last write
        is IDENTITY_SAVE_S old (a container making up names must not make
        the agent write the file at every report: the sweeper writes them
        within that time).  Returns why it could not be written (logged
        once per distinct problem; retried on the next change and every
        sweep), else None."""
        state = self.state
        gen = state.limits_gen
        ident = state.identity_gen
        now = time.monotonic()
        if gen == self.saved_gen and (
            ident == self.saved_identity or now - self.saved_at < IDENTITY_SAVE_S
        ):
            return None
        path = self.config.state_file_path
        try:
            write_state(
                path,
                encode_state(
                    state.saved_limits(), time.time(), state.saved_bindings(), state.saved_terms()
                ),
            )
        except OSError as exc:
            problem = f"cannot save {path} ({exc.strerror or exc})"
            if problem != self.save_problem:
                log.warning("%s: administrators' limits will not survive a restart", problem)
            self.save_problem = problem
            return problem
        self.saved_gen = gen
        self.saved_identity = ident
        self.saved_at = now
        if self.save_problem is not None:
            log.warning("%s saved again", path)
        self.save_problem = None
        return None

    # ---- lifecycle -----------------------------------------------------------

    def _prepare_socket(self) -> None:
        path = Path(self.config.socket_path)
        own = socket_dir_is_own(str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        if own:  # never a directory shared with others
            # Containers of any uid reach the socket and create the library's
            # node-wide files here (launch order, context costs: they open
            # them without following links); sticky, as /tmp, so none of
            # them removes or renames another's file or the agent's.
            with contextlib.suppress(OSError):
                os.chmod(path.parent, os.stat(path.parent).st_mode | 0o1777)
        self._prepare_context_lock()
        _clear_stale(path)

    def _prepare_admin_socket(self) -> None:
        """The admin socket's directory: the agent's uid only (0700)."""
        admin = self.config.admin_socket_path
        problem = admin_socket_problem(self.config.socket_path, admin) or admin_dir_problem(
            admin, self.config.state_file_path
        )
        if problem is not None:
            raise RuntimeError(f"--admin-socket {problem}")
        path = Path(admin)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(path.parent, 0o700)
        _clear_stale(path)

    def _prepare_context_lock(self) -> None:
        """The file beside the socket that containers' libraries flock while
        they measure a new context (context_lock_path).  Readable by any
        uid: flock needs no write access.  Never truncated: a library may
        hold it across an agent restart."""
        lock = context_lock_path(self.config.socket_path)
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            log.warning(
                "cannot create %s (%s): contexts are measured without the node lock", lock, exc
            )
            return
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o644)
        os.close(fd)

    def start_http(self) -> int:
        cfg = self.config
        handler = type(
            "Handler",
            (HttpHandler,),
            {"agent": self, "timeout": cfg.http_timeout, "status_public": cfg.status_public},
        )
        try:
            self.http = HttpServer((cfg.metrics_host, cfg.metrics_port), handler, cfg.http_timeout)
        except (OSError, OverflowError) as exc:
            raise RuntimeError(
                f"--metrics-host/--metrics-port {cfg.metrics_host}:{cfg.metrics_port}: "
                f"{getattr(exc, 'strerror', None) or exc}"
            ) from None
        threading.Thread(target=self.http.serve_forever, name="http", daemon=True).start()
        return int(self.http.server_address[1])

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.load_state()  # first: a state file it cannot use stops it
        self._prepare_admin_socket()
        self._prepare_socket()
        self.save_state()  # what it restored, less what expired meanwhile
        loop = asyncio.get_running_loop()
        admin = self.config.admin_socket_path
        self.admin_server = await loop.create_unix_server(
            lambda: Connection(self, admin=True), path=admin, backlog=16
        )
        self.bound.append(admin)
        os.chmod(admin, 0o600)  # the agent's uid (and root) only
        self.server = await loop.create_unix_server(
            lambda: Connection(self), path=self.config.socket_path, backlog=1024
        )
        self.bound.append(self.config.socket_path)
        os.chmod(self.config.socket_path, 0o666)  # containers run as any uid
        self.stopping = asyncio.Event()
        self.sweeper = loop.create_task(self._sweeper())
        self.watcher = loop.create_task(self._watch_process_use())
        if self.config.region_dir:
            self.scanner = RegionScanner(
                self.config.region_dir, self.state, self.config.region_scan_interval
            )
            self.scanning = loop.create_task(self._scan_regions())

    async def _scan_regions(self) -> None:
        """Read the containers' region files (region_dir.py) every interval."""
        assert self.scanner is not None
        while True:
            try:
                self.scanner.scan()
            except Exception:  # never the agent: the next scan tries again
                log.exception("reading --region-dir %s failed", self.config.region_dir)
            await asyncio.sleep(self.config.region_scan_interval)

    async def _watch_process_use(self) -> None:
        """Read NVML's per-process utilisation while some container's gate
        measures nothing (no SM limit, whatever its priority: it reports
        0 %, but NVML sees its processes work), or a low-priority container
        reports beside a high-priority one: the figures mark high-priority
        containers active and stand in for the unmeasured containers' SM
        share.  Also read while any container is known: the PIDs that no
        container reports mark their GPU unmanaged (unmanaged.py)."""
        period = max(0.05, min(0.5, self.config.active_window / 4))
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            # Read too while any container is known, for the processes
            # beside them that no container reports (unmanaged.py).
            wanted = self.state.wants_process_use()
            if not self.gpus.available or not (wanted or self.state.containers):
                self.state.unmanaged.clear()  # nothing managed to be beside
                continue
            use = await loop.run_in_executor(None, self.gpus.process_use, period + 0.2)
            now = time.monotonic()
            if wanted:
                self.state.note_process_use(use, peer_cgroups, now)
            self.state.unmanaged.note(use, self.state.containers, peer_cgroups, now)

    async def _sweeper(self) -> None:
        cfg = self.config
        period = max(0.05, min(0.5, cfg.read_timeout / 4, cfg.expire_after / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in [*self.conns, *self.admin_conns]:
                if conn.paused_since is not None:
                    # Lines held in buf wait for the peer to read: not a
                    # trickled line.
                    if now - conn.paused_since > cfg.read_timeout:
                        conn.disconnect("slow-reader")
                elif conn.buf and now - conn.partial_since > cfg.read_timeout:
                    conn.disconnect(
                        "timeout",
                        encode(error_message(None, f"incomplete line for {cfg.read_timeout:g} s")),
                    )
                elif now - conn.last_activity > cfg.idle_timeout:
                    conn.disconnect("idle")
            self.state.expire(now)
            self.save_state()

    async def run(self, ready: Any = None) -> None:
        try:
            await self.start()
            port = self.start_http()
        except BaseException:
            self.close()  # no stale socket left behind
            raise
        loop = asyncio.get_running_loop()
        assert self.stopping is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        if ready is not None:
            ready(port)
        await self.stopping.wait()
        self.close()

    def close(self) -> None:
        for server in (self.server, self.admin_server):
            if server is not None:
                server.close()
        for conn in [*self.conns, *self.admin_conns]:
            if conn.transport is not None:
                conn.transport.close()
        # Only the sockets this agent bound: one it failed to bind may be
        # another agent's.
        for path in self.bound:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.bound.clear()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        self.gpus.close()


def run_agent(
    config: AgentConfig, ready: Any = None, inventory: InventoryReader | None = None
) -> None:
    if config.cpu is not None:
        try:
            os.sched_setaffinity(0, {config.cpu})
        except (OSError, OverflowError) as exc:
            raise RuntimeError(
                f"--cpu {config.cpu}: cannot pin the agent there "
                f"({getattr(exc, 'strerror', None) or exc})"
            ) from None
    agent = Agent(config, inventory)
    asyncio.run(agent.run(ready))


# ---- admin client ---------------------------------------------------------------


class NotAnAgentReply(ValueError):
    """What came back from an admin socket is not a node agent's reply."""


def send_admin(socket_path: str, msg: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """Send one admin message to the agent's admin socket; return its
    (decoded) reply: an `ack`, or an `error` with its text.  OSError when
    the socket cannot be reached or closes without a reply (the agent
    stopped); NotAnAgentReply for a reply of another form (another
    daemon's socket)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(encode(msg))
        data = b""
        while not data.endswith(b"\n") and len(data) <= MAX_MESSAGE_BYTES:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    if not data:
        raise ConnectionError("the node agent closed the connection without a reply")
    line = data.split(b"\n", 1)[0]
    try:
        reply = json.loads(line)
    except (ValueError, RecursionError):
        reply = None
    if not (
        isinstance(reply, dict)
        and (reply.get("type") == "ack" or isinstance(reply.get("error"), str))
    ):
        raise NotAnAgentReply(f"not a gpuvisor node agent's reply: {line[:80]!r}")
    return reply
