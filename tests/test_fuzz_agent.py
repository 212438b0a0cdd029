"""Fuzzing the node agent's boundaries (issue 36, "Also"): the node socket
and the HTTP port get what the hostile-container review threw at them,
and more of it, from a seeded generator (GPUVISOR_FUZZ_SEED, default
36: a failure names its seed and reruns the same way).

Thrown at the node socket, from many connections at once: random binary
lines (NUL, invalid UTF-8, control characters), JSON that is not a report
(deep nesting, huge numbers, NaN, a byte-order mark, other types and
versions), valid reports with one field mutated to a random value,
reports claiming another cgroup or a neighbour's labels, lines over the
size limit, blank-line floods, bursts past the rate, and many connections
held idle.  At the HTTP port: random bytes, half requests left hanging,
and idle clients.

Pass criteria, checked at the end of each round and at the end:
- the agent stays up;
- its memory stays bounded: RSS grows by less than RSS_GROWTH_MAX over
  the run (the agent's buffers are bounded per connection and the
  connections per cgroup);
- another container's data is unchanged: a well-behaved container that
  reports the same figures throughout keeps its acks and its /status
  entry (figures, labels, priority) as it reported them;
- every scrape is answered: /metrics from another client address every
  0.1 s throughout, each answered 200 within 5 s.
- no forged priority pauses the victim: the attackers claim priority 0
  and full use of the victim's GPU (the simulated node's device 0, which
  none of their processes uses; the agent reads the simulated NVML), and
  every ack of the victim says not to yield.

Bounded: FUZZ_SECONDS of throwing (12 s by default), well inside a minute.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tests.helpers import SimNode, run_py
from tests.test_agent import (  # noqa: F401 (sock_path is a fixture)
    GPU_B,
    AgentProc,
    Client,
    device,
    sock_path,
)

SEED = int(os.environ.get("GPUVISOR_FUZZ_SEED", "36"))
FUZZ_SECONDS = float(os.environ.get("GPUVISOR_FUZZ_SECONDS", "12"))
ROUNDS = 3
RSS_GROWTH_MAX = 48 * 2**20
ATTACKERS = 6  # threads throwing at the node socket at once
# Node-socket connections held open and silent.  The test's clients share
# one cgroup (the test's), which holds at most 64 connections
# (--max-connections-per-cgroup): room is left for the attackers.
IDLE_CONNECTIONS = 40

MiB = 2**20

UUID0 = """
import pynvml
pynvml.nvmlInit()
print(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0)))
"""


def _random_value(rng: random.Random) -> Any:
    choice = rng.randrange(12)
    if choice == 0:
        return None
    if choice == 1:
        return rng.choice([True, False])
    if choice == 2:
        return rng.randint(-(2**70), 2**70)
    if choice == 3:
        return rng.uniform(-1e300, 1e300)
    if choice == 4:
        return "".join(chr(rng.randrange(0x110000 - 0x800)) for _ in range(rng.randrange(40)))
    if choice == 5:
        return "x" * rng.randrange(5000)
    if choice == 6:
        return [_random_value(rng) for _ in range(rng.randrange(4))]
    if choice == 7:
        return {str(rng.random()): rng.random() for _ in range(rng.randrange(4))}
    if choice == 8:
        return "GPU-" + "".join(rng.choice("0123456789abcdef-") for _ in range(36))
    if choice == 9:
        return rng.choice(["\r", "\x00", "\x1b[2J", "\u2028", "\u202e", "\ud800"])
    if choice == 10:
        return rng.randint(0, 2**64 + 5)
    return rng.choice([0, 1, -1, 100, 101, 1e308, -0.0])


def _mutated_report(rng: random.Random, base: dict[str, Any]) -> dict[str, Any]:
    msg: dict[str, Any] = json.loads(json.dumps(base))
    for _ in range(rng.randint(1, 3)):
        target: Any = msg
        devices = msg.get("devices")
        if rng.random() < 0.3 and isinstance(msg.get("container"), dict):
            target = msg["container"]
        elif rng.random() < 0.4 and isinstance(devices, list) and devices:
            target = devices[0] if isinstance(devices[0], dict) else msg
        key = rng.choice([*list(target), "extra", "final", "interval", "visible"])
        if rng.random() < 0.15:
            target.pop(key, None)
        else:
            target[key] = _random_value(rng)
    return msg


def _line(rng: random.Random, base: dict[str, Any], victim: dict[str, Any]) -> bytes:
    """One hostile line for the node socket (ending in a newline)."""
    kind = rng.randrange(14)
    if kind == 0:
        return (
            bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))).replace(b"\n", b" ")
            + b"\n"
        )
    if kind == 1:
        return b"[" * rng.randrange(100, 5000) + b"\n"
    if kind == 2:
        return b'{"v":1,"type":"report","seq":' + b"9" * rng.randrange(10, 6000) + b"}\n"
    if kind == 3:
        return rng.choice([b'{"v":NaN,"type":"report"}', b"\xef\xbb\xbf{}", b"null", b"[]", b'"'])
    if kind == 4:
        return b"\n" * rng.randrange(1, 400)
    if kind == 5:
        return json.dumps({"v": rng.randrange(5), "type": _random_value(rng)}).encode() + b"\n"
    if kind == 6:
        # Another cgroup claimed: identity.
        msg = json.loads(json.dumps(base))
        msg["container"]["cgroup"] = rng.choice(["/kubepods/other", "/..", "/x/../y", "x"])
        return json.dumps(msg).encode() + b"\n"
    if kind == 7:
        return b"x" * rng.randrange(65537, 80000) + b"\n"  # oversize: disconnects
    if kind == 8:
        return json.dumps({"v": 1, "type": "set-limit", "container": "x", "sm": 1}).encode() + b"\n"
    if kind == 9:
        # Priority 0 and full use claimed on the victim's GPU (defect 4).
        msg = json.loads(json.dumps(base))
        msg["priority"] = 0
        msg["container"]["pod"] = f"high-{rng.randrange(100)}"
        msg["devices"][0].update(uuid=victim["devices"][0]["uuid"], sm_share=100.0, sm_limit=None)
        return json.dumps(msg).encode() + b"\n"
    try:
        return json.dumps(_mutated_report(rng, base)).encode("utf-8", "surrogatepass") + b"\n"
    except (ValueError, OverflowError):
        return b"{}\n"


def _attacker(
    sock: str, seed: int, until: float, base: dict[str, Any], victim: dict[str, Any]
) -> int:
    """Throw lines at the node socket until `until`, reconnecting when cut
    off; reads what comes back without waiting for it.  Returns lines sent."""
    rng = random.Random(seed)
    sent = 0
    while time.monotonic() < until:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                s.connect(sock)
                for _ in range(rng.randrange(1, 60)):
                    if time.monotonic() >= until:
                        break
                    data = b"".join(_line(rng, base, victim) for _ in range(rng.randrange(1, 8)))
                    if rng.random() < 0.1:  # a partial line, finished or not
                        cut = rng.randrange(len(data))
                        s.sendall(data[:cut])
                        time.sleep(rng.random() * 0.05)
                        data = data[cut:]
                    s.sendall(data)
                    sent += 1
                    s.setblocking(False)
                    try:
                        while s.recv(65536):
                            pass
                    except (BlockingIOError, InterruptedError):
                        pass
                    s.settimeout(0.5)
        except OSError:
            time.sleep(0.01)  # cut off (oversize, errors, rate): come back
    return sent


def _http_attacker(port: int, seed: int, until: float) -> None:
    """Random bytes, half requests and idle clients at the HTTP port, all
    from 127.0.0.1 (the scraper comes from 127.0.0.2)."""
    rng = random.Random(seed)
    held: list[socket.socket] = []
    while time.monotonic() < until:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:
            time.sleep(0.01)
            continue
        kind = rng.randrange(4)
        try:
            if kind == 0:
                s.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000))))
            elif kind == 1:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * rng.randrange(9000))
            elif kind == 2:
                s.sendall(b"GET /" + b"%" * rng.randrange(100) + b" HTTP/1.0\r\n\r\n")
        except OSError:
            pass
        held.append(s)
        if len(held) > 40:
            held.pop(0).close()
        time.sleep(rng.random() * 0.02)
    for s in held:
        s.close()


def _scrape(port: int) -> bool:
    try:
        with socket.create_connection(
            ("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0)
        ) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.0 200")
    except OSError:
        return False


def _bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_the_agent_survives_what_the_review_threw(node: SimNode, sock_path: str) -> None:  # noqa: F811
    rng = random.Random(SEED)
    # The test's clients share the test's cgroup, which a node's container
    # would not: room for every label set the attackers make up, so that
    # none replaces the victim's entry (a container's own label sets only
    # replace each other).
    # The agent reads the simulated NVML: the victim's GPU is the node's
    # device 0, on which the attackers claim priority 0 and full use while
    # none of their processes uses it (defect 4), so the per-process
    # reading runs throughout.
    gpu = run_py(UUID0, node.env).stdout.strip()
    with AgentProc(sock_path, "--max-containers-per-cgroup", "100000", env=node.env) as agent:
        victim = Client(sock_path, pod="victim", namespace="prod", priority=1)
        mine = device(uuid=gpu, used=3 * MiB, share=12.5, sm_limit=25)
        assert victim.report(mine)["type"] == "ack"
        before = _victim_entry(agent.status())
        rss0 = agent.rss()
        victim_msg = victim.report_msg(mine)
        attacker = Client(sock_path, pod="attacker", namespace="prod", priority=1)
        base = attacker.report_msg(replace(mine, uuid=GPU_B))

        idle: list[socket.socket] = []
        for _ in range(IDLE_CONNECTIONS):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sock_path)
            idle.append(s)

        scrapes: list[bool] = []
        stop = threading.Event()

        def scraper() -> None:
            while not stop.is_set():
                scrapes.append(_scrape(agent.port))
                time.sleep(0.1)

        scraping = threading.Thread(target=scraper, daemon=True)
        scraping.start()
        sent = 0
        try:
            for r in range(ROUNDS):
                until = time.monotonic() + FUZZ_SECONDS / ROUNDS
                workers = [
                    _in_thread(
                        _bind(_attacker, sock_path, rng.randrange(2**32), until, base, victim_msg)
                    )
                    for _ in range(ATTACKERS)
                ]
                http, _ = _in_thread(_bind(_http_attacker, agent.port, rng.randrange(2**32), until))
                while time.monotonic() < until:
                    ack = victim.report(mine)
                    assert ack["type"] == "ack", (SEED, r, ack)
                    assert ack["yield"] == {gpu: False}, (SEED, r, ack)
                    time.sleep(0.2)
                for t, out in workers:
                    t.join(30)
                    sent += out[0] if out else 0
                http.join(30)
                assert agent.proc is not None
                assert agent.proc.poll() is None, (SEED, r)
                assert _victim_entry(agent.status()) == before, (SEED, r)
        finally:
            stop.set()
            scraping.join(10)
            for s in idle:
                s.close()
        growth = agent.rss() - rss0
        print(
            f"seed {SEED}: {sent} batches thrown, {len(scrapes)} scrapes, "
            f"RSS {rss0 / MiB:.1f} MiB + {growth / MiB:.1f} MiB"
        )
        assert scrapes
        assert all(scrapes), (SEED, scrapes.count(False), len(scrapes))
        assert growth < RSS_GROWTH_MAX, (SEED, growth)
        assert sent > ATTACKERS * ROUNDS, sent
        st = agent.status()
        assert _victim_entry(st) == before
        rejected = st["agent"]["rejected_reports_total"]
        for reason in ("malformed", "version", "field", "type", "identity", "oversize"):
            assert rejected[reason], (reason, rejected)
        assert st["agent"]["disconnects_total"]["oversize"], st["agent"]["disconnects_total"]
        victim.close()
        attacker.close()


def _victim_entry(status: dict[str, Any]) -> dict[str, Any]:
    """What /status says of the victim that its reports decide (and its yields)."""
    (c,) = [c for c in status["containers"] if c["container"]["pod"] == "victim"]
    keep = ("memory_used", "memory_limit", "sm_limit", "uuid", "yield")
    return {
        "container": c["container"],
        "priority": c["priority"],
        "policy": c["policy"],
        "devices": [{k: d[k] for k in keep} for d in c["devices"]],
    }
