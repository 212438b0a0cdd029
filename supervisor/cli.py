"""The `gpuvisor` command line (click)."""

from __future__ import annotations

import click
from gpuvisor.shim.cli import shim_info


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """gpuvisor: GPU sharing for containers that holds its promises."""


main.add_command(shim_info)
