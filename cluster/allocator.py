"""The allocator: where a pod goes and which GPUs it gets (docs/placement.md).

`Allocator` holds the cluster's state (each node's inventory and what is
allocated on it) and decides pods as a pure computation over that state:
no I/O.  It is safe to share between threads: a decision reads the nodes
without locking and `commit` takes only the chosen node's lock, re-checks the
grants against that node's usage (optimistic check-and-commit) and applies
them; a decision that lost a race is re-decided.  There is no cluster-wide
or node-wide lock held across a decision.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .allocation import (
    Allocation,
    ContainerGrant,
    GpuGrant,
    MigGrant,
    load_allocation,
)
from .inventory_model import DocumentError, Gpu, Inventory, fail, load_inventory, obj
from .mig import (
    GeometryRule,
    MigChoice,
    geometries_for,
    half_for_cores,
    hami_first_geometry,
    plan_instance,
    profile_cores,
)
from .request import (
    NOUSE_TYPE,
    NOUSE_UUID,
    USE_TYPE,
    USE_UUID,
    VGPU_MODE,
    ContainerKind,
    ContainerRequest,
    PodRequest,
)
from .room import (
    MIG_CLASSES,
    ROOM_SIZE,
    extinct,
    group_room,
    loss,
    may_extinct,
    mig_room,
    supply_seen,
)
from .topology import Tier, best_tier, ranked_sets, set_tier, set_weight, topology

PLAN_SHAPES = 16  # request shapes whose plans are kept (the oldest dropped)
PLANS_PER_SHAPE = 8192  # nodes' plans kept per shape (all dropped past it)


class Conflict(RuntimeError):
    """A commit found the node changed under the decision and the grants no longer fit."""


@dataclass(frozen=True)
class Config:
    split_count: int = 10  # HAMi's deviceSplitCount
    geometries: tuple[GeometryRule, ...] = ()  # HAMi's knownMigGeometries
    finalists: int = 8  # nodes fully planned per decision, in cheap-score order
    rules: str = "gpuvisor"  # "hami": the benchmark's baseline (docs/placement.md)
    # policies for pods without hami.io/*-scheduler-policy.  HAMi's chart has node
    # binpack, GPU spread; gpuvisor packs GPUs too (docs/placement.md says why)
    node_policy: str = "binpack"
    gpu_policy: str = "binpack"


@dataclass
class GpuCharge:
    slots: int = 0
    memory_mib: int = 0
    cores: int = 0
    mig: list[MigGrant] = field(default_factory=list)


def shared_part(ch: Mapping[int, GpuCharge]) -> dict[int, GpuCharge]:
    """The slots, memory and cores of a charge, without its MIG instances."""
    return {i: GpuCharge(c.slots, c.memory_mib, c.cores) for i, c in ch.items()}


def add_charge(into: dict[int, GpuCharge], ch: Mapping[int, GpuCharge]) -> dict[int, GpuCharge]:
    """`into` (updated in place and returned) plus `ch`, per GPU."""
    for i, c in ch.items():
        cur = into.setdefault(i, GpuCharge())
        cur.slots += c.slots
        cur.memory_mib += c.memory_mib
        cur.cores += c.cores
        cur.mig.extend(c.mig)
    return into


def pod_charge(
    parts: Sequence[tuple[ContainerKind, Mapping[int, GpuCharge]]],
) -> dict[int, GpuCharge]:
    """A pod's charge as Kubernetes counts its containers, from each
    container's own charge in manifest order (init containers first): per
    GPU and per dimension the larger of
      - the app containers and the sidecars together (they all run at once),
      - each plain init container with the sidecars started before it;
    MIG instances add up (an instance is not shared in time)."""
    app: dict[int, GpuCharge] = {}
    running: dict[int, GpuCharge] = {}  # the sidecars started so far, without MIG
    inits: list[dict[int, GpuCharge]] = []
    for kind, ch in parts:
        if kind is ContainerKind.INIT:
            inits.append(add_charge(shared_part(running), ch))
            continue
        add_charge(app, ch)
        if kind is ContainerKind.SIDECAR:
            add_charge(running, shared_part(ch))
    for ic in inits:
        for i, c2 in ic.items():
            cur = app.setdefault(i, GpuCharge())
            cur.slots = max(cur.slots, c2.slots)
            cur.memory_mib = max(cur.memory_mib, c2.memory_mib)
            cur.cores = max(cur.cores, c2.cores)
            cur.mig.extend(c2.mig)
    return app


@dataclass(frozen=True)
class Decision:
    pod: PodRequest
    node: str | None
    allocation: Allocation | None
    charge: Mapping[int, GpuCharge]
    version: int
    reasons: Mapping[str, str]
    score: Mapping[str, Any]
    # the node's state the plan was made on (None: the pod fits nowhere):
    # `version` counts its changes only, and commit's check of a node whose
    # state moved meanwhile counts usage by GPU index, which holds only on
    # its inventory
    planned_on: NodeState | None = field(compare=False, repr=False)

    @property
    def inventory(self) -> Inventory | None:
        """The node's inventory the plan was made on."""
        return self.planned_on.inv if self.planned_on is not None else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pod": self.pod.name, "node": self.node}
        out["containers"] = (
            [c.to_json() for c in self.allocation.containers] if self.allocation else []
        )
        out["reasons"] = dict(self.reasons)
        out["score"] = dict(self.score)
        return out


def gpu_usage(
    slots: int, mem: int, cores: int, mig_on: bool, mig_used: int, g: Gpu, split: int
) -> float:
    if mig_on and g.mig is not None:
        return bin(mig_used).count("1") / g.mig.memory_slices
    # an unhealthy GPU NVML could not read has no memory size: never given
    # out, it counts as full
    memory = mem / g.memory_mib if g.memory_mib else 1.0
    return (slots / split + min(cores, 100) / 100 + memory) / 3


