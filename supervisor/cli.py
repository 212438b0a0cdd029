"""The `gpuvisor` command line (click): the one place where every
subcommand is assembled.  To add one, import its click command here and
list it in COMMANDS."""

from __future__ import annotations

import click
from gpuvisor.shim.cli import shim_info

from .agent.cli import node_agent
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
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """gpuvisor: GPU sharing for containers that holds its promises."""


for _command in COMMANDS:
    main.add_command(_command)
