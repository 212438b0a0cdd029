"""A context's learned cost is reserved before the driver creates it.

A context takes device memory of its own (32 MiB in the simulator).  The
library measures it around the creation (hooks_context.c); a context that
does not fit the quota used to be created, measured, then destroyed again,
so the device's physical use passed the quota meanwhile.  The container now
keeps the smallest cost its processes measured on each device, and reserves
it before the driver is called: a context that cannot fit is refused
without being created.  Physical use is read through NVML by a process
without the library (the simulator's figure for the whole device), sampled
in a loop while the creation is tried.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Holder, SimNode, region_call, run_cli, run_json, run_py, start_ready

MiB = 1 << 20
SIM_CONTEXT = 32 * MiB

# Device 0's used memory as NVML reports it, read as fast as it can be
# until a line comes on stdin: the first, peak and last readings.
SAMPLER = """
import json, sys, threading
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
def used():
    return n.nvmlDeviceGetMemoryInfo(h).used
first = used()
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
print("ready", flush=True)
peak, count = first, 0
while not stop.is_set():
    peak = max(peak, used())
    count += 1
print(json.dumps({"first": first, "peak": peak, "last": used(), "samples": count}))
"""

HOLD = """
from tests.cuclient import *
init(0)
ptr = ok(cu.cuMemAlloc, {alloc})
hold(used=used())
"""

# Try a context (primary or cuCtxCreate) once; report the CUDA result.
TRY = """
import json, os
from tests.cuclient import *
ok(cu.cuInit, 0)
dev = ok(cu.cuDeviceGet, 0)
if {create}:
    err, ctx = call(cu.cuCtxCreate, None, 0, dev)
else:
    err, ctx = call(cu.cuDevicePrimaryCtxRetain, dev)
# What the container holds on the device, read before this process exits
# (and gives back all it holds).
from gpuvisor.shim.region import Region
held = Region.attach().used(0)
print(json.dumps({{"err": int(err), "pid": os.getpid(), "held": held}}))
"""

OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY

# NVML's per-process figures on device 0, read without the library.
NVML_PROCS = """
import json
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({p.pid: p.usedGpuMemory for p in n.nvmlDeviceGetComputeRunningProcesses(h)}))
"""


USAGE = "import json\nprint(json.dumps(r.usage_by_process(0)))"


def env_for(node: SimNode, limit: str = "1g", **extra: str) -> dict[str, str]:
    return node.shimmed(CUDA_DEVICE_MEMORY_LIMIT=limit, LIBCUDA_LOG_LEVEL="2", **extra)


def sampled(node: SimNode, code: str, env: dict[str, str]) -> tuple[dict[str, Any], Any]:
    """Run code in env while a sampler without the library reads NVML's
    device figure; (the sampler's readings, the code's JSON)."""
    sampler = start_ready(SAMPLER, node.env)
    try:
        out = run_json(code, env)
    finally:
        assert sampler.stdin is not None
        sampler.stdin.write("\n")
        sampler.stdin.flush()
        stdout, stderr = sampler.communicate(timeout=30)
    assert sampler.returncode == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1]), out


def region_used(node: SimNode) -> int:
    return int(region_call(node, "print(r.used(0))").strip())


def nvml_processes(node: SimNode) -> dict[str, int]:
    procs: dict[str, int] = run_json(NVML_PROCS, node.env)
    return procs


@pytest.mark.parametrize("create", [False, True], ids=["primary-ctx", "cuCtxCreate"])
def test_a_context_that_cannot_fit_is_refused_before_it_is_created(
    node: SimNode, create: bool
) -> None:
    """The QA scenario: a 1 GiB quota, one process holding 1008 MiB (its
    context and 976 MiB); a second process's context is refused with
    CUDA_ERROR_OUT_OF_MEMORY, and the device's physical use never rises
    above what the first holds (it reached 1040 MiB before)."""
    with Holder(HOLD.format(alloc=976 * MiB), env_for(node)) as held:
        assert held["used"] == 1008 * MiB
        assert region_used(node) == 1008 * MiB
        env = env_for(node, GPUVISOR_SIM_CTX_CREATE_MS="300")
        seen, out = sampled(node, TRY.format(create=create), env)
        assert out["err"] == OOM
        assert out["held"] == 1008 * MiB
        assert seen["samples"] > 10, seen
        assert seen["first"] == 1008 * MiB, seen
        assert seen["peak"] == 1008 * MiB, seen  # 1040 MiB without the reservation
        assert seen["last"] == 1008 * MiB, seen
        assert region_used(node) == 1008 * MiB


@pytest.mark.parametrize("create", [False, True], ids=["primary-ctx", "cuCtxCreate"])
def test_a_context_that_fits_is_created_and_charged_its_measured_cost(
    node: SimNode, create: bool
) -> None:
    """With the cost learned, a context that fits is created as before and
    charged what it takes: the region's total is NVML's figure for the
    container's processes."""
    keep = """
from tests.cuclient import *
init(0, create={create})
hold(used=used())
"""
    with Holder(HOLD.format(alloc=200 * MiB), env_for(node)) as first:
        assert first["used"] == SIM_CONTEXT + 200 * MiB
        second = Holder(keep.format(create=create), env_for(node))
        with second as out:
            assert out["used"] == 2 * SIM_CONTEXT + 200 * MiB  # the container's
            procs = nvml_processes(node)
            charged = json.loads(region_call(node, USAGE))
            assert procs[str(second.pid)] == SIM_CONTEXT, procs
            assert charged == procs, (charged, procs)
            assert region_used(node) == sum(procs.values()) == 264 * MiB


