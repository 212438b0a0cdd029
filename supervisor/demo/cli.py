"""`gpuvisor demo` (make demo): GPU sharing at work on one node.

It starts a node agent and three containers, each a `gpuvisor run`
supervisor around a workload (workload.py) with its own memory quota,
SM quota and policy, on a simulated two-GPU node (or on the real GPUs when
present):

  notebook  GPU 0  burst-share 20 %, 4 GiB; keeps asking for 512 MiB more
            every second, past its quota, and is refused;
  trainer   GPU 0  fixed-share 60 %, 8 GiB; starts a third of the way in,
            and the notebook gives back what it borrowed;
  batch     GPU 1  fixed-share 25 %, 2 GiB; alone on its GPU and still
            capped (a fixed share is a hard cap).

While it runs it shows a live table (rich); at the end it prints target
against achieved, writes summary.json and, with matplotlib, a PNG plot of
each container's SM share over time.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import IO

import click
from gpuvisor.shim.hardware import real_gpu_present
from gpuvisor.shim.loader import (
    SIM_NVML_NAME,
    NativeLibraryNotFound,
    library_path,
    simulator_dir,
)
from rich.console import Console
from rich.live import Live
from rich.markup import escape

from ..cli_types import Finite, seconds_option
from ..entrypoint.config import one_line
from .report import first_use, live_table, plot, stops, summary_table, verdicts
from .sampler import ProcessUtilization, Sampler
from .scenario import Workload, scenario

GPUVISOR = [sys.executable, "-m", "gpuvisor.supervisor"]
POLL_S = 0.5
_SCRUB_PREFIXES = ("CUDA_DEVICE_", "GPUVISOR_", "CUDA_TASK_", "GPU_CORE_")
_SCRUB = {"LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "CUDA_DISABLE_CONTROL"}


def _base_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith(_SCRUB_PREFIXES)
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _ends_with_the_demo() -> Callable[[], None]:
    """A preexec_fn for the demo's children (the agent, the containers):
    each gets SIGTERM when the demo dies, SIGKILL included, so that none
    outlives it (an agent left running kept its socket and port)."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork
    demo_pid = os.getpid()

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != demo_pid:  # the demo died before prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def _readline(stream: IO[str], timeout: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else ""


class Node:
    """The node agent and the supervised containers of one demo run."""

    def __init__(self, workdir: Path, logs: Path, env: dict[str, str], simulate: bool) -> None:
        self.workdir = workdir
        self.logs = logs
        self.env = env
        self.simulate = simulate
        # In a directory of its own, so that the agent's admin directory
        # ("<socket's directory>-admin": admin socket, state file) is inside
        # workdir too, and goes with it.
        self.socket = str(workdir / "run" / "node.sock")
        self.agent: subprocess.Popen[str] | None = None
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.status_url = ""

    def start_agent(self) -> None:
        env = dict(self.env)
        if self.simulate:  # host metrics from the simulated NVML
            env["LD_LIBRARY_PATH"] = str(simulator_dir())
        cmd = [*GPUVISOR, "node-agent", "--socket", self.socket, "--metrics-host", "127.0.0.1"]
        self.agent = subprocess.Popen(
            [*cmd, "--metrics-port", "0"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=(self.logs / "node-agent.log").open("w"),
            text=True,
            preexec_fn=_ends_with_the_demo(),
        )
        assert self.agent.stdout is not None
        line = _readline(self.agent.stdout, 30.0)
        if "ready" not in line:
            raise click.ClickException(
                f"the node agent did not start; see {self.logs / 'node-agent.log'}"
            )
        port = json.loads(line.split("ready", 1)[1])["metrics_port"]
        self.status_url = f"http://127.0.0.1:{port}/status"

    def start(self, w: Workload, seconds: float, backend: str) -> None:
        env = dict(self.env, POD_NAME=w.name, POD_NAMESPACE="demo", CONTAINER_NAME="main")
        env["CUDA_VISIBLE_DEVICES"] = str(w.gpu)
        cmd = [
            *GPUVISOR,
            "run",
            "--memory",
            w.memory,
            "--cores",
            str(w.sm),
            "--policy",
            w.policy,
            "--socket",
            self.socket,
            "--region",
            str(self.workdir / f"{w.name}.shr"),
            "--report-interval",
            "0.25",
            *(["--simulate"] if self.simulate else []),
            "--",
            sys.executable,
            "-m",
            "gpuvisor.supervisor.demo.workload",
            "--seconds",
            f"{seconds:.1f}",
            "--hold",
            w.hold,
            *(["--grow-to", w.grow_to] if w.grow_to else []),
            "--backend",
            backend,
        ]
        log = (self.logs / f"{w.name}.log").open("w")
        self.procs[w.name] = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_ends_with_the_demo(),
        )

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def stop(self) -> dict[str, int | None]:
        deadline = time.monotonic() + 30
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=15)
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()
        return {name: p.returncode for name, p in self.procs.items()}


