"""Decisions kept and committed later hold only for the node they were
planned on (cluster/allocator.py `commit`, cluster/scheduler/extender.py).

The extender keeps filter's decision for prioritize (up to CACHE_SECONDS),
and prioritize commits it (`ClusterState.assume`).  A decision read from a
node whose state moved since is checked against the node's usage before it
is committed; that check counts slots, memory, cores and MIG slices by GPU
index, and so holds only while the node's inventory is the one the
decision was planned on.  A node whose inventory changed meanwhile (a GPU
turned unhealthy, a GPU gone: the device plugin republished it) conflicts:
the pod is decided again on the new inventory, never committed to a GPU
that is unhealthy or no longer there."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from gpuvisor.cluster.allocator import Allocator, Config, Conflict
from gpuvisor.cluster.deviceplugin.publish import NODE_INVENTORY
from gpuvisor.cluster.inventory_model import load_inventory
from gpuvisor.cluster.request import pod_request
from gpuvisor.cluster.scheduler.api_view import view
from gpuvisor.cluster.scheduler.extender import Extender
from gpuvisor.cluster.scheduler.state import ClusterState

from tests.inventories import ctr, gpu, inventory, links_pcie, pod
from tests.test_bind_ambiguity import Pods, bind_args, gpus_of


def box(healthy: tuple[bool, ...]) -> dict[str, Any]:
    """Node n0, one L40S per entry, healthy as given."""
    gpus = [gpu("n0", i, "NVIDIA L40S", 46068, healthy=h) for i, h in enumerate(healthy)]
    return inventory("n0", gpus, links_pcie(len(gpus)))


def allocator(healthy: tuple[bool, ...]) -> Allocator:
    a = Allocator(config=Config())
    a.add_node(load_inventory(box(healthy)))
    return a


def whole_gpu(name: str) -> Any:
    return pod_request(pod(name, ctr(gpu=1, gpucores=100)))


def test_a_decision_on_a_gpu_turned_unhealthy_since_conflicts() -> None:
    a = allocator((True, True))
    d = a.decide(whole_gpu("default/x"))
    assert d.allocation is not None
    (g,) = d.allocation.containers[0].gpus
    healthy = [True, True]
    healthy[g.index] = False
    a.replace_node(load_inventory(box(tuple(healthy))))
    with pytest.raises(Conflict, match="inventory changed"):
        a.commit(d)
    assert a.nodes["n0"].pods == {}
    # decided again: the other GPU
    again = a.place(whole_gpu("default/x"))
    assert again.allocation is not None
    assert [h.index for h in again.allocation.containers[0].gpus] == [1 - g.index]


def test_a_decision_on_a_gpu_gone_since_conflicts() -> None:
    """Planned on GPU 1, which the node no longer has: a Conflict, not an
    IndexError out of the usage check (index 1 of a 1-GPU node)."""
    a = allocator((True, True))
    on_0 = pod("a", ctr(gpu=1, gpucores=100), annotations={"nvidia.com/use-gpuuuid": "GPU-n0-0"})
    assert a.place(pod_request(on_0)).node == "n0"
    d = a.decide(whole_gpu("default/b"))
    assert d.allocation is not None
    assert [g.index for g in d.allocation.containers[0].gpus] == [1]
    one = box((True,))
    assert a.replace_node(load_inventory(one)) == []  # pod a keeps GPU 0
    with pytest.raises(Conflict, match="inventory changed"):
        a.commit(d)
    assert list(a.nodes["n0"].pods) == ["default/a"]


def test_an_unchanged_inventory_republished_keeps_the_decision() -> None:
    """The same inventory published again (a new NodeState, an equal
    inventory): the decision is checked against the usage, as for any
    other move of the node's state, and commits."""
    a = allocator((True, True))
    d = a.decide(whole_gpu("default/x"))
    a.replace_node(load_inventory(box((True, True))))
    assert a.commit(d) == d.allocation


def node_event(e: Extender, healthy: tuple[bool, ...]) -> None:
    text = json.dumps(box(healthy))
    e.state.node_event(view({"metadata": {"name": "n0", "annotations": {NODE_INVENTORY: text}}}))