def test_without_a_learned_cost_the_context_is_created_then_measured(node: SimNode) -> None:
    """The container's first context is created and measured as before,
    even if it then does not fit (a 16 MiB quota, a 32 MiB context: the
    device's use rises for the while); its cost is learned all the same, so
    the next process's context is refused without being created."""
    env = env_for(node, limit="16m", GPUVISOR_SIM_CTX_CREATE_MS="300")
    first, out = sampled(node, TRY.format(create=False), env)
    assert out["err"] == OOM
    assert first["first"] == 0, first
    assert first["last"] == 0, first
    assert first["peak"] == SIM_CONTEXT, first
    again, out = sampled(node, TRY.format(create=False), env)
    assert out["err"] == OOM
    assert out["held"] == 0
    assert again["peak"] == 0, again
    assert region_used(node) == 0


SLOW = """
import sys
from tests.cuclient import *
ok(cu.cuInit, 0)
dev = ok(cu.cuDeviceGet, 0)
print("ready", flush=True)
call(cu.cuDevicePrimaryCtxRetain, dev)
"""


def test_a_process_killed_after_reserving_leaves_no_reservation(node: SimNode) -> None:
    """SIGKILLed while its context is being created, with the learned cost
    reserved: once its slot is reclaimed the container's other processes
    get the whole quota back."""
    with Holder(HOLD.format(alloc=2 * MiB), env_for(node)):
        assert region_used(node) == SIM_CONTEXT + 2 * MiB
        slow = start_ready(SLOW, env_for(node, GPUVISOR_SIM_CTX_CREATE_MS="20000"))
        try:
            deadline = time.monotonic() + 15
            while region_used(node) < 2 * SIM_CONTEXT + 2 * MiB:  # reserved
                assert time.monotonic() < deadline, "the slow process never reserved"
                time.sleep(0.05)
            assert region_used(node) == 2 * SIM_CONTEXT + 2 * MiB
        finally:
            os.kill(slow.pid, signal.SIGKILL)
            slow.wait(10)
        # The next process fills what is left of the quota with its own
        # context: it fits only once the dead reservation is reclaimed.
        rest = 1024 * MiB - 2 * SIM_CONTEXT - 2 * MiB
        with Holder(HOLD.format(alloc=rest), env_for(node)) as out:
            assert out["used"] == 1024 * MiB
            assert region_used(node) == 1024 * MiB


UUID = "GPU-12345678-1234-1234-1234-123456789abc"


def two_sizes(tmp_path: Path, first: str, second: str) -> tuple[SimNode, SimNode]:
    """Two simulated nodes whose one device has the same UUID but contexts
    of different sizes, and one region file: the container's processes see
    one device entry, so the second learns the first's cost."""
    nodes = []
    for name, ctx in (("a", first), ("b", second)):
        directory = tmp_path / name
        directory.mkdir()
        node = SimNode.create(directory, devices=f"16g:uuid={UUID}:ctx={ctx}")
        node.env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(tmp_path / "region.shr")
        nodes.append(node)
    return nodes[0], nodes[1]


KEEP = """
from tests.cuclient import *
init(0, create={create})
hold(used=used())
"""


def one_then_the_other(a: SimNode, b: SimNode, create: bool, a_cost: int) -> None:
    """A context on node a (charged a_cost), then, while it lives, one on
    node b, which learned a's cost: once created, the two are charged
    their real costs, 64 MiB in all, on the region they share."""
    with Holder(KEEP.format(create=create), env_for(a)) as first:
        assert first["used"] == a_cost
        with Holder(KEEP.format(create=create), env_for(b)) as second:
            assert second["used"] == 64 * MiB
            assert region_used(a) == 64 * MiB


