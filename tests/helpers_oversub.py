"""The setting of the memory oversubscription tests
(tests/test_oversubscribe.py, tests/test_oversubscribe_async.py): containers
on one simulated 4 GiB device (the `small` fixture), each with its own region
file and worker processes driven line by line, and the witnesses: the
simulated driver's own per-process figures (NVML, read without the library)
and the region's figures through the exported API."""

from __future__ import annotations

import signal
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from tests.helpers import GiB, MiB, SimNode, answer, run_json, start_ready

SIM_CONTEXT = 32 * MiB
DEVICE = 4 * GiB

# Each container: a 4 GiB quota and S = 2, so 2 GiB guaranteed on the device.
OVER = {
    "CUDA_DEVICE_MEMORY_LIMIT": "4g",
    "CUDA_OVERSUBSCRIBE": "true",
    "GPUVISOR_MEMORY_SCALING": "2",
}

# A worker's start and end: between them a worker program makes its
# context and defines COMMANDS, {name: function(*args) -> answer}.  It
# prints "ready", then answers each line "NAME ARGS..." on stdin with one
# JSON line.  `held` is its live allocations [(pointer, size)]; `keep`
# records one if it was made; "free" frees the last one; "touch" does a
# memset and copies on every one (kernels' stand-ins on spilled memory).
WORKER_HEAD = """
from tests.cuclient import *
import json, sys
held = []
def keep(err, p, n):
    if err == SUCCESS:
        held.append((p, n))
    return {"err": err.name}
def free():
    p, _ = held.pop()
    return {"err": call(cu.cuMemFree, p)[0].name}
def touch():
    buf = bytearray(MiB)
    for p, n in held:
        ok(cu.cuMemsetD8, p, 7, n)
        ok(cu.cuMemcpyHtoD, p, buf, MiB)
        ok(cu.cuMemcpyDtoH, buf, p, MiB)
    return {"err": "CUDA_SUCCESS"}
"""
WORKER_LOOP = """
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    print(json.dumps(COMMANDS[cmd](*args)), flush=True)
"""

# The device's physical use and each process's, as the simulated driver
# counts them (no library: its own figures).
PHYSICAL = """
import json
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
procs = {str(p.pid): p.usedGpuMemory
         for p in n.nvmlDeviceGetComputeRunningProcesses(h)}
print(json.dumps({"used": n.nvmlDeviceGetMemoryInfo(h).used, "procs": procs}))
"""

# A region's figures per device entry, through the exported API.
REGION = """
import json, sys
from gpuvisor.shim.region import Region
r = Region.attach(sys.argv[1])
r.reclaim_dead()
print(json.dumps([{"used": d.used, "spilled": d.spilled, "resident": d.resident,
                   "guarantee": d.guarantee} for d in r.devices()]))
"""


def physical(node: SimNode) -> dict[str, Any]:
    """The driver's figures: {"used": bytes, "procs": {pid: bytes}}."""
    result: dict[str, Any] = run_json(PHYSICAL, node.env)
    return result


class Container:
    """One container: its own region file, one worker process (started
    with `worker`, which prints "ready" and then answers each line with one
    JSON line), or more (`another`)."""

    def __init__(self, node: SimNode, name: str, worker: str, **env: str) -> None:
        self.node = node
        self.worker = worker
        self.region = node.dir / f"{name}.shr"
        self.env = node.shimmed(CUDA_DEVICE_MEMORY_SHARED_CACHE=str(self.region), **env)
        self.procs = [start_ready(worker, self.env)]

    @property
    def pid(self) -> int:
        """The first worker's pid."""
        return self.procs[0].pid

    @property
    def pids(self) -> set[str]:
        return {str(p.pid) for p in self.procs}

    def another(self) -> None:
        """Another worker process in this container."""
        self.procs.append(start_ready(self.worker, self.env))

    def ask(self, line: str, proc: int = 0) -> dict[str, Any]:
        """Worker `proc`'s answer to line."""
        return answer(self.procs[proc], line)

    def send(self, line: str) -> None:
        """line to every worker, not waiting for the answers."""
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(line + "\n")
            p.stdin.flush()

    def kill(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)

    def figures(self) -> dict[str, int]:
        """The region's figures of device 0 (its dead processes reclaimed)."""
        out: list[dict[str, int]] = run_json(REGION, self.node.env, args=[str(self.region)])
        return out[0]

    def on_device(self, phys: Mapping[str, Any]) -> int:
        """What the driver holds on the device for this container's
        processes, by physical's figures."""
        return sum(int(v) for pid, v in phys["procs"].items() if pid in self.pids)


def race(node: SimNode, cs: Sequence[Container]) -> None:
    """Every worker of cs loops at once ("loop 100000": allocating and
    freeing 256 MiB): six times over, the device holds no more than it has
    and each container at least its 2 GiB guarantee."""
    for c in cs:
        c.send("loop 100000")
    for _ in range(6):
        phys = physical(node)
        assert phys["used"] <= DEVICE, phys
        for c in cs:
            assert c.on_device(phys) >= 2 * GiB, (c.region.name, phys)


def all_given_back(node: SimNode, cs: Sequence[Container]) -> None:
    """Once cs's workers are gone: nothing on the device, and nothing left
    in their regions but the guarantees."""
    assert physical(node)["used"] == 0
    for c in cs:
        assert c.figures() == {"used": 0, "spilled": 0, "resident": 0, "guarantee": 2 * GiB}


def race_and_kill(node: SimNode, cs: Sequence[Container], hold: str) -> None:
    """Each container of cs gets a second worker; every worker holds what
    the line `hold` allocates (1 GiB: so each container asked for its
    guarantee); then they race and are killed mid-way, and everything is
    given back."""
    for c in cs:
        c.another()
    try:
        for c in cs:
            for i in range(2):
                assert c.ask(hold, i)["err"] == "CUDA_SUCCESS"
        race(node, cs)
    finally:
        for c in cs:
            c.kill()
    all_given_back(node, cs)


def check_guarantees(
    node: SimNode, *containers: Container, asked: Mapping[int, int] | None = None
) -> None:
    """The device within its size, and each container holding at least its
    2 GiB guarantee there by the driver's count (with `asked`, {pid: bytes}:
    each that asked for at least that, its context included), and the
    region's resident bytes agreeing with it."""
    phys = physical(node)
    assert phys["used"] <= DEVICE, phys
    for c in containers:
        held = c.on_device(phys)
        fig = c.figures()
        assert fig["guarantee"] == 2 * GiB, fig
        if asked is None or asked[c.pid] + SIM_CONTEXT >= 2 * GiB:
            assert held >= 2 * GiB, (c.region.name, held, phys)
        assert fig["resident"] == held, (fig, held)


def nothing_left(node: SimNode, cs: Sequence[Container]) -> None:
    """Once cs are killed: nothing on the device, nothing used or spilled
    in their regions."""
    assert physical(node)["used"] == 0
    for c in cs:
        assert c.figures()["used"] == 0
        assert c.figures()["spilled"] == 0


def worker(commands: str) -> str:
    """A worker program: WORKER_HEAD, a primary context (init()), then
    `commands` (what else it sets up, its functions and COMMANDS), then
    WORKER_LOOP."""
    return WORKER_HEAD + "init()\n" + textwrap.dedent(commands) + WORKER_LOOP
