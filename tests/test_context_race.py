"""Contexts created in the same moment by processes of different containers.

The library measures a new context from outside: NVML's process list and
memory before and after.  On a node whose pods start together, a real
driver takes 100 ms or more per context, so each process would see the
others' new PIDs and memory too: none would learn the PID NVML shows for it
(in a PID namespace NVML shows host PIDs), and each context would be charged
the sum of all of them.  The library serialises that measurement across the
node with flock on $GPUVISOR_NODE_LOCK (by default in /tmp/vgpulock, which
HAMi's device plugin shares between containers).  The simulator stands in
for the slow driver (GPUVISOR_SIM_CTX_CREATE_MS) and for host PIDs
(GPUVISOR_SIM_NVML_PID_OFFSET).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import SimNode, run_json, start_ready

MiB = 1 << 20
SIM_CONTEXT = 32 * MiB  # what the simulator charges for one context
OFFSET = 1_000_000
CTX_MS = 300

CHILD = """
import os, sys, time
from tests.cuclient import *
ok(cu.cuInit, 0)
ok(cu.cuDeviceGet, 0)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
init(0, create={create})
emit(pid=os.getpid(), used=used(), secs=time.monotonic() - t0)
"""


def spawn(env: dict[str, str], create: bool) -> subprocess.Popen[str]:
    return start_ready(CHILD.format(create=create), env)


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


def result(proc: subprocess.Popen[str]) -> tuple[dict[str, Any], str]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def container_env(node: SimNode, name: str, lock: Path | str, **extra: str) -> dict[str, str]:
    """A process of its own container (region file), NVML showing host PIDs."""
    env = {
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(node.dir / f"{name}.shr"),
        "CUDA_DEVICE_MEMORY_LIMIT": "4g",
        "GPUVISOR_SIM_NVML_PID_OFFSET": str(OFFSET),
        "GPUVISOR_SIM_CTX_CREATE_MS": str(CTX_MS),
        "GPUVISOR_NODE_LOCK": str(lock),
        "LIBCUDA_LOG_LEVEL": "2",
    }
    return node.shimmed(**{**env, **extra})


@pytest.mark.parametrize("create", [False, True], ids=["primary-ctx", "cuCtxCreate"])
def test_contexts_created_together_are_each_measured_alone(node: SimNode, create: bool) -> None:
    """Four containers' processes create their contexts at once: each
    learns its own NVML PID and is charged exactly its own context."""
    lock = node.dir / "vgpulock" / "gpuvisor.lock"
    lock.parent.mkdir()
    procs = [spawn(container_env(node, f"c{i}", lock), create) for i in range(4)]
    for p in procs:
        go(p)
    for p in procs:
        out, err = result(p)
        learned = f"NVML lists this process as PID {out['pid'] + OFFSET}"
        assert learned in err, err
        assert out["used"] == SIM_CONTEXT


def test_without_the_shared_directory_nothing_is_locked(node: SimNode) -> None:
    """No lock directory (not under HAMi's device plugin): a context is
    created at once, without waiting for anything."""
    env = container_env(node, "c", node.dir / "missing" / "gpuvisor.lock")
    out, err = result(_started(env))
    assert out["secs"] < CTX_MS / 1000 + 1.0
    assert "NODE_LOCK" not in err
    assert not (node.dir / "missing").exists()


def _started(env: dict[str, str], create: bool = False) -> subprocess.Popen[str]:
    proc = spawn(env, create)
    go(proc)
    return proc


def test_a_held_lock_is_waited_for_then_given_up(node: SimNode) -> None:
    """Another process holds the lock: the creation waits for it while it is
    held briefly, and after 5 s goes on without it, saying so in one line."""
    lock = node.dir / "gpuvisor.lock"
    env = container_env(node, "c", lock, GPUVISOR_SIM_CTX_CREATE_MS="1")
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = _started(env)
        time.sleep(0.5)
        fcntl.flock(held, fcntl.LOCK_UN)
        out, err = result(proc)
    assert 0.4 <= out["secs"] < 3.0, out
    assert out["used"] == SIM_CONTEXT
    assert "NODE_LOCK" not in err

    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        out, err = result(_started(env))
    assert 5.0 <= out["secs"] < 9.0, out
    said = [line for line in err.splitlines() if "GPUVISOR_NODE_LOCK" in line]
    assert len(said) == 1, err
    assert "without it" in said[0]
    assert str(lock) in said[0]


def test_a_process_killed_holding_the_lock_does_not_block_the_others(node: SimNode) -> None:
    """SIGKILLed in the middle of creating its context, with the lock held:
    the next process gets the lock at once."""
    lock = node.dir / "gpuvisor.lock"
    slow = _started(container_env(node, "slow", lock, GPUVISOR_SIM_CTX_CREATE_MS="10000"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until it holds the lock
        if not lock.exists():
            time.sleep(0.01)
            continue
        with lock.open("r") as probe:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(probe, fcntl.LOCK_UN)
            except BlockingIOError:
                break
        time.sleep(0.01)
    else:
        pytest.fail("the slow process never took the lock")
    os.kill(slow.pid, signal.SIGKILL)
    slow.wait(10)
    out, err = result(_started(container_env(node, "next", lock, GPUVISOR_SIM_CTX_CREATE_MS="1")))
    assert out["secs"] < 2.0, out
    assert f"NVML lists this process as PID {out['pid'] + OFFSET}" in err
    assert out["used"] == SIM_CONTEXT


# The start of the programs that fork while a context is made: fork_sleeper
# forks a child that sleeps, then exits; end_with says a word, then on a
# line on stdin kills the child and reaps it.
FORKING = """
import os, sys, threading, time
from tests.cuclient import *
ok(cu.cuInit, 0)
def fork_sleeper(seconds):
    child = os.fork()
    if child == 0:
        time.sleep(seconds)
        os._exit(0)
    return child
def end_with(word, child):
    print(word, flush=True)
    sys.stdin.readline()
    os.kill(child, 9)
    os.waitpid(child, 0)
"""

FORK_WHILE_CREATING = (
    FORKING
    + """
t = threading.Thread(target=init)
t.start()
time.sleep(0.3)  # the thread is creating the context, holding the lock
child = fork_sleeper(30)
t.join()
end_with("ready", child)
"""
)


def test_a_child_forked_during_a_creation_does_not_keep_the_lock(node: SimNode) -> None:
    """Another thread forks while a context is being created: once the
    parent is done, the lock is free although the child lives on."""
    lock = node.dir / "gpuvisor.lock"
    env = container_env(node, "c", lock, GPUVISOR_SIM_CTX_CREATE_MS="1000")
    proc = start_ready(FORK_WHILE_CREATING, env)
    try:
        with lock.open("r") as probe:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if held
    finally:
        go(proc)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


FORKS_WHILE_WAITING = (
    FORKING
    + """
dev = ok(cu.cuDeviceGet, 0)
print("ready", flush=True)
sys.stdin.readline()
t = threading.Thread(target=lambda: ok(cu.cuDevicePrimaryCtxRetain, dev))
t.start()
time.sleep(0.3)                       # the thread waits for the node lock
child = fork_sleeper(60)              # e.g. a data-loader worker
print(child, flush=True)
t.join()
end_with("created", child)
"""
)


def test_a_child_forked_while_waiting_for_the_lock_does_not_keep_it(node: SimNode) -> None:
    """A process forks while one of its threads waits for the node lock.  The
    child's copy of the lock file is closed at fork, so once the parent has
    created its context and unlocked, the lock is free although the child
    lives on (before, every other context creation on the node waited 5 s
    for it)."""
    lock = node.dir / "gpuvisor.lock"
    env = container_env(node, "c", lock, GPUVISOR_SIM_CTX_CREATE_MS="1")
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = start_ready(FORKS_WHILE_WAITING, env)
        go(proc)
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        fcntl.flock(held, fcntl.LOCK_UN)
    try:
        assert proc.stdout.readline().strip() == "created"
        os.kill(child, 0)  # the child is alive
        with lock.open("w") as probe:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: no BlockingIOError
    finally:
        go(proc)
        proc.communicate(timeout=30)


FREED_WHILE_CREATING = """
import os, threading, time
import pynvml
from tests.cuclient import *
ctx0 = init()
p = ok(cu.cuMemAlloc, 1 * GiB)
res = {}
go = threading.Barrier(3)
def freer():
    ok(cu.cuCtxSetCurrent, ctx0)
    go.wait()
    time.sleep(0.05)
    ok(cu.cuMemFree, p)
def grabber():
    ok(cu.cuCtxSetCurrent, ctx0)
    go.wait()
    time.sleep(0.1)
    res["grab"] = call(cu.cuMemAlloc, 2000 * MiB)[0].name
threads = [threading.Thread(target=freer), threading.Thread(target=grabber)]
for t in threads:
    t.start()
go.wait()
res["create"] = call(cu.cuCtxCreate, None, 0, ok(cu.cuDeviceGet, 0))[0].name
for t in threads:
    t.join()
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
res["held"] = sum(x.usedGpuMemory for x in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                  if x.pid == os.getpid())
emit(**res)
"""


def test_memory_freed_while_a_context_is_created_is_not_taken_off_its_cost(
    node: SimNode,
) -> None:
    """While the context is being created (the driver takes 400 ms here),
    one thread frees 1 GiB and another reserves 2000 MiB, whose driver call
    is still running (800 ms) when the creation returns.  The context's
    cost (32 MiB) was measured as NVML's growth less the charges' growth;
    with a charge in flight nothing was taken out, so the 1 GiB freed made
    the context look free: both were granted, 2064 MiB held under a 2 GiB
    quota.  The reading waits for the charge to land, and one of the two
    is refused."""
    out = run_json(
        FREED_WHILE_CREATING,
        node.shimmed(
            CUDA_DEVICE_MEMORY_LIMIT="2g",
            GPUVISOR_SIM_CTX_CREATE_MS="400",
            GPUVISOR_SIM_ALLOC_MS="800",
        ),
    )
    assert out["held"] <= 2048 * MiB, out
    assert "CUDA_ERROR_OUT_OF_MEMORY" in (out["create"], out["grab"]), out


CONTEXT = """
import json
from tests.cuclient import *
init()
emit(ok=True)
"""


def test_an_existing_lock_file_keeps_its_mode(node: SimNode) -> None:
    """The node agent keeps context.lock mode 0644 (flock needs no write
    access, and nothing but its owner should write it); a library that ran
    as its owner (root in a container) made it 0666.  A lock file the
    library creates itself is made 0666, for the node's other users."""
    lock = Path(node.env["GPUVISOR_NODE_LOCK"])
    assert run_json(CONTEXT, node.shimmed())["ok"]
    assert lock.stat().st_mode & 0o777 == 0o666
    lock.chmod(0o644)
    assert run_json(CONTEXT, node.shimmed())["ok"]
    assert lock.stat().st_mode & 0o777 == 0o644