class NodeState:
    """One node's inventory and usage.  Mutated only under `lock` by commit/release."""

    def __init__(self, inv: Inventory, cfg: Config) -> None:
        self.inv = inv
        self.cfg = cfg
        self.lock = threading.Lock()
        self.version = 0
        n = len(inv.gpus)
        self.slots = [0] * n
        self.mem = [0] * n
        self.cores = [0] * n
        self.mig_used = [0] * n
        self.mig_profiles: list[Counter[str]] = [Counter() for _ in range(n)]
        self.mig_refs: list[frozenset[str]] = [frozenset() for _ in range(n)]
        self.mig_on = [g.mig is not None and g.mig.enabled for g in inv.gpus]
        self.capable = [g.mig is not None and g.mig.capable for g in inv.gpus]
        self.in_use = [
            g.mig is not None and any(i.in_use for i in g.mig.instances) for g in inv.gpus
        ]
        # slices of instances in use by something this allocator did not place
        self.fixed = [
            sum(i.placement.mask for i in g.mig.instances if i.in_use) if g.mig else 0
            for g in inv.gpus
        ]
        self.geometries = [
            geometries_for(g.model, cfg.geometries) if cfg.geometries else None for g in inv.gpus
        ]
        self.pods: dict[str, tuple[Allocation, dict[int, GpuCharge]]] = {}
        self.indexed = 0.0  # the usage under which the allocator's index holds this node
        self.links_topo = topology(inv.links)
        self.mig_rooms: dict[tuple[int, int], tuple[int, ...]] = {}
        self.indexed_room: tuple[int, ...] = (0,) * ROOM_SIZE  # counted in Allocator.supply
        self.summarise()

    def idle(self, i: int) -> bool:
        return self.slots[i] == 0 and self.mig_used[i] == 0 and not self.in_use[i]

    def room_of(
        self, slots: Sequence[int], mig_used: Sequence[int], mig_on: Sequence[bool]
    ) -> tuple[int, ...]:
        """The node's room for the largest requests at this usage (cluster/room.py)."""
        idle_mask = 0
        mig = [0] * len(MIG_CLASSES)
        for i, g in enumerate(self.inv.gpus):
            if not g.healthy:
                continue
            idle = slots[i] == 0 and mig_used[i] == 0 and not self.in_use[i]
            if idle:
                idle_mask |= 1 << i
            if g.mig is not None and self.capable[i] and (mig_on[i] or idle):
                taken = mig_used[i] | self.fixed[i]
                r = self.mig_rooms.get((i, taken))
                if r is None:
                    r = self.mig_rooms[(i, taken)] = mig_room(g.mig, taken)
                for pos, v in enumerate(r):
                    mig[pos] += v
        return (*group_room(self.inv.links, idle_mask), *mig, bin(idle_mask).count("1"))

    def summarise(self) -> None:
        """The cheap per-node view a decision filters and orders nodes by."""
        split = self.cfg.split_count
        gpus = self.inv.gpus
        n = len(gpus)
        total = sum(
            gpu_usage(
                self.slots[i],
                self.mem[i],
                self.cores[i],
                self.mig_on[i],
                self.mig_used[i] | self.fixed[i],
                gpus[i],
                split,
            )
            for i in range(n)
        )
        self.usage = total / n if n else 1.0
        self.room = self.room_of(self.slots, self.mig_used, self.mig_on)
        self.shareable = tuple(
            (gpus[i].memory_mib - self.mem[i], 100 - self.cores[i])
            for i in range(n)
            if gpus[i].healthy
            and not self.mig_on[i]
            and self.slots[i] < split
            and self.cores[i] < 100
        )
        self.idle_count = sum(1 for i in range(n) if gpus[i].healthy and self.idle(i))
        self.mig_count = sum(
            1
            for i in range(n)
            if gpus[i].healthy and self.capable[i] and (self.mig_on[i] or self.idle(i))
        )

    # -- applying and checking charges ---------------------------------------------------
    def check(self, charge: Mapping[int, GpuCharge], done: bool = False) -> str | None:
        """What the charge would over-commit, or None.  done: the charge is
        an allocation already made (restored), whose MIG reconfiguration may
        have been carried out: the GPU then runs the pod's own instance, and
        "reconfigure only an idle GPU" is a rule for deciding, not for it."""
        split = self.cfg.split_count
        for i, c in charge.items():
            g = self.inv.gpus[i]
            if c.slots:
                if self.mig_on[i]:
                    return f"GPU {i} is in MIG mode"
                if self.slots[i] + c.slots > split:
                    return f"GPU {i} has no free slot"
                if self.mem[i] + c.memory_mib > g.memory_mib:
                    return f"GPU {i} has not enough memory"
                if self.cores[i] + c.cores > 100:
                    return f"GPU {i} has not enough cores"
                if c.cores >= 100 and self.slots[i]:
                    return f"GPU {i} is not idle"
                if c.cores == 0 and self.cores[i] >= 100:
                    return f"GPU {i} has no cores free"
            taken = self.mig_used[i]
            for grant in c.mig:
                if taken & grant.placement.mask:
                    return f"GPU {i} MIG placement {grant.placement} is taken"
                if grant.instance is not None and grant.instance in self.mig_refs[i]:
                    return f"GPU {i} MIG instance {grant.instance} is taken"
                if (grant.enable or grant.destroy) and not done and not self.idle(i):
                    return f"GPU {i} is not idle"
                taken |= grant.placement.mask
        return None

    def apply(self, charge: Mapping[int, GpuCharge], sign: int) -> None:
        for i, c in charge.items():
            self.slots[i] += sign * c.slots
            self.mem[i] += sign * c.memory_mib
            self.cores[i] += sign * c.cores
            for grant in c.mig:
                self.mig_used[i] ^= grant.placement.mask
                counts = Counter(self.mig_profiles[i])
                counts[grant.profile] += sign
                self.mig_profiles[i] = +counts
                if grant.instance is not None:
                    self.mig_refs[i] = (
                        self.mig_refs[i] | {grant.instance}
                        if sign > 0
                        else self.mig_refs[i] - {grant.instance}
                    )
                if sign > 0:
                    # (enable or not: a plan made while the GPU was in MIG
                    # mode is realised by turning it on again, should the
                    # device plugin have turned it off in between)
                    self.mig_on[i] = True
        self.version += 1
        self.summarise()


# -- planning one pod on one node ---------------------------------------------------------
@dataclass(frozen=True)
class Option:
    index: int
    memory_mib: int
    cores: int
    mig: MigChoice | None
    usage_after: float
    # a MIG instance of half the GPU or more for a pod without vgpu-mode
    # whose memory alone a smaller profile would hold (its cores ask for it)
    half_for_cores: bool = False


