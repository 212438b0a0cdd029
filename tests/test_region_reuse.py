"""A region reused by a later run (a restarted container keeps its region
file): the limits its environment gives apply once nothing of the earlier
run is alive, and a process whose environment gives another limit than
the live processes' is refused with one line that names both, unless the
limit was set live (set-limit, through the supervisor's
gv_device_set_limit)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.helpers import REPO_ROOT, RUN, GiB, Holder, SimNode, run_cmd, run_py

# The device's total as cuMemGetInfo shows it, and whether 1.5 GiB fits.
PROBE = """
import json
from tests.cuclient import call, init, mem_info, cu
init()
err, ptr = call(cu.cuMemAlloc, 3 << 29)
print(json.dumps({"total": mem_info()[1], "alloc": err.name}))
"""

# Holds a context and 64 MiB (so it is registered in the region) until told.
HOLD = """
from tests.cuclient import hold, init, ok, cu
init()
ok(cu.cuMemAlloc, 64 << 20)
hold()
"""


def run(node: SimNode, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(node.env)
    env["GPUVISOR_NODE_SOCKET"] = str(node.dir / "no-agent.sock")
    probe = [sys.executable, "-c", textwrap.dedent(PROBE)]
    return run_cmd([*RUN, *args, "--region", str(node.region), "--", *probe], env)


def probe(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return result


def test_a_later_run_gets_its_own_limit(node: SimNode):
    assert probe(run(node, "--memory", "8g")) == {"total": 8 * GiB, "alloc": "CUDA_SUCCESS"}
    assert probe(run(node, "--memory", "1g")) == {
        "total": GiB,
        "alloc": "CUDA_ERROR_OUT_OF_MEMORY",
    }


def test_a_run_without_a_limit_leaves_none_behind(node: SimNode):
    assert probe(run(node))["total"] == 16 * GiB
    assert probe(run(node, "--memory", "1g")) == {
        "total": GiB,
        "alloc": "CUDA_ERROR_OUT_OF_MEMORY",
    }


def test_a_newcomer_with_another_limit_is_refused_while_one_lives(node: SimNode):
    with Holder(HOLD, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="8g")):
        proc = run_py(PROBE, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"))
        assert proc.returncode != 0
        assert "CUDA_ERROR_NOT_PERMITTED" in proc.stderr
        said = [line for line in proc.stderr.splitlines() if "CUDA_DEVICE_MEMORY_LIMIT" in line]
        assert len(said) == 1, proc.stderr
        assert "1073741824 bytes" in said[0]
        assert "8589934592 bytes" in said[0]
        # The same limit is welcome, and the live one's stands.
        assert json.loads(
            run_py(PROBE, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="8g")).stdout.splitlines()[-1]
        ) == {"total": 8 * GiB, "alloc": "CUDA_SUCCESS"}


SET_LIMIT = """
import sys
from gpuvisor.shim import Region
r = Region.attach(sys.argv[1])
r.set_limit(0, 2 << 30)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_limit_set_live_stands_for_newcomers(node: SimNode):
    with Holder(HOLD, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="8g")):
        run_py(SET_LIMIT, node.env, args=[str(node.region)], timeout=30)  # the setter exits
        for env_limit in ("1g", "8g"):
            proc = run_py(PROBE, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT=env_limit))
            assert json.loads(proc.stdout.splitlines()[-1]) == {
                "total": 2 * GiB,
                "alloc": "CUDA_SUCCESS",
            }, proc.stderr


def test_a_limit_set_live_stands_while_its_setter_lives(node: SimNode):
    """The supervisor applies a pushed limit before the workload's first
    process registers: nothing but the setter is alive then."""
    assert probe(run(node, "--memory", "8g"))["total"] == 8 * GiB  # the entry exists
    setter = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SET_LIMIT), str(node.region)],
        env=node.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        assert setter.stdout is not None
        assert setter.stdout.readline().strip() == "ready"
        proc = run_py(PROBE, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"))
        assert json.loads(proc.stdout.splitlines()[-1])["total"] == 2 * GiB, proc.stderr
    finally:
        setter.kill()
        setter.wait(30)
    # Gone, and nobody else alive: the environment's limit again.
    proc = run_py(PROBE, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT="1g"))
    assert json.loads(proc.stdout.splitlines()[-1])["total"] == GiB, proc.stderr
