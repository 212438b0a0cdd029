"""Small helpers for the simulated-driver tests (tests/test_sim_*.py).

Every test gets its own state file under tmp_path, so tests are safe to run
in parallel (pytest -n auto).  Nothing here builds anything: `make all`
(or at least `make sim ctests`) must have run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from tests.helpers import start_cmd

REPO = Path(__file__).resolve().parent.parent
SIM_DIR = REPO / "build" / "sim"
T_SIM_BASIC = REPO / "build" / "tests" / "t_sim_basic"
T_SIM_KILL = REPO / "build" / "tests" / "t_sim_kill"
T_LINK_SIM = REPO / "build" / "tests" / "t_link_sim"
MiB = 1 << 20
GiB = 1 << 30

_SCRUB_PREFIXES = ("CUDA_", "GPUVISOR_", "NVIDIA_")


def sim_env(tmp_path: Path, devices: str | None = "2x16g", **extra: str) -> dict[str, str]:
    """A clean environment pointing the loader at build/sim and at a private state file."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_SCRUB_PREFIXES) and k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")
    }
    env["LD_LIBRARY_PATH"] = str(SIM_DIR)
    env["GPUVISOR_SIM_STATE"] = str(tmp_path / "sim.state")
    env["PYTHONUNBUFFERED"] = "1"
    if devices is not None:
        env["GPUVISOR_SIM_DEVICES"] = devices
    env.update(extra)
    return env


def run_py(
    code: str, env: dict[str, str], timeout: float = 60, *, args: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """Run Python code (with args) in a child process; returns the completed process."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def spawn_py(code: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """Start `python -c code` (dedented), its stdin, stdout and stderr piped."""
    return start_cmd([sys.executable, "-c", textwrap.dedent(code)], env, stdin=True)


def ready_then_go(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Wait for each child (spawn_py) to print "ready", then send each "go"."""
    for p in procs:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()


def ok(cp: subprocess.CompletedProcess[str]) -> str:
    """Assert the child succeeded; return its stdout."""
    assert cp.returncode == 0, f"rc={cp.returncode}\nstdout:\n{cp.stdout}\nstderr:\n{cp.stderr}"
    return cp.stdout


def run_c_test(binary: Path, tmp_path: Path) -> None:
    """Run one of the simulator's C tests with TMPDIR=tmp_path: it exits 0
    and its output ends with OK."""
    env = sim_env(tmp_path, TMPDIR=str(tmp_path))
    cp = subprocess.run([str(binary)], env=env, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert cp.stdout.strip().endswith("OK"), cp.stdout + cp.stderr


def has_cuda_bindings() -> bool:
    cp = subprocess.run([sys.executable, "-c", "import cuda.bindings.driver"], capture_output=True)
    return cp.returncode == 0


# ctypes prelude for child processes: direct calls into the simulated
# libcuda, cheaper than cuda-python for loops and crash tests.
CTYPES_PRELUDE = """
import ctypes, os, sys
cu = ctypes.CDLL("libcuda.so.1")
def chk(rc, what="call"):
    if rc != 0:
        raise SystemExit(f"{what} failed: {rc}")
def ctx(dev=0):
    chk(cu.cuInit(0), "cuInit")
    c = ctypes.c_void_p()
    chk(cu.cuCtxCreate_v2(ctypes.byref(c), 0, dev), "cuCtxCreate_v2")
    return c
def alloc(n):
    p = ctypes.c_ulonglong()
    rc = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))
    return rc, p.value
def free(p):
    return cu.cuMemFree_v2(ctypes.c_ulonglong(p))
def meminfo():
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    chk(cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)), "cuMemGetInfo_v2")
    return f.value, t.value
"""
