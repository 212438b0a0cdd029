"""The node inventory document (docs/inventory.md, version 1) as typed, validated data.

`load_inventory(doc)` turns the JSON object that `gpuvisor inventory --json`
prints into frozen dataclasses, or raises `DocumentError` with one line that
names the field (`gpus[2].memory_mib: expected a positive integer, got -1`).
Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KIND = "gpuvisor.io/node-inventory"
VERSION = 1


class DocumentError(ValueError):
    """Bad input; the message is one line naming the field and the value."""


@dataclass(frozen=True)
class Placement:
    start: int
    size: int

    @property
    def mask(self) -> int:
        return ((1 << self.size) - 1) << self.start


@dataclass(frozen=True)
class MigProfile:
    id: int
    name: str
    memory_mib: int
    memory_slices: int
    compute_slices: int
    max_count: int
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class MigInstance:
    gi_id: int
    profile_id: int
    profile: str
    placement: Placement
    uuid: str | None
    memory_mib: int
    in_use: bool


@dataclass(frozen=True)
class MigState:
    capable: bool
    enabled: bool
    memory_slices: int
    compute_slices: int
    profiles: tuple[MigProfile, ...]
    instances: tuple[MigInstance, ...]


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    model: str
    memory_mib: int
    numa: int
    pci_bus_id: str
    healthy: bool
    mig: MigState | None


@dataclass(frozen=True)
class Inventory:
    node: str
    driver_version: str
    gpus: tuple[Gpu, ...]
    links: tuple[tuple[str, ...], ...]


LINK_RE = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS)$")


def fail(path: str, what: str, value: Any) -> DocumentError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return DocumentError(f"{path}: {what}, got {shown}")


def obj(v: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise fail(path, "expected an object", v)
    return v


def seq(v: Any, path: str) -> Sequence[Any]:
    if not isinstance(v, list):
        raise fail(path, "expected a list", v)
    return v


def field(m: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in m:
        raise DocumentError(f"{path}.{key}: missing")
    return m[key]


def integer(v: Any, path: str, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise fail(path, f"expected an integer >= {minimum}", v)
    return v


def string(v: Any, path: str) -> str:
    if not isinstance(v, str) or not v:
        raise fail(path, "expected a non-empty string", v)
    return v


def boolean(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise fail(path, "expected true or false", v)
    return v


def load_placement(v: Any, path: str, slices: int) -> Placement:
    m = obj(v, path)
    start = integer(field(m, "start", path), f"{path}.start")
    size = integer(field(m, "size", path), f"{path}.size", 1)
    if start + size > slices:
        raise fail(path, f"placement beyond the GPU's {slices} memory slices", dict(m))
    return Placement(start, size)


def load_profile(v: Any, path: str, slices: int) -> MigProfile:
    m = obj(v, path)
    placements = tuple(
        load_placement(p, f"{path}.placements[{i}]", slices)
        for i, p in enumerate(seq(field(m, "placements", path), f"{path}.placements"))
    )
    size = integer(field(m, "memory_slices", path), f"{path}.memory_slices", 1)
    for i, p in enumerate(placements):
        if p.size != size:
            raise fail(f"{path}.placements[{i}].size", f"expected memory_slices {size}", p.size)
    return MigProfile(
        id=integer(field(m, "id", path), f"{path}.id"),
        name=string(field(m, "name", path), f"{path}.name"),
        memory_mib=integer(field(m, "memory_mib", path), f"{path}.memory_mib", 1),
        memory_slices=size,
        compute_slices=integer(field(m, "compute_slices", path), f"{path}.compute_slices", 1),
        max_count=integer(field(m, "max_count", path), f"{path}.max_count"),
        placements=placements,
    )


def load_instance(v: Any, path: str, slices: int) -> MigInstance:
    m = obj(v, path)
    return MigInstance(
        gi_id=integer(field(m, "gi_id", path), f"{path}.gi_id"),
        profile_id=integer(field(m, "profile_id", path), f"{path}.profile_id"),
        profile=string(field(m, "profile", path), f"{path}.profile"),
        placement=load_placement(field(m, "placement", path), f"{path}.placement", slices),
        # null: a GPU instance without a compute instance (no MIG device yet)
        uuid=None if m.get("uuid") is None else string(m["uuid"], f"{path}.uuid"),
        memory_mib=integer(field(m, "memory_mib", path), f"{path}.memory_mib"),
        in_use=boolean(field(m, "in_use", path), f"{path}.in_use"),
    )


def load_mig(v: Any, path: str) -> MigState | None:
    if v is None:
        return None
    m = obj(v, path)
    mode = field(m, "mode", path)
    if mode not in ("enabled", "disabled"):
        raise fail(f"{path}.mode", "expected 'enabled' or 'disabled'", mode)
    slices = integer(field(m, "memory_slices", path), f"{path}.memory_slices", 1)
    if slices > 32:
        raise fail(f"{path}.memory_slices", "expected at most 32", slices)
    profiles = tuple(
        load_profile(p, f"{path}.profiles[{i}]", slices)
        for i, p in enumerate(seq(field(m, "profiles", path), f"{path}.profiles"))
    )
    instances = tuple(
        load_instance(p, f"{path}.instances[{i}]", slices)
        for i, p in enumerate(seq(m.get("instances", []), f"{path}.instances"))
    )
    taken = 0
    for i, inst in enumerate(instances):
        if taken & inst.placement.mask:
            raise fail(f"{path}.instances[{i}].placement", "overlaps another instance", inst.gi_id)
        taken |= inst.placement.mask
    return MigState(
        capable=boolean(field(m, "capable", path), f"{path}.capable"),
        enabled=mode == "enabled",
        memory_slices=slices,
        compute_slices=integer(field(m, "compute_slices", path), f"{path}.compute_slices", 1),
        profiles=profiles,
        instances=instances,
    )


def load_gpu(v: Any, path: str, position: int) -> Gpu:
    m = obj(v, path)
    index = integer(field(m, "index", path), f"{path}.index")
    if index != position:
        raise fail(f"{path}.index", f"expected {position} (gpus are ordered by index)", index)
    healthy = boolean(m.get("healthy", True), f"{path}.healthy")
    # An unhealthy GPU may not answer NVML: its model, memory and bus id
    # may be null.  It is never given out, so nothing is made up for them.
    unknown = not healthy
    return Gpu(
        index=index,
        uuid=string(field(m, "uuid", path), f"{path}.uuid"),
        model=(
            ""
            if unknown and m.get("model") is None
            else string(field(m, "model", path), f"{path}.model")
        ),
        memory_mib=(
            0
            if unknown and m.get("memory_mib") is None
            else integer(field(m, "memory_mib", path), f"{path}.memory_mib", 1)
        ),
        numa=integer(m.get("numa", 0), f"{path}.numa", -1),
        pci_bus_id=str(m.get("pci_bus_id") or ""),
        healthy=healthy,
        mig=load_mig(m.get("mig"), f"{path}.mig"),
    )


def load_links(v: Any, path: str, n: int) -> tuple[tuple[str, ...], ...]:
    rows = seq(v, path)
    if len(rows) != n:
        raise fail(path, f"expected {n} rows (one per GPU)", len(rows))
    out: list[tuple[str, ...]] = []
    for i, row in enumerate(rows):
        cells = seq(row, f"{path}[{i}]")
        if len(cells) != n:
            raise fail(f"{path}[{i}]", f"expected {n} entries", len(cells))
        for j, c in enumerate(cells):
            if not isinstance(c, str) or not LINK_RE.match(c) or (c == "X") != (i == j):
                raise fail(f"{path}[{i}][{j}]", "expected X, NV<n>, PIX, PXB, PHB, NODE or SYS", c)
        out.append(tuple(cells))
    for i in range(n):
        for j in range(i):
            if out[i][j] != out[j][i]:
                raise fail(f"{path}[{i}][{j}]", f"not symmetric with [{j}][{i}]", out[i][j])
    return tuple(out)


def load_inventory(doc: Any, path: str = "inventory") -> Inventory:
    """Validate a node inventory document (version 1) and return it typed."""
    m = obj(doc, path)
    kind = m.get("kind")
    if kind != KIND:
        raise fail(f"{path}.kind", f"expected {KIND!r}", kind)
    version = m.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= VERSION:
        raise fail(f"{path}.version", f"expected an integer 1..{VERSION}", version)
    gpus = tuple(
        load_gpu(g, f"{path}.gpus[{i}]", i)
        for i, g in enumerate(seq(field(m, "gpus", path), f"{path}.gpus"))
    )
    if len({g.uuid for g in gpus}) != len(gpus):
        raise fail(f"{path}.gpus", "duplicate uuid", [g.uuid for g in gpus])
    links = m.get("links")
    if links is None:
        matrix = tuple(tuple("X" if i == j else "SYS" for j in gpus) for i in gpus)
    else:
        matrix = load_links(links, f"{path}.links", len(gpus))
    return Inventory(
        node=string(field(m, "node", path), f"{path}.node"),
        driver_version=str(m.get("driver_version", "")),
        gpus=gpus,
        links=matrix,
    )