def _workload_summary(log: Path) -> dict[str, int] | None:
    try:
        lines = log.read_text().strip().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                data: dict[str, int] = json.loads(line)
            except ValueError:
                return None
            return data
    return None


def run_demo(seconds: float, simulate: bool, out: Path, console: Console) -> int:
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    backend = "driver" if simulate else "torch"
    if not simulate and importlib.util.find_spec("torch") is None:
        raise click.ClickException(
            "the demo on a real GPU runs PyTorch workloads and PyTorch is not installed; "
            "install it, or run gpuvisor demo --simulate"
        )
    with tempfile.TemporaryDirectory(prefix="gpuvisor-demo-") as tmp:
        env = _base_env()
        nvml_path: str | None = None
        if simulate:
            env["GPUVISOR_SIM_STATE"] = str(Path(tmp) / "sim.state")
            env["GPUVISOR_SIM_DEVICES"] = "2x16g"
            os.environ.update({k: env[k] for k in ("GPUVISOR_SIM_STATE", "GPUVISOR_SIM_DEVICES")})
            nvml_path = str(simulator_dir() / SIM_NVML_NAME)
        try:
            nvml = ProcessUtilization(nvml_path)
        except Exception as exc:  # pynvml.NVMLError, OSError
            where = "the simulated NVML" if simulate else "NVML (no real GPU here?)"
            raise click.ClickException(
                f"cannot open {where}: {exc}; try gpuvisor demo --simulate"
            ) from None
        gpus = len(nvml.handles)
        where = "a simulated 2-GPU node (2 x 16 GiB)" if simulate else f"{gpus} real GPU(s)"
        workloads = scenario(seconds, gpus)
        console.print(f"[bold]gpuvisor demo[/] on {where}: a node agent and three containers")
        for w in workloads:
            extra = f", asks for up to {w.grow_to}" if w.grow_to else ""
            console.print(
                f"  {w.name:9} GPU {w.gpu}  {w.policy:12} SM {w.sm:3d} %  memory {w.memory}"
                f" (holds {w.hold}{extra})  from t = {w.start:g} s"
            )
        node = Node(Path(tmp), logs, env, simulate)
        try:
            node.start_agent()
            t0 = time.monotonic()
            sampler = Sampler(node.status_url, nvml, t0)
            began = _watch(node, sampler, workloads, seconds, backend, t0, console)
        finally:
            codes = node.stop()
            nvml.close()
    stopped = stops(workloads, sampler.series, began, seconds)
    results = verdicts(workloads, sampler.series, seconds, stopped)
    console.print(summary_table(workloads, sampler.series, results))
    failed = [n for n, c in codes.items() if c != 0]
    if failed:
        console.print(
            f"[red]workload(s) {', '.join(failed)} failed[/]; logs in {escape(str(logs))}"
        )
    summaries = {w.name: _workload_summary(logs / f"{w.name}.log") for w in workloads}
    for name, s in summaries.items():
        if s is not None:
            console.print(
                f"{name}: cuMemGetInfo inside the container reports a total of "
                f"{s['total'] / (1 << 30):.2f} GiB (its quota)"
            )
        if s is not None and s.get("refused"):
            console.print(
                f"{name}: {s['refused']} allocation(s) refused with CUDA_ERROR_OUT_OF_MEMORY; "
                f"it held {s['held'] >> 20} MiB against its quota"
            )
    png = plot(workloads, sampler.series, out / "sm-share.png", where)
    if png is None:
        console.print(
            "no plot: matplotlib is not installed (pip install 'gpuvisor[plot]', "
            "or pip install matplotlib, then run the demo again)",
            markup=False,
        )
    else:
        console.print(f"plot of each container's SM share over time: {png}", markup=False)
    (out / "summary.json").write_text(
        json.dumps(
            {
                "where": where,
                "seconds": seconds,
                "workloads": [asdict(w) for w in workloads],
                "exit_codes": codes,
                "workload_summaries": summaries,
                "verdicts": [asdict(v) for v in results],
                "series": {k: [asdict(p) for p in s.points] for k, s in sampler.series.items()},
                "plot": None if png is None else str(png),
            },
            indent=1,
        )
    )
    held = all(v.ok for v in results) and not failed
    console.print(
        f"every promise held: {'[green]yes[/]' if held else '[red]no[/]'}  "
        f"(details: {escape(str(out / 'summary.json'))}, logs: {escape(str(logs))})"
    )
    return 0 if not failed else 1


