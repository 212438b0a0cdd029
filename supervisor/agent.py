"""The node agent (`gpuvisor node-agent`): collects the supervisors' reports.

One process, one asyncio loop: a Unix-socket server speaking
supervisor/protocol.py (docs/protocol.md), plus a small HTTP server thread
for /metrics (Prometheus, supervisor/metrics.py) and /status (JSON).

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
- at most --max-connections connections: more are told so and closed;
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
  sooner if they stall that long); at most 32 are served at once, more are
  closed unanswered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import stat
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .agent_config import AgentConfig, admin_socket_problem, context_lock_path
from .agent_persist import encode_state, read_state, state_file_problem, write_state
from .agent_state import AgentState
from .identity import PeerCred, claim_matches, is_admin, peer_cgroups, peer_cred
from .protocol import (
    MAX_MESSAGE_BYTES,
    OWN_LIMIT,
    ContainerId,
    ProtocolError,
    ack_message,
    check_uuid,
    decode,
    encode,
    error_message,
    is_int,
    parse_report,
)

log = logging.getLogger("gpuvisor.agent")

# Unread replies per connection: above WRITE_HIGH the agent stops reading
# and serving the peer's lines until they drain below WRITE_LOW; replies
# go to the transport at least every REPLY_FLUSH bytes.
WRITE_HIGH = 256 * 1024
WRITE_LOW = 64 * 1024
REPLY_FLUSH = 16 * 1024


def _classify(exc: ProtocolError) -> str:
    text = str(exc)
    if text.startswith("v="):
        return "version"
    if text.startswith(("not JSON", "message")):
        return "malformed"
    if text.startswith("type="):
        return "type"
    return "field"


def _opt_limit(msg: dict[str, Any], name: str, lo: int, hi: int) -> None:
    if name not in msg or msg[name] is None or msg[name] == OWN_LIMIT:
        return
    v = msg[name]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ProtocolError(
            f"{name}={v!r}: expected null, {OWN_LIMIT!r} or an integer in [{lo}, {hi}]"
        )


class Connection(asyncio.Protocol):
    """One supervisor connection (on the reporting socket), or one admin
    connection (on the admin socket: set-limit only)."""

    def __init__(self, agent: Agent, admin: bool = False) -> None:
        self.agent = agent
        self.admin = admin
        self.state = agent.state
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.partial_since = 0.0  # when the first byte of the incomplete line in buf came
        self.last_activity = time.monotonic()
        self.paused_since: float | None = None
        self.tokens = agent.config.burst
        self.token_time = self.last_activity
        self.cred = PeerCred(0, -1, -1)
        self.cgroups: frozenset[str] = frozenset()
        self.closing = False
        self.errors_in_a_row = 0  # bad messages since the last one served (--max-errors)

    # ---- asyncio.Protocol ----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        agent = self.agent
        if not self.admin and len(agent.conns) >= agent.config.max_connections:
            self.state.disconnects["too-many"] += 1
            transport.write(encode(error_message(None, "too many connections to the node agent")))
            transport.close()
            self.closing = True
            return
        agent.conns_of(self.admin).add(self)
        self.state.connections = len(agent.conns)
        self.state.connections_total += 1
        sock = transport.get_extra_info("socket")
        try:
            self.cred = peer_cred(sock)
            self.cgroups = peer_cgroups(self.cred.pid)
        except OSError as exc:
            log.info("peer credentials unavailable: %s", exc)
        transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)

    def connection_lost(self, exc: Exception | None) -> None:
        self.agent.conns_of(self.admin).discard(self)
        self.state.connections = len(self.agent.conns)
        self.buf = b""

    def pause_writing(self) -> None:
        # The peer does not read its replies: stop reading its requests
        # (and stop serving the lines already read: _serve holds them).
        self.paused_since = time.monotonic()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused_since = None
        if self.transport is not None and not self.closing:
            # Not from inside the transport's write callback: serve the held
            # lines (and read again) on the loop's next turn.
            asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        if self.closing or self.paused_since is not None or self.transport is None:
            return
        if self.buf:
            self._serve(time.monotonic(), continuing=True)
        if self.paused_since is None and not self.closing:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        now = time.monotonic()
        self.last_activity = now
        continuing = bool(self.buf)
        self.buf = self.buf + data if self.buf else data
        self._serve(now, continuing)

    def _serve(self, now: float, continuing: bool) -> None:
        """Answer the complete lines in buf, in order, until the replies the
        peer has not read pass the transport's high-water mark (then
        pause_writing has stopped reading): the lines not yet served stay
        in buf until resume_writing.  So a connection holds at most
        WRITE_HIGH + REPLY_FLUSH bytes of replies and one read (256 KiB)
        plus one partial line of requests."""
        data, self.buf = self.buf, b""
        out: list[bytes] = []
        size = 0
        start = 0
        limit = MAX_MESSAGE_BYTES
        while self.paused_since is None:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            if nl + 1 - start > limit:
                self._oversize(out)
                return
            line = data[start:nl]
            start = nl + 1
            if line.strip():
                reply = self.handle_safely(line, now)
                out.append(reply)
                size += len(reply)
                if 0 < self.agent.config.max_errors <= self.errors_in_a_row:
                    self._too_many_errors(out)
                    return
                if size >= REPLY_FLUSH:
                    self._write(out)  # may call pause_writing
                    out, size = [], 0
        self._write(out)
        rest = data[start:] if start else data
        if self.closing or not rest:
            return
        held = self.paused_since is not None and b"\n" in rest
        if not held and len(rest) >= limit:
            # A line can only be valid if its newline arrives within limit bytes.
            self._oversize([])
            return
        # The read timeout runs from a line's first byte: bytes that
        # continue the same line do not restart it.
        if start or not continuing:
            self.partial_since = now
        self.buf = rest

    def _write(self, out: list[bytes]) -> None:
        if out and self.transport is not None and not self.closing:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    # ---- messages -------------------------------------------------------------

    def _too_many_errors(self, out: list[bytes]) -> None:
        """After the reply to the last of --max-errors bad messages in a
        row: one more error, then disconnect (the lines after it are not
        served)."""
        n = self.errors_in_a_row
        out.append(encode(error_message(None, f"{n} bad messages in a row: disconnecting")))
        self.disconnect("errors", b"".join(out))

    def _oversize(self, out: list[bytes]) -> None:
        self.state.rejected["oversize"] += 1
        out.append(encode(error_message(None, f"message longer than {MAX_MESSAGE_BYTES} bytes")))
        self.disconnect("oversize", b"".join(out))

    def disconnect(self, reason: str, last: bytes = b"") -> None:
        if self.closing or self.transport is None:
            return
        self.closing = True
        self.state.disconnects[reason] += 1
        self.buf = b""
        if last:
            self.transport.write(last)
        self.transport.close()

    def _take_token(self, now: float) -> bool:
        rate = self.agent.config.rate
        if rate <= 0:
            return True
        tokens = self.tokens + (now - self.token_time) * rate
        burst = self.agent.config.burst
        if tokens > burst:
            tokens = burst
        self.token_time = now
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True

    def handle_safely(self, line: bytes, now: float) -> bytes:
        """handle(), with any exception it lets out answered as a malformed
        message (an error reply, counted) instead of losing the connection."""
        try:
            return self.handle(line, now)
        except Exception as exc:
            kind = type(exc).__name__
            if kind not in self.agent.logged_errors:
                self.agent.logged_errors.add(kind)
                log.warning("a message could not be handled", exc_info=True)
            return self._refuse("malformed", None, f"message: could not be handled ({kind})")

    def _refuse(self, reason: str, seq: int | None, text: str) -> bytes:
        """The error reply to a message refused for `reason` (counted).  A
        message that is bad in itself (not a label conflict, which depends
        on another container) adds to errors_in_a_row; one over the rate
        limit (not read) does not go through here."""
        self.state.rejected[reason] += 1
        if reason != "conflict":
            self.errors_in_a_row += 1
        return encode(error_message(seq, text))

    def handle(self, line: bytes, now: float) -> bytes:
        state = self.state
        if not self._take_token(now):
            state.rejected["rate"] += 1  # not a bad message: not in errors_in_a_row
            return self.agent.rate_error
        try:
            obj = decode(line)
        except ProtocolError as exc:
            return self._refuse(_classify(exc), None, str(exc))
        raw_seq = obj.get("seq")
        seq = raw_seq if is_int(raw_seq) and 0 <= raw_seq < 2**64 else None
        mtype = obj["type"]
        if self.admin:
            if mtype == "set-limit":
                return self._set_limit(obj, seq)
            return self._refuse("type", seq, f"type={mtype!r}: the admin socket takes 'set-limit'")
        if mtype == "report":
            try:
                report = parse_report(obj)
            except ProtocolError as exc:
                return self._refuse(_classify(exc), seq, str(exc))
            claimed = report.container.cgroup
            seen = claim_matches(claimed, self.cgroups)
            if seen is None:
                # The peer may have moved (or its cgroup was unreadable): look again.
                with contextlib.suppress(OSError):
                    self.cgroups = peer_cgroups(self.cred.pid)
                seen = claim_matches(claimed, self.cgroups)
                if seen is None:
                    return self._refuse(
                        "identity",
                        seq,
                        f"container.cgroup={claimed!r}: the peer (pid {self.cred.pid}) is "
                        f"in cgroup {sorted(self.cgroups)!r}",
                    )
            if seen != claimed:  # keyed by the cgroup the agent read, not the claim
                report = replace(report, container=replace(report.container, cgroup=seen))
            if not self._labels_free(report.container):
                labels = "/".join(report.container.labels)
                return self._refuse(
                    "conflict",
                    seq,
                    f"container: namespace/pod/container {labels!r} "
                    "is reported by another live cgroup",
                )
            churn = state.device_churn(report)
            if churn is not None:
                return self._refuse("devices", seq, churn)
            instr = state.accept_report(report, self.cred, now)
            self.agent.save_state()  # a container that took parked limits, or left
            self.errors_in_a_row = 0
            return encode(ack_message(report.seq, instr))
        if mtype == "set-limit":
            # The reporting socket is mounted into every workload: whatever
            # a peer's uid, limits change only over the admin socket.
            return self._refuse(
                "unauthorized", seq, "set-limit: not on the reporting socket; use the admin socket"
            )
        return self._refuse("type", seq, f"type={mtype!r}: expected 'report' or 'set-limit'")

    def _labels_free(self, cid: ContainerId) -> bool:
        """May cid's labels be reported from its cgroup: no other cgroup
        holds them, or the one that does has no live reporter left (its
        last peer is gone or has left it: a restarted container takes its
        labels over at once), or cid gives no labels (its cgroup names it)."""
        holder = self.state.label_holder(cid)
        if holder is None:
            return True
        if cid.named_by_cgroup:
            # Named by its own (verified) cgroup: a container of another
            # cgroup that took that path as its name gives it up.
            self.state.remove(holder.id.key)
            return True
        try:
            alive = holder.id.cgroup in peer_cgroups(holder.peer.pid)
        except OSError:
            alive = False
        if alive:
            return False
        # A restarted container (a new cgroup): it takes its predecessor's
        # administrator's limits too, when it is of the same pod.
        self.state.remove(holder.id.key, park=time.monotonic())
        return True

    def _set_limit(self, msg: dict[str, Any], seq: int | None) -> bytes:
        state = self.state
        if not is_admin(self.cred):
            return self._refuse(
                "unauthorized", seq, f"set-limit: uid {self.cred.uid} may not change limits"
            )
        try:
            name = msg.get("container")
            if not isinstance(name, str):
                raise ProtocolError(f"container={name!r}: expected a container key")
            device = check_uuid(msg.get("device"), "device")
            if "memory" not in msg and "sm" not in msg:
                raise ProtocolError("memory, sm: give at least one")
            _opt_limit(msg, "memory", 1, 2**64 - 1)
            _opt_limit(msg, "sm", 1, 100)
            key = state.find_container(name)
            if key is None:
                raise ProtocolError(f"container={name!r}: no such container reports here")
            state.set_limit(key, device, msg)
        except ValueError as exc:  # ProtocolError included
            return self._refuse("field", seq, str(exc))
        self.errors_in_a_row = 0
        reply = {**ack_message(seq or 0), "container": key}
        problem = self.agent.save_state()
        if problem is not None:
            # Set all the same (the container gets it), but the admin is told.
            reply["warning"] = f"{problem}: the limit will not survive an agent restart"
        return encode(reply)


class _HttpHandler(BaseHTTPRequestHandler):
    agent: Agent  # set on the subclass made per agent
    # Seconds a client may stall a read or write (StreamRequestHandler sets
    # it on the socket); the subclass made per agent sets --http-timeout.
    timeout = 10.0

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype = self.agent.metrics_payload(self.headers.get("Accept"))
        elif path in ("/status", "/status/"):
            body = json.dumps(self.agent.state.status()).encode()
            ctype = "application/json"
        elif path == "/healthz":
            body, ctype = b"ok\n", "text/plain"
        else:
            self.send_error(404, "try /metrics or /status")
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)


class _HttpServer(ThreadingHTTPServer):
    """One thread per connection, at most MAX_HANDLERS at once (more are
    closed at once), each cut off `deadline` seconds after it was accepted
    however slowly its client trickles the request or reads the reply."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog
    MAX_HANDLERS = 32

    def __init__(self, address: tuple[str, int], handler: Any, deadline: float) -> None:
        self.deadline = deadline
        self.slots = threading.BoundedSemaphore(self.MAX_HANDLERS)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: closed unanswered
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        timer = threading.Timer(self.deadline, _cut_off, (request,))
        timer.daemon = True
        timer.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            timer.cancel()
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away mid-reply (BrokenPipeError, reset): not
        # worth a traceback on stderr.
        log.debug("http: request from %s failed", client_address, exc_info=True)


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


