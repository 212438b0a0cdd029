"""Reports to the node agent over its Unix socket (supervisor/protocol.py).

Every report interval the reporter sends a `report` built from the
tuner's latest sample and reads the agent's reply: an `ack` carries
instructions, handed to the tuner; an `error` is logged (once per distinct
message).  When the workload has exited it sends a last report with
final=true.

The workload never waits for the agent: everything runs in a daemon
thread, socket operations time out after 1 s, and when the socket is
missing or the agent is down the reporter reconnects with exponential
backoff (0.5 s doubling to 10 s); reports in between are dropped.

A report that fails on a connection used before (the agent may have closed
it, e.g. for idleness, and the send meets EPIPE) is sent again, once, on a
new connection.  Between reports the reporter watches the connection: when
the agent closes it (or the agent crashes) the tuner is told at once
(Tuner.agent_lost: yield flags cleared) and the next report reconnects.
A reply that takes longer than the socket timeout closes the connection
too, but the agent is slow, not gone: its yield flags stand until the
tuner's ack timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..identity import parse_cgroup
from ..protocol import (
    MAX_MESSAGE_BYTES,
    ContainerId,
    DeviceReport,
    ProtocolError,
    Report,
    decode,
    encode,
    parse_ack,
    report_message,
)
from .tuner import Sample, Tuner

log = logging.getLogger("gpuvisor.run")

SOCKET_TIMEOUT_S = 1.0
BACKOFF_START_S = 0.5
BACKOFF_CAP_S = 10.0
LABEL_MAX = 253

# Downward-API variables for the container's labels, first match wins.
POD_VARS = ("POD_NAME", "KUBERNETES_POD_NAME", "HAMI_POD_NAME")
NAMESPACE_VARS = ("POD_NAMESPACE", "KUBERNETES_POD_NAMESPACE", "HAMI_POD_NAMESPACE")
CONTAINER_VARS = ("CONTAINER_NAME", "KUBERNETES_CONTAINER_NAME", "HAMI_CONTAINER_NAME")


def own_cgroup(proc_cgroup: str = "/proc/self/cgroup") -> str:
    """This process's cgroup, by the agent's own rule (identity.parse_cgroup)."""
    try:
        return parse_cgroup(Path(proc_cgroup).read_text())
    except OSError:
        return "/"


def _label(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        # Bytes that are not UTF-8 become U+FFFD: as lone surrogates they
        # would reach the agent as text no UTF-8 page (/metrics) can carry.
        value = env.get(name, "").encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        value = value.strip()
        if value:
            return value[:LABEL_MAX]
    return None


def container_identity(env: Mapping[str, str] | None = None) -> ContainerId:
    env = os.environ if env is None else env
    return ContainerId(
        cgroup=own_cgroup()[:4096],
        pod=_label(env, POD_VARS),
        namespace=_label(env, NAMESPACE_VARS),
        container=_label(env, CONTAINER_VARS),
    )


class _Baseline:
    """busy/wait counters of a device in the sample of the previous report
    (taken at ts), and what that report said."""

    def __init__(
        self, busy: int, wait: int, ts: float, share: float = 0.0, throttled: bool = False
    ) -> None:
        self.busy = busy
        self.wait = wait
        self.ts = ts
        self.share = share
        self.throttled = throttled


class Reporter:
    def __init__(
        self,
        socket_path: str,
        interval: float,
        tuner: Tuner,
        container: ContainerId,
        policy: str,
        priority: int,
        clock: Callable[[], float] = time.monotonic,
        baseline: Sample | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.interval = interval
        self.tuner = tuner
        self.container = container
        self.policy = policy
        self.priority = priority
        self._clock = clock
        self._sock: socket.socket | None = None
        self._buf = b""
        self._seq = 0
        # When the latest sample a report used was taken (time.monotonic()).
        self._last_ts = baseline.ts if baseline is not None else clock()
        # The region's counters are cumulative and the region may outlive a
        # supervisor: the first report counts from baseline (read before
        # the workload started), not from the region's creation.
        self._base: dict[str, _Baseline] = {
            d.usage.uuid: _Baseline(d.sm.busy_ns, d.sm.wait_ns, self._last_ts)
            for d in (baseline.devices if baseline is not None else [])
        }
        self._backoff = BACKOFF_START_S
        self._logged: set[str] = set()
        self._connected_once = False
        self._sock_used = False  # the connection has carried a report and its reply
        # Reports written to the socket; acks for them taken (their
        # instructions handed to the tuner); acks for them refused whole
        # for a bad field (logged, nothing applied: see protocol.md).  An
        # ack for another seq counts in neither.
        self.sent = 0
        self.acked = 0
        self.refused_acks = 0
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # stop() wakes the loop's select
        self._thread = threading.Thread(target=self._run, name="gpuvisor-reporter", daemon=True)

    # ---- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, final_sample: Sample | None = None) -> None:
        """Stop the loop and send the final report (bounded: a few seconds at most)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(SOCKET_TIMEOUT_S * 2 + 0.5)
        try:
            if not self.send(self.build(final_sample or self.tuner.sample(), final=True)):
                log.debug("final report not delivered: the node agent is unreachable")
        except Exception as exc:
            self._log_once("final report", exc)
        self._close()
        if not self._thread.is_alive() and self._wake_r >= 0:
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    # ---- helpers ----------------------------------------------------------------

    def _log_once(self, what: str, exc: object) -> None:
        key = f"{what}: {exc}"
        if key not in self._logged:
            self._logged.add(key)
            log.warning("%s", key)

    def _close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None
        self._buf = b""
        self._sock_used = False

    def _connect(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(SOCKET_TIMEOUT_S)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            log.debug("node agent at %s not reachable: %s", self.socket_path, exc)
            return False
        self._sock = sock
        if not self._connected_once:
            log.info("connected to the node agent at %s", self.socket_path)
            self._connected_once = True
        return True

    def _readline(self) -> bytes:
        assert self._sock is not None
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_MESSAGE_BYTES:
                raise ProtocolError(f"reply longer than {MAX_MESSAGE_BYTES} bytes")
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError("the node agent closed the connection")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def build(self, sample: Sample, final: bool = False) -> Report:
        """A report from sample; advances the per-interval baselines.

        A device's share is its GPU time between the samples two reports
        used over the time between those samples (the tuner takes them on
        its own clock); a report whose sample is not newer repeats it."""
        devices = []
        for d in sample.devices:
            # A device missing from the previous sample entered the region
            # since: its counters started at 0 after that sample.
            base = self._base.get(d.usage.uuid) or _Baseline(0, 0, self._last_ts)
            elapsed_ns = (sample.ts - base.ts) * 1e9
            if elapsed_ns > 0:
                busy = max(0, d.sm.busy_ns - base.busy)
                share = min(100.0, max(0.0, busy / elapsed_ns * 100))
                throttled = d.sm.wait_ns > base.wait
                self._base[d.usage.uuid] = _Baseline(
                    d.sm.busy_ns, d.sm.wait_ns, sample.ts, share, throttled
                )
            else:
                share, throttled = base.share, base.throttled
            devices.append(
                DeviceReport(
                    uuid=d.usage.uuid,
                    index=d.usage.index,
                    memory_used=d.usage.used,
                    memory_limit=d.usage.limit,
                    memory_physical=d.usage.physical_total,
                    oom_refusals=d.usage.oom_count,
                    sm_share=round(share, 3),
                    sm_limit=d.sm.limit if d.sm.limit and 1 <= d.sm.limit <= 100 else None,
                    sm_enforced=min(100.0, max(0.0, d.sm.share)),
                    throttled=throttled,
                    memory_spilled=min(d.usage.spilled, d.usage.used),
                )
            )
        self._last_ts = max(self._last_ts, sample.ts)
        self._seq += 1
        return Report(
            seq=self._seq,
            ts=time.time(),
            container=self.container,
            policy=self.policy,
            priority=self.priority,
            pids=[p for p in sample.pids if 1 <= p < 2**31],
            devices=devices,
            final=final,
            interval=self.interval,
            visible=None if sample.visible is None else list(sample.visible),
        )

    def send(self, report: Report) -> bool:
        """Send one report, connecting first when there is no connection,
        and handle the reply.  A connection the agent closed since the last
        report (the send or the read meets EPIPE, a reset or EOF) is
        replaced and the report sent again, once.  True when a reply came;
        False (the connection closed) when the agent cannot be reached.
        Raises ProtocolError for a bad reply (the connection is closed)."""
        for _ in range(2):
            if self._sock is None and not self._connect():
                return False
            reused = self._sock_used
            try:
                self._exchange(report)
                self._sock_used = True
                return True
            except ConnectionError as exc:
                self._close()
                if not reused:
                    log.debug("report failed on a new connection: %s", exc)
                    return False
                log.debug("report failed on a reused connection (%s): reconnecting", exc)
            except (OSError, ProtocolError):
                self._close()
                raise
        return False

    def _exchange(self, report: Report) -> None:
        """Send one report and handle the reply; raises on a broken connection."""
        assert self._sock is not None
        self._sock.sendall(encode(report_message(report)))
        self.sent += 1
        try:
            reply = decode(self._readline())
        except ProtocolError as exc:
            self._log_once("bad reply from the node agent", exc)
            raise
        kind = reply.get("type")
        if kind == "ack":
            if reply.get("seq") != report.seq:
                self._log_once("node agent", f"ack for seq {reply.get('seq')!r}, sent {report.seq}")
                return
            try:
                instructions = parse_ack(reply)
            except ProtocolError as exc:
                self.refused_acks += 1
                self._log_once("bad ack from the node agent", exc)
                return
            self.acked += 1
            self.tuner.submit(instructions)
        elif kind == "error":
            self._log_once("node agent refused a report", reply.get("error"))
        else:
            self._log_once("node agent", f"unexpected reply type {kind!r}")

    # ---- the loop ---------------------------------------------------------------

    def _lost(self, why: str) -> None:
        """The connection is gone: close it; the agent's view lapses now."""
        self._close()
        self.tuner.agent_lost(why)

    def _wait(self, until: float) -> bool:
        """Sleep until `until` (clock time) or stop(); False when the agent
        closed the connection meanwhile (EOF, or a message nobody asked
        for: the agent says why before it closes)."""
        fds: list[Any] = [self._wake_r]
        if self._sock is not None:
            fds.append(self._sock)
        readable, _, _ = select.select(fds, [], [], max(0.0, until - self._clock()))
        return self._sock is None or self._sock not in readable

    def _run(self) -> None:
        next_connect = self._clock()
        next_report = self._clock() + self.interval
        while not self._stop.is_set():
            now = self._clock()
            try:
                if self._sock is None and now >= next_connect and not self._connect():
                    next_connect = now + self._backoff
                    self._backoff = min(BACKOFF_CAP_S, self._backoff * 2)
                if now >= next_report:
                    next_report = max(next_report + self.interval, now)
                    if self._sock is not None:
                        slow = False
                        try:
                            delivered = self.send(self.build(self.tuner.sample()))
                        except TimeoutError as exc:
                            # The agent is slow (starved of CPU, say), not
                            # gone: the connection is closed, as its reply
                            # may still come, but the agent's view stands
                            # until the ack timeout lets it lapse.
                            log.debug(
                                "no reply from the node agent within %g s: %s",
                                SOCKET_TIMEOUT_S,
                                exc,
                            )
                            delivered, slow = False, True
                        except (OSError, ProtocolError) as exc:
                            log.debug("report failed: %s", exc)
                            delivered = False
                        if delivered:
                            self._backoff = BACKOFF_START_S
                        else:
                            if not slow:
                                self._lost("the node agent stopped answering")
                            next_connect = self._clock() + self._backoff
                            self._backoff = min(BACKOFF_CAP_S, self._backoff * 2)
                    else:
                        self.build(self.tuner.sample())  # dropped; keeps shares per interval
                wake = next_report if self._sock is not None else min(next_report, next_connect)
                if not self._wait(wake):
                    self._lost("the node agent closed the connection")
                    next_connect = next_report  # reconnect for the next report
            except Exception as exc:
                self._log_once("reporting failed", exc)
                self._close()
                self._stop.wait(min(self.interval, BACKOFF_CAP_S))
