"""`gpuvisor run` configuration: options + injected environment -> RunConfig.

Every value is checked before the workload starts.  The limits the shim
reads are checked by the C library itself (gv_validate_env, the single
parser) against the exact environment the workload will get; the
supervisor's own settings (socket, report interval, grace period) are
checked here.  A bad value raises ConfigError with one line naming the
variable or option and the value.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from gpuvisor.shim.capi import GV_EINVAL, UNLIMITED, GpuvisorError, lib
from gpuvisor.shim.limits import (
    DeviceEnvLimits,
    SmSettings,
    env_device_limits,
    env_sm_settings,
    parse_memory_limit,
    validate_environment,
)
from gpuvisor.shim.loader import preload_env
from gpuvisor.shim.region import SM_POLICIES, default_region_path

from ..cli_types import DECIMAL
from ..paths import (
    DEFAULT_SOCKET,
    HAMI_LOCK_DIR,
    NODE_LOCK_ENV,
    SOCKET_ENV,
    SUN_PATH_MAX,
    context_lock_path,
)

# Variables the shim reads (HAMi's names).
ENV_MEMORY = "CUDA_DEVICE_MEMORY_LIMIT"
ENV_SM = "CUDA_DEVICE_SM_LIMIT"
ENV_LIMITS_FILE = "GPUVISOR_LIMITS_FILE"
ENV_OVERSUBSCRIBE = "CUDA_OVERSUBSCRIBE"
ENV_SCALING = "GPUVISOR_MEMORY_SCALING"
ENV_POLICY = "GPUVISOR_SM_POLICY"
ENV_HAMI_POLICY = "GPU_CORE_UTILIZATION_POLICY"
ENV_PRIORITY = "CUDA_TASK_PRIORITY"
ENV_REGION = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
ENV_SIM_STATE = "GPUVISOR_SIM_STATE"
# Variables only the supervisor reads.
ENV_SOCKET = SOCKET_ENV
ENV_INTERVAL = "GPUVISOR_REPORT_INTERVAL"
ENV_GRACE = "GPUVISOR_KILL_GRACE"

DEFAULT_INTERVAL = 1.0
DEFAULT_GRACE = 10.0
MIN_INTERVAL, MAX_INTERVAL = 0.1, 3600.0
MAX_GRACE = 3600.0
POLICIES = SM_POLICIES


class ConfigError(ValueError):
    """A bad option or variable; the text is one line naming it and its value."""


@dataclass(frozen=True)
class RunOptions:
    """What was given on the command line (None: not given)."""

    memory: str | None = None
    oversubscribe: bool | None = None  # True: CUDA_OVERSUBSCRIBE=true
    memory_scaling: str | None = None  # GPUVISOR_MEMORY_SCALING
    cores: str | int | None = None
    policy: str | None = None
    priority: str | int | None = None
    socket: str | None = None
    simulate: bool = False
    report_interval: float | None = None
    region: str | None = None
    grace: float | None = None


_PER_DEVICE = {
    kind: re.compile(rf"{name}_[0-9]+") for kind, name in (("memory", ENV_MEMORY), ("sm", ENV_SM))
}


@dataclass(frozen=True)
class EnvLimits:
    """The limits the container's environment gives its devices, as the
    library reads it (limits_memory_for_ordinal, limits_sm_for_ordinal):
    what the supervisor puts back when an administrator clears a limit of
    theirs (an ack's `restore`).

    Per-device variables (CUDA_DEVICE_MEMORY_LIMIT_<n>) name CUDA ordinals,
    which the region does not record: with one of a kind set, that kind's
    limit is not known here (None in memory_text / sm_known False), and the
    tuner asks the library for the device (device(): the UUID's ordinal as
    the library maps it, from NVML's list through the environment's
    CUDA_VISIBLE_DEVICES), from env, the workload's environment."""

    memory_text: str | None = None  # CUDA_DEVICE_MEMORY_LIMIT ("" : no limit)
    sm: int | None = None  # percent; None: no limit
    sm_known: bool = True
    # the workload's environment (None: not known, device() refuses)
    env: tuple[tuple[str, str], ...] | None = None

    def memory(self, physical_total: int) -> tuple[bool, int | None]:
        """(known, bytes or None for no limit) on a device of physical_total bytes."""
        if self.memory_text is None:
            return False, None
        if not self.memory_text:
            return True, None
        try:
            value = parse_memory_limit(self.memory_text, physical_total)
        except GpuvisorError:  # a percentage of a size not known yet
            return False, None
        return True, None if value == UNLIMITED else value

    def device(self, uuid: str, physical_total: int) -> DeviceEnvLimits:
        """The limits the environment gives the device uuid, from the
        library (env_device_limits): its ordinal None when not known, and
        then the strictest limits the environment gives any ordinal.
        GpuvisorError for a value the library refuses, or no environment."""
        if self.env is None:
            raise GpuvisorError(GV_EINVAL, "gpuvisor: the workload's environment is not known")
        return env_device_limits(dict(self.env), uuid, physical_total)


def env_limits(env: Mapping[str, str]) -> EnvLimits:
    """The EnvLimits of a workload's environment (already validated)."""

    def per_device(kind: str) -> bool:
        return any(_PER_DEVICE[kind].fullmatch(k) and v for k, v in env.items())

    items = tuple(env.items())
    if env.get(ENV_LIMITS_FILE):
        # The limits are in the file (gpuvisor device-plugin's), which only
        # the library reads: every device's limits are asked of it.
        return EnvLimits(None, None, False, items)
    memory = None if per_device("memory") else (_env(env, ENV_MEMORY) or "")
    if env.get(ENV_HAMI_POLICY, "").strip().lower() == "disable":
        return EnvLimits(memory, None, True, items)  # the library configures no SM limit
    if per_device("sm"):
        return EnvLimits(memory, None, False, items)
    sm = int((_env(env, ENV_SM) or "0").strip())
    return EnvLimits(memory, sm or None, True, items)


@dataclass(frozen=True)
class RunConfig:
    command: list[str]
    env: dict[str, str]  # the workload's environment (shim preloaded)
    socket: str
    report_interval: float
    grace: float
    region: str
    policy: str  # effective policy, as reported
    priority: int
    simulate: bool
    limits: EnvLimits = EnvLimits()  # the environment's limits (restored on `restore`)


def one_line(text: str) -> str:
    text = " ".join(text.split())
    return text[len("gpuvisor: ") :] if text.startswith("gpuvisor: ") else text


def default_sim_state() -> str:
    return f"/tmp/gpuvisor-sim-{os.getuid()}.state"  # the simulator's own default


def _seconds(value: str | float, name: str, lo: float, hi: float, lo_open: bool) -> float:
    if isinstance(value, str) and not DECIMAL.fullmatch(value.strip()):
        raise ConfigError(f"{name}={value!r}: not a number of seconds")
    try:
        v = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: not a number of seconds") from None
    too_low = v <= lo if lo_open else v < lo
    if not math.isfinite(v) or too_low or v > hi:
        bound = f"greater than {lo:g}" if lo_open else f"at least {lo:g}"
        raise ConfigError(f"{name}={value!r}: must be {bound} and at most {hi:g} seconds")
    return v


def _env(env: Mapping[str, str], name: str) -> str | None:
    """env[name], or None when it is unset or empty: as in the library (a
    limit variable set but empty counts as unset) and the node agent."""
    value = env.get(name)
    return value if value else None


def _path(value: str, name: str, max_bytes: int | None = None) -> str:
    if not value or "\0" in value:
        raise ConfigError(f"{name}={value!r}: not a usable path")
    if max_bytes is not None and len(os.fsencode(value)) > max_bytes:
        raise ConfigError(f"{name}={value!r}: longer than {max_bytes} bytes (a Unix socket path)")
    return value


@contextmanager
def process_environment(env: Mapping[str, str]) -> Iterator[None]:
    """Make os.environ (the C library's getenv) exactly env, then restore it."""
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def validate_shim_environment(env: Mapping[str, str]) -> None:
    """Check env's limits exactly as libgpuvisor.so will (gv_validate_env)."""
    with process_environment(env):
        try:
            validate_environment()
        except GpuvisorError as exc:
            raise ConfigError(one_line(exc.message)) from None


def check_shim_value(name: str, value: str) -> None:
    """Check one library variable's value alone, by the library's own parser."""
    lib()  # loaded first: the check empties the environment it is found by
    validate_shim_environment({name: value})


def sm_settings(env: Mapping[str, str]) -> SmSettings:
    """The policy and priority the library configures the region with, for
    an environment validate_shim_environment accepted, asked of the library
    itself (gv_env_sm_settings).  CUDA_TASK_PRIORITY is 0 (high) only when
    set to "0"; unset or empty means 1 (low), as in HAMi-core, whose region
    starts with priority 1.  GPU_CORE_UTILIZATION_POLICY=force makes the
    limit a hard cap; =disable ignores the SM limits: the library then
    configures every device with no limit and fixed-share, whatever
    GPUVISOR_SM_POLICY says, so burst-share or best-effort would name a
    policy that nothing applies (and a limit pushed live later is a hard
    cap, as fixed-share's)."""
    try:
        return env_sm_settings(env)
    except GpuvisorError as exc:
        raise ConfigError(one_line(exc.message)) from None


def build(options: RunOptions, command: list[str], base_env: Mapping[str, str]) -> RunConfig:
    """The workload's environment and the supervisor's settings; ConfigError if bad."""
    if not command:
        raise ConfigError("no command given: gpuvisor run [OPTIONS] -- COMMAND [ARGS]...")
    env = dict(base_env)
    if limits_file := _env(env, ENV_LIMITS_FILE):
        given = [
            name
            for name, value in (
                ("--memory", options.memory),
                ("--oversubscribe", options.oversubscribe),
                ("--memory-scaling", options.memory_scaling),
                ("--cores", options.cores),
                ("--policy", options.policy),
                ("--priority", options.priority),
            )
            if value is not None
        ]
        if given:
            raise ConfigError(
                f"{given[0]}: the limits come from {ENV_LIMITS_FILE}={limits_file!r} "
                "(gpuvisor device-plugin's), which the library reads instead of the options"
            )
    if options.memory is not None:
        env[ENV_MEMORY] = options.memory
    if options.oversubscribe:
        env[ENV_OVERSUBSCRIBE] = "true"
    if options.memory_scaling is not None:
        env[ENV_SCALING] = options.memory_scaling
    if options.cores is not None:
        env[ENV_SM] = str(options.cores)
    if options.policy is not None:
        env[ENV_POLICY] = options.policy
    if options.priority is not None:
        env[ENV_PRIORITY] = str(options.priority)
    if options.region is not None:
        env[ENV_REGION] = _path(options.region, "--region")
    region = _path(_env(env, ENV_REGION) or default_region_path(), ENV_REGION)
    env[ENV_REGION] = os.path.abspath(region)

    if options.socket is not None:
        socket = _path(options.socket, "--socket", SUN_PATH_MAX)
        env[ENV_SOCKET] = socket
    else:
        socket = _path(_env(env, ENV_SOCKET) or DEFAULT_SOCKET, ENV_SOCKET, SUN_PATH_MAX)
    if options.report_interval is not None:
        interval = _seconds(
            options.report_interval, "--report-interval", MIN_INTERVAL, MAX_INTERVAL, False
        )
    elif (value := _env(env, ENV_INTERVAL)) is not None:
        interval = _seconds(value, ENV_INTERVAL, MIN_INTERVAL, MAX_INTERVAL, False)
    else:
        interval = DEFAULT_INTERVAL
    if options.grace is not None:
        grace = _seconds(options.grace, "--grace", 0.0, MAX_GRACE, False)
    elif (value := _env(env, ENV_GRACE)) is not None:
        grace = _seconds(value, ENV_GRACE, 0.0, MAX_GRACE, False)
    else:
        grace = DEFAULT_GRACE

    if (
        NODE_LOCK_ENV not in env
        and not os.path.isdir(HAMI_LOCK_DIR)
        and os.path.isfile(context_lock_path(socket))
    ):
        # The node agent's lock file, in the socket's directory the
        # container mounts: the library measures new contexts one at a time
        # across the node with it.  Under HAMi's device plugin the library's
        # default, which every container of the node shares, is kept.
        env[NODE_LOCK_ENV] = context_lock_path(socket)
    validate_shim_environment(env)
    if options.simulate:
        env.setdefault(ENV_SIM_STATE, default_sim_state())
    env = preload_env(env, simulate=options.simulate)
    settings = sm_settings(env)
    return RunConfig(
        command=list(command),
        env=env,
        socket=socket,
        report_interval=interval,
        grace=grace,
        region=env[ENV_REGION],
        policy=settings.policy,
        priority=settings.priority,
        simulate=options.simulate,
        limits=env_limits(env),
    )
