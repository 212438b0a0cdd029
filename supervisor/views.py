"""Human views: `gpuvisor status` and `gpuvisor top` (docs/cli.md)."""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import click
from gpuvisor.shim.cli import shown

from .cli_types import Finite, seconds_option
from .protocol import describe_unmanaged

REGION_ENV = "CUDA_DEVICE_MEMORY_SHARED_CACHE"


def _size(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB", "MiB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _pct(v: float | int | None) -> str:
    return "-" if v is None else f"{float(v):.0f}%"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=False))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


# ---- status (inside a container) ----------------------------------------------------


def region_status(region_path: str | None, sample: float) -> dict[str, Any]:
    import psutil
    from gpuvisor.shim import Region

    region = Region.attach(region_path)
    n = region.device_count()
    before = [region.sm(i) for i in range(n)]
    t0 = time.monotonic()
    if sample > 0:
        time.sleep(sample)
    dt = time.monotonic() - t0
    pids = region.processes()
    devices = []
    for i in range(n):
        dev = region.device(i)
        sm = region.sm(i)
        # --sample 0: not measured (the few microseconds between the two
        # reads would make any figure, 0 % or 100 %, meaningless).
        achieved = 100.0 * (sm.busy_ns - before[i].busy_ns) / (dt * 1e9) if sample > 0 else None
        if not (sm.limit or sm.launches != before[i].launches):
            # nothing is gated (a low priority alone gates only while the
            # container yields), so nothing is measured
            achieved = None
        procs = []
        for pid, used in region.usage_by_process(i).items():
            if used:
                try:
                    name = str(psutil.Process(pid).name())
                except psutil.Error:
                    name = "(gone)"
                procs.append({"pid": pid, "name": name, "used": used})
        devices.append(
            {
                "index": i,
                "uuid": dev.uuid,
                "memory_limit": dev.limit,
                "memory_used": dev.used,
                # CUDA_OVERSUBSCRIBE: of memory_used, in host memory; the
                # device memory the container is guaranteed (0: not
                # oversubscribed).
                "memory_spilled": dev.spilled,
                "memory_guarantee": dev.guarantee,
                "memory_physical": dev.physical_total,
                "oom_refusals": dev.oom_count,
                "context_cost": dev.context_cost,
                "sm_limit": sm.limit,
                "sm_enforced": sm.share,
                "sm_achieved": None if achieved is None else round(min(achieved, 100.0), 2),
                "policy": sm.policy,
                "priority": sm.priority,
                "launches": sm.launches,
                "processes": procs,
            }
        )
    from gpuvisor.shim.version import build_info

    return {
        "region": str(region.path),
        "build": build_info(),
        "devices": devices,
        "processes": pids,
    }


