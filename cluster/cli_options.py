"""Click options the cluster's commands share, so that each kind reads,
checks and shows its value one way wherever it appears: a listen address, a
port, an existing file, a path, the split count; and the log lines of the servers
(`gpuvisor device-plugin`, `scheduler`, `webhook`).  Only the kinds live
here; each command still names its options and writes their help."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.decorators import FC

EXISTING_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


def host_option(name: str, help: str, default: str = "0.0.0.0") -> Callable[[FC], FC]:
    """An address to listen on, every interface unless told."""
    return click.option(name, default=default, show_default=True, help=help)


def port_option(
    name: str, default: int, help: str, *, any_port: bool = False
) -> Callable[[FC], FC]:
    """A TCP port; with any_port, 0 too (the kernel picks a free one)."""
    ports = click.IntRange(0 if any_port else 1, 65535)
    return click.option(name, type=ports, default=default, show_default=True, help=help)


def file_option(name: str, help: str, **extra: Any) -> Callable[[FC], FC]:
    """A file that must exist when the command starts; None when not given."""
    return click.option(name, type=EXISTING_FILE, default=None, help=help, **extra)


def path_option(name: str, default: Path | str, help: str) -> Callable[[FC], FC]:
    """A path (a directory, a socket), as a Path; need not exist yet."""
    kind = click.Path(path_type=Path)
    return click.option(name, type=kind, default=default, show_default=True, help=help)


def split_count_option(default: int, help: str) -> Callable[[FC], FC]:
    """--split-count: vGPUs per GPU, HAMi's deviceSplitCount (1 to 1000)."""
    counts = click.IntRange(1, 1000)
    return click.option("--split-count", type=counts, default=default, show_default=True, help=help)


def log_server_lines() -> None:
    """The servers' log: info and above on stderr, each line with its time
    and its logger's name."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
