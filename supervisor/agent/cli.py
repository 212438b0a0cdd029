"""The node agent's command line (docs/cli.md): `gpuvisor node-agent`, which
checks its options and runs the agent (server.py), and
`gpuvisor node-agent set-limit`, which sends an administrator's limit to the
agent's admin socket."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource
from click.decorators import FC

from ..cli_types import Finite, count_option, seconds_option
from ..paths import default_socket
from ..protocol import OWN_LIMIT, UUID_FORM, is_uuid
from .config import (
    ADMIN_SOCKET_ENV,
    AgentConfig,
    admin_dir_problem,
    admin_socket_for,
    admin_socket_problem,
    socket_path_problem,
)
from .persist import state_file_for, state_file_problem
from .region_dir import HAMI_CONTAINERS_DIR, default_region_dir
from .server import NotAnAgentReply, run_agent, send_admin

if TYPE_CHECKING:
    from .metrics import InventoryReader

# The CLI group (supervisor/cli.py) puts the cluster half's inventory reader
# in its context object under this key: the agent serves the inventory
# without importing gpuvisor.cluster (docs/architecture.md, "Packages").
INVENTORY_READER = "read_inventory"


def inventory_reader(ctx: click.Context) -> InventoryReader | None:
    """The inventory reader the CLI group passed in, or None (the agent then
    serves no inventory)."""
    obj = ctx.find_root().obj
    reader = obj.get(INVENTORY_READER) if isinstance(obj, dict) else None
    return reader if callable(reader) else None


ADMIN_SOCKET_HELP = (
    "The admin socket (set-limit), mode 0600 in a directory of mode 0700 that must not be "
    "the reporting socket's: never mount it into containers."
)
ADMIN_SOCKET_DEFAULT = "$GPUVISOR_ADMIN_SOCKET, else admin.sock in '<socket's directory>-admin'"


def socket_options(socket_help: str, admin_help: str) -> Callable[[FC], FC]:
    """--socket and --admin-socket, as `node-agent` and `set-limit` both take them."""
    socket = click.option(
        "--socket",
        "socket_path",
        default=default_socket,
        show_default="$GPUVISOR_NODE_SOCKET or /run/gpuvisor/node.sock",
        help=socket_help,
    )
    admin = click.option(
        "--admin-socket",
        envvar=ADMIN_SOCKET_ENV,
        default=None,
        show_default=ADMIN_SOCKET_DEFAULT,
        help=admin_help,
    )
    return lambda f: socket(admin(f))


@click.group("node-agent", invoke_without_command=True)
@socket_options(
    "The reporting socket (mode 0666): mount its directory into containers.", ADMIN_SOCKET_HELP
)
@click.option(
    "--metrics-host",
    default="0.0.0.0",
    show_default=True,
    help="Address the HTTP server (/metrics, /status, /healthz) listens on.",
)
@click.option(
    "--metrics-port",
    default=9400,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="0: any free port",
)
@seconds_option(
    "--expire-after",
    10.0,
    "Seconds without a report (or 3 report intervals, if longer) before a container expires.",
)
@seconds_option(
    "--read-timeout",
    5.0,
    "Disconnect a peer whose line stays incomplete (or who leaves replies unread) this long.",
)
@seconds_option(
    "--idle-timeout",
    120.0,
    "Disconnect a peer that sends nothing for this long.",
)
@seconds_option(
    "--http-timeout",
    10.0,
    "Disconnect an HTTP client (/metrics, /status) this long after it connected.",
)
@click.option(
    "--rate",
    default=50.0,
    show_default=True,
    type=Finite(min=0),
    help="Messages per second per connection (token bucket; 0: unlimited).",
)
@click.option(
    "--burst",
    default=100.0,
    show_default=True,
    type=Finite(min=1),
    help="Messages a connection may send at once (token bucket size; at least 1).",
)
@count_option(
    "--max-connections",
    4096,
    "Most connections served at once; past it the cgroup holding the most gives one "
    "up to a peer of a cgroup holding fewer, any other newcomer gets an error.",
)
@count_option(
    "--max-connections-per-cgroup",
    64,
    "Most connections served at once from the processes of one cgroup (a "
    "container); more from it get an error and are closed, others are not affected.",
)
@click.option(
    "--status-public",
    is_flag=True,
    help="Serve /status (every container's labels, cgroups, PIDs and uids) to clients "
    "beyond the node too; by default only to loopback clients (gpuvisor top on the node).",
)
@count_option(
    "--max-errors",
    10,
    "Disconnect a peer after this many bad messages in a row (0: never).",
    minimum=0,
)
@count_option(
    "--max-containers-per-cgroup",
    16,
    (
        "Containers (label sets) one cgroup may report; a new one replaces the one that "
        "reported least recently."
    ),
)
@seconds_option(
    "--max-expire",
    300.0,
    "Longest a container is kept without a report, however long its report interval.",
)
@seconds_option(
    "--active-window",
    3.0,
    (
        "Seconds a high-priority container's activity (a report with sm_share above 1 "
        "percent, or its processes' use in NVML) keeps its device busy."
    ),
)
@seconds_option(
    "--limit-grace",
    300.0,
    kind=Finite(min=0, max=86400),
    help=(
        "Seconds an administrator's limits (set-limit) outlive a container that left "
        "(final report, expiry, a restarted container taking its labels over), for "
        "its restarted container in the same pod (same labels); 0: forgotten at once."
    ),
)
@click.option(
    "--state-file",
    default=None,
    show_default="limits.json beside the admin socket",
    help=(
        "Where the administrators' limits (set-limit) are kept across an agent restart; "
        "never in the reporting socket's directory.  A file the agent cannot read or use "
        "stops it: delete it to start without its limits."
    ),
)
@click.option(
    "--region-dir",
    envvar="GPUVISOR_REGION_DIR",
    default=None,
    metavar="DIR",
    help=(
        "Read the region file of every container under DIR, one directory "
        "<pod UID>_<container name> each with its <name>.cache region file (HAMi's layout), "
        "export their series and apply their priority, with or without `gpuvisor run` "
        f"(default: {HAMI_CONTAINERS_DIR} where it exists; '' for none)."
    ),
)
@click.option(
    "--region-scan-interval",
    type=Finite(min=0.1, max=60.0),
    default=1.0,
    show_default=True,
    help="Seconds between two readings of --region-dir (0.1 to 60).",
)
@click.option("--legacy-metrics", is_flag=True, help="Also export HAMi's legacy metric names.")
@click.option(
    "--node-name",
    envvar="NODE_NAME",
    default="",
    help="The node label of the host series (default: $NODE_NAME, else the host name).",
)
@click.option("--cpu", type=click.IntRange(min=0), default=None, help="Pin the agent to this CPU.")
@click.option(
    "-v",
    "--verbose",
    count=True,
    help="Log more on stderr: -v info, -vv debug (default: warnings).",
)
@click.pass_context
def node_agent(
    ctx: click.Context,
    socket_path: str,
    admin_socket: str | None,
    metrics_host: str,
    metrics_port: int,
    expire_after: float,
    read_timeout: float,
    idle_timeout: float,
    http_timeout: float,
    rate: float,
    burst: float,
    max_connections: int,
    max_connections_per_cgroup: int,
    status_public: bool,
    max_errors: int,
    max_containers_per_cgroup: int,
    max_expire: float,
    active_window: float,
    limit_grace: float,
    state_file: str | None,
    region_dir: str | None,
    region_scan_interval: float,
    legacy_metrics: bool,
    node_name: str,
    cpu: int | None,
    verbose: int,
) -> None:
    """Run the node agent: collect the supervisors' reports, serve /metrics and /status."""
    if ctx.invoked_subcommand is not None:
        _refuse_agent_options(ctx, ctx.invoked_subcommand)
        return
    if cpu is not None and cpu not in os.sched_getaffinity(0):
        allowed = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        raise click.BadParameter(
            f"{cpu} is not a CPU this process may run on (allowed: {allowed}).",
            param_hint="'--cpu'",
        )
    problem = socket_path_problem(socket_path)
    if problem is not None:
        raise click.BadParameter(problem, param_hint="'--socket'")
    admin_socket = admin_socket or admin_socket_for(socket_path)
    problem = socket_path_problem(admin_socket) or admin_socket_problem(socket_path, admin_socket)
    if problem is not None:
        raise click.BadParameter(problem, param_hint="'--admin-socket'")
    state_file = state_file or state_file_for(admin_socket)
    problem = state_file_problem(socket_path, state_file, admin_socket)
    if problem is not None:
        raise click.BadParameter(problem, param_hint="'--state-file'")
    problem = admin_dir_problem(admin_socket, state_file)
    if problem is not None:
        raise click.BadParameter(problem, param_hint="'--admin-socket'")
    import logging

    logging.basicConfig(
        level=logging.WARNING - 10 * min(verbose, 2),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    config = AgentConfig(
        socket_path=socket_path,
        admin_socket=admin_socket,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        expire_after=expire_after,
        read_timeout=read_timeout,
        idle_timeout=idle_timeout,
        http_timeout=http_timeout,
        rate=rate,
        burst=burst,
        max_connections=max_connections,
        max_connections_per_cgroup=max_connections_per_cgroup,
        status_public=status_public,
        max_errors=max_errors,
        max_per_cgroup=max_containers_per_cgroup,
        max_expire=max_expire,
        active_window=active_window,
        limit_grace=limit_grace,
        state_file=state_file,
        region_dir=default_region_dir() if region_dir is None else region_dir,
        region_scan_interval=region_scan_interval,
        legacy_metrics=legacy_metrics,
        node_name=node_name,
        cpu=cpu,
    )

    def ready(port: int) -> None:
        info = {
            "socket": socket_path,
            "admin_socket": admin_socket,
            "state_file": state_file,
            "region_dir": config.region_dir,
            "metrics_port": port,
            "pid": os.getpid(),
        }
        click.echo("gpuvisor node-agent ready " + json.dumps(info))
        sys.stdout.flush()

    try:
        run_agent(config, ready, inventory_reader(ctx))
    except (RuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc


def _refuse_agent_options(ctx: click.Context, subcommand: str) -> None:
    """A usage error for an option of the agent itself given on the command
    line before subcommand (`node-agent --socket PATH set-limit ...`): it
    would be ignored, and set-limit would reach the default socket's agent,
    not the one named.  Those from the environment are not given here."""
    for param in ctx.command.params:
        if ctx.get_parameter_source(param.name or "") is ParameterSource.COMMANDLINE:
            name = max(param.opts, key=len)
            raise click.UsageError(
                f"{name} is an option of the node agent, not of {subcommand}: "
                f"give {subcommand}'s options after it"
            )


def _limit_value(value: str | None, what: str) -> int | str | None:
    """A set-limit option's value: an integer, None (no limit) or OWN_LIMIT.

    Checked by the library's own parsers, as the variables are: --cores as
    CUDA_DEVICE_SM_LIMIT (blanks around whole digits 0-100, 0: no limit),
    --memory as CUDA_DEVICE_MEMORY_LIMIT, except that an amount of zero
    bytes in any spelling ("0", "00", "0g") lifts the limit, where the
    variable refuses it."""
    if value is not None and value.lower() == OWN_LIMIT:
        return OWN_LIMIT
    if value is None or value.lower() in ("none", "unlimited"):
        return None
    from gpuvisor.shim.capi import GpuvisorError
    from gpuvisor.shim.limits import parse_memory_limit
    from gpuvisor.shim.loader import NativeLibraryNotFound

    from ..entrypoint.config import ENV_SM, ConfigError, check_shim_value

    try:
        if what == "sm":
            bad = click.BadParameter(
                f"{value!r}: expected a percent 1-100 (0, none or unlimited: no limit)",
                param_hint="'--cores'",
            )
            if not value:
                raise bad  # empty: "unset" to the library
            try:
                check_shim_value(ENV_SM, value)
            except ConfigError:
                raise bad from None
            # The library took it: ASCII digits, maybe inside C blanks.
            pct = int(value.strip())
            return pct if pct > 0 else None
        try:
            return int(parse_memory_limit(value))
        except GpuvisorError as exc:
            if _zero_amount(value):
                return None
            raise click.BadParameter(
                f"{value!r}: {_memory_problem(value, exc)}", param_hint="'--memory'"
            ) from None
    except (NativeLibraryNotFound, GpuvisorError) as exc:
        # Not a bad value: the library is missing or not this version.
        raise click.ClickException(" ".join(str(exc).split())) from None


def _memory_problem(value: str, exc: Exception) -> str:
    """Why the library refused value as a memory limit, for set-limit: no
    percentages here (the agent does not know the device's total, so the
    library's hint to use one would mislead), and without the library's
    'gpuvisor: memory limit "..."' prefix and error code."""
    if value.strip().endswith("%"):
        return (
            "a percentage is not taken here (the device's total is not known): "
            "give bytes, or a number with k/m/g/t such as 4g"
        )
    why = str(exc)
    _, sep, rest = why.partition(f"{json.dumps(value)}: ")
    why = rest if sep else why
    why = why.removesuffix(" (GV_EINVAL)")
    return why.replace(
        "bytes, a number with k/m/g/t, or a percentage like 50%", "bytes or a number with k/m/g/t"
    )


def _zero_amount(value: str) -> bool:
    """Whether the library refused value only for being zero bytes: the same
    spelling with every 0 made a 1 ("00" -> "11", "0.0g" -> "1.1g") parses,
    so the form is good and no digit is non-zero."""
    from gpuvisor.shim.capi import GpuvisorError
    from gpuvisor.shim.limits import parse_memory_limit

    if not any(c == "0" for c in value):
        return False
    try:
        parse_memory_limit(value.replace("0", "1"))
    except GpuvisorError:
        return False
    return True


@node_agent.command("set-limit")
@socket_options(
    "The agent's reporting socket: the default admin socket is found beside it.",
    "The agent's admin socket (its --admin-socket).",
)
@click.option(
    "--container",
    required=True,
    help="Container key (see `gpuvisor top`) or namespace/pod/container.",
)
@click.option(
    "--device", required=True, help=f"Device UUID, as the container reports it ({UUID_FORM})."
)
@click.option(
    "--memory",
    default=None,
    help=(
        "New memory limit (4g, 512m, bytes; 'none', 'unlimited' or zero in any "
        "spelling (0, 00, 0g): no limit; 'env': clear the administrator's, back to "
        "the container's own)."
    ),
)
@click.option(
    "--cores",
    default=None,
    help=(
        "New SM limit in percent, as CUDA_DEVICE_SM_LIMIT reads it (1-100; "
        "'none', 'unlimited' or 0: no limit; 'env': clear the administrator's, "
        "back to the container's own)."
    ),
)
def set_limit(
    socket_path: str,
    admin_socket: str | None,
    container: str,
    device: str,
    memory: str | None,
    cores: str | None,
) -> None:
    """Set a container's limit on one device: the agent pushes it in the container's acks,
    and again whenever its reports show another value, until the container leaves (and
    for --limit-grace seconds to its pod's restarted container).  'env' takes the
    administrator's limit of that kind back: the container's own limit (its environment's)
    is put back."""
    if memory is None and cores is None:
        raise click.UsageError("give --memory and/or --cores")
    msg: dict[str, Any] = {
        "v": 1,
        "type": "set-limit",
        "seq": 1,
        "container": container,
        "device": device,
    }
    if memory is not None:
        msg["memory"] = _limit_value(memory, "memory")
    if cores is not None:
        msg["sm"] = _limit_value(cores, "sm")
    if not is_uuid(device):
        raise click.BadParameter(
            f"{device!r}: expected a device UUID, {UUID_FORM} (lowercase hex)",
            param_hint="'--device'",
        )
    if not admin_socket and not socket_path:
        raise click.BadParameter(f"{socket_path!r}: not a usable path", param_hint="'--socket'")
    path = admin_socket or admin_socket_for(socket_path)
    try:
        reply = send_admin(path, msg)
    except OSError as exc:
        raise click.ClickException(f"cannot reach the node agent at {path}: {exc}") from exc
    except NotAnAgentReply as exc:
        raise click.ClickException(f"{path}: {exc}") from None
    if reply.get("type") != "ack":
        raise click.ClickException(" ".join(str(reply["error"]).split()))
    click.echo(f"limit change queued for {reply.get('container', container)}")
    if reply.get("warning"):
        click.echo(f"Warning: {reply['warning']}", err=True)
