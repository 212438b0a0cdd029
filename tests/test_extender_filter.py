"""The extender's filter verb on many nodes (cluster/scheduler/extender.py),
without Kubernetes: offered more than EXPLAINED_NODES nodes, it plans in full
only the allocator's finalists and answers those, with the allocator's
choice among them, so that a filter costs about what one decision does;
offered few, it explains every node.  A pod that fits nowhere gets a reason
for every node offered."""

from __future__ import annotations

import time
from typing import Any

import pytest
from gpuvisor.cluster.allocator import Allocator
from gpuvisor.cluster.request import pod_request
from gpuvisor.cluster.scheduler import state as state_mod
from gpuvisor.cluster.scheduler.extender import EXPLAINED_NODES, NOT_EXPLAINED, Extender
from gpuvisor.cluster.scheduler.state import ClusterState

from tests.inventories import cluster, ctr, pcie_box, pod


def extender(nodes: int) -> Extender:
    state = ClusterState(core=None)
    state.allocator = Allocator.from_cluster(cluster(*(pcie_box(f"n{i:04}") for i in range(nodes))))
    return Extender(state, core=None, binder=None)


def body(p: dict[str, Any], nodes: int) -> dict[str, Any]:
    p = {**p, "metadata": {**p["metadata"], "uid": "u-" + p["metadata"]["name"]}}
    return {"Pod": p, "NodeNames": [f"n{i:04}" for i in range(nodes)]}


def test_many_nodes_get_the_allocators_finalists_fast() -> None:
    ext = extender(1000)
    want = pod("small", ctr(gpu=1, gpumem=4000))
    t0 = time.process_time()
    out = ext.filter(body(want, 1000))
    took = time.process_time() - t0
    names = out["NodeNames"]
    assert 1 <= len(names) <= 2 * ext.allocator.config.finalists
    d = ext.allocator.decide(pod_request(body(want, 1000)["Pod"]))
    assert d.node in names
    assert out["FailedNodes"] == {}
    # prioritize ranks the allocator's choice first among them
    scores = {
        s["Host"]: s["Score"] for s in ext.prioritize(body(want, 1000) | {"NodeNames": names})
    }
    assert scores[d.node] == max(scores.values())
    print(f"filter over 1,000 nodes: {took * 1000:.1f} ms CPU")


def test_few_nodes_are_each_explained() -> None:
    ext = extender(EXPLAINED_NODES)
    out = ext.filter(body(pod("big", ctr(gpu=1, gpumem=46068)), EXPLAINED_NODES))
    assert len(out["NodeNames"]) == EXPLAINED_NODES
    out = ext.filter(body(pod("huge", ctr(gpu=9)), EXPLAINED_NODES))
    assert out["NodeNames"] == []
    assert len(out["FailedNodes"]) == EXPLAINED_NODES
    assert all("needs 9 idle GPUs, has 8" in why for why in out["FailedNodes"].values()), out


def test_a_pod_that_fits_nowhere_gets_a_reason_for_every_node() -> None:
    ext = extender(200)
    out = ext.filter(body(pod("huge", ctr(gpu=9)), 200))
    assert out["NodeNames"] == []
    failed = out["FailedNodes"]
    assert len(failed) == 200
    explained = [why for why in failed.values() if why != NOT_EXPLAINED]
    assert len(explained) >= EXPLAINED_NODES
    assert all("needs 9 idle GPUs, has 8" in why for why in explained), explained[:3]


def test_prioritize_holds_the_room_until_the_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    """kube-scheduler binds after its cycle, so the next pod's filter used to
    find the room of the pod before it free, and one bind in 16 failed under
    make bench-cluster.  prioritize (the cycle's last verb) now holds the
    room: the next pod's filter sees it taken; the same pod decided again
    (a new cycle) and a pod never bound (ASSUME_SECONDS) give it back."""
    ext = extender(2)
    whole = ctr(gpu=8, gpucores=100)  # a whole node

    def cycle(name: str) -> list[str]:
        b = body(pod(name, whole), 2)
        names: list[str] = ext.filter(b)["NodeNames"]
        if names:
            ext.prioritize(b | {"NodeNames": names})
        return names

    assert sorted(cycle("a")) == ["n0000", "n0001"]
    (held,) = [n for n, st in ext.allocator.nodes.items() if st.pods]
    assert cycle("b") == [n for n in ("n0000", "n0001") if n != held]
    assert set(ext.state.assumed) == {"default/a", "default/b"}
    assert cycle("c") == []  # both held, by a and b
    # a decided again: its own room is not in its way
    assert held in cycle("a")
    # never bound: given back after ASSUME_SECONDS
    monkeypatch.setattr(state_mod, "ASSUME_SECONDS", 0.0)
    ext.state._swept = float("-inf")
    assert sorted(cycle("x")) == ["n0000", "n0001"]
    assert set(ext.state.held) == {"default/x"}
    assert set(ext.state.assumed) == {"default/x"}


def test_the_node_the_last_pod_took_is_planned_once_per_filter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pod after pod of one shape over many nodes, none started: each
    filter plans only the node the pod before took room on, and that once.
    Its waiting check (would the pod wait for the not-started pod there?)
    planned it for the pod narrowed to the other pod's GPUs, and the
    decision then planned it again for the pod itself; the pod's own plan,
    on those GPUs already, now answers for both (make bench-cluster)."""
    import gpuvisor.cluster.allocator as allocator

    ext = extender(EXPLAINED_NODES + 36)
    planned: list[str] = []
    real = allocator.plan_node

    def counting(node: Any, *args: Any, **kw: Any) -> Any:
        planned.append(node.inv.node)
        return real(node, *args, **kw)

    monkeypatch.setattr(allocator, "plan_node", counting)
    took: list[str] = []
    for i in range(6):
        planned.clear()
        b = body(pod(f"p{i}", ctr(gpu=1, gpumem=1000, gpucores=10)), EXPLAINED_NODES + 36)
        names = ext.filter(b)["NodeNames"]
        scores = ext.prioritize(b | {"NodeNames": names})
        took.append(max(scores, key=lambda s: s["Score"])["Host"])
        if i:
            assert planned == [took[i - 1]], (i, planned)
    assert len(set(took)) == 1  # binpack: the pods share a GPU, and no pod waits
    assert len(ext.state.assumed) == 6