@dataclass
class Work:
    """A node's usage while a pod's containers are placed one after another."""

    slots: list[int]
    mem: list[int]
    cores: list[int]
    mig_used: list[int]
    mig_profiles: list[Counter[str]]
    mig_refs: list[frozenset[str]]
    mig_on: list[bool]

    @staticmethod
    def of(node: NodeState) -> Work:
        return Work(
            list(node.slots),
            list(node.mem),
            list(node.cores),
            list(node.mig_used),
            list(node.mig_profiles),  # copied on write (take)
            list(node.mig_refs),
            list(node.mig_on),
        )


def static_reason(g: Gpu, pod: PodRequest, node: NodeState) -> str | None:
    """Filters that do not depend on usage: health, type, UUID, mode."""
    if not g.healthy:
        return f"GPU {g.index} unhealthy"
    model = g.model.lower()
    if pod.use_types and not any(t.lower() in model for t in pod.use_types):
        return f"GPU type {g.model} not in {USE_TYPE}"
    if any(t.lower() in model for t in pod.nouse_types):
        return f"GPU type {g.model} excluded by {NOUSE_TYPE}"
    if pod.use_uuids and g.uuid not in pod.use_uuids:
        return f"GPU {g.uuid} not in {USE_UUID}"
    if g.uuid in pod.nouse_uuids:
        return f"GPU {g.uuid} excluded by {NOUSE_UUID}"
    capable = g.mig is not None and g.mig.capable
    if pod.mode == "mig" and not capable:
        return f"GPU {g.index} ({g.model}) cannot do MIG ({VGPU_MODE}: mig)"
    if pod.mode == "hami-core" and node.mig_on[g.index]:
        return f"GPU {g.index} is in MIG mode ({VGPU_MODE}: hami-core)"
    return None


def option(
    node: NodeState, work: Work, i: int, c: ContainerRequest, pod: PodRequest, hami: bool
) -> Option | str:
    g = node.inv.gpus[i]
    split = node.cfg.split_count
    m = c.memory_on(g.memory_mib)
    idle = work.slots[i] == 0 and work.mig_used[i] == 0 and not node.in_use[i]
    shared: Option | None = None
    why = ""
    if pod.mode != "mig" and not work.mig_on[i]:
        if work.slots[i] >= split:
            why = "no free slot"
        elif work.mem[i] + m > g.memory_mib:
            why = f"{g.memory_mib - work.mem[i]} MiB free"
        elif c.cores >= 100 and work.slots[i]:
            why = "not idle (exclusive request)"
        elif work.cores[i] + c.cores > 100 or (c.cores == 0 and work.cores[i] >= 100):
            why = f"{100 - work.cores[i]}% cores free"
        else:
            after = gpu_usage(
                work.slots[i] + 1, work.mem[i] + m, work.cores[i] + c.cores, False, 0, g, split
            )
            shared = Option(i, m, c.cores, None, after)
    if shared is not None:
        return shared  # shared wastes no memory: it is the better fit when it fits
    mig = g.mig
    if pod.mode != "hami-core" and mig is not None and mig.capable:
        enabled = work.mig_on[i]
        if hami:
            choice = hami_first_geometry(
                mig,
                enabled,
                idle,
                work.mig_used[i],
                work.mig_profiles[i],
                m,
                node.geometries[i],
            )
        else:
            choice = plan_instance(
                mig,
                enabled,
                idle,
                work.mig_used[i],
                work.mig_profiles[i],
                work.mig_refs[i],
                m,
                c.cores if c.cores < 100 else 0,
                node.geometries[i],
            )
        if choice is not None:
            used = work.mig_used[i] | node.fixed[i] | choice.placement.mask
            after = bin(used).count("1") / mig.memory_slices
            for_cores = pod.mode is None and not hami and half_for_cores(mig, choice.profile, m)
            return Option(
                i,
                choice.profile.memory_mib,
                profile_cores(mig, choice.profile),
                choice,
                after,
                for_cores,
            )
        why = why or "no MIG placement fits"
    return why or "in MIG mode"


def first_reconfigures(
    containers: Sequence[ContainerRequest], grants: dict[str, list[GpuGrant]]
) -> Sequence[ContainerRequest]:
    """`containers` (init containers first, as kubelet starts them and the
    device plugin realises their MIG plans), with each GPU's reconfiguration
    (MIG mode on, idle instances destroyed) moved in `grants` to the first
    of the pod's MIG grants there: the app containers are planned before
    the init containers, so their grants carry it, but the init containers'
    instances are made first, and on a GPU still out of MIG mode."""
    seen: dict[int, tuple[str, int]] = {}  # GPU index -> the first grant's container, position
    for c in containers:
        for k, g in enumerate(grants.get(c.name, [])):
            m = g.mig
            if m is None:
                continue
            if g.index not in seen:
                seen[g.index] = (c.name, k)
                continue
            if not (m.enable or m.destroy):
                continue
            name, j = seen[g.index]
            first = grants[name][j]
            assert first.mig is not None
            grants[name][j] = dataclasses.replace(
                first,
                mig=dataclasses.replace(
                    first.mig,
                    enable=first.mig.enable or m.enable,
                    destroy=tuple(dict.fromkeys(first.mig.destroy + m.destroy)),
                ),
            )
            grants[c.name][k] = dataclasses.replace(
                g, mig=dataclasses.replace(m, enable=False, destroy=())
            )
    return containers


def take(work: Work, o: Option, charge: dict[int, GpuCharge] | None) -> MigGrant | None:
    i = o.index
    grant = None
    if o.mig is not None:
        ch = o.mig
        grant = MigGrant(
            ch.profile.name, ch.profile.id, ch.placement, ch.instance, ch.destroy, ch.enable
        )
        work.mig_used[i] |= ch.placement.mask
        work.mig_profiles[i] = work.mig_profiles[i] + Counter({ch.profile.name: 1})
        if ch.instance is not None:
            work.mig_refs[i] = work.mig_refs[i] | {ch.instance}
        if ch.enable:
            work.mig_on[i] = True
        if charge is not None:
            charge.setdefault(i, GpuCharge()).mig.append(grant)
    else:
        work.slots[i] += 1
        work.mem[i] += o.memory_mib
        work.cores[i] += o.cores
    return grant


