"""One connection to the node agent (Connection): a supervisor's on the
reporting socket, or an administrator's on the admin socket (set-limit only).

It reads the lines of supervisor/protocol.py, answers them in order, and
holds the defences against bad clients that server.py lists (line
length, rate, unread replies, read and idle timeouts, identity, errors in a
row).  Agent (server.py) accepts the connections and sweeps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import Any, Protocol

from ..identity import (
    PeerCred,
    cgroup_exists,
    claim_matches,
    is_admin,
    peer_cgroups,
    peer_cred,
)
from ..protocol import (
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
from .config import AgentConfig
from .records import cgroup_scope, is_region_container
from .state import MAX_LABEL_SCOPES, MAX_SCOPE_LABELS, AgentState


class Server(Protocol):
    """What a connection asks of the agent that accepted it (server.Agent),
    which passes itself in."""

    config: AgentConfig
    state: AgentState
    conns: set[Connection]  # on the reporting socket
    logged_errors: set[str]  # exception types already logged
    rate_error: bytes  # the encoded reply to a client over its rate

    def conns_of(self, admin: bool) -> set[Connection]: ...

    def save_state(self) -> str | None: ...


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

    def __init__(self, agent: Server, admin: bool = False) -> None:
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
        sock = transport.get_extra_info("socket")
        try:
            self.cred = peer_cred(sock)
            self.cgroups = peer_cgroups(self.cred.pid)
        except OSError as exc:
            log.info("peer credentials unavailable: %s", exc)
        if not self.admin:
            # A share per peer cgroup (its process's, as the agent reads it:
            # a container cannot choose it), so that one container holding
            # connections open locks only itself out.
            share = agent.config.max_connections_per_cgroup
            held = sum(1 for c in agent.conns if c.cgroups == self.cgroups)
            if held >= share:
                self.state.disconnects["too-many"] += 1
                transport.write(
                    encode(
                        error_message(
                            None,
                            f"too many connections from cgroup {sorted(self.cgroups)!r}: "
                            f"at most {share} (--max-connections-per-cgroup)",
                        )
                    )
                )
                transport.close()
                self.closing = True
                return
        if (
            not self.admin
            and len(agent.conns) >= agent.config.max_connections
            and not self._take_from_the_greediest()
        ):
            self.state.disconnects["too-many"] += 1
            transport.write(encode(error_message(None, "too many connections to the node agent")))
            transport.close()
            self.closing = True
            return
        agent.conns_of(self.admin).add(self)
        self.state.connections = len(agent.conns)
        self.state.connections_total += 1
        transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)

    def _take_from_the_greediest(self) -> bool:
        """With every connection of --max-connections taken: close the
        least recently active connection of the cgroup holding the most,
        if that cgroup holds more than this peer's does (so it is never
        this peer's own), and say so.  The global pool is then one
        cgroup's only while no other wants a connection: cgroups filling
        it together (each within its --max-connections-per-cgroup share)
        lock out no other, they give up connections to it."""
        held: dict[frozenset[str], list[Connection]] = {}
        for c in self.agent.conns:
            if not c.closing:
                held.setdefault(c.cgroups, []).append(c)
        if not held:
            return False
        greedy = max(held.values(), key=len)
        if len(greedy) <= len(held.get(self.cgroups, [])) + 1:
            return False
        victim = min(greedy, key=lambda c: c.last_activity)
        victim.disconnect(
            "too-many",
            encode(
                error_message(
                    None,
                    f"too many connections to the node agent: cgroup {sorted(victim.cgroups)!r} "
                    "holds the most, and gives one up to another",
                )
            ),
        )
        return True

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
            if not line.strip():
                # Blank: no reply, but not free either (a flood of them
                # slowed the agent for everyone): it takes one of the peer's
                # messages, and past its rate it is a bad message in a row.
                # It does not keep an idle peer connected.
                if not self._take_token(now):
                    self.state.rejected["rate"] += 1
                    self.errors_in_a_row += 1
                    if 0 < self.agent.config.max_errors <= self.errors_in_a_row:
                        self._too_many_errors(out)
                        return
                continue
            self.last_activity = now
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
        if not cid.named_by_cgroup and not self._scope_may_hold(cid):
            return False
        holder = self.state.label_holder(cid)
        if holder is None:
            return True
        if cid.named_by_cgroup:
            # Named by its own (verified) cgroup: a container of another
            # cgroup that took that path as its name gives it up.
            self.state.remove(holder.id.key)
            return True
        if is_region_container(holder.id):
            return False  # named by its directory on the host (region_dir.py)
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

    def _scope_may_hold(self, cid: ContainerId) -> bool:
        """Labels are bound to the scope (the pod's cgroup) of the first
        verified cgroup that reported them, for as long as that cgroup
        exists: a container of another pod never takes them, not even
        while the owner's reporter is gone (every container restart)."""
        state = self.state
        scopes = state.label_scopes
        scope = cgroup_scope(cid.cgroup)
        bound = scopes.get(cid.labels)
        if bound is not None and bound != scope:
            if cgroup_exists(bound):
                return False
            state.unbind_scope(cid.labels)  # that pod is gone: the name is free again
        if bound != scope:
            own = state.scope_labels.get(scope, {})
            if len(own) >= MAX_SCOPE_LABELS:
                # One pod making up names forgets its own oldest free one,
                # never another pod's (nor fills the table for them).
                for labels in list(own):
                    if state.label_holder_key(labels) is None:
                        state.unbind_scope(labels)
                        break
                else:
                    return False  # every one held by a live container of its own
            if len(scopes) >= MAX_LABEL_SCOPES:
                for labels, other in list(scopes.items()):
                    if not cgroup_exists(other):
                        state.unbind_scope(labels)
            if len(scopes) >= MAX_LABEL_SCOPES:
                return False  # fail closed: more pods than a node runs
            state.bind_scope(cid.labels, scope)
        else:
            mine = state.scope_labels.get(scope)
            if mine is not None and cid.labels in mine:
                mine[cid.labels] = mine.pop(cid.labels)  # most recent last
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
