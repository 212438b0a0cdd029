"""The room a node keeps for each kind of request, and the cluster's (docs/placement.md).

With binpack, a pod never takes the last place in the cluster where some
kind of request could still go, when another choice keeps it: so the only
box that can take a 4-GPU job is not opened by a fraction while a GPU of the
MIG box can take it, and the other way round.  The room of a node is one
vector of counts, one per kind of request:

- per group size (8, 4, 2 GPUs): how many disjoint groups of idle GPUs at the
  best link tier the node offers for that size it could still give;
- per MIG instance class (the whole GPU, a half, a quarter, an eighth of its
  memory slices): how many instances of the profile of that class that fits
  most could still be created on the node's GPUs that can take MIG grants
  (in MIG mode, or idle and MIG-capable);
- idle GPUs (whole-GPU requests).

The cluster's supply is the sum over its nodes.  A grant's cost is the
node's room before minus after, per entry; `extinct` counts the kinds whose
last place it takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from .inventory_model import MigState
from .topology import best_tier, ranked_sets

GROUP_SIZES = (8, 4, 2)
MIG_CLASSES = (1, 2, 4, 8)  # an instance of 1/d of the GPU's memory slices
ROOM_SIZE = len(GROUP_SIZES) + len(MIG_CLASSES) + 1
# the most one GPU adds to each entry: one group per size, 8 // d instances of 1/d
PER_GPU = (*(1 for _ in GROUP_SIZES), *MIG_CLASSES, 1)


@lru_cache(maxsize=8192)
def group_room(links: tuple[tuple[str, ...], ...], idle_mask: int) -> tuple[int, ...]:
    """Per group size (largest first): disjoint idle groups at the node's best tier.

    Greedy over the sets ranked best first: exact for the boxes in use
    (NVLink pairs, one or two PCIe switches, an NVSwitch).
    """
    n = len(links)
    full = (1 << n) - 1
    out = []
    for k in GROUP_SIZES:
        if k > n or bin(idle_mask).count("1") < k:
            out.append(0)
            continue
        top = best_tier(links, full, k)
        free = idle_mask
        count = 0
        for key, combo in ranked_sets(links, idle_mask, 0, k, False):
            if key.tier < top:
                break
            m = 0
            for j in combo:
                m |= 1 << j
            if free & m == m:
                free &= ~m
                count += 1
        out.append(count)
    return tuple(out)


def mig_class(mig: MigState, memory_slices: int) -> int:
    """The position in MIG_CLASSES of a profile of that many memory slices."""
    for pos, d in enumerate(MIG_CLASSES):
        if memory_slices * d >= mig.memory_slices:
            return pos
    return len(MIG_CLASSES) - 1


def mig_room(mig: MigState, taken: int) -> tuple[int, ...]:
    """Per MIG class: the most instances of one profile of that class still creatable."""
    out = [0] * len(MIG_CLASSES)
    for p in mig.profiles:
        count = 0
        busy = taken
        for pl in sorted(p.placements, key=lambda q: q.start + q.size):
            if not busy & pl.mask:
                busy |= pl.mask
                count += 1
        pos = mig_class(mig, p.memory_slices)
        out[pos] = max(out[pos], count)
    return tuple(out)


def loss(before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, ...]:
    """Per kind of request: the places a grant takes."""
    return tuple(b - a for b, a in zip(before, after, strict=True))


def extinct(cost: Sequence[int], supply: Sequence[int]) -> int:
    """How many kinds of request would have no place left in the cluster."""
    return sum(1 for c, s in zip(cost, supply, strict=True) if c > 0 and s <= c)


def may_extinct(supply: Sequence[int], gpus: int) -> bool:
    """Whether a grant of this many GPUs could take the last place of some kind.

    False on a cluster with room to spare: the rule then costs nothing.
    """
    return any(s <= b * gpus for s, b in zip(supply, PER_GPU, strict=True))


def near_last(supply: Sequence[int], gpus: int) -> bool:
    """`may_extinct` for the kinds the cluster has places for.

    A kind with no place at all (MIG instances where no GPU is MIG-capable)
    has no last place to take: `extinct` never counts it.
    """
    return any(0 < s <= b * gpus for s, b in zip(supply, PER_GPU, strict=True))


def supply_seen(supply: Sequence[int], gpus: int) -> tuple[int, ...]:
    """What of the cluster's supply a node's plan for a grant of this many
    GPUs depends on: all of it near the last place of a kind the cluster
    has places for; otherwise only which kinds it has no place for (they
    make `may_extinct` true, and `extinct` counts nothing), marked -1
    (none) and -2 (some) so that it never equals a supply.  Keyed by the
    whole supply there too, every bind, which changes the supply, voided
    every kept plan on a cluster without MIG (make bench-cluster)."""
    if not supply:
        return ()
    if near_last(supply, gpus):
        return tuple(supply)
    return tuple(-1 if s == 0 else -2 for s in supply)
