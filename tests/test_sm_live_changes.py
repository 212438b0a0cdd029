"""The SM quota changed live while launches wait at the gate.

A worker launches 1 ms `spin` kernels back to back on the simulated device;
another process (as the supervisor or an operator would) changes the
container's yield flag and SM limit through the region API.  NVML's
per-process utilisation, computed by the simulator from its timeline, shows
what the worker gets.
"""

from __future__ import annotations

import json
import select
import time

import pytest

from tests.helpers import (
    CU_SPIN_LAUNCHER,
    CU_SPIN_PRELUDE,
    SimNode,
    driven,
    region_call,
    shares_over,
)

WORKER = CU_SPIN_LAUNCHER


def share_over(node: SimNode, pid: int, seconds: float) -> int:
    """NVML's SM share of pid over the next `seconds` (waits them)."""
    return shares_over(node, seconds).get(str(pid), 0)


def test_a_pause_ended_then_a_lifted_limit_frees_a_waiting_launch(node: SimNode) -> None:
    """A burst-share container at 30 % is paused (its yield flag: its meter
    sets the share to 0 and the launch waits at the gate); then the pause
    is cleared and at once the limit lifted.  Nothing gates the container
    any more, so its meter thread sleeps until the next gated launch, and
    the launch that waited at the gate must not wait on for a share of 0
    that nobody will update: it ran 0 % for good before.  Nor may a limit
    set again later meet that share of 0 (the meter asleep)."""
    env = node.shimmed(CUDA_DEVICE_SM_LIMIT="30", GPUVISOR_SM_POLICY="burst-share")
    with driven(WORKER, env) as w:
        assert w.stdin is not None
        w.stdin.write("go\n")
        w.stdin.flush()
        time.sleep(0.8)
        region_call(node, "r.set_sm_yield(0, 30)")
        time.sleep(0.5)  # its meter sets the share to 0: the launch waits
        paused_share = region_call(node, "print(r.sm(0).share)").strip()
        region_call(node, "r.set_sm_yield(0, 0)\nr.set_sm_limit(0, 0)")
        time.sleep(1.0)
        free = share_over(node, w.pid, 1.0)
        region_call(node, "r.set_sm_limit(0, 30)")
        time.sleep(2.0)  # the up to 1024 launches queued while free run first
        again = share_over(node, w.pid, 1.0)
        print(
            f"share while paused: {paused_share}; after the pause and the limit: {free} %; "
            f"limit 30 again: {again} %"
        )
        assert w.poll() is None
        assert float(paused_share) == 0
        assert free >= 80
        assert again >= 24  # at least its limit (alone, burst-share lends it the rest)


# A 200 ms kernel, then "ready"; the program goes on to time a 1 ms launch.
LONG_FIRST = (
    CU_SPIN_PRELUDE
    + """
import json, sys, time
launch(200000)                      # 200 ms: far past its 1 ms first estimate
chk(cu.cuStreamSynchronize(s))
print("ready", flush=True)
"""
)

LONG_THEN_SHORT = (
    LONG_FIRST
    + """
sys.stdin.readline()
t0 = time.monotonic()
launch(1000)
print(json.dumps({"waited": time.monotonic() - t0}), flush=True)
"""
)


def test_a_limit_raised_live_applies_to_the_next_launch(node: SimNode) -> None:
    """A fixed-share container at 5 % runs a 200 ms kernel: its clock moves
    4 s ahead (200 ms at 5 %).  The limit raised live to 100 % applies to
    its next launch: the debt run up at 5 % is paid at 100 %, as when the
    meter changes the share (about 0.2 s), not at the old share.  Before,
    the launch waited the whole 4 s."""
    env = node.shimmed(CUDA_DEVICE_SM_LIMIT="5")
    with driven(LONG_THEN_SHORT, env) as w:
        region_call(node, "r.set_sm_limit(0, 100)")
        assert w.stdin is not None
        assert w.stdout is not None
        w.stdin.write("go\n")
        w.stdin.flush()
        waited = json.loads(w.stdout.readline())["waited"]
        print(f"next launch after 5 -> 100 %: waited {waited:.2f} s")
        assert waited < 1.0


LONG_THEN_WAITING = (
    LONG_FIRST
    + """
t0 = time.monotonic()
launch(1000)                        # waits at the gate: the clock is 4 s ahead
print(json.dumps({"waited": time.monotonic() - t0}), flush=True)
"""
)


@pytest.mark.parametrize("policy", ["fixed-share", "burst-share"])
def test_a_limit_lifted_frees_a_launch_that_waits(node: SimNode, policy: str) -> None:
    """A container at 5 % runs a 200 ms kernel: its clock moves 4 s ahead,
    and its next launch waits at the gate.  The limit lifted meanwhile
    frees that launch at once: nothing gates the container any more.
    (NVML's device handles fail, so that burst-share lends nothing and
    runs at its limit: the others' use is not known.)"""
    env = node.shimmed(
        CUDA_DEVICE_SM_LIMIT="5",
        GPUVISOR_SM_POLICY=policy,
        GPUVISOR_SIM_NVML_FAIL="nvmlDeviceGetHandleByUUID",
    )
    with driven(LONG_THEN_WAITING, env) as w:
        time.sleep(0.3)
        region_call(node, "r.set_sm_limit(0, 0)")
        assert w.stdout is not None
        waited = json.loads(w.stdout.readline())["waited"]
        print(f"{policy}: the launch waiting at 5 % went {waited:.2f} s later (lifted at 0.3 s)")
        assert waited < 1.0


@pytest.mark.parametrize("after", [None, 5], ids=["raised", "raised-then-lowered"])
def test_a_limit_raised_during_a_pause_rescales_the_clock(node: SimNode, after: int | None) -> None:
    """A fixed-share container at 5 % runs a 200 ms kernel (its clock 4 s
    ahead), then is paused (its yield flag set: its meter sets the share to
    0), and its limit is raised to 100 % meanwhile.  After the pause the
    debt is paid at 100 %, as for a change outside a pause (about 0.2 s,
    already past).  Before, a share coming out of 0 was never rescaled: the
    next launch still waited out the 4 s run up at 5 % (3.1 s); and a limit
    lowered back to 5 % after the pause multiplied that unpaid debt by 20
    (a single launch waited about a minute)."""
    env = node.shimmed(CUDA_DEVICE_SM_LIMIT="5")
    with driven(LONG_THEN_SHORT, env) as w:
        region_call(node, "r.set_sm_yield(0, 30)")
        time.sleep(0.5)  # its meter sets the share to 0
        paused = float(region_call(node, "print(r.sm(0).share)").strip())
        region_call(node, "r.set_sm_limit(0, 100)\nr.set_sm_yield(0, 0)")
        if after is not None:
            time.sleep(0.3)  # its meter sets the share to 100 % again
            region_call(node, f"r.set_sm_limit(0, {after})")
        assert w.stdin is not None
        assert w.stdout is not None
        w.stdin.write("go\n")
        w.stdin.flush()
        ready, _, _ = select.select([w.stdout], [], [], 10.0)
        assert ready, "the next launch still waited after 10 s"
        waited = json.loads(w.stdout.readline())["waited"]
        print(
            f"5 -> 100 % in a pause (share {paused}), then {after}: "
            f"next launch waited {waited:.2f} s"
        )
        assert paused == 0
        assert waited < 1.0