# A later container on a GPU starts this long after the earlier ones there
# first used it (report.py needs 2.5 s alone for an "alone" phase), and at
# most MAX_WAIT_S after its own time.
ALONE_S = 3.0
MAX_WAIT_S = 30.0


def _watch(
    node: Node,
    sampler: Sampler,
    workloads: list[Workload],
    seconds: float,
    backend: str,
    t0: float,
    console: Console,
) -> dict[str, float]:
    """Start the workloads on time and show the table until they are done;
    when each was started (seconds since t0)."""
    pending = sorted(workloads, key=lambda w: w.start)
    started: list[Workload] = []
    began: dict[str, float] = {}
    last_plain = -10.0

    def due(w: Workload, t: float) -> bool:
        """w's time has come, and the containers started before it on its
        GPU have used the GPU for ALONE_S (so the summary shows them alone:
        on a loaded machine a container's start took longer than the
        schedule allowed, and the demo had no "alone" phase), or w waited
        MAX_WAIT_S past its time for them."""
        if t < w.start:
            return False
        if t >= w.start + MAX_WAIT_S:
            return True
        for o in started:
            if o.gpu == w.gpu:
                first = first_use(sampler.series.get(o.name), o.start)
                if first is None or t - first < ALONE_S:
                    return False
        return True

    def step() -> float:
        t = time.monotonic() - t0
        while pending and due(pending[0], t):
            w = pending.pop(0)
            started.append(w)
            began[w.name] = t
            node.start(w, seconds - w.start, backend)
        sampler.poll()
        return t

    if console.is_terminal:
        with Live(console=console, auto_refresh=False) as live:
            while pending or node.running():
                t = step()
                live.update(live_table(workloads, sampler.series, t), refresh=True)
                time.sleep(POLL_S)
        return began
    while pending or node.running():
        t = step()
        if t - last_plain >= 4.0:
            console.print(live_table(workloads, sampler.series, t))
            last_plain = t
        time.sleep(POLL_S)
    return began


@click.command("demo")
@seconds_option(
    "--seconds",
    24.0,
    "How long the demo runs.",
    # Finite: click's FloatRange lets nan through (every comparison with it
    # is false), and a demo of nan seconds never ends.
    kind=Finite(min=9, max=600),
)
@click.option(
    "--simulate/--real",
    default=None,
    help="Use the simulated GPU / the real ones (default: real GPUs when present).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("gpuvisor-demo"),
    show_default=True,
    help="Where summary.json, sm-share.png and the logs go.",
)
def demo(seconds: float, simulate: bool | None, out: Path) -> None:
    """Three containers sharing GPUs: live view, summary and a plot of SM shares."""
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(
            f"{str(out)!r}: cannot create {exc.filename or out} ({exc.strerror or exc})",
            param_hint="'--out'",
        ) from None
    if simulate is None:
        simulate = not real_gpu_present()
        if not simulate and importlib.util.find_spec("torch") is None:
            # The workloads on real GPUs are PyTorch programs.
            click.echo(
                "Real GPUs found, but PyTorch is not installed: running the demo on the "
                "simulated node (install PyTorch, or pass --real to be told what is missing)."
            )
            simulate = True
    try:  # the containers' library, and the simulated driver they run on
        library_path()
        if simulate:
            simulator_dir()
    except NativeLibraryNotFound as exc:
        raise click.ClickException(one_line(str(exc))) from None
    # Not a terminal (a log, CI): plain tables wide enough for every column.
    console = Console() if sys.stdout.isatty() else Console(width=150)
    sys.exit(run_demo(seconds, simulate, out, console))
