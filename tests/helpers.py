"""Helpers shared by the test modules (the fixtures are in conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = REPO_ROOT / "build"
LIBRARY = BUILD_DIR / "libgpuvisor.so"
SIM_DIR = BUILD_DIR / "sim"
SIM_LIBS = (SIM_DIR / "libcuda.so.1", SIM_DIR / "libnvidia-ml.so.1")

GiB = 1 << 30
MiB = 1 << 20

# Variables of the host environment that would change what a test sees.
_SCRUBBED_PREFIXES = ("CUDA_", "GPUVISOR_", "LIBCUDA_", "NVIDIA_")
_SCRUBBED = {"LD_PRELOAD", "LD_LIBRARY_PATH"}


# Prelude of child programs that call the driver through cuda-python: `cu`,
# `R` (CUDA_SUCCESS) and `chk`, which asserts a call's success and unwraps a
# (CUresult, value) tuple.  Programs add their own imports.
CU_CHK = """
import ctypes
from cuda.bindings import driver as cu
R = cu.CUresult.CUDA_SUCCESS
def chk(r):
    e = r[0] if isinstance(r, tuple) else r
    assert e == R, e
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r
"""

# CU_CHK, then for programs that launch `spin` kernels: `spin` is the
# simulator's kernel (its first parameter: microseconds), `s` a stream on
# device 0's primary context.
CU_SPIN_PRELUDE = (
    CU_CHK
    + """
chk(cu.cuInit(0))
chk(cu.cuCtxSetCurrent(chk(cu.cuDevicePrimaryCtxRetain(0))))
spin = chk(cu.cuModuleGetFunction(chk(cu.cuModuleLoadData(b"any image")), b"spin"))
s = chk(cu.cuStreamCreate(0))
def launch(us):
    chk(cu.cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, s, ((us,), (ctypes.c_uint32,)), 0))
"""
)

# Says "ready", waits for a line on stdin, then launches 1 ms kernels back
# to back until killed (start_ready starts it).
CU_SPIN_LAUNCHER = (
    CU_SPIN_PRELUDE
    + """
import sys
print("ready", flush=True)
sys.stdin.readline()
while True:
    launch(1000)
"""
)


def missing_build_outputs() -> list[Path]:
    return [p for p in (LIBRARY, *SIM_LIBS) if not p.is_file()]


def clean_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without the variables gpuvisor, CUDA or the loader read."""
    env = dict(os.environ if base is None else base)
    for key in list(env):
        if key in _SCRUBBED or key.startswith(_SCRUBBED_PREFIXES):
            del env[key]
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class SimNode:
    """A fresh simulated node: its own state file and region file under dir."""

    dir: Path
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, directory: Path, devices: str = "2x16g") -> SimNode:
        env = clean_env()
        env.update(
            {
                "LD_LIBRARY_PATH": str(SIM_DIR),
                "GPUVISOR_SIM_STATE": str(directory / "sim.state"),
                "GPUVISOR_SIM_DEVICES": devices,
                "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(directory / "region.shr"),
                # This node's own shared directory (HAMi's /tmp/vgpulock):
                # the node lock and the launch order between containers.
                "GPUVISOR_NODE_LOCK": str(directory / "gpuvisor.lock"),
            }
        )
        return cls(dir=directory, env=env)

    @property
    def state(self) -> Path:
        return Path(self.env["GPUVISOR_SIM_STATE"])

    @property
    def region(self) -> Path:
        return Path(self.env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])

    def shimmed(self, **extra: str) -> dict[str, str]:
        """The node's env with libgpuvisor.so preloaded, plus extra variables."""
        env = dict(self.env)
        env["LD_PRELOAD"] = str(LIBRARY)
        env.update(extra)
        return env


def run_cmd(
    cmd: list[str], env: Mapping[str, str], timeout: float = 60, cwd: Path = REPO_ROOT
) -> subprocess.CompletedProcess[str]:
    """Run cmd from cwd (the checkout's root) in env, its output captured as
    text; return the finished process, whatever its exit status."""
    return subprocess.run(
        cmd,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
    )


