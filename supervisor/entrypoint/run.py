"""`gpuvisor run [OPTIONS] -- COMMAND [ARGS]...`: the container entrypoint.

Checks every value, attaches the container's region, starts the workload
with the shim preloaded in its own process group, and supervises it as
PID 1 (pid1.py) while a tuner thread (tuner.py) applies the node agent's
instructions and a reporter thread (reporter.py) reports usage to the
node agent.  See docs/cli.md.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import click
from gpuvisor.shim.capi import GpuvisorError
from gpuvisor.shim.limits import parse_memory_limit
from gpuvisor.shim.loader import SIM_NVML_NAME, NativeLibraryNotFound, simulator_dir
from gpuvisor.shim.region import Region

from ..cli_types import Finite
from .config import (
    ENV_PRIORITY,
    ENV_REGION,
    ENV_SCALING,
    ENV_SIM_STATE,
    ENV_SM,
    MAX_GRACE,
    MAX_INTERVAL,
    MIN_INTERVAL,
    POLICIES,
    ConfigError,
    RunConfig,
    RunOptions,
    build,
    check_shim_value,
    one_line,
)
from .pid1 import HANDLED, Pid1, SpawnError
from .reporter import Reporter, container_identity
from .tuner import Nvml, Sample, Tuner, agent_ack_timeout, clear_yields, open_nvml, read_sample

EXIT_USAGE = 2
ENV_LOG_LEVEL = "GPUVISOR_LOG_LEVEL"

log = logging.getLogger("gpuvisor.run")


class RunError(click.ClickException):
    """A bad value: one line on stderr, exit code 2, the workload not started."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class _RunCommand(click.Command):
    """Reports a bad option or value as one line (no usage block): the
    container's log shows the error alone (docs/cli.md)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:  # BadParameter, NoSuchOption, ...
            raise RunError(exc.format_message()) from None


class MemorySize(click.ParamType):  # type: ignore[type-arg]
    """A CUDA_DEVICE_MEMORY_LIMIT value, checked by the C parser."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        # As given: the C parser ignores the blanks it knows (str.strip()
        # would also drop U+00A0 and others the library refuses).
        text = str(value)
        try:
            # A percentage needs a device total; any total checks the form.
            parse_memory_limit(text, 1 << 40)
        except GpuvisorError as exc:
            self.fail(one_line(exc.message), param, ctx)
        except NativeLibraryNotFound as exc:
            # Not a bad value: the library is missing (exit 1, as documented).
            raise click.ClickException(one_line(str(exc))) from None
        return text


class ShimValue(click.ParamType):  # type: ignore[type-arg]
    """A value for one of the library's variables, checked by the library
    itself (gv_validate_env): click's int() would also take "+50", "5_0"
    or non-ASCII digits, which the variable refuses."""

    def __init__(self, variable: str, metavar: str) -> None:
        self.variable = variable
        self.name = metavar

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        if not text:
            # Empty would mean "unset" (no limit) to the library.
            self.fail(f'{self.variable}="": empty', param, ctx)
        try:
            check_shim_value(self.variable, text)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        except (NativeLibraryNotFound, GpuvisorError) as exc:
            # Not a bad value: the library is missing or not this version.
            raise click.ClickException(one_line(str(exc))) from None
        return text


LOG_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
}


def _setup_logging() -> None:
    level = os.environ.get(ENV_LOG_LEVEL, "warning").upper()
    logging.basicConfig(
        format="gpuvisor run: %(message)s",
        level=LOG_LEVELS.get(level, logging.WARNING),
        stream=sys.stderr,
    )


def _nvml_loader(cfg: RunConfig) -> Nvml | None:
    sim_nvml: str | None = None
    if cfg.simulate:
        os.environ[ENV_SIM_STATE] = cfg.env[ENV_SIM_STATE]
        try:
            sim_nvml = str(simulator_dir() / SIM_NVML_NAME)
        except NativeLibraryNotFound:
            return None
    return open_nvml(sim_nvml)


def supervise(cfg: RunConfig) -> int:
    """Attach the region, run the workload, tune and report; return the exit code."""
    try:
        region = Region.attach(cfg.region)
    except GpuvisorError as exc:
        raise RunError(f"{ENV_REGION}={cfg.region!r}: {one_line(exc.message)}") from None
    clear_yields(region)
    try:
        baseline: Sample | None = read_sample(region)
    except GpuvisorError as exc:
        log.warning("reading the region's counters failed: %s", exc)
        baseline = None
    tuner: Tuner | None = None
    reporter: Reporter | None = None

    def started(pid: int) -> None:
        nonlocal tuner, reporter
        tuner = Tuner(
            region,
            pid,
            nvml_loader=lambda: _nvml_loader(cfg),
            ack_timeout=agent_ack_timeout(cfg.report_interval),
            env_limits=cfg.limits,
        )
        tuner.start()
        reporter = Reporter(
            cfg.socket,
            cfg.report_interval,
            tuner,
            container_identity(cfg.env),
            cfg.policy,
            cfg.priority,
            baseline=baseline,
        )
        reporter.start()

    pid1 = Pid1(cfg.command, cfg.env, cfg.grace)
    try:
        code = pid1.run(started)
    except SpawnError as exc:
        click.echo(f"gpuvisor run: {exc}", err=True)
        code = exc.exit_code
    finally:
        if tuner is not None:
            tuner.stop()
        if reporter is not None and tuner is not None:
            final = None
            try:
                final = tuner.tick()
            except Exception as exc:
                log.debug("final sample failed: %s", exc)
            reporter.stop(final)
    return code


