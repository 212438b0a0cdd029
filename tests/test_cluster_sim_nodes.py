"""The cluster half end to end with simulated nodes behind real device
plugins: every Node's inventory is published by a `gpuvisor device-plugin`
process reading a simulated node (`GPUVISOR_SIM_TOPOLOGY`) through NVML,
not written by the test (tests/cluster_sim.py).  kube-scheduler (real)
places the pods through `gpuvisor scheduler`; kubelet's side is played by
tests/kubelet_harness.py; the workloads run under the library with exactly
what the plugin returned."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from gpuvisor.cluster.allocation import ANNOTATION, load_allocation

from tests.cluster_sim import SimTopologyNode, limits_file, node_uuid, topology
from tests.k8s_cluster import KubeTest
from tests.test_scheduler_e2e import Extender, scheduler_config

A100_40 = "NVIDIA A100-SXM4-40GB"
A100_80 = "NVIDIA A100-SXM4-80GB"


class Cluster:
    """The extender, kube-scheduler and the simulated nodes of one test."""

    def __init__(self, k8s: KubeTest, tmp: Path) -> None:
        self.k8s = k8s
        self.tmp = tmp
        self.extender = Extender(k8s.cluster.kubeconfig, tmp / "extender.log")
        self.nodes: dict[str, SimTopologyNode] = {}

    def launch(
        self, name: str, models: Sequence[str], nvlink: Sequence[Sequence[int]] = ()
    ) -> SimTopologyNode:
        """Starts a simulated node's plugin without waiting for it."""
        topo = topology(models, len(self.nodes), nvlink)
        node = SimTopologyNode.launch(self.k8s, name, topo, self.tmp)
        self.nodes[name] = node
        return node

    def node(
        self, name: str, models: Sequence[str], nvlink: Sequence[Sequence[int]] = ()
    ) -> SimTopologyNode:
        node = self.launch(name, models, nvlink)
        node.wait_ready(self.k8s)
        return node

    def stop(self) -> None:
        self.extender.stop()
        for n in self.nodes.values():
            n.stop()


