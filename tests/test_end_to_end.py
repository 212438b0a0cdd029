"""End to end on the simulator: a node agent and two supervised containers.

Each container is `gpuvisor run` (its own region file, limits and pod labels)
around a cuda-python workload that allocates memory and launches kernels.
The agent's /metrics must show each container's memory and limits, under
gpuvisor's and HAMi's names, within 2 s of the workload allocating; the
agent's view of the node must steer the SM policies that need it
(burst-share giving back, a low-priority container yielding), measured
through NVML's per-process utilisation.
"""

from __future__ import annotations

import os
import select
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import CLI, CU_SPIN_PRELUDE, REPO_ROOT, SimNode, shares_over
from tests.test_agent import AgentProc, find, set_limit, sock_path, wait_for  # noqa: F401

GiB = 1 << 30

# These tests measure shares of a device kept busy by launching processes,
# several per test: with `make test` (--dist loadgroup) they run one after
# another on one worker, so they do not starve each other's launchers of
# CPU on a 2-core machine (A alone read 53 % instead of about 100 % once
# when they ran side by side).
pytestmark = pytest.mark.xdist_group("e2e-shares")

WORKLOAD = (
    CU_SPIN_PRELUDE
    + """
import sys, time
held = chk(cu.cuMemAlloc(int(sys.argv[1]) * 2**20))
print("allocated", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    launch(500)
chk(cu.cuStreamSynchronize(s))
"""
)