@pytest.mark.parametrize("create", [False, True], ids=["primary-ctx", "cuCtxCreate"])
def test_a_context_larger_than_reserved_is_charged_its_measured_cost(
    tmp_path: Path, create: bool
) -> None:
    """The cost reserved (16 MiB, learned) is less than the context takes
    (48 MiB): the difference is charged after the creation."""
    a, b = two_sizes(tmp_path, "16m", "48m")
    one_then_the_other(a, b, create, 16 * MiB)


@pytest.mark.parametrize("create", [False, True], ids=["primary-ctx", "cuCtxCreate"])
def test_a_context_larger_than_reserved_that_does_not_fit_is_destroyed(
    tmp_path: Path, create: bool
) -> None:
    """The reservation fits (16 MiB of the 40 MiB left) but the context
    takes 48 MiB: it is destroyed again and the call fails, leaving
    nothing charged (the reservation given back with it)."""
    a, b = two_sizes(tmp_path, "16m", "48m")
    with Holder(HOLD.format(alloc=968 * MiB), env_for(a)) as first:
        assert first["used"] == 984 * MiB
        seen, out = sampled(
            b, TRY.format(create=create), env_for(b, GPUVISOR_SIM_CTX_CREATE_MS="300")
        )
        assert out["err"] == OOM
        assert out["held"] == 984 * MiB
        assert seen["peak"] == 48 * MiB, seen  # created, as without a reservation
        assert seen["last"] == 0, seen
        assert region_used(a) == 984 * MiB


@pytest.mark.parametrize("create", [False, True], ids=["primary-ctx", "cuCtxCreate"])
def test_a_context_smaller_than_reserved_gives_the_difference_back(
    tmp_path: Path, create: bool
) -> None:
    """The cost reserved (48 MiB) is more than the context takes (16 MiB):
    the difference is given back, and the smaller cost learned."""
    a, b = two_sizes(tmp_path, "48m", "16m")
    one_then_the_other(a, b, create, 48 * MiB)
    # The smallest cost is kept: with 24 MiB left, a 16 MiB context is
    # created (48 MiB reserved would have refused it in advance).
    with Holder(HOLD.format(alloc=984 * MiB), env_for(b)) as first:
        assert first["used"] == 1000 * MiB
        with Holder(KEEP.format(create=create), env_for(b)) as second:
            assert second["used"] == 1016 * MiB


@pytest.mark.parametrize("create", [False, True], ids=["primary-ctx", "cuCtxCreate"])
def test_a_creation_the_driver_refuses_gives_the_reservation_back(
    tmp_path: Path, create: bool
) -> None:
    """The learned cost fits the quota, but the device itself is full
    (another container holds the rest of a 1 GiB GPU): the driver refuses
    the context, and the reservation is given back."""
    node = SimNode.create(tmp_path, devices="1g")
    mine = env_for(node, limit="4g")
    other = env_for(node, limit="4g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "o.shr"))
    with Holder(KEEP.format(create=create), mine) as first:
        assert first["used"] == SIM_CONTEXT
        with Holder(HOLD.format(alloc=960 * MiB), other):
            out = run_json(TRY.format(create=create), mine)
            assert out["err"] == OOM
            assert out["held"] == SIM_CONTEXT
            assert region_used(node) == SIM_CONTEXT


def test_status_shows_what_a_new_context_is_reserved(node: SimNode) -> None:
    """The learned cost is what each next context of the container is
    reserved: `gpuvisor status` (CTX, and context_cost in --json) and the
    Python API show it, 0 until a process measured one."""
    region_call(
        node, 'r.register_device("GPU-6776a51d-5e11-4000-8000-000000000000", 1 << 34, 1 << 30)'
    )
    assert region_call(node, "print(r.device(0).context_cost)").strip() == "0"
    with Holder(HOLD.format(alloc=MiB), env_for(node)):
        assert region_call(node, "print(r.device(0).context_cost)").strip() == str(SIM_CONTEXT)
        proc = run_cli("status", "--json", "--sample", "0", env=node.env)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["devices"][0]["context_cost"] == SIM_CONTEXT
        table = run_cli("status", "--sample", "0", env=node.env)
        print(table.stdout)
        lines = table.stdout.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("DEV "))
        header, row = lines[at : at + 2]
        assert header.rstrip().endswith("CTX"), table.stdout
        assert row.rstrip().endswith("32 MiB"), table.stdout