def test_prioritize_never_assumes_filters_decision_on_a_gpu_turned_unhealthy() -> None:
    """kube-scheduler's cycle: filter decides (and keeps the decision),
    the device plugin reports the chosen GPU unhealthy, prioritize recalls
    the decision and holds its room, bind binds what prioritize held.
    The pod must be bound to the healthy GPU."""
    pods = Pods()
    e = Extender(ClusterState(core=None), core=pods, binder=pods)
    node_event(e, (True, True))
    doc = pod("x", ctr(gpu=1, gpucores=100))
    pods.add(doc)
    sent = json.loads(json.dumps(pods.docs["x"]))
    out = e.filter({"Pod": sent, "NodeNames": ["n0"]})
    assert out["NodeNames"] == ["n0"]
    chosen = e._recall("uid-x", ["n0"])
    assert chosen is not None
    assert chosen.allocation is not None
    bad = chosen.allocation.containers[0].gpus[0]
    healthy = [True, True]
    healthy[bad.index] = False
    node_event(e, tuple(healthy))
    e.prioritize({"Pod": sent, "NodeNames": ["n0"]})
    # the kept decision conflicts: nothing held, the bind decides again
    assert "default/x" not in e.state.assumed
    assert e.allocator.nodes["n0"].pods == {}
    assert asyncio.run(e.bind(bind_args("x"))) == {"Error": ""}
    assert gpus_of(pods, "x") == [[f"GPU-n0-{1 - bad.index}"]]
    (placed,) = [a for a, _c in e.allocator.nodes["n0"].pods.values()]
    assert [g.uuid for g in placed.containers[0].gpus] == [f"GPU-n0-{1 - bad.index}"]


def test_a_room_assumed_on_a_gpu_turned_unhealthy_is_decided_again_at_bind() -> None:
    """prioritize held the room (the pod not bound yet), then the GPU turned
    unhealthy: the bind does not bind the pod to it, it decides again."""
    pods = Pods()
    e = Extender(ClusterState(core=None), core=pods, binder=pods)
    node_event(e, (True, True))
    pods.add(pod("x", ctr(gpu=1, gpucores=100)))
    sent = json.loads(json.dumps(pods.docs["x"]))
    e.filter({"Pod": sent, "NodeNames": ["n0"]})
    e.prioritize({"Pod": sent, "NodeNames": ["n0"]})
    assert "default/x" in e.state.assumed
    (bad,) = e.allocator.nodes["n0"].pods["default/x"][0].containers[0].gpus
    healthy = [True, True]
    healthy[bad.index] = False
    node_event(e, tuple(healthy))
    assert asyncio.run(e.bind(bind_args("x"))) == {"Error": ""}
    assert gpus_of(pods, "x") == [[f"GPU-n0-{1 - bad.index}"]]
    (placed,) = [a for a, _c in e.allocator.nodes["n0"].pods.values()]
    assert [g.uuid for g in placed.containers[0].gpus] == [f"GPU-n0-{1 - bad.index}"]


def test_a_decision_on_a_node_deleted_and_made_again_is_checked() -> None:
    """The node's Node object deleted and made again with the same
    inventory: a new state whose version counts from 0 again.  A decision
    kept from the old state, at the version the new one has reached, is
    still checked against the new state's usage."""
    a = allocator((True,))
    big = pod_request(pod("p", ctr(gpu=1, gpumem=30000, gpucores=10)))
    assert a.place(pod_request(pod("a", ctr(gpu=1, gpumem=1000, gpucores=10)))).node == "n0"
    d = a.decide(big)
    assert d.node == "n0"
    assert a.remove_node("n0")
    a.add_node(load_inventory(box((True,))))
    q = a.place(pod_request(pod("q", ctr(gpu=1, gpumem=30000, gpucores=10))))
    assert q.node == "n0"
    assert a.nodes["n0"].version == d.version  # what the old check compared alone
    with pytest.raises(Conflict, match="not enough memory"):
        a.commit(d)
    assert a.nodes["n0"].mem == [30000]