@dataclass
class NodePlan:
    containers: list[ContainerGrant]
    charge: dict[int, GpuCharge]
    key: tuple[Any, ...]
    terms: dict[str, Any]
    reconfigures: int = 0  # GPUs whose MIG mode or idle instances this plan changes


def choose(
    node: NodeState,
    options: list[Option],
    n: int,
    idle_mask: int,
    binpack: bool,
    pod: PodRequest,
    hami: bool,
) -> tuple[list[Option], dict[str, Any]]:
    sign = -1.0 if binpack else 1.0
    by_index = {o.index: o for o in options}
    mask = 0
    for o in options:
        mask |= 1 << o.index
    offer = Tier(best_tier(node.inv.links, mask, n)).label
    if hami:
        topo = node.links_topo
        if pod.topology_aware:
            # HAMi's topology-aware: the k-combination with the highest summed pair score
            members = max(
                itertools.combinations(sorted(by_index), n),
                key=lambda cb: (set_weight(topo, cb), [-j for j in cb]),
            )
            picked = [by_index[j] for j in members]
        else:
            # HAMi: sort by the linear score, take the first n (no link awareness)
            picked = sorted(options, key=lambda o: (sign * o.usage_after, o.index))[:n]
            members = tuple(o.index for o in picked)
        tier = set_tier(topo, members)
        return picked, {"tier": Tier(tier).label, "best_tier": offer}
    keep = binpack or pod.topology_aware
    ranked = ranked_sets(node.inv.links, mask, idle_mask, n, keep)
    best_key = ranked[0][0]
    best: tuple[float, tuple[int, ...]] | None = None
    for key, combo in ranked:
        if key != best_key:
            break
        s = sign * sum(by_index[j].usage_after for j in combo)
        # waste first for MIG: least memory wasted
        if best is None or (s, combo) < best:
            best = (s, combo)
    assert best is not None
    picked = [by_index[j] for j in best[1]]
    return picked, {"tier": Tier(best_key.tier).label, "best_tier": offer, "cut": -best_key.keep}


def single_key(
    o: Option, binpack: bool, node: NodeState, idle_mask: int, keep: bool, spare: bool = False
) -> tuple[Any, ...]:
    waste = o.mig.waste_mib if o.mig else 0
    lost = o.mig.room_lost if o.mig else ()
    reconfig = o.mig is not None and o.mig.reconfigures
    cut = 0
    if keep and idle_mask >> o.index & 1:
        w = node.links_topo.weight[o.index]
        cut = sum(w[j] for j in range(len(w)) if j != o.index and idle_mask >> j & 1)
    usage = -o.usage_after if binpack else o.usage_after
    # spare: near the last places (roomy), a MIG instance given to a pod that
    # could share a GPU only when no GPU of the node can share (instances are
    # the only home of vgpu-mode: mig pods; for those every option is an
    # instance, so this is a tie)
    instance = spare and o.mig is not None
    return (reconfig, instance, usage, spoils(node, o), cut, waste, lost, o.index)


def room_after(node: NodeState, w: Work, o: Option) -> tuple[int, ...]:
    """The node's room once option `o` is taken on top of `w`."""
    i = o.index
    slots, used, on = list(w.slots), list(w.mig_used), list(w.mig_on)
    if o.mig is not None:
        used[i] |= o.mig.placement.mask
        on[i] = True
    else:
        slots[i] += 1
    return node.room_of(slots, used, on)


def spoils(node: NodeState, o: Option) -> bool:
    """A shared grant on an idle GPU that could do MIG: keep those for MIG requests."""
    return o.mig is None and node.capable[o.index] and node.idle(o.index)


def gpu_policy(pod: PodRequest, cfg: Config) -> str:
    """binpack or spread; `topology-aware` alone packs (keeps well-linked groups whole)."""
    if pod.gpu_policy is not None:
        return pod.gpu_policy
    return "binpack" if pod.topology_aware and cfg.rules != "hami" else cfg.gpu_policy


def kubelet_pools(
    containers: Sequence[ContainerRequest],
) -> tuple[dict[str, ContainerRequest | None], dict[str, list[str]]]:
    """For each plain init container asking for GPUs: the container kubelet
    hands its devices to (its heir: the next one asking for GPUs, in
    kubelet's order, that is not a plain init container: a sidecar or an
    app container; None if none follows), and the plain init containers
    before it whose devices kubelet gives it first (its pool).  kubelet
    allocates init containers (plain and sidecars) in manifest order, then
    app containers; a plain init container's devices go to a pool, which
    the next sidecar or app container takes (devicesToReuse)."""
    order = [c for c in containers if c.init] + [c for c in containers if not c.init]
    heirs: dict[str, ContainerRequest | None] = {}
    pools: dict[str, list[str]] = {}
    pool: list[str] = []
    for k, c in enumerate(order):
        if not c.count:
            continue
        if not c.plain_init:
            pool = []
            continue
        heirs[c.name] = next((d for d in order[k + 1 :] if d.count and not d.plain_init), None)
        pools[c.name] = list(pool)
        pool.append(c.name)
    return heirs, pools


def handed_over(
    c: ContainerRequest, opts: list[Option], heir: str, heir_gpus: list[int], held: list[int]
) -> list[Option] | str:
    """The options of plain init container c that keep kubelet's hand-over
    true to the plan, or why there are none.  kubelet gives a container the
    devices the pod's plain init containers before it held (`held`, its
    pool: all of them when it asks at least as many, then the best others),
    and the next sidecar or app container asking for GPUs (heir,
    kubelet_pools) those the pool holds.  So a plain init container goes on
    the heir's GPUs, including those of its pool.  One asking more GPUs
    than the heir has is left free: kubelet then hands the heir an arbitrary
    part of them."""
    if c.count > len(heir_gpus):
        return opts
    inside = [o for o in opts if o.index in heir_gpus]
    have = {o.index for o in inside}
    if held and c.count >= len(held) and not set(held) <= have:
        gone = sorted(set(held) - have)
        return (
            f"container {c.name}: kubelet hands it GPU {', '.join(map(str, gone))} of the "
            "init containers before it, where it does not fit"
        )
    if held and c.count == len(held):
        inside = [o for o in inside if o.index in held]
    if len(inside) < c.count:
        return (
            f"container {c.name}: kubelet hands its GPUs to container {heir}, placed on GPU "
            f"{', '.join(map(str, heir_gpus))}: {need_text(c)} there, has {len(inside)}"
        )
    return inside


