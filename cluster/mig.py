"""MIG planning: which instance a request gets (docs/placement.md, "MIG").

Pure functions over a GPU's profile table (from the inventory) and the
slices already taken.  A plan never overlaps a taken slice, never touches an
instance in use, and reconfigures (destroys idle instances, turns MIG mode
on) only a GPU with nothing running.  HAMi's `knownMigGeometries` YAML is
accepted as it is and restricts which mixes of profiles a GPU may hold.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .inventory_model import DocumentError, MigProfile, MigState, Placement, fail, integer


@dataclass(frozen=True)
class GeometryRule:
    """One `knownMigGeometries` entry: model substrings and allowed mixes."""

    models: tuple[str, ...]
    geometries: tuple[tuple[tuple[str, int, int], ...], ...]  # (name, memory MiB, count)


def load_geometries(doc: Any) -> tuple[GeometryRule, ...]:
    """HAMi's device config (`nvidia.knownMigGeometries`), the list itself, or either key.

    Both of HAMi's shapes of `allowedGeometries` are read: a list of lists of
    `{name, memory, count}`, and volcano-vgpu's `{group, geometries: [...]}`.
    """
    path = "knownMigGeometries"
    if isinstance(doc, Mapping) and "nvidia" in doc:
        doc = doc["nvidia"]
        path = "nvidia.knownMigGeometries"
    if isinstance(doc, Mapping):
        doc = doc.get("knownMigGeometries")
    if doc is None:
        doc = []
    if not isinstance(doc, list):
        raise fail(path, "expected a list", doc)
    rules: list[GeometryRule] = []
    for i, entry in enumerate(doc):
        p = f"{path}[{i}]"
        if not isinstance(entry, Mapping):
            raise fail(p, "expected an object with models and allowedGeometries", entry)
        models = entry.get("models")
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise fail(f"{p}.models", "expected a list of model names", models)
        allowed = entry.get("allowedGeometries")
        if not isinstance(allowed, list):
            raise fail(f"{p}.allowedGeometries", "expected a list", allowed)
        geos: list[tuple[tuple[str, int, int], ...]] = []
        for j, g in enumerate(allowed):
            gp = f"{p}.allowedGeometries[{j}]"
            if isinstance(g, Mapping):
                g = g.get("geometries")
                gp += ".geometries"
            if not isinstance(g, list) or not g:
                raise fail(gp, "expected a list of {name, memory, count}", g)
            units: list[tuple[str, int, int]] = []
            for k, u in enumerate(g):
                up = f"{gp}[{k}]"
                if not isinstance(u, Mapping):
                    raise fail(up, "expected {name, memory, count}", u)
                name = u.get("name")
                if not isinstance(name, str) or not name:
                    raise fail(f"{up}.name", "expected a profile name", name)
                mem = integer(u.get("memory"), f"{up}.memory", 1)
                count = integer(u.get("count"), f"{up}.count", 1)
                units.append((name, mem, count))
            geos.append(tuple(units))
        rules.append(GeometryRule(tuple(models), tuple(geos)))
    return tuple(rules)


def read_geometries(path: Path) -> tuple[GeometryRule, ...]:
    """load_geometries of a YAML file (`--mig-geometries`); DocumentError
    naming the file when it cannot be read or is not such a document."""
    try:
        doc: Any = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise DocumentError(f"{path}: cannot read: {e}") from None
    try:
        return load_geometries(doc)
    except DocumentError as e:
        raise DocumentError(f"{path}: {e}") from None


def geometries_for(
    model: str, rules: Sequence[GeometryRule]
) -> tuple[tuple[tuple[str, int, int], ...], ...] | None:
    """HAMi's match: the first rule with a model that is a substring of the NVML name."""
    for rule in rules:
        if any(m.lower() in model.lower() for m in rule.models):
            return rule.geometries
    return None


def fits_geometry(
    profiles: Counter[str], geometries: tuple[tuple[tuple[str, int, int], ...], ...] | None
) -> bool:
    if geometries is None:
        return True
    for geo in geometries:
        allowed = Counter({name: count for name, _mem, count in geo})
        if all(allowed[n] >= c for n, c in profiles.items()):
            return True
    return False


def max_count(profile: MigProfile, taken: int) -> int:
    """How many more instances of a profile fit: greedy by end is exact for equal intervals."""
    count = 0
    for p in sorted(profile.placements, key=lambda q: q.start + q.size):
        if not taken & p.mask:
            taken |= p.mask
            count += 1
    return count


def room(mig: MigState, taken: int) -> tuple[int, ...]:
    """Largest profiles first: how many of each could still be created."""
    big_first = sorted(mig.profiles, key=lambda q: (-q.memory_slices, -q.memory_mib))
    return tuple(max_count(q, taken) for q in big_first)


def profile_cores(mig: MigState, profile: MigProfile) -> int:
    return min(100, math.ceil(100 * profile.compute_slices / mig.compute_slices))


def half_for_cores(mig: MigState, profile: MigProfile, memory_mib: int) -> bool:
    """An instance of half the GPU's memory or more that only the request's
    cores ask for: a profile with fewer memory slices would hold its memory
    (docs/placement.md, "No `vgpu-mode`")."""
    if 2 * profile.memory_slices < mig.memory_slices:
        return False
    return any(
        q.memory_mib >= memory_mib and q.memory_slices < profile.memory_slices for q in mig.profiles
    )