@click.command(
    "run",
    cls=_RunCommand,
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
)
@click.option(
    "--memory", type=MemorySize(), help="Memory quota per device (CUDA_DEVICE_MEMORY_LIMIT)."
)
@click.option(
    "--oversubscribe",
    is_flag=True,
    default=None,
    help=(
        "Let the memory quota pass the device's memory: what does not fit in the "
        "container's share of the device is served from host memory (CUDA_OVERSUBSCRIBE=true; "
        "docs/oversubscription.md)."
    ),
)
@click.option(
    "--memory-scaling",
    type=ShimValue(ENV_SCALING, "S"),
    help=(
        "The node's memory scaling factor (GPUVISOR_MEMORY_SCALING, HAMi's "
        "deviceMemoryScaling): with --oversubscribe, the container is guaranteed its "
        "quota / S of device memory."
    ),
)
@click.option(
    "--cores",
    type=ShimValue(ENV_SM, "PCT"),
    help="SM-time quota in percent, 0: none (CUDA_DEVICE_SM_LIMIT).",
)
@click.option(
    "--policy",
    # Any case, as the library reads GPUVISOR_SM_POLICY.
    type=click.Choice(POLICIES, case_sensitive=False),
    help="SM policy (GPUVISOR_SM_POLICY).",
)
@click.option(
    "--priority",
    type=ShimValue(ENV_PRIORITY, "N"),
    help=(
        "0 high, 1 low (CUDA_TASK_PRIORITY); unset means 1 (low), as in HAMi.  "
        "A low-priority container pauses its launches while a high-priority one "
        "works on the device; without an SM limit it is gated only while it yields."
    ),
)
@click.option(
    "--socket",
    "socket_path",
    metavar="PATH",
    help="Node agent socket (GPUVISOR_NODE_SOCKET; default /run/gpuvisor/node.sock).",
)
@click.option("--simulate", is_flag=True, help="Use the simulated GPU driver.")
@click.option(
    "--report-interval",
    type=Finite(MIN_INTERVAL, MAX_INTERVAL),
    metavar="SECONDS",
    help="Seconds between reports (GPUVISOR_REPORT_INTERVAL; default 1).",
)
@click.option(
    "--region",
    metavar="PATH",
    help="Region file (CUDA_DEVICE_MEMORY_SHARED_CACHE).",
)
@click.option(
    "--grace",
    type=Finite(0, MAX_GRACE),
    metavar="SECONDS",
    help="Seconds between SIGTERM and SIGKILL (GPUVISOR_KILL_GRACE; default 10).",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(
    memory: str | None,
    oversubscribe: bool | None,
    memory_scaling: str | None,
    cores: str | None,
    policy: str | None,
    priority: str | None,
    socket_path: str | None,
    simulate: bool,
    report_interval: float | None,
    region: str | None,
    grace: float | None,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND under gpuvisor: the container entrypoint.

    Checks the limits, starts COMMAND with the shim preloaded, forwards
    signals, reaps zombies, reports to the node agent and exits with
    COMMAND's exit code (128+N if signal N killed it).  A pause the node
    agent asks for is a 2 s lease renewed every 100 ms: if this supervisor
    dies while COMMAND lives on (SIGKILL when it is not PID 1), COMMAND
    runs again within 2 s.

    Where the node agent keeps context.lock beside its socket,
    GPUVISOR_NODE_LOCK is unset and HAMi's /tmp/vgpulock is not mounted,
    COMMAND gets GPUVISOR_NODE_LOCK set to it: the library then creates
    contexts one at a time across the node.
    """
    # First of all: hold the signals the supervisor forwards.  As PID 1 a
    # signal without a handler is discarded, so a SIGTERM during start-up
    # would be lost; blocked, it stays pending until Pid1's loop takes it
    # and forwards it to the workload (which starts with an empty mask).
    signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
    _setup_logging()
    options = RunOptions(
        memory=memory,
        oversubscribe=oversubscribe,
        memory_scaling=memory_scaling,
        cores=cores,
        policy=policy,
        priority=priority,
        socket=socket_path,
        simulate=simulate,
        report_interval=report_interval,
        region=region,
        grace=grace,
    )
    try:
        cfg = build(options, list(command), os.environ)
    except ConfigError as exc:
        raise RunError(str(exc)) from None
    except (NativeLibraryNotFound, GpuvisorError) as exc:
        raise click.ClickException(one_line(str(exc))) from None
    sys.exit(supervise(cfg))
