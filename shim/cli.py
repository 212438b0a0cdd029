"""The `gpuvisor` command (moves to gpuvisor.supervisor in a later issue)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
import psutil

from .capi import GpuvisorError
from .loader import NativeLibraryNotFound, library_path, native_dir
from .region import Region, default_region_path
from .version import library_version, package_version

REGION_ENV = "CUDA_DEVICE_MEMORY_SHARED_CACHE"


def _mib(n: int | None) -> str:
    return "unlimited" if n is None else f"{n / 2**20:.0f} MiB"


def shown(text: str) -> str:
    """text for a terminal: what is not printable (control characters,
    line breaks, bidi overrides) escaped, as Python writes it (\\n, \\x1b).
    Process names, a region's contents and a report's labels are whatever a
    workload made them: raw, they could drive the terminal of whoever looks
    at them (an administrator on the node), or forge rows of a table.  For
    tables only: JSON output escapes them itself, and keeps them as they are."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _process_name(pid: int) -> str:
    try:
        return str(psutil.Process(pid).name())
    except psutil.Error:
        return "(gone)"


def _region_info(region: Region) -> dict[str, Any]:
    pids = region.processes()
    devices = []
    for dev in region.devices():
        per_pid = region.usage_by_process(dev.index)
        devices.append(
            {
                "index": dev.index,
                "uuid": dev.uuid,
                "limit": dev.limit,
                "used": dev.used,
                "physical_total": dev.physical_total,
                "oom_count": dev.oom_count,
                "context_cost": dev.context_cost,
                "processes": [
                    {"pid": pid, "name": _process_name(pid), "used": used}
                    for pid, used in per_pid.items()
                    if used
                ],
            }
        )
    return {"devices": devices, "processes": pids}


@click.group()
def main() -> None:
    """gpuvisor: GPU sharing for containers."""


@main.command("shim-info")
@click.option(
    "--region",
    "region_path",
    type=click.Path(dir_okay=False),
    envvar=REGION_ENV,
    help=f"Region file [default: ${REGION_ENV}, else the library's default path].",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def shim_info(region_path: str | None, as_json: bool) -> None:
    """Where the shim library is, and the region's per-device usage."""
    try:
        info: dict[str, Any] = {"library": str(library_path()), "native_dir": str(native_dir())}
        found = library_version()
        info["library_version"], info["library_build_id"] = found.version, found.build_id
        info["package_version"] = package_version()
        if not region_path:
            region_path = default_region_path()
    except (NativeLibraryNotFound, GpuvisorError) as exc:  # none, or not one it can use
        raise click.ClickException(str(exc)) from exc
    info["region"] = os.path.abspath(region_path)
    # Reading must not create a region: report a missing file as such.
    info["region_exists"] = Path(region_path).exists()
    info["devices"], info["processes"] = [], []
    if info["region_exists"]:
        try:
            info.update(_region_info(Region.attach(region_path)))
        except GpuvisorError as exc:
            raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(
        f"library: {info['library']} (release {info['library_version']}, "
        f"build {info['library_build_id']}; package {info['package_version']})"
    )
    click.echo(
        f"region:  {info['region']}" + ("" if info["region_exists"] else " (not created yet)")
    )
    click.echo(f"processes: {' '.join(map(str, info['processes'])) or '-'}")
    if not info["devices"]:
        click.echo("devices: none registered")
        return
    header = f"{'dev':>3}  {'uuid':<40}  {'limit':>12}  {'used':>12}  {'physical':>12}  {'ooms':>5}"
    click.echo(header)
    for d in info["devices"]:
        click.echo(
            f"{d['index']:>3}  {shown(d['uuid']):<40}  {_mib(d['limit']):>12}  "
            f"{_mib(d['used']):>12}  "
            f"{_mib(d['physical_total']):>12}  {d['oom_count']:>5}"
        )
        for p in d["processes"]:
            click.echo(f"     pid {p['pid']} ({shown(p['name'])}): {_mib(p['used'])}")