def plan_node(
    node: NodeState, pod: PodRequest, cfg: Config, supply: Sequence[int] = ()
) -> NodePlan | str:
    """Place every container of the pod on this node, or say in one line why not.

    `supply`: the cluster's room (Allocator.supply), for binpack's rule that a
    pod does not take the last place of a kind of request; empty: no such rule.
    """
    hami = cfg.rules == "hami"
    inv = node.inv
    if pod.filtered:
        statics = [static_reason(g, pod, node) for g in inv.gpus]
    else:
        statics = [None if g.healthy else f"GPU {g.index} unhealthy" for g in inv.gpus]
    allowed = [i for i, r in enumerate(statics) if r is None]
    if not allowed and pod.wants_gpu:
        distinct = list(dict.fromkeys(r for r in statics if r))
        return "; ".join(distinct[:2]) if distinct else "no GPUs"
    binpack = gpu_policy(pod, cfg) == "binpack"
    keep = (binpack or pod.topology_aware) and not hami
    asked = sum(c.count for c in pod.containers)
    roomy = binpack and bool(supply) and not hami and may_extinct(supply, asked)
    work = Work.of(node)
    own: dict[str, dict[int, GpuCharge]] = {}  # each container's own charge
    grants: dict[str, list[GpuGrant]] = {}
    terms: list[dict[str, Any]] = []
    idle_mask = 0
    for i in range(len(inv.gpus)):
        if node.idle(i):
            idle_mask |= 1 << i
    # planned: the app containers, then the sidecars (which run beside them),
    # then the plain init containers (each alone, with the sidecars before it)
    apps = [c for c in pod.containers if not c.init]
    order = apps + [c for c in pod.containers if c.sidecar]
    order += [c for c in pod.containers if c.plain_init]
    heirs, pools = kubelet_pools(pod.containers)
    app_gpus: set[int] = set()  # the GPUs of the app containers and sidecars
    halves = 0  # MIG instances of half a GPU or more that only cores ask for
    for c in order:
        if c.count == 0:
            grants[c.name] = []
            continue
        w = work
        if c.plain_init:
            # a plain init container runs alone, beside the sidecars started
            # before it: it sees the node without this pod but those, and the
            # MIG slices the app containers and sidecars hold (those cannot
            # be shared in time)
            w = Work.of(node)
            w.mig_used = list(work.mig_used)
            w.mig_refs = list(work.mig_refs)
            w.mig_profiles = list(work.mig_profiles)
            w.mig_on = list(work.mig_on)
            k = pod.containers.index(c)
            for d in (d for d in pod.containers[:k] if d.sidecar):
                for i, dc in own.get(d.name, {}).items():
                    if dc.slots:
                        w.slots[i] += dc.slots
                        w.mem[i] += dc.memory_mib
                        w.cores[i] += dc.cores
        opts: list[Option] = []
        why: Counter[str] = Counter()
        for i in allowed:
            o = option(node, w, i, c, pod, hami)
            if isinstance(o, str):
                why[o] += 1
            else:
                opts.append(o)
        if len(opts) < c.count:
            detail = f" ({why.most_common(1)[0][0]})" if why and not opts else ""
            return f"container {c.name}: {need_text(c)}, has {len(opts)}{detail}"
        heir = heirs.get(c.name)
        if heir is not None and not hami:
            held = [g.index for d in pools[c.name] for g in grants.get(d, [])]
            held = list(dict.fromkeys(held))
            handed = handed_over(c, opts, heir.name, [g.index for g in grants[heir.name]], held)
            if isinstance(handed, str):
                return handed
            opts = handed
        live_idle = idle_mask & ~sum(1 << j for j in app_gpus)
        if c.count == 1:
            if hami and pod.topology_aware:
                # HAMi's topology-aware single GPU: the least connected to the others
                wt = node.links_topo.weight
                picked = [
                    min(opts, key=lambda o: (sum(wt[o.index][p.index] for p in opts), o.index))
                ]
            elif hami:
                sign = -1.0 if binpack else 1.0
                picked = [min(opts, key=lambda o: (sign * o.usage_after, o.index))]
            else:
                if c.plain_init:
                    # prefer the GPUs the app containers already hold: no extra charge
                    picked = [
                        min(
                            opts,
                            key=lambda o: (
                                o.index not in app_gpus,
                                single_key(o, binpack, node, live_idle, keep),
                            ),
                        )
                    ]
                elif roomy:
                    # binpack: never take the last place in the cluster for a kind of
                    # request when another GPU keeps it (cluster/room.py); before
                    # that, no half-GPU MIG instance that only the cores ask for
                    before = node.room_of(w.slots, w.mig_used, w.mig_on)
                    picked = [
                        min(
                            opts,
                            key=lambda o: (
                                o.half_for_cores,
                                extinct(loss(before, room_after(node, w, o)), supply),
                                single_key(o, binpack, node, live_idle, keep, True),
                            ),
                        )
                    ]
                else:
                    picked = [
                        min(opts, key=lambda o: single_key(o, binpack, node, live_idle, keep))
                    ]
            t: dict[str, Any] = {"tier": Tier.SELF.label}
        else:
            picked, t = choose(node, opts, c.count, live_idle, binpack, pod, hami)
        t["container"] = c.name
        terms.append(t)
        ch = own.setdefault(c.name, {})
        out = []
        halves += sum(1 for o in picked if o.half_for_cores)
        for o in picked:
            grant = take(w, o, ch)
            if c.plain_init and o.mig is not None:
                # kubelet allocates every container at admission: the MIG
                # instances of all of them exist at once, so the next plain
                # init container plans around this one's too
                take(work, o, None)
            if o.mig is None:
                g = ch.setdefault(o.index, GpuCharge())
                g.slots += 1
                g.memory_mib += o.memory_mib
                g.cores += o.cores
            out.append(GpuGrant(inv.gpus[o.index].uuid, o.index, o.memory_mib, o.cores, grant))
            if not c.plain_init:
                app_gpus.add(o.index)
        grants[c.name] = out
    # the pod's charge, as Kubernetes counts its containers (pod_charge)
    charge = pod_charge([(c.kind, own.get(c.name, {})) for c in pod.containers])
    split = cfg.split_count
    n = len(inv.gpus)
    after = 0.0
    for i in range(n):
        ch2 = charge.get(i)
        used = node.mig_used[i] | node.fixed[i]
        if ch2:
            used |= sum(gr.placement.mask for gr in ch2.mig)
        after += gpu_usage(
            node.slots[i] + (ch2.slots if ch2 else 0),
            node.mem[i] + (ch2.memory_mib if ch2 else 0),
            node.cores[i] + (ch2.cores if ch2 else 0),
            node.mig_on[i] or bool(ch2 and any(gr.enable for gr in ch2.mig)),
            used,
            inv.gpus[i],
            split,
        )
    after /= max(n, 1)
    node_binpack = (pod.node_policy or cfg.node_policy) == "binpack"
    reconfigures = sum(
        1 for ch3 in charge.values() if any(gr.enable or gr.destroy for gr in ch3.mig)
    )
    if hami:
        key: tuple[Any, ...] = ((-node.usage if node_binpack else node.usage), inv.node)
    else:
        # reconfiguring a GPU (MIG mode on, idle instances destroyed) only when no
        # node can take the pod as its GPUs are
        # binpack: first the plan that starts the fewest idle GPUs (fractions go
        # to GPUs already in use, on any node), then the most used node
        # with binpack, before all that: the plan that takes the last place in
        # the cluster of the fewest kinds of request (cluster/room.py)
        cut = sum(t.get("cut", 0) for t in terms)
        opened = sum(1 for i in charge if node.idle(i)) if node_binpack else 0
        spoiled = sum(
            1 for i, c4 in charge.items() if c4.slots and node.capable[i] and node.idle(i)
        )
        near_last = node_binpack and bool(supply) and may_extinct(supply, len(charge))
        # near the last places, a pod without vgpu-mode takes MIG instances
        # only when no node can share GPUs with it at no more last places:
        # they are the only home of vgpu-mode: mig pods
        instances = 0
        if pod.mode is None and near_last:
            instances = sum(len(c6.mig) for c6 in charge.values())
        # near the last places, before all those: no MIG instance of half a
        # GPU or more that only the pod's cores ask for (its memory would
        # fit a smaller one) where a node can take the pod otherwise
        if not near_last:
            halves = 0
        last = 0
        if near_last:
            slots = list(node.slots)
            taken = list(node.mig_used)
            on = list(node.mig_on)
            for i, c5 in charge.items():
                slots[i] += c5.slots
                for gr in c5.mig:
                    taken[i] |= gr.placement.mask
                    on[i] = True
            last = extinct(loss(node.room, node.room_of(slots, taken, on)), supply)
        key = (
            reconfigures,
            halves,
            last,
            instances,
            opened,
            spoiled,
            (-after if node_binpack else after),
            cut,
            inv.node,
        )
    containers = [
        ContainerGrant(
            c.name, c.init, tuple(grants.get(c.name, [])), pod.sm_policy, c.priority, c.sidecar
        )
        for c in first_reconfigures(pod.containers, grants)
    ]
    return NodePlan(
        containers,
        charge,
        key,
        {
            "node_usage_before": round(node.usage, 4),
            "node_usage_after": round(after, 4),
            "gpu_sets": terms,
        },
        reconfigures,
    )


