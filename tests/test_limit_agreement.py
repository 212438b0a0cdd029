"""The library and `gpuvisor run` agree on every limit value.

One table of odd values (blanks of every kind, signs, non-ASCII digits,
overflow, trailing junk, empty, an ordinal past the node's devices) is fed
to three readers: the library in a real process on the simulated node
(cuInit succeeds or fails closed with CUDA_ERROR_NOT_PERMITTED), the
Python validator `gpuvisor run` checks the workload's environment with,
and `gpuvisor run`'s own option (`--memory`, `--cores`, `--priority`).
Each must accept exactly what the others accept, and an accepted option
must mean for the workload what the variable means.
"""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from gpuvisor.shim import parse_memory_limit
from gpuvisor.supervisor.entrypoint import config
from gpuvisor.supervisor.entrypoint.run import run as run_command

from tests.helpers import REPO_ROOT, SimNode, run_py

NOT_PERMITTED = 800

# cuInit's code, through the preloaded library (the whole environment is
# checked there, before the first hooked call returns).
PROBE = "import ctypes; print(ctypes.CDLL('libcuda.so.1').cuInit(0))"

MEMORY_VALUES = [
    "4g",
    " 4g ",
    "\t4g\n",
    "4g\v",
    "4g\u00a0",
    "\u00a04g",
    "\u30004g",
    "4g\x1c",
    "\x854g",
    "+4g",
    "-4g",
    "4 g",
    "\u0664g",
    "\uff14g",
    "4g\u0301",
    "",
    "   ",
    "0",
    "00",
    "0g",
    "18446744073709551615",
    "18446744073709551616",
    "16777215t",
    "16777216t",
    "99999999999999999999999999999999999999999g",
    "4gx",
    "4gibb",
    "1e9",
    "0x10",
    "1_000",
    "4GiB",
    "3000m",
    "1024m",
    "1g",
    "1.5g",
    "1.5",
    ".5g",
    "5.g",
    "25%",
    "25 %",
    "100%",
    "100.000001%",
    "0.5%",
    "150%",
    "4294967296",
    "4\udcffg",
]
SM_VALUES = [
    "50",
    " 50 ",
    "\t50\n",
    "+50",
    "-0",
    "5_0",
    "\u0665\u0660",
    "\uff15\uff10",
    "50\u00a0",
    "\u00a050",
    "101",
    "100",
    "0",
    "",
    " ",
    "000000000000000000000000050",
    "99999999999999999999999999",
    "12.5",
    "50%",
    "0x32",
    "1e2",
    "50x",
]
PRIORITY_VALUES = ["0", "1", " 1", "1 ", "+1", "01", "\u0661", "2", "-0", "", "true"]

POLICY_VALUES = [
    "burst-share",
    "Burst-Share",
    "BEST-EFFORT",
    "fixed-share",
    " burst-share",
    "burst-share ",
    "burst_share",
    "burst",
    "",
]

# Suffixes that are not ordinals: refused whatever the value.
NOT_ORDINALS = [
    f"CUDA_DEVICE_MEMORY_LIMIT{suffix}"
    for suffix in ("_01", "_1000000", "_\u0661", "_+1", "_ 1", "S", "_")
]

ROWS = (
    [("CUDA_DEVICE_MEMORY_LIMIT", v) for v in MEMORY_VALUES]
    + [("CUDA_DEVICE_MEMORY_LIMIT_1", v) for v in ("4g", "+4g", "4g\u00a0")]
    # Ordinals past the node's two devices: unused, but still checked.
    + [("CUDA_DEVICE_MEMORY_LIMIT_7", v) for v in ("1g", "abc", "-1")]
    + [(name, "1g") for name in NOT_ORDINALS]
    + [("CUDA_DEVICE_SM_LIMIT", v) for v in SM_VALUES]
    + [("CUDA_DEVICE_SM_LIMIT_9", v) for v in ("50", "5_0")]
    + [("CUDA_TASK_PRIORITY", v) for v in PRIORITY_VALUES]
    + [("GPUVISOR_SM_POLICY", v) for v in POLICY_VALUES]
)
OPTION = {
    "CUDA_DEVICE_MEMORY_LIMIT": "--memory",
    "CUDA_DEVICE_SM_LIMIT": "--cores",
    "CUDA_TASK_PRIORITY": "--priority",
    "GPUVISOR_SM_POLICY": "--policy",
}