def _cut_off(sock: socket.socket) -> None:
    """End a request past its deadline: its handler's blocked read or write fails."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        from .metrics import AgentCollector, HostGpus  # prometheus_client, pynvml

        self.config = config
        self.state = AgentState(config)
        self.conns: set[Connection] = set()  # on the reporting socket
        self.admin_conns: set[Connection] = set()  # on the admin socket
        self.rate_error = encode(
            error_message(None, f"rate limit exceeded: at most {config.rate:g} messages/s")
        )
        self.gpus = HostGpus()
        self.collector = AgentCollector(
            self.state, self.gpus, legacy=config.legacy_metrics, node=config.node_name
        )
        self.server: asyncio.AbstractServer | None = None
        self.admin_server: asyncio.AbstractServer | None = None
        self.http: ThreadingHTTPServer | None = None
        self.stopping: asyncio.Event | None = None
        self.sweeper: asyncio.Task[None] | None = None
        self.watcher: asyncio.Task[None] | None = None
        self.logged_errors: set[str] = set()  # exception types handle_safely logged
        self.saved_gen = -1  # state.limits_gen last written to the state file
        self.save_problem: str | None = None  # why the last save failed (logged once)

    def conns_of(self, admin: bool) -> set[Connection]:
        return self.admin_conns if admin else self.conns

    def metrics_payload(self, accept: str | None) -> tuple[bytes, str]:
        from .metrics import render

        return render(self.collector, accept)

    # ---- the state file (supervisor/agent_persist.py) ----------------------------

    def load_state(self) -> None:
        """Take back the administrators' limits the state file holds (at
        start, before anything is served).  StateFileError (a RuntimeError):
        the file cannot be read or used; the agent does not start."""
        path = self.config.state_file_path
        problem = state_file_problem(self.config.socket_path, path)
        if problem is not None:
            raise RuntimeError(f"--state-file {problem}")
        entries = read_state(path)
        dropped = self.state.restore_saved(entries, time.monotonic(), time.time())
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
        changed since the last write.  Returns why it could not be written
        (logged once per distinct problem; retried on the next change and
        every sweep), else None."""
        state = self.state
        gen = state.limits_gen
        if gen == self.saved_gen:
            return None
        path = self.config.state_file_path
        try:
            write_state(path, encode_state(state.saved_limits(), time.time()))
        except OSError as exc:
            problem = f"cannot save {path} ({exc.strerror or exc})"
            if problem != self.save_problem:
                log.warning("%s: administrators' limits will not survive a restart", problem)
            self.save_problem = problem
            return problem
        self.saved_gen = gen
        if self.save_problem is not None:
            log.warning("%s saved again", path)
        self.save_problem = None
        return None

    # ---- lifecycle -----------------------------------------------------------

    def _prepare_socket(self) -> None:
        path = Path(self.config.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(path.parent, os.stat(path.parent).st_mode | 0o055)
        self._prepare_context_lock()
        _clear_stale(path)

    def _prepare_admin_socket(self) -> None:
        """The admin socket's directory: the agent's uid only (0700)."""
        admin = self.config.admin_socket_path
        problem = admin_socket_problem(self.config.socket_path, admin)
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
        handler = type("Handler", (_HttpHandler,), {"agent": self, "timeout": cfg.http_timeout})
        try:
            self.http = _HttpServer((cfg.metrics_host, cfg.metrics_port), handler, cfg.http_timeout)
        except (OSError, OverflowError) as exc:
            raise RuntimeError(
                f"--metrics-host/--metrics-port {cfg.metrics_host}:{cfg.metrics_port}: "
                f"{getattr(exc, 'strerror', None) or exc}"
            ) from None
        threading.Thread(target=self.http.serve_forever, name="http", daemon=True).start()
        return int(self.http.server_address[1])

    async def start(self) -> None:
        self.load_state()  # first: a state file it cannot use stops it
        self._prepare_admin_socket()
        self._prepare_socket()
        self.save_state()  # what it restored, less what expired meanwhile
        loop = asyncio.get_running_loop()
        admin = self.config.admin_socket_path
        self.admin_server = await loop.create_unix_server(
            lambda: Connection(self, admin=True), path=admin, backlog=16
        )
        os.chmod(admin, 0o600)  # the agent's uid (and root) only
        self.server = await loop.create_unix_server(
            lambda: Connection(self), path=self.config.socket_path, backlog=1024
        )
        os.chmod(self.config.socket_path, 0o666)  # containers run as any uid
        self.stopping = asyncio.Event()
        self.sweeper = loop.create_task(self._sweeper())
        self.watcher = loop.create_task(self._watch_process_use())

    async def _watch_process_use(self) -> None:
        """Read NVML's per-process utilisation while some container's gate
        measures nothing (no SM limit, whatever its priority: it reports
        0 %, but NVML sees its processes work), or a low-priority container
        reports beside a high-priority one: the figures mark high-priority
        containers active and stand in for the unmeasured containers' SM
        share."""
        period = max(0.05, min(0.5, self.config.active_window / 4))
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            if not self.gpus.available or not self.state.wants_process_use():
                continue
            use = await loop.run_in_executor(None, self.gpus.process_use, period + 0.2)
            self.state.note_process_use(use, peer_cgroups, time.monotonic())

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
        await self.start()
        try:
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
        for path in (self.config.socket_path, self.config.admin_socket_path):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        self.gpus.close()


def run_agent(config: AgentConfig, ready: Any = None) -> None:
    if config.cpu is not None:
        try:
            os.sched_setaffinity(0, {config.cpu})
        except (OSError, OverflowError) as exc:
            raise RuntimeError(
                f"--cpu {config.cpu}: cannot pin the agent there "
                f"({getattr(exc, 'strerror', None) or exc})"
            ) from None
    agent = Agent(config)
    asyncio.run(agent.run(ready))


# ---- admin client ---------------------------------------------------------------


def send_admin(socket_path: str, msg: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """Send one admin message to the agent's admin socket; return its
    (decoded) reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(encode(msg))
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    reply: dict[str, Any] = json.loads(data.splitlines()[0]) if data else {}
    return reply