Need = tuple[int, bool, int, int]  # count, exclusive, MiB (0: a percentage), cores


def needs_of(pod: PodRequest) -> list[Need] | None:
    """What quick_fit checks, once per decision; None when filters make it moot."""
    if pod.filtered:
        return None
    return [(c.count, c.exclusive, c.memory_mib or 0, c.cores) for c in pod.containers if c.count]


def quick_fit(node: NodeState, needs: list[Need] | None) -> bool:
    """A necessary condition checked on the node's summary, before planning."""
    if needs is None:
        return True
    for count, exclusive, m, k in needs:
        if exclusive:
            if node.idle_count < count:
                return False
            continue
        have = node.mig_count
        for fm, fc in node.shareable:
            if fm >= m and fc >= k:
                have += 1
        if have < count:
            return False
    return True


def need_text(c: ContainerRequest) -> str:
    if c.exclusive and c.memory_pct == 100:
        return f"needs {c.count} idle GPU{'s' if c.count > 1 else ''}"
    mem = f"{c.memory_mib} MiB" if c.memory_mib is not None else f"{c.memory_pct}% memory"
    need = f"needs {c.count} GPU{'s' if c.count > 1 else ''} with {mem}"
    if c.cores:
        need += f" and {c.cores}% cores"
    return need + " free"


# a plan kept for a node: the NodeState and version it was made on, the
# cluster's supply it depended on (empty: none), the plan or why not
KeptPlan = tuple[NodeState, int, tuple[int, ...], NodePlan | str]


