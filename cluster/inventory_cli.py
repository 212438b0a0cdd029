"""`gpuvisor inventory`: the node's GPUs, their connections and MIG state (docs/inventory.md)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import click

from .links import LEGEND

if TYPE_CHECKING:
    from .inventory import Document


def read_inventory_lazily(node: str | None) -> dict[str, Any]:
    """gpuvisor.cluster.inventory.read_inventory, imported when called: the
    CLI group hands it to the node agent, and importing the command line must
    not load pynvml (`gpuvisor run` starts every container)."""
    from .inventory import read_inventory

    return read_inventory(node)


def _gib(mib: int | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f} GiB"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return [line.rstrip() for line in lines]


def _placement(p: dict[str, int] | None) -> str:
    return "-" if p is None else f"{p['start']}:{p['size']}"


def _mig_state(gpu: dict[str, Any]) -> str:
    mig = gpu["mig"]
    if mig is None:
        return "-" if gpu["healthy"] else "?"
    return str(mig["mode"])


def _fits(mig: dict[str, Any]) -> str:
    if mig["mode"] != "enabled":
        names = ", ".join(f"{p['name']} x{p['max_count']}" for p in mig["profiles"])
        return f"once enabled it fits {names}"
    fit = [f"{name} x{n}" for name, n in mig["remaining"].items() if n]
    return "still fits " + (", ".join(fit) if fit else "nothing more")


def render(doc: Document) -> str:
    """The human view: GPUs, the `nvidia-smi topo -m` matrix, MIG."""
    gpus: list[dict[str, Any]] = doc["gpus"]
    out = [
        f"node {doc['node']}, driver {doc['driver_version']}, "
        f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}",
        "",
    ]
    rows = [
        [
            str(g["index"]),
            g["uuid"] or "?",
            g["model"] or "?",
            _gib(g["memory_mib"]),
            "-" if g["numa"] < 0 else str(g["numa"]),
            g["pci_bus_id"] or "?",
            _mig_state(g) + ("" if g["healthy"] else " (unhealthy)"),
        ]
        for g in gpus
    ]
    out += _table(["GPU", "UUID", "MODEL", "MEMORY", "NUMA", "PCI BUS ID", "MIG"], rows)
    if not gpus:
        return "\n".join(out)
    names = [f"GPU{g['index']}" for g in gpus]
    matrix = [
        [names[i], *doc["links"][i], "N/A" if g["numa"] < 0 else str(g["numa"])]
        for i, g in enumerate(gpus)
    ]
    out += ["", *_table(["", *names, "NUMA Affinity"], matrix), "", "Legend:"]
    out += [f"  {k:4} = {v}" for k, v in LEGEND.items()]
    mig_lines: list[str] = []
    for g in gpus:
        mig = g["mig"]
        if mig is None:
            continue
        mig_lines.append(
            f"GPU {g['index']}: MIG {mig['mode']}, {mig['memory_slices']} memory and "
            f"{mig['compute_slices']} compute slices; {_fits(mig)}"
        )
        inst = [
            [
                str(i["gi_id"]),
                i["profile"] or "?",
                _placement(i["placement"]),
                _gib(i["memory_mib"]),
                i["uuid"] or "-",
                "in use" if i["in_use"] else "free",
            ]
            for i in mig["instances"]
        ]
        if inst:
            table = _table(["GI", "PROFILE", "PLACEMENT", "MEMORY", "UUID", "STATE"], inst)
            mig_lines += ["  " + line for line in table]
    if mig_lines:
        out += ["", *mig_lines]
    return "\n".join(out)


def collect(simulate: bool, node: str | None) -> Document:
    """Read the inventory from NVML (the simulated one with simulate)."""
    import pynvml

    from .inventory import nvml_session, read_inventory

    nvml_path: str | None = None
    if simulate:
        from gpuvisor.shim.loader import SIM_NVML_NAME, simulator_dir

        nvml_path = str(simulator_dir() / SIM_NVML_NAME)
    try:
        with nvml_session(nvml_path):
            return read_inventory(node)
    except (pynvml.NVMLError, OSError) as exc:
        where = "the simulated NVML" if simulate else "NVML (no GPU driver here?)"
        hint = "" if simulate else "; try gpuvisor inventory --simulate"
        raise click.ClickException(f"cannot read {where}: {exc}{hint}") from None


@click.command("inventory")
@click.option(
    "--simulate",
    is_flag=True,
    help="Read the simulated node (GPUVISOR_SIM_TOPOLOGY or GPUVISOR_SIM_DEVICES, "
    "state in GPUVISOR_SIM_STATE) instead of the real NVML.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the JSON document (docs/inventory.md)."
)
@click.option(
    "--node",
    default=None,
    help="The node name the document gives (default: $NODE_NAME, else the host name).",
)
def inventory(simulate: bool, as_json: bool, node: str | None) -> None:
    """The node's GPUs, how each pair is connected and their MIG state.

    Each GPU's index, UUID, model, memory, NUMA node and PCI bus id; the
    `nvidia-smi topo -m` matrix (NV<n>, PIX, PXB, PHB, NODE, SYS); and per
    MIG-capable GPU its mode, instances and the profiles it could still fit.
    """
    doc = collect(simulate, node or os.environ.get("NODE_NAME") or None)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(render(doc))
