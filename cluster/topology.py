"""Link tiers between GPUs and the choice of a well-linked GPU set (docs/placement.md).

Tiers, best first: NVLink or NVSwitch, the same PCIe switch, the same host
bridge, the same NUMA node, across sockets.  A set's tier is the tier of its
worst pair; among sets of the best tier the larger sum of pair weights wins
(go-gpuallocator's weights, so NVLink counts per link).  Pure and cached per
link matrix, so 1,000 identical boxes share one table.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache


class Tier(IntEnum):
    SYS = 1  # across sockets
    NODE = 2  # host bridges within one NUMA node
    HOST_BRIDGE = 3  # PHB
    PCIE_SWITCH = 4  # PIX, PXB
    NVLINK = 5  # NV<n>, NVLink or NVSwitch
    SELF = 6

    @property
    def label(self) -> str:
        return {
            Tier.SYS: "across sockets",
            Tier.NODE: "same NUMA node",
            Tier.HOST_BRIDGE: "same host bridge",
            Tier.PCIE_SWITCH: "same PCIe switch",
            Tier.NVLINK: "NVLink",
            Tier.SELF: "one GPU",
        }[self]


def tier_of(code: str) -> Tier:
    if code == "X":
        return Tier.SELF
    if code.startswith("NV"):
        return Tier.NVLINK
    return {
        "PIX": Tier.PCIE_SWITCH,
        "PXB": Tier.PCIE_SWITCH,
        "PHB": Tier.HOST_BRIDGE,
        "NODE": Tier.NODE,
    }.get(code, Tier.SYS)


def weight_of(code: str) -> int:
    """go-gpuallocator's pair score: 100 per NVLink, PCIe levels 50..10."""
    if code.startswith("NV"):
        return 100 * int(code[2:])
    return {"X": 0, "PIX": 50, "PXB": 40, "PHB": 30, "NODE": 20}.get(code, 10)


@dataclass(frozen=True)
class Topology:
    """Per link matrix: tiers and weights as small integer tables."""

    n: int
    tier: tuple[tuple[int, ...], ...]
    weight: tuple[tuple[int, ...], ...]


@lru_cache(maxsize=256)
def topology(links: tuple[tuple[str, ...], ...]) -> Topology:
    return Topology(
        n=len(links),
        tier=tuple(tuple(int(tier_of(c)) for c in row) for row in links),
        weight=tuple(tuple(weight_of(c) for c in row) for row in links),
    )


@dataclass(frozen=True)
class SetKey:
    """How good a set is, comparable: larger is better."""

    tier: int  # worst pair's tier (Tier.SELF for one GPU)
    weight: int  # sum of pair weights inside the set
    keep: int  # minus the well-linked weight the choice cuts from the idle GPUs


def set_tier(topo: Topology, members: Sequence[int]) -> int:
    worst = int(Tier.SELF)
    for a, b in itertools.combinations(members, 2):
        worst = min(worst, topo.tier[a][b])
    return worst


def set_weight(topo: Topology, members: Sequence[int]) -> int:
    return sum(topo.weight[a][b] for a, b in itertools.combinations(members, 2))


def cut_weight(topo: Topology, members: Sequence[int], idle_mask: int) -> int:
    """Weight of the links from the chosen GPUs to idle GPUs left behind."""
    chosen = 0
    for m in members:
        chosen |= 1 << m
    rest = [j for j in range(topo.n) if idle_mask >> j & 1 and not chosen >> j & 1]
    return sum(topo.weight[m][j] for m in members if idle_mask >> m & 1 for j in rest)


@lru_cache(maxsize=65536)
def ranked_sets(
    links: tuple[tuple[str, ...], ...], candidates: int, idle: int, k: int, keep: bool
) -> tuple[tuple[SetKey, tuple[int, ...]], ...]:
    """Every k-subset of the candidate mask, best first, with its key.

    `keep` (binpack) adds the cut term: prefer sets whose links to the idle
    GPUs are already broken, so the largest well-linked groups stay free.
    """
    topo = topology(links)
    members = [i for i in range(topo.n) if candidates >> i & 1]
    out: list[tuple[SetKey, tuple[int, ...]]] = []
    for combo in itertools.combinations(members, k):
        key = SetKey(
            tier=set_tier(topo, combo),
            weight=set_weight(topo, combo),
            keep=-cut_weight(topo, combo, idle) if keep else 0,
        )
        out.append((key, combo))
    out.sort(key=lambda kc: (-kc[0].tier, -kc[0].weight, -kc[0].keep, kc[1]))
    return tuple(out)


def best_tier(links: tuple[tuple[str, ...], ...], candidates: int, k: int) -> int:
    """The best tier any k-subset of the candidates reaches (0 if none)."""
    ranked = ranked_sets(links, candidates, 0, k, False)
    return ranked[0][0].tier if ranked else 0