class Allocator:
    """The cluster's GPUs and allocations, and the decisions over them."""

    def __init__(self, inventories: Iterable[Inventory] = (), config: Config | None = None) -> None:
        self.config = config or Config()
        self.nodes: dict[str, NodeState] = {}
        self.order: list[str] = []
        # nodes by (usage, name); a short lock guards only this index
        self.ranked: list[tuple[float, str]] = []
        # the cluster's room, summed over its nodes (cluster/room.py); under index_lock
        self.supply = [0] * ROOM_SIZE
        self.index_lock = threading.Lock()
        # request shape -> node -> KeptPlan: `_plans_of`
        self._plans: dict[PodRequest, dict[str, KeptPlan]] = {}
        for inv in inventories:
            self.add_node(inv)

    def add_node(self, inv: Inventory) -> None:
        if inv.node in self.nodes:
            raise DocumentError(f"node {inv.node!r}: listed twice")
        st = NodeState(inv, self.config)
        self.nodes[inv.node] = st
        self.order.append(inv.node)
        st.indexed = st.usage
        with self.index_lock:
            bisect.insort(self.ranked, (st.usage, inv.node))
            self.count_room(st)

    def count_room(self, st: NodeState | None, old: NodeState | None = None) -> None:
        """Move a node's room into the cluster's supply (under index_lock)."""
        if old is not None:
            for j, v in enumerate(old.indexed_room):
                self.supply[j] -= v
            old.indexed_room = (0,) * ROOM_SIZE
        if st is not None:
            for j, (was, now) in enumerate(zip(st.indexed_room, st.room, strict=True)):
                self.supply[j] += now - was
            st.indexed_room = st.room

    def replace_node(self, inv: Inventory) -> list[str]:
        """A node's inventory changed (a GPU's health, MIG instances): its
        allocations are charged again against the new inventory.  Returns
        the pods whose allocation no longer matches it (a GPU gone), which
        are dropped; an allocation that merely over-commits now is kept (it
        was placed when it fitted).  An unknown node is added."""
        old = self.nodes.get(inv.node)
        if old is None:
            self.add_node(inv)
            return []
        st = NodeState(inv, self.config)
        dropped: list[str] = []
        with old.lock:
            for pod, (allocation, _charge) in old.pods.items():
                try:
                    charge = charge_of(allocation, st, "allocation")
                except DocumentError:
                    dropped.append(pod)
                    continue
                st.apply(charge, +1)
                st.pods[pod] = (allocation, charge)
            st.version = old.version + 1
            old.version += 1  # decisions read from the old state conflict
            self.nodes[inv.node] = st
            with self.index_lock:
                entry = (old.indexed, inv.node)
                i = bisect.bisect_left(self.ranked, entry)
                if i < len(self.ranked) and self.ranked[i] == entry:
                    del self.ranked[i]
                st.indexed = st.usage
                bisect.insort(self.ranked, (st.usage, inv.node))
                self.count_room(st, old)
        return dropped

    def remove_node(self, name: str) -> bool:
        """Forget a node (its Node object was deleted) and its allocations."""
        st = self.nodes.pop(name, None)
        if st is None:
            return False
        with st.lock:
            st.version += 1
            with self.index_lock:
                entry = (st.indexed, name)
                i = bisect.bisect_left(self.ranked, entry)
                if i < len(self.ranked) and self.ranked[i] == entry:
                    del self.ranked[i]
                self.order.remove(name)
                self.count_room(None, st)
        return True

    def reindex(self, st: NodeState) -> None:
        """Move a node in the usage index after its usage changed (under its lock)."""
        with self.index_lock:
            old = (st.indexed, st.inv.node)
            i = bisect.bisect_left(self.ranked, old)
            if i < len(self.ranked) and self.ranked[i] == old:
                del self.ranked[i]
            st.indexed = st.usage
            bisect.insort(self.ranked, (st.usage, st.inv.node))
            self.count_room(st)

    @classmethod
    def from_cluster(cls, doc: Any, config: Config | None = None) -> Allocator:
        """Read CLUSTER.json: `{"nodes": {name: inventory + "allocations": [...]}}`."""
        top = obj(doc, "cluster")
        nodes = obj(top.get("nodes"), "cluster.nodes")
        a = cls(config=config)
        for name, entry in nodes.items():
            path = f"cluster.nodes[{name}]"
            inv = load_inventory(entry, path)
            if inv.node != name:
                raise fail(f"{path}.node", f"expected {name!r} (its key)", inv.node)
            a.add_node(inv)
            allocs = obj(entry, path).get("allocations", [])
            if not isinstance(allocs, list):
                raise fail(f"{path}.allocations", "expected a list", allocs)
            for i, al in enumerate(allocs):
                a.restore(
                    load_allocation(al, f"{path}.allocations[{i}]", name),
                    f"{path}.allocations[{i}]",
                )
        return a

    def restore(self, allocation: Allocation, path: str = "allocation") -> None:
        """Account an allocation made earlier (CLUSTER.json, or a pod's annotation)."""
        node = self.nodes.get(allocation.node)
        if node is None:
            raise fail(f"{path}.node", "no such node", allocation.node)
        charge = charge_of(allocation, node, path)
        with node.lock:
            if allocation.pod in node.pods:
                raise fail(f"{path}.pod", "allocated twice", allocation.pod)
            problem = node.check(charge, done=True)
            if problem:
                raise DocumentError(f"{path}: over-commits the node: {problem}")
            node.apply(charge, +1)
            node.pods[allocation.pod] = (allocation, charge)
            self.reindex(node)

    def release(self, pod: str) -> bool:
        """Forget a pod's allocation (it ended, or its bind failed)."""
        for node in self.nodes.values():
            with node.lock:
                held = node.pods.pop(pod, None)
                if held is not None:
                    node.apply(held[1], -1)
                    self.reindex(node)
                    return True
        return False

    def decide(
        self, pod: PodRequest, explain: bool = False, nodes: Sequence[str] | None = None
    ) -> Decision:
        """Where the pod would go, with no change to the state.

        Nodes are ordered by their cheap usage score (policy order); the first
        `finalists` that can hold the pod are planned in full and the best
        plan wins.  With `explain`, every node is planned so each rejected one
        gets its reason (the choice is the same).
        """
        cfg = self.config
        reasons: dict[str, str] = {}
        with self.index_lock:
            if nodes is not None and len(nodes) * 8 < len(self.ranked):
                # a few nodes (a bind's, or a node checked alone): their
                # index entries sorted, not the whole index copied and filtered
                ranked = sorted(
                    (st.indexed, name)
                    for name in set(nodes)
                    if (st := self.nodes.get(name)) is not None
                )
            else:
                ranked = list(self.ranked)  # (usage, name), least used first
            supply = tuple(self.supply) if cfg.rules != "hami" else ()
        binpack = (pod.node_policy or cfg.node_policy) == "binpack"
        if binpack:
            ranked.reverse()
        # the nodes' states in rank order, looked up as the loop below gets
        # to them: it usually stops after the first finalists, and listing
        # every offered node first cost a fifth of a decision over the 420
        # nodes kube-scheduler offers (make bench-cluster)
        known = self.nodes
        if nodes is not None:
            wanted = set(nodes)
            for name in wanted - known.keys():
                reasons[name] = "unknown node"
            states: Iterable[NodeState] = (
                st for _u, name in ranked if name in wanted and (st := known.get(name)) is not None
            )
        else:
            states = (st for _u, name in ranked if (st := known.get(name)) is not None)
        needs = needs_of(pod)
        plans = self._plans_of(pod)
        # a plan depends on the cluster's room only where a grant of this
        # size could take the last place of a kind (plan_node): kept plans
        # hold for the same supply there, elsewhere for any supply without
        # a place for the same kinds (room.supply_seen)
        asked = sum(c.count for c in pod.containers)
        seen = supply_seen(supply, asked)
        finalists: list[tuple[NodeState, int, NodePlan]] = []
        clean = changing = 0  # finalists without / with a GPU to reconfigure
        for st in states:
            if clean >= cfg.finalists and not explain:
                break
            if not explain and not quick_fit(st, needs):
                continue  # not recorded: explain=True gives every node's reason
            version = st.version
            hit = plans.get(st.inv.node)
            if hit is not None and hit[0] is st and hit[1] == version and hit[2] == seen:
                plan = hit[3]
            else:
                plan = plan_node(st, pod, cfg, supply)
                self._keep_plan(plans, st, version, seen, plan)
            if isinstance(plan, str):
                reasons[st.inv.node] = plan
            elif clean >= cfg.finalists:
                continue  # explaining only: the choice is already made
            elif plan.reconfigures == 0:
                clean += 1
                finalists.append((st, version, plan))
            elif changing < cfg.finalists:
                changing += 1
                finalists.append((st, version, plan))
        if not finalists:
            return Decision(pod, None, None, {}, 0, reasons, {}, None)
        st, version, plan = min(finalists, key=lambda f: f[2].key)
        alloc = Allocation(pod.name, pod.uid, st.inv.node, tuple(plan.containers))
        score = {
            "node_policy": pod.node_policy or cfg.node_policy,
            "gpu_policy": gpu_policy(pod, cfg),
            "finalists": [f[0].inv.node for f in finalists],
            **plan.terms,
        }
        return Decision(pod, st.inv.node, alloc, plan.charge, version, reasons, score, st)

    def _plans_of(self, pod: PodRequest) -> dict[str, KeptPlan]:
        """The plans kept for pods of this one's shape (all but its name and
        uid, which no plan depends on), by node.  A plan holds while its
        node's state (`version`, and the same NodeState) does: a scheduler
        decides pod after pod of one shape while each bind changes one node,
        so most finalists were planned for the pod before."""
        shape = dataclasses.replace(pod, name="", uid="")
        with self.index_lock:
            plans = self._plans.get(shape)
            if plans is None:
                if len(self._plans) >= PLAN_SHAPES:
                    del self._plans[next(iter(self._plans))]
                plans = self._plans[shape] = {}
            return plans

    def _keep_plan(
        self,
        plans: dict[str, KeptPlan],
        st: NodeState,
        version: int,
        seen: tuple[int, ...],
        plan: NodePlan | str,
    ) -> None:
        if len(plans) >= PLANS_PER_SHAPE:
            plans.clear()  # nodes gone, or more than a cluster's worth
        plans[st.inv.node] = (st, version, seen, plan)

    def commit(self, decision: Decision) -> Allocation:
        """Take the decision's reservation, or raise Conflict if it no longer fits."""
        if decision.allocation is None or decision.node is None:
            raise ValueError("nothing to commit: the pod fits nowhere")
        node = self.nodes.get(decision.node)
        if node is None:
            raise Conflict(f"{decision.node}: the node is gone")
        with node.lock:
            if self.nodes.get(decision.node) is not node:
                raise Conflict(f"{decision.node}: its inventory changed")
            planned_on = decision.planned_on
            if planned_on is not node and (planned_on is None or planned_on.inv != node.inv):
                # a GPU turned unhealthy, gone, or renumbered since: the
                # usage check below counts by index and would not see it
                raise Conflict(f"{decision.node}: its inventory changed since the pod was placed")
            if decision.pod.name in node.pods:
                raise Conflict(f"{decision.pod.name} is already allocated on {decision.node}")
            # another state of the node (its inventory published again, its
            # Node made again) counts its versions anew: checked whatever it says
            if planned_on is not node or node.version != decision.version:
                problem = node.check(decision.charge)
                if problem:
                    raise Conflict(f"{decision.node}: {problem}")
            node.apply(decision.charge, +1)
            node.pods[decision.pod.name] = (decision.allocation, dict(decision.charge))
            self.reindex(node)
        return decision.allocation

    def place(self, pod: PodRequest, explain: bool = False, attempts: int = 5) -> Decision:
        """Decide and commit; a decision that lost a race is decided again."""
        for _ in range(attempts):
            d = self.decide(pod, explain)
            if d.allocation is None:
                return d
            try:
                self.commit(d)
                return d
            except Conflict:
                continue
        raise Conflict(f"{pod.name}: lost {attempts} races in a row")

    def allocations(self, node: str) -> list[Allocation]:
        st = self.nodes[node]
        with st.lock:
            return [a for a, _c in st.pods.values()]