def start_cmd(
    cmd: list[str], env: Mapping[str, str], *, stdin: bool = False, stderr: IO[str] | None = None
) -> subprocess.Popen[str]:
    """Start cmd from the checkout's root in env, its stdout and stderr (and
    stdin, if asked) piped as text; stderr into a file instead if given one
    (a chatty child must never block on a pipe nobody reads)."""
    return subprocess.Popen(
        cmd,
        env=dict(env),
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr is None else stderr,
        text=True,
        cwd=REPO_ROOT,
    )


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGTERM proc if it still runs, SIGKILL it if it has not exited within
    timeout; reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_benches(*names: str) -> Path:
    """Build the benchmarks build/bench/NAME (make, from the checkout's
    root: the Makefile's pattern rules are written for $(BUILD)/..., and an
    absolute path matches none), one make at a time across pytest-xdist
    workers; return their directory."""
    import fcntl

    bench = BUILD_DIR / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    with open(bench / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        targets = [f"build/bench/{name}" for name in names]
        subprocess.run(
            ["make", "-s", "-C", str(REPO_ROOT), *targets],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
    return bench


def run_py(
    code: str, env: Mapping[str, str], timeout: float = 60, *, args: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `python -c code` (dedented) in env; return the finished process."""
    return run_cmd([sys.executable, "-c", textwrap.dedent(code), *(args or [])], env, timeout)


# A process a test drives dies with the test's process (PR_SET_PDEATHSIG):
# an interrupted run leaves no helper behind (one paused by its yield flag
# would poll its gate for good).  It also writes its Python threads' stacks
# to stderr on SIGUSR2 (hung_report).
DIE_WITH_PARENT = (
    "import ctypes, faulthandler, signal; ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
    "faulthandler.register(signal.SIGUSR2, all_threads=True)\n"
)


def hung_report(procs: Mapping[str, subprocess.Popen[str]]) -> str:
    """What processes that did not finish in time were doing, for the
    failure message: each one's state, each thread's kernel wait channel and
    system call (/proc), then, for a child started by start_piped that can
    still run, its Python stacks (SIGUSR2; a stopped one cannot answer).
    Kills them all."""
    lines = []
    for name, proc in procs.items():
        task = Path(f"/proc/{proc.pid}")
        try:
            state = next(
                (ln for ln in (task / "status").read_text().splitlines() if ln.startswith("State")),
                "State: ?",
            )
            lines.append(f"{name} (pid {proc.pid}): {state}")
            for t in sorted((task / "task").iterdir(), key=lambda p: int(p.name)):
                wchan = (t / "wchan").read_text().strip() or "-"
                call = (t / "syscall").read_text().split()[:1]
                lines.append(f"  thread {t.name}: wchan {wchan}, syscall {' '.join(call)}")
        except OSError as e:
            lines.append(f"{name} (pid {proc.pid}): gone ({e})")
            continue
        if "stopped" not in state and proc.poll() is None:
            proc.send_signal(signal.SIGUSR2)
    time.sleep(1.0)
    for name, proc in procs.items():
        if proc.poll() is None:
            proc.kill()
        try:
            _, err = proc.communicate(timeout=30)
        except (subprocess.TimeoutExpired, ValueError):
            err = ""
        lines.append(f"--- {name}'s stderr (tail):\n{(err or '')[-3000:]}")
    return "\n".join(lines)


def start_piped(code: str, env: Mapping[str, str], *args: str) -> subprocess.Popen[str]:
    """Start `python -c code args` (dedented) with piped stdin, stdout and
    stderr, for a test that drives it line by line; it dies with the test."""
    cmd = [sys.executable, "-c", DIE_WITH_PARENT + textwrap.dedent(code), *args]
    return start_cmd(cmd, env, stdin=True)


def start_ready(
    code: str, env: Mapping[str, str], *args: str, ready: str = "ready"
) -> subprocess.Popen[str]:
    """start_piped, returning once the child printed the line `ready`.
    Fails the test with its stderr if the first line is anything else."""
    proc = start_piped(code, env, *args)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == ready, line + (proc.stderr.read() if proc.stderr else "")
    return proc


CLI = [sys.executable, "-c", "from gpuvisor.supervisor.cli import main; main()"]
RUN = [*CLI, "run"]  # gpuvisor run


def answer(proc: subprocess.Popen[str], line: str | None = None) -> dict[str, Any]:
    """The JSON object on proc's next line of output, after line (if any) is
    written to its stdin; fails with proc's stderr if it ended instead."""
    assert proc.stdin is not None
    assert proc.stdout is not None
    if line is not None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    out = proc.stdout.readline()
    assert out, proc.stderr.read() if proc.stderr else f"{proc.args!r} ended"
    result: dict[str, Any] = json.loads(out)
    return result


@contextmanager
def driven(
    code: str, env: Mapping[str, str], *args: str, ready: str = "ready"
) -> Iterator[subprocess.Popen[str]]:
    """start_ready for a with block, at whose end the child is killed and reaped."""
    proc = start_ready(code, env, *args, ready=ready)
    try:
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def run_cli(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run the gpuvisor command line (from this checkout) with args, in env
    (a clean environment unless given)."""
    return run_cmd([*CLI, *args], clean_env() if env is None else env, timeout)


def run_json(
    code: str, env: Mapping[str, str], timeout: float = 60, *, args: list[str] | None = None
) -> Any:
    """Run code that prints one JSON document as its last stdout line; return it.

    Fails the test with the process's output when it exits non-zero or
    prints no JSON.
    """
    proc = run_py(code, env, timeout, args=args)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"child exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise AssertionError(
            f"child printed no JSON: {exc}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        ) from exc


class Holder:
    """A child process that sets something up, reports READY, and holds it.

    The code must end by calling tests.cuclient.hold(**values); entering the
    context returns those values; leaving it releases and reaps the child.
    """

    def __init__(self, code: str, env: Mapping[str, str], timeout: float = 60) -> None:
        self.code = textwrap.dedent(code)
        self.env = dict(env)
        self.timeout = timeout
        self.proc: subprocess.Popen[str] | None = None
        # A file, not a pipe: a chatty child must never block on stderr.
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in __exit__)

    def __enter__(self) -> Any:
        self.proc = start_cmd(
            [sys.executable, "-c", self.code], self.env, stdin=True, stderr=self.stderr
        )
        assert self.proc.stdout is not None
        seen: list[str] = []
        for line in self.proc.stdout:
            if line.startswith("READY "):
                return json.loads(line[len("READY ") :])
            seen.append(line)
        self.proc.wait(self.timeout)
        self.stderr.seek(0)
        err = self.stderr.read()
        raise AssertionError(
            f"holder exited {self.proc.returncode} before READY\n--- stdout\n"
            f"{''.join(seen)}--- stderr\n{err}"
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL the holder (it leaves its slot behind) and reap it."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(self.timeout)

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
                self.proc.wait(self.timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(self.timeout)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self.stderr.close()


def repo_files(root: Path = REPO_ROOT) -> list[str]:
    """The checkout's tracked and untracked-but-not-ignored files (no build outputs)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return [name.decode() for name in out if name and (root / name.decode()).is_file()]


# NVML's per-process SM utilisation of device 0 since a timestamp (us), as
# {pid: smUtil}; {} when NVML has no samples since then.
NVML_SHARES = """
import json, sys
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
try:
    samples = n.nvmlDeviceGetProcessUtilization(h, int(sys.argv[1]))
except n.NVMLError:
    samples = []
# One entry per process over the samples asked for, or one per process and
# sample (GPUVISOR_SIM_NVML_PER_SAMPLE, as a real driver may answer): then a
# process's share is its entries' sum over the samples there were.
pids = [s.pid for s in samples]
periods = len({s.timeStamp for s in samples}) if len(set(pids)) < len(pids) else 1
shares = {}
for s in samples:
    shares[str(s.pid)] = shares.get(str(s.pid), 0) + s.smUtil
print(json.dumps({pid: round(v / periods) for pid, v in shares.items()}))
"""


def nvml_shares(node: SimNode, since_us: int) -> dict[str, int]:
    """NVML's per-process SM shares on node's device 0 since since_us."""
    shares: dict[str, int] = run_json(NVML_SHARES, node.env, args=[str(since_us)])
    return shares


def shares_over(node: SimNode, seconds: float) -> dict[str, int]:
    """NVML's per-process SM shares over the next `seconds` (waits them)."""
    since = int(time.time() * 1e6)
    time.sleep(seconds)
    return nvml_shares(node, since)


def region_call(node: SimNode, code: str) -> str:
    """Run code with `r`, the node's region attached, in another process (as
    the supervisor or an operator would); its stdout."""
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from gpuvisor.shim.region import Region\nr = Region.attach()\n" + code,
        ],
        env=node.env,
        check=True,
        timeout=60,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    ).stdout