def library_accepts(node: SimNode, name: str, value: str) -> bool:
    proc = subprocess.run(
        [sys.executable, "-S", "-c", PROBE],
        env=node.shimmed(**{name: value}),
        capture_output=True,
        text=True,
        errors="surrogateescape",  # the line quotes the value's own bytes
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    code = int(proc.stdout)
    assert code in (0, NOT_PERMITTED), proc.stderr
    said = [line for line in proc.stderr.splitlines() if name in line]
    if code == NOT_PERMITTED:
        assert len(said) == 1, proc.stderr  # one line naming the variable
    return code == 0


def validator_accepts(node: SimNode, name: str, value: str) -> bool:
    try:
        config.validate_shim_environment({**node.env, name: value})
    except config.ConfigError as exc:
        message = str(exc)
    else:
        return True
    assert name in message
    assert "\n" not in message
    return False


def option_env(node: SimNode, option: str, value: str) -> dict[str, str] | None:
    """The workload's environment `gpuvisor run OPTION VALUE` builds, or
    None when it refuses the value (one line, naming the option)."""
    try:
        ctx = run_command.make_context("run", [option, value, "--", "true"])
    except click.ClickException as exc:
        message = exc.format_message()
    else:
        p = ctx.params
        opts = config.RunOptions(
            memory=p["memory"], cores=p["cores"], priority=p["priority"], policy=p["policy"]
        )
        built: dict[str, str] = config.build(opts, ["true"], node.env).env
        return built
    assert option in message, message
    assert "\n" not in message, message
    return None


def meaning(name: str, value: str) -> object:
    """What an accepted value means to the library."""
    if name.startswith("CUDA_DEVICE_MEMORY_LIMIT"):
        return parse_memory_limit(value, 16 << 30)
    if name == "GPUVISOR_SM_POLICY":
        return value.lower()  # any case; blanks are refused
    return int(value.strip(" \t\n\v\f\r"))


@pytest.mark.parametrize(("name", "value"), ROWS, ids=[f"{n}={v!a}" for n, v in ROWS])
def test_library_validator_and_option_agree(node, name, value):
    lib_ok = library_accepts(node, name, value)
    if name in NOT_ORDINALS:
        assert not lib_ok
    assert validator_accepts(node, name, value) == lib_ok
    option = OPTION.get(name)
    if option is None:
        return
    env = option_env(node, option, value)
    if value == "":
        # Given but empty: refused (the variable empty would mean "no limit").
        assert env is None
        return
    assert (env is not None) == lib_ok, f"{option} {value!a}: library says {lib_ok}"
    if env is not None:
        assert meaning(name, env[name]) == meaning(name, value)


# A process of the container configures device 0's region entry from its
# environment at its first CUDA use, then reads the priority stored there.
PRIORITY_PROBE = """
import ctypes
lib = ctypes.CDLL("libcuda.so.1")
ctx = ctypes.c_void_p()
assert lib.cuInit(0) == 0
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert lib.cuCtxSetCurrent(ctx) == 0
free, total = ctypes.c_size_t(), ctypes.c_size_t()
assert lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
from gpuvisor.shim.region import Region
sm = Region.attach().sm(0)
print(sm.policy, sm.priority)
"""

SM_SETTINGS = ("CUDA_TASK_PRIORITY", "GPUVISOR_SM_POLICY", "GPU_CORE_UTILIZATION_POLICY")
# (priority, policy, core policy); None: unset.
SETTINGS_ROWS = [
    (None, None, None),
    ("", None, None),
    ("0", None, None),
    ("1", None, None),
    ("0", "burst-share", None),
    (None, "Best-Effort", None),
    ("1", "best-effort", "default"),
    ("0", "burst-share", "force"),
    (None, "best-effort", "Disable"),
]


@pytest.mark.parametrize(
    "row", SETTINGS_ROWS, ids=["-".join(str(v) for v in row) for row in SETTINGS_ROWS]
)
def test_library_and_supervisor_read_policy_and_priority_alike(node, tmp_path, row):
    """What the supervisor reports (config.build: policy and priority) is
    what a process of the container stores in the region at its first CUDA
    use.  CUDA_TASK_PRIORITY unset or empty means 1 (low), as in HAMi-core
    (whose region starts with priority 1); GPU_CORE_UTILIZATION_POLICY=force
    or disable mean fixed-share."""
    env = node.shimmed(CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "prio.shr"))
    base = dict(node.env)
    for name, value in zip(SM_SETTINGS, row, strict=True):
        env.pop(name, None)
        base.pop(name, None)
        if value is not None:
            env[name] = base[name] = value
    proc = run_py(PRIORITY_PROBE, env)
    assert proc.returncode == 0, proc.stderr
    policy, priority = proc.stdout.split()[-2:]
    built = config.build(config.RunOptions(), ["true"], base)
    assert (policy, int(priority)) == (built.policy, built.priority)
    prio, pol, core = row
    assert built.priority == (0 if prio == "0" else 1)
    plain = pol.lower() if pol and (core or "").lower() not in ("force", "disable") else None
    assert built.policy == (plain or "fixed-share")


def test_the_largest_memory_value_means_no_limit_as_documented(node: SimNode) -> None:
    """CUDA_DEVICE_MEMORY_LIMIT=2^64-1 is the library's GV_UNLIMITED: the
    device shows all its memory.  docs/environment.md says so in the
    variable's row."""
    code = "from tests.cuclient import init, mem_info\ninit()\nprint(mem_info()[1])\n"
    proc = run_py(code, node.shimmed(CUDA_DEVICE_MEMORY_LIMIT=str(2**64 - 1)))
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) == 16 << 30
    doc = (REPO_ROOT / "docs" / "environment.md").read_text()
    (row,) = [
        line for line in doc.splitlines() if line.startswith("| `CUDA_DEVICE_MEMORY_LIMIT` |")
    ]
    assert "18446744073709551615" in row
    assert "no limit" in row.split("|")[4]
