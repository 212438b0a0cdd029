"""The `gpuvisor` command line (click)."""

from __future__ import annotations

import click
from gpuvisor.shim.cli import shim_info

from .agent_cli import node_agent
from .demo import demo
from .run import run
from .views import status, top


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """gpuvisor: GPU sharing for containers that holds its promises."""


main.add_command(shim_info)
main.add_command(run)

main.add_command(node_agent)
main.add_command(status)
main.add_command(top)
main.add_command(demo)