@pytest.fixture
def cluster(k8s: KubeTest, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(k8s, tmp_path)
    try:
        c.extender.start()
        k8s.start_scheduler(scheduler_config(c.extender.port))
        yield c
    finally:
        c.stop()


def allocation_of(pod: kubernetes.client.V1Pod) -> dict[str, Any]:
    text = (pod.metadata.annotations or {}).get(ANNOTATION)
    assert text, f"pod {pod.metadata.name} has no {ANNOTATION}"
    doc: dict[str, Any] = json.loads(text)
    load_allocation(doc)
    return doc


def main_gpus(doc: dict[str, Any]) -> list[dict[str, Any]]:
    (c,) = [c for c in doc["containers"] if c["name"] == "main"]
    return list(c["gpus"])


def test_the_plugin_publishes_the_simulated_inventory(cluster: Cluster) -> None:
    """What the extender reads is what NVML showed the plugin: the models,
    memory and UUIDs of the topology file."""
    node = cluster.node("cs-inv", [A100_40, A100_80])
    gpus = node.inventory["gpus"]
    assert [(g["uuid"], g["model"], g["memory_mib"]) for g in gpus] == [
        (node_uuid(0, 0), A100_40, 40960),
        (node_uuid(0, 1), A100_80, 81920),
    ]
    assert node.inventory["node"] == "cs-inv"


def test_a_single_pod_on_a_simulated_node(cluster: Cluster) -> None:
    k = cluster.k8s
    node = cluster.node("cs-1", [A100_40, A100_40])
    k.create_pod("train", gpus=1, gpumem=3000, gpucores=30)
    assert k.wait_bound("train") == "cs-1"
    pod = k.read_pod("train")
    doc = allocation_of(pod)
    (g,) = main_gpus(doc)
    assert (g["memory_mib"], g["cores"]) == (3000, 30)
    assert g["uuid"] in {node_uuid(0, 0), node_uuid(0, 1)}
    _, resps = node.admit(pod)
    text = limits_file(resps["main"]).read_text()
    assert f"pod {k.namespace}/train, container main" in text
    assert "CUDA_DEVICE_MEMORY_LIMIT=3000m\nCUDA_DEVICE_SM_LIMIT=30\n" in text
    assert node.run(resps["main"]) == {"init": 0, "uuids": [g["uuid"]], "mib": [3000]}


def test_a_two_gpu_pod_gets_the_nvlink_pair_nvml_shows(cluster: Cluster) -> None:
    """The links come from the simulated NVML through the plugin: with GPU 0
    taken exclusively, a 2-GPU pod gets the intact NVLink pair (2, 3)."""
    k = cluster.k8s
    node = cluster.node("cs-nv", [A100_80] * 4, nvlink=[[0, 1, 12], [2, 3, 12]])
    links = node.inventory.get("links")
    assert links is not None
    assert links[0][1].startswith("NV")
    assert links[0][2] != links[0][1]
    k.create_pod("small", gpus=1, gpumem=1000, gpucores=100)
    assert k.wait_bound("small") == "cs-nv"
    (taken,) = main_gpus(allocation_of(k.read_pod("small")))
    k.create_pod("pair", gpus=2, gpumem=8000, gpucores=50)
    assert k.wait_bound("pair") == "cs-nv"
    pod = k.read_pod("pair")
    got = sorted(g["index"] for g in main_gpus(allocation_of(pod)))
    assert got in ([0, 1], [2, 3]), (got, taken)
    assert taken["index"] not in got, (got, taken)
    _, resps = node.admit(pod)
    seen = node.run(resps["main"])
    assert seen["mib"] == [8000, 8000]
    assert sorted(seen["uuids"]) == sorted(node_uuid(0, i) for i in got)


def test_fifty_pods_at_once_onto_five_simulated_nodes(cluster: Cluster) -> None:
    """Exactly a full cluster: 5 nodes x 2 GPUs x 5 pods of 3000 MiB and
    20 %, submitted at once, each node's kubelet admitting them as they are
    bound.  All are placed and start, no GPU is over-committed (by the
    inventories the plugins published), every container's limits file names
    its own pod and limits, one workload per node sees 3000 MiB, and a 51st
    pod is Unschedulable."""
    k = cluster.k8s
    # the plugins start together (from this thread: they die with the one that started them)
    started = [cluster.launch(f"cs-f{i}", [A100_40] * 2) for i in range(5)]
    for n in started:
        n.wait_ready(k)
    total = {(n.name, g["uuid"]): g["memory_mib"] for n in started for g in n.inventory["gpus"]}
    assert len(total) == 10
    assert set(total.values()) == {40960}
    # kubelet on each node admits and starts the pods as their bindings
    # arrive: the extender holds back a bind the device plugin could
    # confuse with a not-started pod's until that one starts
    serving = {n.name: n.serve(k) for n in started}
    names = [f"p{i:02d}" for i in range(50)]
    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda n: k.create_pod(n, gpus=1, gpumem=3000, gpucores=20), names))
    bound = {n: k.wait_bound(n, timeout=180) for n in names}
    elapsed = time.monotonic() - began
    assert sorted(list(bound.values()).count(f"cs-f{i}") for i in range(5)) == [10] * 5
    pods = [k.read_pod(n) for n in names]
    used: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for pod in pods:
        doc = allocation_of(pod)
        assert doc["node"] == pod.spec.node_name
        for g in main_gpus(doc):
            u = used[(doc["node"], g["uuid"])]
            u[0], u[1], u[2] = u[0] + 1, u[1] + g["memory_mib"], u[2] + g["cores"]
    assert set(used) <= set(total)
    assert {key: v for key, v in used.items() if v[1] > total[key] or v[2] > 100} == {}
    assert sorted(v[0] for v in used.values()) == [5] * 10
    ran: set[str] = set()
    for pod in pods:
        node = cluster.nodes[pod.spec.node_name]
        result = serving[node.name].wait([pod.metadata.name], timeout=120)[pod.metadata.name]
        assert not isinstance(result, Exception), f"{pod.metadata.name}: {result}"
        _, resps = result
        text = limits_file(resps["main"]).read_text()
        assert f"pod {k.namespace}/{pod.metadata.name}, container main" in text
        assert "CUDA_DEVICE_MEMORY_LIMIT=3000m\nCUDA_DEVICE_SM_LIMIT=20\n" in text
        if node.name not in ran:
            ran.add(node.name)
            (g,) = main_gpus(allocation_of(pod))
            assert node.run(resps["main"]) == {"init": 0, "uuids": [g["uuid"]], "mib": [3000]}
    k.create_pod("one-too-many", gpus=1, gpumem=3000, gpucores=20)
    message = k.wait_unschedulable("one-too-many")
    assert "0/5 nodes are available" in message, message
    print(f"50 pods bound in {elapsed:.1f}s; the 51st: {message}")
