"""The extender's view of the cluster (cluster/scheduler/state.py) against a
real kube-apiserver when the watches miss something: a Node deleted and
registered again while a pod holds its GPUs, and a watch that expired (410
Gone) while pods ended, which is listed again.

A missed end leaves GPUs reserved for nobody; a missed reservation hands a
pod's GPUs to the next pod (two pods with the same GPU memory: the
over-commit HAMi's users report).  Each test asserts what the allocator
holds afterwards, and what it decides for a pod that needs the whole GPU."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from gpuvisor.cluster.allocation import ANNOTATION
from gpuvisor.cluster.allocator import Allocator
from gpuvisor.cluster.deviceplugin.publish import NODE_INVENTORY
from gpuvisor.cluster.request import pod_request
from gpuvisor.cluster.scheduler import state as state_mod
from gpuvisor.cluster.scheduler.api_view import RawWatch
from gpuvisor.cluster.scheduler.state import ClusterState
from kubernetes.client.exceptions import ApiException

from tests.inventories import cluster, pcie_box
from tests.k8s_cluster import KubeCluster, KubeTest
from tests.scheduler_views import fits_on, held_on, wait_for, whole_gpu_pod


def holding_pod(k: KubeTest, name: str, node: str, inventories: list[dict[str, Any]]) -> str:
    """Creates a pod of one whole GPU, bound to `node` with the allocation
    annotation the extender writes at bind (planned on `inventories`);
    returns its key."""
    doc = whole_gpu_pod(k, name)
    created = k.core.create_namespaced_pod(k.namespace, kubernetes.client.V1Pod.from_dict(doc))
    doc["metadata"]["uid"] = created.metadata.uid
    decision = Allocator.from_cluster(cluster(*inventories)).place(pod_request(doc))
    assert decision.node == node, decision
    assert decision.allocation is not None
    k.core.patch_namespaced_pod(
        name,
        k.namespace,
        {"metadata": {"annotations": {ANNOTATION: decision.allocation.annotation()}}},
    )
    k.bind(name, node)
    return f"{k.namespace}/{name}"


@pytest.fixture
def watching(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[ClusterState, Any]]]:
    """The states a test watches with, and their watch threads; stopped
    after it (a watch ends within WATCH_SECONDS, here 2 s, of `stopping`)."""
    monkeypatch.setattr(state_mod, "WATCH_SECONDS", 2)
    running: list[tuple[ClusterState, Any]] = []
    yield running
    for st, _ in running:
        st.stopping.set()
    for _, threads in running:
        for t in threads:
            t.join(timeout=10)


def test_a_node_made_again_holds_its_pods_gpus_again(
    k8s: KubeTest, watching: list[tuple[ClusterState, Any]]
) -> None:
    """kubelet registers a deleted Node again (or the device plugin publishes
    its inventory again after removing it) while a pod still runs on its
    GPU: the pod's reservation comes back with the node, before any other
    pod can take that GPU, though the pod itself sends no event."""
    node = f"a-{k8s.namespace}"
    inv = pcie_box(node, n=1)
    annotations = {NODE_INVENTORY: json.dumps(inv)}
    k8s.create_node(node, annotations=annotations)
    state = ClusterState(k8s.core)
    watching.append((state, state.start()))
    key = holding_pod(k8s, "holder", node, [inv])
    wait_for(lambda: held_on(state, node) == [key], what=f"{key} held on {node}")
    assert not fits_on(state, k8s, node)

    k8s.core.delete_node(node)
    wait_for(lambda: node not in state.inventories, what=f"{node} forgotten")
    k8s.create_node(node, annotations=annotations)
    wait_for(lambda: node in state.inventories, what=f"{node} known again")
    assert held_on(state, node) == [key]
    assert key in state.held
    assert not fits_on(state, k8s, node), "the holder's GPU was free for another pod"

    # Its inventory taken off the Node and published again: the same.
    k8s.core.patch_node(node, {"metadata": {"annotations": {NODE_INVENTORY: None}}})
    wait_for(lambda: node not in state.inventories, what=f"{node} without an inventory")
    k8s.core.patch_node(node, {"metadata": {"annotations": annotations}})
    wait_for(lambda: node in state.inventories, what=f"{node} with an inventory again")
    assert held_on(state, node) == [key]
    assert not fits_on(state, k8s, node)

    # The pod ends: its GPU is free.
    k8s.core.delete_namespaced_pod("holder", k8s.namespace, grace_period_seconds=0)
    wait_for(lambda: held_on(state, node) == [], what=f"{key} released")
    assert fits_on(state, k8s, node)


@pytest.fixture
def compacting(tmp_path: Path) -> Iterator[KubeTest]:
    """A control plane of its own whose watches expire: kube-apiserver
    without its watch cache (watches are etcd's) and compacting etcd's
    history every second, so a watch from an older resourceVersion gets 410
    Gone, as one that was down for a while does on a busy cluster."""
    cluster_ = KubeCluster.start(
        tmp_path / "k8s", apiserver_args=["--watch-cache=false", "--etcd-compaction-interval=1s"]
    )
    test = KubeTest(cluster_)
    try:
        yield test
    finally:
        test.teardown()
        cluster_.stop()


def expired(core: Any, rv: str) -> bool:
    """Whether a pod watch from `rv` is answered 410 Gone."""
    w = RawWatch()
    try:
        for event in w.stream(
            core.list_pod_for_all_namespaces, resource_version=rv, timeout_seconds=1
        ):
            if event["type"] == "ERROR":
                return int(event["object"].get("code", 0)) == 410
    except ApiException as exc:
        return bool(exc.status == 410)
    finally:
        w.stop()
    return False


def test_an_expired_watch_lists_again_and_settles_what_it_missed(
    compacting: KubeTest, watching: list[tuple[ClusterState, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """The extender's watches were down while a pod holding a GPU ended, a
    pod bound to a node without an inventory yet ended, and a Node went
    away and came back; by then etcd had compacted what happened.  The
    watches get 410 Gone, list again, and the state is what the cluster
    says: the ended pods hold nothing (also once the second node publishes
    its inventory), the third pod's GPU is held on the node that came back."""
    k = compacting
    a, b, c = (f"{x}-{k.namespace}" for x in "abc")
    inv_a, inv_b, inv_c = pcie_box(a, n=1), pcie_box(b, n=1), pcie_box(c, n=1)
    k.create_node(a, annotations={NODE_INVENTORY: json.dumps(inv_a)})
    k.create_node(b)  # its device plugin has not published yet
    k.create_node(c, annotations={NODE_INVENTORY: json.dumps(inv_c)})
    ended = holding_pod(k, "ended", a, [inv_a])
    early = holding_pod(k, "early", b, [inv_b])
    stays = holding_pod(k, "stays", c, [inv_c])

    state = ClusterState(k.core)
    node_rv, pod_rv = state.sync()
    assert held_on(state, a) == [ended]
    assert held_on(state, c) == [stays]
    assert state.waiting == {b: {early: state.waiting[b][early]}}

    # Missed: two pods end, node c is deleted and registered again.
    for name in ("ended", "early"):
        k.core.delete_namespaced_pod(name, k.namespace, grace_period_seconds=0)
    k.core.delete_node(c)
    k.create_node(c, annotations={NODE_INVENTORY: json.dumps(inv_c)})
    wait_for(lambda: expired(k.core, pod_rv), what="410 Gone for a watch from before")

    with caplog.at_level(logging.INFO, logger="gpuvisor.scheduler"):
        watching.append((state, state.watch(node_rv, pod_rv)))
        wait_for(
            lambda: caplog.text.count("watch expired; listing again") >= 2,
            what="both watches listing again",
        )
        wait_for(lambda: ended not in state.held, what=f"{ended} released")
    assert held_on(state, a) == []
    assert fits_on(state, k, a)
    assert state.waiting == {}
    assert held_on(state, c) == [stays]
    assert not fits_on(state, k, c)

    # Node b publishes its inventory: the ended pod's allocation is not taken back.
    k.core.patch_node(b, {"metadata": {"annotations": {NODE_INVENTORY: json.dumps(inv_b)}}})
    wait_for(lambda: b in state.inventories, what=f"{b}'s inventory")
    assert held_on(state, b) == []
    assert fits_on(state, k, b)
