"""The `gpuvisor` command line (click): the one place where every
subcommand is assembled.  To add one, import its click command here and
list it in COMMANDS."""

from __future__ import annotations

import contextlib

import click
from gpuvisor.cluster.deviceplugin.cli import device_plugin
from gpuvisor.cluster.inventory_cli import inventory, read_inventory_lazily
from gpuvisor.cluster.place_cli import place
from gpuvisor.cluster.scheduler.cli import scheduler
from gpuvisor.cluster.webhook.cli import webhook
from gpuvisor.shim.cli import shim_info

from .agent.cli import INVENTORY_READER, node_agent
from .demo.cli import demo
from .entrypoint.run import run
from .views import status, top

# Every `gpuvisor` subcommand (--help lists them by name).
COMMANDS: tuple[click.Command, ...] = (
    shim_info,
    run,
    node_agent,
    status,
    top,
    demo,
    device_plugin,
    place,
    inventory,
    webhook,
    scheduler,
)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """--version: the package's release, and the library's release and build id."""
    if not value or ctx.resilient_parsing:
        return
    from gpuvisor.shim import GpuvisorError, NativeLibraryNotFound
    from gpuvisor.shim.version import library_version, package_version

    click.echo(f"gpuvisor {package_version()}")
    try:
        found = library_version()
    except (GpuvisorError, NativeLibraryNotFound) as exc:
        click.echo(f"library: not usable ({exc})")
    else:
        click.echo(f"library: {found.path} {found.version} (build {found.build_id})")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Print the package's release and the library's release and build id, and exit.",
)
@click.pass_context
def main(ctx: click.Context) -> None:
    """gpuvisor: GPU sharing for containers that holds its promises."""
    # what the commands get passed in rather than import (the node agent
    # serves the cluster half's inventory)
    ctx.obj = {INVENTORY_READER: read_inventory_lazily}
    from gpuvisor.shim import GpuvisorError, NativeLibraryNotFound
    from gpuvisor.shim.version import warn_on_mismatch

    # One line when the package and the library differ; commands that need
    # the library say themselves when it cannot be used.
    with contextlib.suppress(GpuvisorError, NativeLibraryNotFound):
        warn_on_mismatch()


for _command in COMMANDS:
    main.add_command(_command)
