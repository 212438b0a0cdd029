"""Fuzzing what a container can write on the node besides the socket
(issue 36, "Also"): the node-wide launch-order file every container maps
(`gpuvisor-sm-<uuid>`), and region files of its own making.  Seeded
(GPUVISOR_FUZZ_SEED, default 36), bounded (about 10 s).

Pass criteria: a victim container (SM limit 50 %, memory limit 1 GiB)
running beside the garbage keeps launching (no stall: at least
MIN_LAUNCHES 1 ms kernels in RUN_S seconds, where it makes about 2,000
alone), exits 0, and its own region's figures are what it did; a process
given a region of garbage is refused with one line, never killed by a
signal.
"""

from __future__ import annotations

import json
import os
import random
import sys
import textwrap
import threading
import time
from pathlib import Path

from tests.helpers import CU_SPIN_PRELUDE, SimNode, run_py, start_cmd

SEED = int(os.environ.get("GPUVISOR_FUZZ_SEED", "36"))
RUN_S = 4.0
MIN_LAUNCHES = 100
MiB = 2**20

VICTIM = CU_SPIN_PRELUDE + textwrap.dedent(
    """
    import json, sys, time
    held = chk(cu.cuMemAlloc(64 * 2**20))
    launch(1000)
    chk(cu.cuStreamSynchronize(s))
    print("ready", flush=True)
    sys.stdin.readline()
    end = time.monotonic() + float(sys.argv[1])
    n = 0
    while time.monotonic() < end:
        launch(1000)
        n += 1
        if n % 50 == 0:
            chk(cu.cuMemFree(chk(cu.cuMemAlloc(2**20))))
    chk(cu.cuStreamSynchronize(s))
    print(json.dumps({"launches": n}), flush=True)
    """
)

USED = """
from gpuvisor.shim.region import Region
r = Region.attach()
print(r.used(0), r.get_limit(0))
"""

TRY_CUDA = (
    "from cuda.bindings import driver as cu\n"
    "print(cu.cuInit(0)[0].name)\n"
    "print(cu.cuDevicePrimaryCtxRetain(0)[0].name)\n"
)


def _scribble(path: Path, rng: random.Random, until: float) -> int:
    """Random bytes at random offsets of path (never past its end: a
    truncated file is a known open case, docs/security.md) until `until`."""
    writes = 0
    size = path.stat().st_size
    with path.open("r+b") as f:
        while time.monotonic() < until:
            off = rng.randrange(size)
            f.seek(off)
            f.write(bytes(rng.randrange(256) for _ in range(min(rng.randrange(1, 64), size - off))))
            f.flush()
            writes += 1
            time.sleep(rng.random() * 0.002)
    return writes


def test_garbage_in_the_launch_order_file_stalls_no_neighbour(node: SimNode) -> None:
    rng = random.Random(SEED)
    env = node.shimmed(CUDA_DEVICE_SM_LIMIT="50", CUDA_DEVICE_MEMORY_LIMIT="1g")
    victim = start_cmd(
        [sys.executable, "-c", VICTIM, str(RUN_S)],
        env,
        stdin=True,
    )
    try:
        assert victim.stdout is not None
        assert victim.stdin is not None
        assert victim.stdout.readline().strip() == "ready", victim.stderr
        before = run_py(USED, node.env).stdout.split()
        (order,) = node.dir.glob("gpuvisor-sm-*")  # made by the victim's first launch
        until = time.monotonic() + RUN_S
        writes: list[int] = []
        hostile = threading.Thread(
            target=lambda: writes.append(_scribble(order, rng, until)), daemon=True
        )
        hostile.start()
        victim.stdin.write("\n")
        victim.stdin.flush()
        out, err = victim.communicate(timeout=RUN_S + 60)
        hostile.join(30)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert victim.returncode == 0, (SEED, victim.returncode, err)
    launches = json.loads(out.strip().splitlines()[-1])["launches"]
    print(f"seed {SEED}: {writes[0]} writes into {order.name}; victim launched {launches}")
    assert launches >= MIN_LAUNCHES, (SEED, launches, err)
    assert writes[0] > 100
    # Its own region: the limit it was given is unchanged, and it held its
    # 64 MiB (and context) while it ran.
    after = run_py(USED, node.env).stdout.split()
    assert after[1] == before[1] == str(1 << 30), (before, after)
    assert int(before[0]) >= 64 * MiB


def test_a_region_of_garbage_is_refused_in_one_line(node: SimNode, tmp_path: Path) -> None:
    """A region file a container filled with random bytes (or a real
    region whose header is intact and whose body is garbage): its
    processes are refused or run on, but are never killed by a signal nor
    hang, and the refusal is one line."""
    rng = random.Random(SEED)
    # A real region to take the header from.
    assert run_py(TRY_CUDA, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g")).returncode == 0
    real = node.region.read_bytes()
    cases = {
        "random": bytes(rng.randrange(256) for _ in range(len(real))),
        "short": bytes(rng.randrange(256) for _ in range(100)),
        "body": real[:64] + bytes(rng.randrange(256) for _ in range(len(real) - 64)),
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.shr"
        path.write_bytes(data)
        env = node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(path))
        proc = run_py(TRY_CUDA, env)
        assert proc.returncode >= 0, (SEED, name, proc.returncode, proc.stderr)
        results = proc.stdout.split()
        if results[:1] != ["CUDA_SUCCESS"]:
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert len(lines) == 1, (SEED, name, proc.stderr)
            assert str(path) in lines[0], (SEED, name, lines)