def charge_of(allocation: Allocation, node: NodeState, path: str) -> dict[int, GpuCharge]:
    """The per-GPU charge of an allocation, its containers counted as Kubernetes does."""
    gpus = node.inv.gpus
    parts: list[tuple[ContainerKind, dict[int, GpuCharge]]] = []
    for ci, c in enumerate(allocation.containers):
        ch: dict[int, GpuCharge] = {}
        for gi, g in enumerate(c.gpus):
            gp = f"{path}.containers[{ci}].gpus[{gi}]"
            if g.index >= len(gpus) or gpus[g.index].uuid != g.uuid:
                raise fail(f"{gp}.uuid", f"not GPU {g.index} of node {node.inv.node}", g.uuid)
            cur = ch.setdefault(g.index, GpuCharge())
            if g.mig is not None:
                mig = gpus[g.index].mig
                legal = mig is not None and any(
                    p.id == g.mig.profile_id and g.mig.placement in p.placements
                    for p in mig.profiles
                )
                if not legal:
                    raise fail(
                        f"{gp}.mig",
                        f"not a legal placement of a MIG profile of GPU {g.index}",
                        g.mig.profile,
                    )
                cur.mig.append(g.mig)
            else:
                cur.slots += 1
                cur.memory_mib += g.memory_mib
                cur.cores += g.cores
        parts.append((ContainerKind.of(c.init, c.sidecar), ch))
    # init containers first (the record lists them so), in their order
    parts.sort(key=lambda p: p[0] is ContainerKind.APP)
    return pod_charge(parts)