def supervised(
    node: SimNode,
    sock: str,
    region: Path,
    pod: str,
    memory: str,
    cores: str,
    mib: int,
    seconds: float = 4,
) -> subprocess.Popen[str]:
    env = dict(node.env, POD_NAME=pod, POD_NAMESPACE="e2e", CONTAINER_NAME="main")
    return subprocess.Popen(
        [
            *CLI,
            "run",
            "--memory",
            memory,
            "--cores",
            cores,
            "--socket",
            sock,
            "--region",
            str(region),
            "--report-interval",
            "0.5",
            "--",
            sys.executable,
            "-c",
            textwrap.dedent(WORKLOAD),
            str(mib),
            str(seconds),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )


def memory_limit(agent: AgentProc, pod: str) -> list[float]:
    """The agent's gpuvisor_container_memory_limit_bytes of a pod's container."""
    return find(agent.metrics(), "gpuvisor_container_memory_limit_bytes", podname=pod)


def test_agent_sees_two_supervised_containers(node: SimNode, sock_path: str) -> None:  # noqa: F811
    with AgentProc(sock_path, env=node.env) as agent:
        a = supervised(node, sock_path, node.dir / "a.shr", "pod-a", "4g", "30", 1024)
        b = supervised(node, sock_path, node.dir / "b.shr", "pod-b", "2g", "50", 512)
        try:
            for p in (a, b):
                assert p.stdout is not None
                assert p.stdout.readline().strip() == "allocated"
            t0 = time.monotonic()

            def both_reported() -> bool:
                m = agent.metrics()
                return all(
                    find(m, "gpuvisor_container_memory_used_bytes", podname=pod)
                    and find(m, "gpuvisor_container_memory_used_bytes", podname=pod)[0] >= want
                    for pod, want in (("pod-a", 1 * GiB), ("pod-b", GiB // 2))
                )

            assert wait_for(both_reported, timeout=2.0), agent.get("/metrics")
            seen_after = time.monotonic() - t0
            m = agent.metrics()
            for pod, used, limit, sm in (
                ("pod-a", 1 * GiB, 4 * GiB, 0.3),
                ("pod-b", GiB // 2, 2 * GiB, 0.5),
            ):
                got = find(m, "gpuvisor_container_memory_used_bytes", podname=pod)[0]
                assert used <= got < used + 64 * 2**20  # + the context
                assert find(m, "gpuvisor_container_memory_limit_bytes", podname=pod) == [limit]
                assert find(m, "gpuvisor_container_sm_limit_ratio", podname=pod) == [sm]
                assert find(m, "hami_vgpu_memory_limit_bytes", pod=pod) == [limit]
                assert find(m, "hami_vgpu_memory_used_bytes", pod=pod)[0] == got
            print(f"both containers in /metrics {seen_after:.2f} s after allocating")
        finally:
            outs = [p.communicate(timeout=60) for p in (a, b)]
        for p, (_, err) in zip((a, b), outs, strict=True):
            assert p.returncode == 0, err
        # Final reports remove the containers.
        assert wait_for(
            lambda: not find(agent.metrics(), "gpuvisor_container_memory_used_bytes"), timeout=2.0
        )


SPIN = (
    CU_SPIN_PRELUDE
    + """
import sys, time
launch(1000)
print("spinning", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    launch(1000)
chk(cu.cuStreamSynchronize(s))
"""
)


def started(p: subprocess.Popen[str], timeout: float = 60.0) -> None:
    """Until spinning()'s workload has launched its first kernel: its start
    (Python, CUDA init, under gpuvisor run) took over 2 s on a loaded 2-core
    machine, so a reading after a fixed sleep caught none or part of it."""
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    assert ready, f"no kernel within {timeout} s"
    line = p.stdout.readline().strip()
    assert line == "spinning", (line, p.poll())


def spinning(
    node: SimNode, sock: str, name: str, args: list[str], seconds: float
) -> subprocess.Popen[str]:
    """A supervised container (pod `name`) launching 1 ms kernels for `seconds`
    after its first launch (see started())."""
    return subprocess.Popen(
        [
            *CLI,
            "run",
            *args,
            "--socket",
            sock,
            "--region",
            str(node.dir / f"{name}.shr"),
            "--report-interval",
            "0.2",
            "--",
            sys.executable,
            "-c",
            textwrap.dedent(SPIN),
            str(seconds),
        ],
        env=dict(node.env, POD_NAME=name),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )


def shares_alone_then_both(
    node: SimNode,
    sock: str,
    first: tuple[str, list[str]],
    second: tuple[str, list[str]],
    second_seconds: float,
) -> tuple[dict[str, int], dict[str, int]]:
    """Under the node agent, `first` (a container's name and its `gpuvisor
    run` options) spins alone; NVML's shares over 1 s after 1 s.  Then
    `second` spins for second_seconds; the shares over 1.5 s, 2.5 s after
    it started (1 s is the goal, which make bench-sm measures; a loaded
    2-core CI machine delays reports and acks).  first outlives the last
    reading however slowly second starts (a finished first would read as a
    share of 0 beside it); it is stopped after it."""
    with AgentProc(sock, env=node.env):
        p1 = spinning(node, sock, first[0], first[1], 60.0)
        try:
            started(p1)
            time.sleep(1.0)
            alone = shares_over(node, 1.0)
            p2 = spinning(node, sock, second[0], second[1], second_seconds)
            started(p2)
            time.sleep(2.5)
            both = shares_over(node, 1.5)
            p2.communicate(timeout=60)
        finally:
            p1.terminate()
            p1.communicate(timeout=60)
    return alone, both


def test_burst_share_gives_back_to_a_starved_container_via_the_agent(
    node: SimNode,
    sock_path: str,  # noqa: F811
) -> None:
    """A (burst-share, 10 %) alone takes the idle GPU.  B (fixed-share, 90 %)
    starts: the agent tells A that B claims 90 %, so A drops to its 10 %
    and B gets its 90 %, although B's own use starts low."""
    alone, both = shares_alone_then_both(
        node,
        sock_path,
        ("a", ["--cores", "10", "--policy", "burst-share"]),
        ("b", ["--cores", "90"]),
        5.0,
    )
    (a_pid,) = alone
    b_pid = next(p for p in both if p != a_pid)
    print(f"A alone {alone[a_pid]} %, then A {both.get(a_pid)} % and B {both[b_pid]} %")
    assert alone[a_pid] >= 80
    assert both.get(a_pid, 0) <= 15
    # B's bound is looser than A's: under a loaded full suite on 2 cores B's
    # launching process is sometimes not scheduled in time to keep its short
    # in-flight queue (about 2 ms of work) full, and the device idles (B
    # measured 82 % with A at 10 %); alone it gets 90 %.
    assert both[b_pid] >= 80


@pytest.mark.parametrize("first", ["burst", "best-effort"])
def test_best_effort_yields_to_a_burst_share_container_via_the_agent(
    node: SimNode,
    sock_path: str,  # noqa: F811
    first: str,
) -> None:
    """A (burst-share, 30 %) and B (best-effort, limit 50) both want the
    whole GPU; one starts alone and takes it, then the other starts.
    Best-effort has no guarantee and yields: B ends with what A leaves (1 %
    or so), A with the rest, as without the agent.  The agent used to
    count B's limit as a claim, which A then kept off: whichever started
    first, A ended near 40 % and B near its 50 %."""

    a_args = ["--cores", "30", "--policy", "burst-share"]
    b_args = ["--cores", "50", "--policy", "best-effort"]
    one, two = ("a", a_args), ("b", b_args)
    if first != "burst":
        one, two = two, one
    alone, both = shares_alone_then_both(node, sock_path, one, two, 6.0)
    (pid1,) = alone
    pid2 = next((p for p in both if p != pid1), None)
    shares = {one[0]: both.get(pid1, 0), two[0]: both.get(pid2, 0) if pid2 else 0}
    print(f"{one[0]} alone {alone[pid1]} %, then A {shares['a']} % and B {shares['b']} %")
    assert alone[pid1] >= 80
    assert shares["a"] >= 75
    assert shares["b"] <= 15


@pytest.mark.parametrize(
    ("low_cores", "high_cores", "low_priority"),
    [("50", "40", "1"), (None, None, "1"), (None, None, None)],
    ids=["limits", "no-limits", "unset"],
)
def test_low_priority_yields_while_a_high_priority_container_works(
    node: SimNode,
    sock_path: str,  # noqa: F811
    low_cores: str | None,
    high_cores: str | None,
    low_priority: str | None,
) -> None:
    """CUDA_TASK_PRIORITY end to end: L (priority 1, or unset, which means
    1 as in HAMi-core; fixed-share 50 %, or no SM limit) runs alone at its
    share; H (priority 0; 40 %, or no SM limit) starts, the agent sees H
    active on the device (from H's reports, or from NVML when H has no
    limit and so measures nothing itself) and tells L to yield, so L's
    kernels stop while H gets its share; H exits, and after the agent's
    active window L resumes.  Without a limit L measures nothing either
    (it keeps the launch fast path until told to yield): the agent's
    figure for it is NVML's."""
    from tests.helpers import nvml_shares

    def yielding(agent: AgentProc) -> list[float]:
        return find(agent.metrics(), "gpuvisor_container_yield", podname="low")

    # A 2 s active window: on a loaded CI machine the agent's NVML reading of an
    # unlimited H went stale for over 1 s (its figure for H read 8 %), which
    # lifted L's yield while H still worked.
    with AgentProc(sock_path, "--active-window", "2", env=node.env) as agent:
        cores = ["--cores", low_cores] if low_cores else []
        prio = ["--priority", low_priority] if low_priority else []
        low = spinning(node, sock_path, "low", [*cores, *prio], 60.0)
        try:
            # L launching (its gate, or NVML without a limit, measures it) before the
            # reading: on a loaded 2-core machine its start (Python, CUDA
            # init) took over 1.5 s, and the reading caught none of it, or
            # a part (69 % instead of about 100 %).
            half = (int(low_cores) if low_cores else 100) / 200
            assert wait_for(
                lambda: any(
                    v >= half
                    for v in find(
                        agent.metrics(), "gpuvisor_container_sm_share_ratio", podname="low"
                    )
                ),
                timeout=20.0,
            )
            time.sleep(0.5)
            alone = shares_over(node, 1.0)
            hcores = ["--cores", high_cores] if high_cores else []
            high = spinning(node, sock_path, "high", [*hcores, "--priority", "0"], 10.0)
            try:
                # H's first report (0.2 s apart), or the agent's next NVML
                # read when H has no limit, shows it active; L's next ack
                # carries the yield; L's queued work drains.  Without a
                # limit H keeps up to 1024 launches (about 1 s) queued, and
                # on the simulator's launch-order device the kernels L had
                # queued (as many, without a limit of its own) run after
                # them.
                assert wait_for(lambda: yielding(agent) == [1.0], timeout=3.0)
                # Without a limit of its own, L's queue is as deep, and
                # the two drain interleaved: about 2 s, more when L's
                # supervisor hears of the yield late (a CI run read L at
                # 25 % over the second after 2.5 s).
                time.sleep(0.5 if high_cores else 1.5 if low_cores else 4.0)
                since = int(time.time() * 1e6)
                # The agent's figure for H meanwhile (its gate's over each
                # 0.2 s report, or NVML's without a limit): the median of
                # its readings, as one report can catch H's launcher short
                # of CPU on a loaded machine.
                metrics = []
                t0 = time.monotonic()
                while time.monotonic() - t0 < 1.0:
                    metrics += find(
                        agent.metrics(), "gpuvisor_container_sm_share_ratio", podname="high"
                    )
                    time.sleep(0.1)
                both = nvml_shares(node, since)
                h_metric = statistics.median(metrics)
                assert high.poll() is None, "H ended before the reading"
            finally:
                high.communicate(timeout=60)
            # The active window (2 s) passes with no report of H.
            assert wait_for(lambda: yielding(agent) == [0.0], timeout=4.0)
            time.sleep(0.5)
            after = shares_over(node, 1.0)
            assert low.poll() is None, "L ended before the last reading"
        finally:
            low.terminate()
            low.communicate(timeout=60)
    (low_pid,) = alone
    high_pid = next(p for p in both if p != low_pid)
    print(
        f"L alone {alone[low_pid]} %; with H: L {both.get(low_pid, 0)} %, "
        f"H {both[high_pid]} % (agent {h_metric * 100:.0f} %); after H: L {after.get(low_pid, 0)} %"
    )
    share = (40, 55) if low_cores else (90, 100)
    assert share[0] <= alone[low_pid] <= share[1]
    assert both.get(low_pid, 0) <= 3
    # H is alone on the device, 1 kernel at a time below 50 %: a loaded
    # 2-core machine can leave its device idle between kernels.
    assert (30 <= both[high_pid] <= 45) if high_cores else both[high_pid] >= 90
    assert abs(h_metric * 100 - both[high_pid]) <= 10, h_metric
    assert share[0] <= after.get(low_pid, 0) <= share[1]


def test_containers_with_priority_unset_do_not_make_each_other_yield(
    node: SimNode,
    sock_path: str,  # noqa: F811
) -> None:
    """CUDA_TASK_PRIORITY unset means 1 (low), as in HAMi-core: two such
    containers without SM limits share the device, each reported as
    priority 1, and neither is told to yield to the other (only a
    priority-0 container makes a device busy)."""
    from tests.helpers import nvml_shares

    with AgentProc(sock_path, "--active-window", "1", env=node.env) as agent:
        a = spinning(node, sock_path, "a", [], 6.0)
        b = spinning(node, sock_path, "b", [], 6.0)
        try:

            def both_working() -> bool:
                m = agent.metrics()
                return all(
                    any(v > 0.2 for v in find(m, "gpuvisor_container_sm_share_ratio", podname=p))
                    for p in ("a", "b")
                )

            assert wait_for(both_working, timeout=20.0), agent.get("/metrics")
            m = agent.metrics()
            for pod in ("a", "b"):
                assert find(m, "gpuvisor_container_priority", podname=pod) == [1.0]
            since = int(time.time() * 1e6)
            yields = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5:
                m = agent.metrics()
                yields += [
                    v for p in ("a", "b") for v in find(m, "gpuvisor_container_yield", podname=p)
                ]
                time.sleep(0.1)
            shares = nvml_shares(node, since)
            assert a.poll() is None, "a ended before the reading"
            assert b.poll() is None, "b ended before the reading"
        finally:
            outs = [p.communicate(timeout=60) for p in (a, b)]
    for p, (_, err) in zip((a, b), outs, strict=True):
        assert p.returncode == 0, err
    print(f"yield metrics {sorted(set(yields))}, NVML shares {shares}")
    assert yields
    assert set(yields) == {0.0}
    assert len(shares) == 2, shares
    assert all(v >= 25 for v in shares.values()), shares


# Samples a region's enforced SM share of device 0 (0 while it yields),
# with CLOCK_MONOTONIC times, for argv[2] seconds.
SHARE_POLL = """
import sys, time
from gpuvisor.shim.region import Region
r = Region.attach(sys.argv[1])
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    print(f"{time.monotonic():.3f} {r.sm(0).share:.1f}", flush=True)
    time.sleep(0.02)
"""


def test_a_slow_agent_does_not_end_a_yield_before_the_ack_timeout(
    node: SimNode,
    sock_path: str,  # noqa: F811
) -> None:
    """L (priority 1) yields to H (priority 0).  The node agent stops for
    1.6 s (SIGSTOP: an agent starved of CPU), so L's next report gets no
    reply within the reporter's 1 s socket timeout.  The agent is slow, not
    gone: L's yield holds until its ack timeout (3 report intervals, at
    least 2 s after its last ack), and L's gate enforces 0 % for all of
    the 1.5 s after the stop.  (A reply timeout used to clear the yield
    flags at once, about 1.2 s after the stop.)"""
    import signal

    region = node.dir / "low.shr"
    with AgentProc(sock_path, "--active-window", "1", env=node.env) as agent:
        low = spinning(node, sock_path, "low", ["--cores", "50", "--priority", "1"], 60.0)
        high = spinning(node, sock_path, "high", ["--cores", "40", "--priority", "0"], 60.0)
        try:
            assert wait_for(
                lambda: find(agent.metrics(), "gpuvisor_container_yield", podname="low") == [1.0],
                timeout=10.0,
            )
            poll = subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(SHARE_POLL), str(region), "3.5"],
                env=node.env,
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO_ROOT,
            )
            time.sleep(1.0)  # the poller is up, the gate at 0 %
            assert agent.proc is not None
            stopped = time.monotonic()
            agent.proc.send_signal(signal.SIGSTOP)
            try:
                time.sleep(1.6)
            finally:
                agent.proc.send_signal(signal.SIGCONT)
            out, _ = poll.communicate(timeout=60)
        finally:
            for p in (high, low):
                p.terminate()
                p.communicate(timeout=60)
    samples = [(float(t), float(v)) for t, v in (line.split() for line in out.splitlines())]
    before = [v for t, v in samples if stopped - 0.5 <= t < stopped]
    during = [(round(t - stopped, 2), v) for t, v in samples if stopped <= t <= stopped + 1.5]
    assert before
    assert max(before) == 0, before  # yielding before the stop
    assert len(during) >= 20, during
    assert all(v == 0 for _, v in during), [(t, v) for t, v in during if v]


def test_an_admins_limit_is_applied_again_by_a_restarted_supervisor(
    node: SimNode,
    sock_path: str,  # noqa: F811
) -> None:
    """`set-limit` lowers a container's memory limit; its supervisor dies
    (SIGKILL: no final report) and a new one starts in the same container
    with a fresh region, configured from the environment (4 GiB).  The
    agent, which still knows the container, pushes the admin's 1 GiB again,
    and the new supervisor applies it."""
    with AgentProc(sock_path, "--expire-after", "30", env=node.env) as agent:
        first = supervised(node, sock_path, node.dir / "r1.shr", "pod-r", "4g", "0", 64)
        try:
            assert first.stdout is not None
            assert first.stdout.readline().strip() == "allocated"
            assert wait_for(lambda: memory_limit(agent, "pod-r") == [4 * GiB], timeout=5.0), (
                memory_limit(agent, "pod-r")
            )
            uuid = agent.status()["containers"][0]["devices"][0]["uuid"]
            proc = subprocess.run(
                [
                    *CLI,
                    "node-agent",
                    "set-limit",
                    "--socket",
                    sock_path,
                    "--container",
                    "e2e/pod-r/main",
                    "--device",
                    uuid,
                    "--memory",
                    "1g",
                ],
                capture_output=True,
                text=True,
                cwd=REPO_ROOT,
                timeout=30,
            )
            assert proc.returncode == 0, proc.stderr
            assert wait_for(lambda: memory_limit(agent, "pod-r") == [GiB], timeout=5.0), (
                memory_limit(agent, "pod-r")
            )
            kill_container(first)
        finally:
            first.kill()
            first.communicate(timeout=30)
        second = supervised(node, sock_path, node.dir / "r2.shr", "pod-r", "4g", "0", 64)
        try:
            assert second.stdout is not None
            assert second.stdout.readline().strip() == "allocated"

            def reported_by_second() -> bool:
                st = agent.status()["containers"]
                return bool(st) and st[0]["peer"]["pid"] == second.pid

            assert wait_for(reported_by_second, timeout=5.0)
            assert wait_for(lambda: memory_limit(agent, "pod-r") == [GiB], timeout=5.0), (
                memory_limit(agent, "pod-r")
            )
            assert len(agent.status()["containers"]) == 1
        finally:
            second.kill()
            second.communicate(timeout=30)


def admin_set_limit(sock: str, container: str, uuid: str, *args: str) -> None:
    proc = set_limit(sock, container, *args, device=uuid)
    assert proc.returncode == 0, proc.stderr


def test_an_admin_clears_a_limit_and_the_containers_own_comes_back(
    node: SimNode,
    sock_path: str,  # noqa: F811
) -> None:
    """`set-limit --memory env` takes an administrator's limit back: the
    container's environment gave it 2 GiB, the admin's 1 GiB is applied,
    then cleared, and the supervisor puts 2 GiB back in the region (it
    would otherwise keep applying the 1 GiB it was pushed)."""

    with AgentProc(sock_path, env=node.env) as agent:
        sup = supervised(node, sock_path, node.dir / "c.shr", "pod-c", "2g", "0", 64, 20)
        try:
            assert sup.stdout is not None
            assert sup.stdout.readline().strip() == "allocated"
            assert wait_for(lambda: memory_limit(agent, "pod-c") == [2 * GiB], timeout=5.0), (
                memory_limit(agent, "pod-c")
            )
            uuid = agent.status()["containers"][0]["devices"][0]["uuid"]
            admin_set_limit(sock_path, "e2e/pod-c/main", uuid, "--memory", "1g")
            assert wait_for(lambda: memory_limit(agent, "pod-c") == [GiB], timeout=5.0), (
                memory_limit(agent, "pod-c")
            )
            admin_set_limit(sock_path, "e2e/pod-c/main", uuid, "--memory", "env")
            assert wait_for(lambda: memory_limit(agent, "pod-c") == [2 * GiB], timeout=5.0), (
                memory_limit(agent, "pod-c")
            )
            st = agent.status()["containers"][0]
            assert st["admin_limits"] == {"memory": {uuid: "env"}, "sm": {}}
            # It stays so: nothing pushes the admin's 1 GiB any more.
            time.sleep(1.5)
            assert memory_limit(agent, "pod-c") == [2 * GiB]
        finally:
            sup.terminate()  # forwarded to the workload
            sup.communicate(timeout=30)


def test_an_admins_limit_survives_a_clean_restart_of_the_container(
    node: SimNode,
    sock_path: str,  # noqa: F811
) -> None:
    """A container whose supervisor ends cleanly (its workload exits: a
    final report) and starts again with the same labels (a restart in the
    same pod) gets the admin's limit again, as after a crash: the agent
    keeps it --limit-grace seconds after the final report."""

    with AgentProc(sock_path, env=node.env) as agent:
        first = supervised(node, sock_path, node.dir / "g1.shr", "pod-g", "4g", "0", 64, 8)
        try:
            assert first.stdout is not None
            assert first.stdout.readline().strip() == "allocated"
            assert wait_for(lambda: memory_limit(agent, "pod-g") == [4 * GiB], timeout=5.0), (
                memory_limit(agent, "pod-g")
            )
            uuid = agent.status()["containers"][0]["devices"][0]["uuid"]
            admin_set_limit(sock_path, "e2e/pod-g/main", uuid, "--memory", "1g")
            assert wait_for(lambda: memory_limit(agent, "pod-g") == [GiB], timeout=5.0), (
                memory_limit(agent, "pod-g")
            )
            first.communicate(timeout=30)  # the workload ends: a clean exit
            assert first.returncode == 0
        finally:
            if first.poll() is None:
                first.kill()
                first.communicate(timeout=30)
        assert agent.status()["containers"] == []  # its final report came
        parked = agent.status()["agent"].get("parked_limits")
        second = supervised(node, sock_path, node.dir / "g2.shr", "pod-g", "4g", "0", 64, 20)
        try:
            assert second.stdout is not None
            assert second.stdout.readline().strip() == "allocated"
            assert wait_for(lambda: memory_limit(agent, "pod-g") == [GiB], timeout=5.0), (
                memory_limit(agent, "pod-g")
            )
            assert parked == 1
            st = agent.status()
            assert st["containers"][0]["admin_limits"] == {"memory": {uuid: GiB}, "sm": {}}
            assert st["agent"]["parked_limits"] == 0
        finally:
            second.terminate()
            second.communicate(timeout=30)


# Uses device 0 at once, device 1 only after argv[1] seconds, then holds
# both for argv[2] seconds.
LATE_SECOND_DEVICE = (
    CU_SPIN_PRELUDE
    + """
import sys, time
held = chk(cu.cuMemAlloc(64 * 2**20))
print("allocated", flush=True)
time.sleep(float(sys.argv[1]))
chk(cu.cuCtxSetCurrent(chk(cu.cuDevicePrimaryCtxRetain(1))))
held1 = chk(cu.cuMemAlloc(64 * 2**20))
print("second", flush=True)
time.sleep(float(sys.argv[2]))
"""
)


def kill_container(sup: subprocess.Popen[str]) -> None:
    """SIGKILLs a supervised container: its supervisor (no final report) and
    its workload's process group, as a restart of the container would."""
    workload = psutil.Process(sup.pid).children()
    sup.send_signal(signal.SIGKILL)
    for p in workload:
        os.killpg(p.pid, signal.SIGKILL)


def supervised_late(
    node: SimNode, sock: str, region: Path, pod: str, first_s: float, hold_s: float
) -> subprocess.Popen[str]:
    """`gpuvisor run --memory 4g` around LATE_SECOND_DEVICE (two devices visible)."""
    env = dict(node.env, POD_NAME=pod, POD_NAMESPACE="e2e", CONTAINER_NAME="main")
    return subprocess.Popen(
        [
            *CLI, "run", "--memory", "4g", "--socket", sock, "--region", str(region),
            "--report-interval", "0.5", "--",
            sys.executable, "-c", textwrap.dedent(LATE_SECOND_DEVICE), str(first_s), str(hold_s),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )  # fmt: skip


def test_an_admins_limit_on_a_gpu_a_restarted_container_leaves_unused_is_kept(
    node: SimNode,
    sock_path: str,  # noqa: F811
) -> None:
    """A container restarts and does not touch its second GPU within
    --limit-grace: the administrator's limit on that GPU stays its own (its
    supervisor reports the devices the container can see), so it is parked
    again when that container goes, and the next restart, which uses the
    GPU at once, runs there under the administrator's 1 GiB, never under
    its own 4 GiB.  (The waits allow 15 s: under a loaded full suite on 2
    cores the admin's limit took over 5 s to show.)"""
    with AgentProc(sock_path, "--limit-grace", "2", env=node.env) as agent:
        first = supervised_late(node, sock_path, node.dir / "l1.shr", "pod-l", 0.0, 60.0)
        try:
            assert first.stdout is not None
            assert first.stdout.readline().strip() == "allocated"
            assert first.stdout.readline().strip() == "second"
            assert wait_for(lambda: memory_limit(agent, "pod-l") == [4 * GiB] * 2, timeout=15.0), (
                memory_limit(agent, "pod-l")
            )
            uuids = [d["uuid"] for d in agent.status()["containers"][0]["devices"]]
            for uuid in uuids:
                admin_set_limit(sock_path, "e2e/pod-l/main", uuid, "--memory", "1g")
            assert wait_for(lambda: memory_limit(agent, "pod-l") == [GiB] * 2, timeout=15.0), (
                memory_limit(agent, "pod-l")
            )
        finally:
            first.terminate()  # forwarded to the workload; a final report
            first.communicate(timeout=30)
        assert wait_for(lambda: agent.status()["agent"]["parked_limits"] == 1, timeout=15.0)
        both = {"memory": dict.fromkeys(uuids, GiB), "sm": {}}
        # Restarted, it uses its first GPU only, past the grace.
        second = supervised_late(node, sock_path, node.dir / "l2.shr", "pod-l", 60.0, 0.0)
        try:
            assert second.stdout is not None
            assert second.stdout.readline().strip() == "allocated"
            assert wait_for(lambda: memory_limit(agent, "pod-l") == [GiB], timeout=15.0), (
                memory_limit(agent, "pod-l")
            )
            time.sleep(3.0)  # the grace is over
            assert agent.status()["containers"][0]["admin_limits"] == both
        finally:
            second.terminate()
            second.communicate(timeout=30)
        assert wait_for(lambda: agent.status()["agent"]["parked_limits"] == 1, timeout=15.0)
        # Restarted again, it uses both at once: the admin's limit on each.
        third = supervised_late(node, sock_path, node.dir / "l3.shr", "pod-l", 0.0, 60.0)
        try:
            assert third.stdout is not None
            assert third.stdout.readline().strip() == "allocated"
            assert third.stdout.readline().strip() == "second"
            assert wait_for(lambda: memory_limit(agent, "pod-l") == [GiB] * 2, timeout=15.0), (
                memory_limit(agent, "pod-l")
            )
            assert agent.status()["containers"][0]["admin_limits"] == both
        finally:
            third.terminate()
            third.communicate(timeout=30)