@pytest.mark.parametrize("create", [False, True], ids=["primary", "cuCtxCreate"])
def test_a_containers_first_context_is_reserved_what_the_node_measured(
    node: SimNode, tmp_path: Path, create: bool
) -> None:
    """A container that has measured no context yet reserves what another
    container of the node measured on the GPU (kept in the node directory's
    file for that GPU), so its first context is covered too: under a 16 MiB
    quota a 32 MiB context is refused without being created (the device's
    use never rises), where it used to be created, measured and destroyed.
    One that fits is created and charged its own measured cost."""
    first = run_json(TRY.format(create=create), env_for(node))
    assert first["err"] == 0
    small = env_for(
        node,
        limit="16m",
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "small.shr"),
        GPUVISOR_SIM_CTX_CREATE_MS="300",
    )
    seen, out = sampled(node, TRY.format(create=create), small)
    assert out["err"] == OOM
    assert out["held"] == 0
    assert seen["peak"] == 0, seen
    roomy = env_for(node, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "roomy.shr"))
    out = run_json(TRY.format(create=create), roomy)
    assert out["err"] == 0
    assert out["held"] == SIM_CONTEXT


# A primary context reset (its retain kept, as CUDA does), then retained
# again with the quota nearly full: the driver makes the context anew.
RETAIN_AFTER_RESET = """
import os
import pynvml as n
from gpuvisor.shim.region import Region
from tests.cuclient import *
init()
dev = ok(cu.cuDeviceGet, 0)
ok(cu.cuDevicePrimaryCtxReset, dev)      # the context goes, its retain stays
ok(cu.cuCtxCreate, None, 0, dev)
ok(cu.cuMemAlloc, {fill})
err = call(cu.cuDevicePrimaryCtxRetain, dev)[0]
active = ok(cu.cuDevicePrimaryCtxGetState, dev)[1]
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
mine = sum(p.usedGpuMemory for p in n.nvmlDeviceGetComputeRunningProcesses(h)
           if p.pid == os.getpid())
emit(err=int(err), active=active, physical=mine, held=Region.attach().used(0))
"""


def test_a_primary_context_retained_after_a_reset_is_reserved_before_it_is_made(
    node: SimNode,
) -> None:
    """After cuDevicePrimaryCtxReset the next retain makes the context anew,
    so its learned cost is reserved first, as for the first retain: one that
    cannot fit is refused and nothing is made.  The retain made after a
    reset used to reserve nothing (the process still held a retain), and
    the context it made did not fit: the call failed, but the context stayed
    (the earlier retain held it), its 32 MiB uncharged and the device's use
    past the 1 GiB quota."""
    out = run_json(RETAIN_AFTER_RESET.format(fill=976 * MiB), env_for(node))
    assert out["err"] == OOM, out
    assert out["active"] == 0, out
    assert out["physical"] == SIM_CONTEXT + 976 * MiB, out
    assert out["held"] == out["physical"], out


def test_a_primary_context_made_anew_that_does_not_fit_is_reset_again(
    tmp_path: Path,
) -> None:
    """The learned cost (16 MiB) fits, but the context made anew after a
    reset takes 48 MiB, which does not: the call fails and the context is
    reset again, as it was before the call.  Released once, it used to stay
    (the retain from before the reset held it) with nothing charged."""
    a, b = two_sizes(tmp_path, "16m", "48m")
    with Holder(HOLD.format(alloc=MiB), env_for(a)) as first:
        assert first["used"] == 18 * MiB
        out = run_json(RETAIN_AFTER_RESET.format(fill=934 * MiB), env_for(b))
    assert out["err"] == OOM, out
    assert out["active"] == 0, out
    assert out["physical"] == 48 * MiB + 934 * MiB, out
    assert out["held"] == 18 * MiB + out["physical"], out


@pytest.mark.parametrize("poison", [1 << 40, 16 << 30, 5 << 30], ids=["1TiB", "device", "quarter"])
def test_an_implausible_node_wide_cost_is_ignored_and_said_once(
    node: SimNode, tmp_path: Path, poison: int
) -> None:
    """The node-wide cost lies in a file every container can write: a
    container that stores a cost larger than the device (16 GiB here), or
    than a quarter of it (no context takes that), made every new
    memory-limited container's first context fail with out-of-memory.
    Such a value is ignored (one line says so), the context is created and
    measured, and its cost mends the word."""
    assert run_json(TRY.format(create=False), env_for(node))["err"] == 0
    (path,) = node.dir.glob("gpuvisor-sm-*")
    with path.open("r+b") as f:  # the word after the magic, the count and the enqueue word
        f.seek(24)
        assert int.from_bytes(f.read(8), "little") == SIM_CONTEXT
        f.seek(24)
        f.write(poison.to_bytes(8, "little"))
    env = env_for(node, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "new.shr"))
    proc = run_py(TRY.format(create=False) + TRY.format(create=True), env)
    outs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [o["err"] for o in outs] == [0, 0], proc.stderr
    assert outs[0]["held"] == SIM_CONTEXT
    said = [line for line in proc.stderr.splitlines() if "implausible" in line]
    assert len(said) == 1, proc.stderr
    assert str(poison) in said[0]
    assert int.from_bytes(path.read_bytes()[24:32], "little") == SIM_CONTEXT