@dataclass(frozen=True)
class MigChoice:
    profile: MigProfile
    placement: Placement
    instance: str | None  # an existing idle instance reused, else None (create)
    destroy: tuple[str, ...]  # idle instances to destroy first (only on an idle GPU)
    enable: bool  # turn MIG mode on first (only on an idle GPU)
    waste_mib: int
    room_lost: tuple[int, ...]  # per profile, largest first: instances no longer possible

    @property
    def reconfigures(self) -> bool:
        return self.enable or bool(self.destroy)

    def key(self) -> tuple[Any, ...]:
        """Smaller is better: least waste, least room lost for larger profiles, least change."""
        return (self.waste_mib, self.room_lost, self.reconfigures, self.instance is None)


def plan_instance(
    mig: MigState,
    enabled: bool,
    idle: bool,
    used_mask: int,
    used_profiles: Counter[str],
    referenced: frozenset[str],
    memory_mib: int,
    cores: int,
    geometries: tuple[tuple[tuple[str, int, int], ...], ...] | None,
) -> MigChoice | None:
    """The best instance for a request on one GPU, or None.

    `used_mask`: slices reserved by allocations; `used_profiles`: their
    profiles; `referenced`: uuids of existing instances that allocations use.
    """
    if not mig.capable or (not enabled and not idle):
        return None
    busy = used_mask
    kept: Counter[str] = Counter(used_profiles)
    reusable = []
    for inst in mig.instances:
        if inst.uuid is None:
            # a GPU instance without a compute instance has no MIG device to
            # hand out or to name for destruction: its slices stay taken
            busy |= inst.placement.mask
            kept[inst.profile] += 1
            continue
        if inst.uuid in referenced:
            continue
        if inst.in_use or not idle:
            busy |= inst.placement.mask  # never touched while anything runs
            if not inst.in_use:
                reusable.append(inst)
            kept[inst.profile] += 1
        else:
            reusable.append(inst)
    best: MigChoice | None = None
    before = room(mig, busy if not idle else used_mask)

    def lost(after: int) -> tuple[int, ...]:
        return tuple(b - a for b, a in zip(before, room(mig, after), strict=True))

    for prof in mig.profiles:
        if prof.memory_mib < memory_mib or profile_cores(mig, prof) < cores:
            continue
        waste = prof.memory_mib - memory_mib
        # reuse an idle instance of this profile as it is
        for inst in reusable:
            if inst.profile_id != prof.id or inst.profile != prof.name:
                continue
            if inst.placement.mask & used_mask:
                continue  # its slices are granted already (recorded before it existed)
            mix = Counter(kept)
            if not (inst.in_use or not idle):
                mix[inst.profile] += 1
            if not fits_geometry(mix, geometries):
                continue
            c = MigChoice(prof, inst.placement, inst.uuid, (), False, waste, lost(busy))
            if best is None or c.key() < best.key():
                best = c
        # or create one in free slices
        mix = Counter(kept)
        mix[prof.name] += 1
        if not fits_geometry(mix, geometries):
            continue
        for pl in prof.placements:
            if busy & pl.mask:
                continue
            destroy = tuple(
                i.uuid
                for i in mig.instances
                if idle
                and i.uuid is not None
                and i.uuid not in referenced
                and i.placement.mask & pl.mask
            )
            after = busy | pl.mask
            c = MigChoice(prof, pl, None, destroy, not enabled, waste, lost(after))
            if best is None or c.key() < best.key():
                best = c
    return best


def hami_first_geometry(
    mig: MigState,
    enabled: bool,
    idle: bool,
    used_mask: int,
    used_profiles: Counter[str],
    memory_mib: int,
    geometries: tuple[tuple[tuple[str, int, int], ...], ...] | None,
) -> MigChoice | None:
    """HAMi's legacy rule, for the benchmark's baseline.

    On an idle GPU the first geometry (in list order) with an entry of enough
    memory; once something is placed the geometry is fixed to the first one
    that holds what is there.  The first entry big enough, the lowest free
    placement.  Without geometries: the smallest profile with enough memory.
    A GPU's mode is the node's configuration in HAMi: never switched here.
    """
    if not mig.capable or not enabled:
        return None
    busy = used_mask
    for inst in mig.instances:
        if inst.in_use or not idle:
            busy |= inst.placement.mask
    by_name = {p.name: p for p in mig.profiles}
    if geometries is None:
        order = sorted(mig.profiles, key=lambda q: (q.memory_mib, q.memory_slices))
        names = [q.name for q in order if q.memory_mib >= memory_mib]
    else:
        names = []
        for geo in geometries:
            have = Counter({n: c for n, _m, c in geo})
            if used_profiles and not all(have[n] >= c for n, c in used_profiles.items()):
                continue
            for n, mem, count in geo:
                if mem >= memory_mib and count > used_profiles[n] and n in by_name:
                    names.append(n)
                    break
            if names:
                break
    for n in names:
        prof = by_name.get(n)
        if prof is None:
            continue
        for pl in sorted(prof.placements, key=lambda q: q.start):
            if not busy & pl.mask:
                return MigChoice(prof, pl, None, (), not enabled, prof.memory_mib - memory_mib, ())
        if geometries is not None:
            return None
    return None