@click.command("status")
@click.option(
    "--region",
    "region_path",
    default=None,
    envvar=REGION_ENV,
    help="Region file [default: $CUDA_DEVICE_MEMORY_SHARED_CACHE or the shim's default].",
)
@seconds_option(
    "--sample",
    0.5,
    "Seconds over which the achieved SM share is measured.",
    kind=Finite(min=0, max=3600),
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(region_path: str | None, sample: float, as_json: bool) -> None:
    """This container's GPU limits and usage, per device, from its region."""
    from gpuvisor.shim import GpuvisorError, NativeLibraryNotFound

    if region_path is not None and not os.path.isabs(region_path):
        # Refused as the library refuses it: a relative region would be
        # another file from every directory (and be created, empty, here).
        source = click.get_current_context().get_parameter_source("region_path")
        named = REGION_ENV if source == click.core.ParameterSource.ENVIRONMENT else "--region"
        why = (
            "not an absolute path (the library refuses one: processes in other "
            "directories would not share the region)"
            if region_path
            else "not a usable path"
        )
        raise click.BadParameter(f"{region_path!r}: {why}", param_hint=f"'{named}'")

    try:
        from gpuvisor.shim.region import default_region_path

        path = region_path or os.environ.get(REGION_ENV) or default_region_path()
        if not os.path.lexists(path):
            # Attaching creates the file: a look must change nothing.
            raise click.ClickException(
                f"no region at {shown(path)}: no process of this container has used "
                "the GPU through the library yet (status creates none)"
            )
        info = region_status(path, sample)
    except (GpuvisorError, NativeLibraryNotFound, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"region {info['region']}")
    rows = [
        [
            str(d["index"]),
            shown(d["uuid"]),
            _size(d["memory_used"]),
            _size(d["memory_spilled"]) if d["memory_spilled"] else "-",
            "unlimited" if d["memory_limit"] is None else _size(d["memory_limit"]),
            _pct(d["sm_limit"]) if d["sm_limit"] else "none",
            _pct(d["sm_achieved"]),
            _pct(d["sm_enforced"]),
            d["policy"],
            str(d["priority"]),
            str(d["oom_refusals"]),
            _size(d["context_cost"]) if d["context_cost"] else "-",
        ]
        for d in info["devices"]
    ]
    click.echo(
        _table(
            [
                "DEV",
                "UUID",
                "USED",
                "SPILLED",
                "LIMIT",
                "SM-LIMIT",
                "SM-ACHIEVED",
                "SM-ENFORCED",
                "POLICY",
                "PRIO",
                "OOM",
                "CTX",
            ],
            rows,
        )
    )
    prows = [
        [str(p["pid"]), shown(p["name"]), str(d["index"]), _size(p["used"])]
        for d in info["devices"]
        for p in d["processes"]
    ]
    if prows:
        click.echo("")
        click.echo(_table(["PID", "NAME", "DEV", "USED"], prows))
    library = info["build"]["library"]
    click.echo("")
    click.echo(
        f"gpuvisor {info['build']['version']}, library "
        + (f"{library['version']} (build {library['build_id']})" if library else "not usable")
    )


# ---- top (on the node) ---------------------------------------------------------------


NOT_STATUS = "not a gpuvisor node agent's /status document"


def fetch_status(url: str, timeout: float = 5.0) -> dict[str, Any]:
    """The agent's /status document at url.  ValueError for JSON of another
    form (another service, a proxy's error object): an object with an
    `agent` object and a `containers` list is what the callers read.
    OSError (urllib's URLError included) when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read()
    except http.client.HTTPException as exc:  # a bad URL, or a peer that is no HTTP server
        # Neither OSError nor ValueError: say it in one line, as an unreachable agent.
        raise OSError(shown(" ".join(f"{type(exc).__name__}: {exc}".split()))) from None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # another page (/metrics), not UTF-8
        raise ValueError(f"{NOT_STATUS} (not JSON: {exc})") from None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("agent"), dict)
        or not isinstance(data.get("containers"), list)
    ):
        raise ValueError(f"{NOT_STATUS} (an object with 'agent' and 'containers')")
    return data


def render_top(data: dict[str, Any]) -> str:
    agent = data.get("agent", {})
    rej = sum(agent.get("rejected_reports_total", {}).values())
    head = (
        f"gpuvisor node agent pid {agent.get('pid')}  up {agent.get('uptime_s', 0):.0f}s  "
        f"containers {len(data.get('containers', []))}  connections {agent.get('connections')}  "
        f"reports {agent.get('reports_total')}  rejected {rej}"
    )
    rows = []
    for c in data.get("containers", []):
        cid = c["container"]
        ns, pod, ctr = cid.get("namespace"), cid.get("pod"), cid.get("container")
        if not (ns or pod or ctr):
            # Named by its cgroup, as in /metrics (ContainerId.labels).
            ctr = cid.get("cgroup")
        name = "/".join(shown(x) if x else "-" for x in (ns, pod, ctr))
        for d in c["devices"] or [None]:
            if d is None:
                rows.append(
                    [
                        name,
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                        str(c["priority"]),
                        "-",
                        f"{c['age_s']:.1f}s",
                    ]
                )
                continue
            rows.append(
                [
                    name,
                    f"{d['index']}:{d['uuid'][:12]}",
                    _size(d["memory_used"]),
                    _size(d["memory_spilled"]) if d.get("memory_spilled") else "-",
                    "unlimited" if d["memory_limit"] is None else _size(d["memory_limit"]),
                    _pct(d["sm_share"]),
                    _pct(d["sm_limit"]) if d["sm_limit"] else "none",
                    _pct(d["sm_enforced"]),
                    str(c["priority"]),
                    ("yield" if d.get("yield") else "") + (" throttled" if d["throttled"] else ""),
                    f"{c['age_s']:.1f}s",
                ]
            )
    table = _table(
        [
            "CONTAINER",
            "DEVICE",
            "USED",
            "SPILLED",
            "LIMIT",
            "SM",
            "SM-LIMIT",
            "ENFORCED",
            "PRIO",
            "STATE",
            "AGE",
        ],
        rows,
    )
    # GPUs where NVML lists processes that no container reports (the
    # agent's unmanaged.py): the shares of the containers there do not hold.
    warnings = [
        f"WARNING {shown(str(g['uuid']))}: {describe_unmanaged(g['unmanaged_pids'])}: "
        "its SM use is not limited"
        for g in data.get("gpus") or []
        if g.get("unmanaged_pids")
    ]
    return head + "\n\n" + table + ("\n\n" + "\n".join(warnings) if warnings else "")


def _render(data: dict[str, Any]) -> str:
    """render_top(data); ValueError naming what is missing or ill-typed when
    a container entry is not what an agent writes."""
    try:
        return render_top(data)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"{NOT_STATUS} (a container entry: {what})") from None


@click.command("top")
@click.option(
    "--url",
    default="http://127.0.0.1:9400/status",
    show_default=True,
    help="The node agent's /status endpoint.",
)
@seconds_option(
    "--interval",
    2.0,
    "Seconds between refreshes (0.1 to 3600).",
    kind=Finite(min=0.1, max=3600),
)
@click.option("--once", is_flag=True, help="Print once and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print the agent's status JSON.")
def top(url: str, interval: float, once: bool, as_json: bool) -> None:
    """Every container on the node, from the node agent's /status endpoint."""
    while True:
        try:
            data = fetch_status(url)
            text = json.dumps(data, indent=2) if as_json else _render(data)
        except (OSError, urllib.error.URLError, ValueError) as exc:
            if once:
                raise click.ClickException(f"cannot read {url}: {exc}") from exc
            text = f"cannot read {url}: {exc}"
        if once:
            click.echo(text)
            return
        if sys.stdout.isatty():
            click.echo("\x1b[H\x1b[2J", nl=False)
        click.echo(text)
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return
