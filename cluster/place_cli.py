"""`gpuvisor place`: where would these pods go, and why (docs/placement.md).

The I/O around the allocator: reads CLUSTER.json, Pod manifests and an
optional knownMigGeometries file, places the pods in order, prints.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

import click
import yaml

from .allocator import Allocator, Config, Decision
from .cli_options import split_count_option
from .inventory_model import DocumentError
from .mig import GeometryRule, read_geometries
from .request import PodRequest, pod_request

EXIT_PLACED, EXIT_UNPLACED, EXIT_BAD_INPUT = 0, 1, 2


def read_pods(paths: list[Path]) -> list[PodRequest]:
    pods: list[PodRequest] = []
    for path in paths:
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except (OSError, yaml.YAMLError) as e:
            raise DocumentError(f"{path}: cannot read: {str(e).splitlines()[0]}") from None
        for n, doc in enumerate(docs):
            if doc is None:
                continue
            items = (
                doc.get("items")
                if isinstance(doc, Mapping) and doc.get("kind") == "List"
                else [doc]
            )
            for item in items or []:
                try:
                    pods.append(pod_request(item))
                except DocumentError as e:
                    raise DocumentError(f"{path} (document {n + 1}): {e}") from None
    return pods


def read_cluster(path: Path, config: Config) -> Allocator:
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise DocumentError(f"{path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise DocumentError(f"{path}: not JSON: {e.msg} at line {e.lineno}") from None
    try:
        return Allocator.from_cluster(doc, config)
    except DocumentError as e:
        raise DocumentError(f"{path}: {e}") from None


def describe(d: Decision) -> str:
    lines = [f"pod {d.pod.name} -> {d.node or 'nowhere'}"]
    if d.allocation is not None:
        for c in d.allocation.containers:
            kind = " (sidecar)" if c.sidecar else " (init)" if c.init else ""
            if not c.gpus:
                lines.append(f"  container {c.name}{kind}: no GPU")
            for g in c.gpus:
                what = f"{g.memory_mib} MiB, {g.cores}% cores"
                if g.mig is not None:
                    m = g.mig
                    act = f"instance {m.instance}" if m.instance else "create"
                    if m.destroy:
                        act += f", destroy {len(m.destroy)} idle"
                    if m.enable:
                        act += ", turn MIG mode on"
                    what += f", MIG {m.profile} at {m.placement.start}+{m.placement.size} ({act})"
                lines.append(f"  container {c.name}{kind}: GPU {g.index} {g.uuid}: {what}")
        s = d.score
        lines.append(
            f"  score: {s['node_policy']} node, usage {s['node_usage_before']} -> "
            f"{s['node_usage_after']}; {s['gpu_policy']} GPUs"
            + "".join(
                f"; {t['container']}: {t['tier']}" + (f", cuts {t['cut']}" if t.get("cut") else "")
                for t in s.get("gpu_sets", [])
            )
        )
    for node, why in d.reasons.items():
        lines.append(f"  {node}: {why}")
    return "\n".join(lines)


@click.command("place")
@click.option(
    "--cluster",
    "cluster_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="CLUSTER.json: {'nodes': {name: inventory document + 'allocations'}}.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per pod.")
@click.option(
    "--mig-geometries",
    type=click.Path(dir_okay=False, path_type=Path),
    help="HAMi's device config or a knownMigGeometries list (YAML): allowed MIG mixes per model.",
)
@split_count_option(10, "vGPUs per GPU at most (HAMi's deviceSplitCount).")
@click.argument("pods", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
def place(
    cluster_path: Path,
    as_json: bool,
    mig_geometries: Path | None,
    split_count: int,
    pods: tuple[Path, ...],
) -> None:
    """Place POD manifests on the cluster, in order, and say why.

    Each pod sees the reservations of those before it.  Exit status: 0 all
    placed, 1 some pod fits nowhere, 2 bad input.
    """
    try:
        rules: tuple[GeometryRule, ...] = ()
        if mig_geometries is not None:
            rules = read_geometries(mig_geometries)
        allocator = read_cluster(cluster_path, Config(split_count=split_count, geometries=rules))
        requests = read_pods(list(pods))
    except DocumentError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    decisions = [allocator.place(p, explain=True) for p in requests]
    if as_json:
        click.echo(json.dumps([d.to_json() for d in decisions], indent=2))
    else:
        click.echo("\n".join(describe(d) for d in decisions))
    sys.exit(EXIT_PLACED if all(d.node for d in decisions) else EXIT_UNPLACED)
