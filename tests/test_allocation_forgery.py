"""A tenant writing `gpuvisor.io/allocation` on their own pod, against the
real kube-apiserver, kube-scheduler and extender (the `stack` of
tests/test_scheduler_e2e.py), with no admission webhook installed: what
the extender and the device plugin do with a forged record on their own
(docs/security.md, "The cluster half").  The webhook's refusal of the
write itself is tested in tests/test_webhook_k8s.py.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from tests import test_scheduler_e2e as e2e
from tests.k8s_cluster import KubeTest
from tests.test_scheduler_e2e import Stack, allocation_of, gpus_of_container

# the fixtures of tests/test_scheduler_e2e.py
sim_gpus = e2e.sim_gpus
stack = e2e.stack

A100 = "NVIDIA A100-SXM4-40GB"  # 40960 MiB in Stack.inventory_node


def forged(namespace: str, name: str, node: str, uuid: str, mib: int, cores: int) -> str:
    """An allocation record as a tenant writes it for their own pod."""
    return json.dumps(
        {
            "version": 1,
            "pod": f"{namespace}/{name}",
            "node": node,
            "containers": [
                {
                    "name": "main",
                    "init": False,
                    "sm_policy": None,
                    "priority": None,
                    "gpus": [
                        {"uuid": uuid, "index": 0, "memory_mib": mib, "cores": cores, "mig": None}
                    ],
                }
            ],
        }
    )


def patch_allocation(k: KubeTest, name: str, doc: dict[str, Any]) -> None:
    annotations = {"gpuvisor.io/allocation": json.dumps(doc)}
    k.core.patch_namespaced_pod(name, k.namespace, {"metadata": {"annotations": annotations}})


def test_an_unbound_pods_record_reserves_nothing(stack: Stack) -> None:
    """A pod created with the annotation set and never bound (here: it
    names a scheduler nobody runs) holds no GPU in the extender; before,
    the extender restored it from the annotation as soon as it saw the
    pod, and the GPU it named was full for everyone else."""
    k = stack.k8s
    (uuid,) = stack.inventory_node("fx-1", [A100])
    text = forged(k.namespace, "squatter", "fx-1", uuid, 40960, 100)
    k.create_pod(
        "squatter",
        gpus=1,
        gpumem=1000,
        gpucores=10,
        scheduler_name="nobody",
        annotations={"gpuvisor.io/allocation": text},
    )
    k.create_pod("victim", gpus=1, gpumem=30000, gpucores=50)
    assert k.wait_bound("victim", timeout=60) == "fx-1"


def test_the_bind_overwrites_a_record_written_at_creation(stack: Stack) -> None:
    """A pod created with a forged record and placed by gpuvisor's
    scheduler ends up with the extender's record (the Binding's copy
    replaces the pod's), for what it asked."""
    k = stack.k8s
    (uuid,) = stack.inventory_node("fx-2", [A100])
    text = forged(k.namespace, "greedy", "fx-2", uuid, 40960, 100)
    k.create_pod(
        "greedy", gpus=1, gpumem=3000, gpucores=30, annotations={"gpuvisor.io/allocation": text}
    )
    assert k.wait_bound("greedy", timeout=60) == "fx-2"
    (g,) = gpus_of_container(allocation_of(k.read_pod("greedy")), "main")
    assert (g["memory_mib"], g["cores"]) == (3000, 30)


def test_an_extender_restart_restores_no_record_beyond_the_pods_request(stack: Stack) -> None:
    """A bound pod whose record its owner raised to the whole GPU: a
    restarted extender does not take the raise as a reservation (before,
    it did, and the other pod's reservation on that GPU then failed to
    restore, leaving it unaccounted)."""
    k = stack.k8s
    stack.inventory_node("fx-3", [A100])
    k.create_pod("aaa-tenant", gpus=1, gpumem=5000, gpucores=10)
    assert k.wait_bound("aaa-tenant", timeout=60) == "fx-3"
    k.create_pod("victim", gpus=1, gpumem=30000, gpucores=50)
    assert k.wait_bound("victim", timeout=60) == "fx-3"
    doc = allocation_of(k.read_pod("aaa-tenant"))
    doc["containers"][0]["gpus"][0].update(memory_mib=40960, cores=100)
    patch_allocation(k, "aaa-tenant", doc)
    stack.extender.kill()
    stack.extender.start()
    # 40960 - 30000 (victim): room for 5000 more, not for 11000
    k.create_pod("next", gpus=1, gpumem=5000, gpucores=10)
    assert k.wait_bound("next", timeout=60) == "fx-3"
    k.create_pod("over", gpus=1, gpumem=11000, gpucores=10)
    message = k.wait_unschedulable("over", timeout=60)
    assert "needs 1 GPU with 11000 MiB" in message, message


def test_a_raised_record_is_refused_at_the_containers_restart(stack: Stack) -> None:
    """The owner of a running pod raises its record (memory and cores)
    and its container restarts: PreStartContainer refuses the start with
    one line naming the field, instead of writing the raised limits."""
    k = stack.k8s
    node = stack.plugin_node("fx-4")
    k.create_pod("raiser", gpus=1, gpumem=3000, gpucores=30)
    assert k.wait_bound("raiser", timeout=60) == "fx-4"
    hp, resps = node.admit(k.read_pod("raiser"))
    assert node.probe(resps["main"])["mib"] == [3000]
    doc = allocation_of(k.read_pod("raiser"))
    doc["containers"][0]["gpus"][0].update(memory_mib=16000, cores=100)
    patch_allocation(k, "raiser", doc)
    with pytest.raises(grpc.RpcError) as refused:
        node.kubelet.start(hp, "main")  # the container restarts
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    detail = str(refused.value.details())
    assert "containers[0].gpus[0].memory_mib=16000" in detail, detail
    assert "nvidia.com/gpumem" in detail, detail
    # the cores alone
    doc["containers"][0]["gpus"][0].update(memory_mib=3000, cores=100)
    patch_allocation(k, "raiser", doc)
    with pytest.raises(grpc.RpcError) as refused:
        node.kubelet.start(hp, "main")
    assert "containers[0].gpus[0].cores=100" in str(refused.value.details())
    # the record as the extender wrote it starts again
    doc["containers"][0]["gpus"][0].update(memory_mib=3000, cores=30)
    patch_allocation(k, "raiser", doc)
    node.kubelet.start(hp, "main")
    assert node.probe(resps["main"])["mib"] == [3000]
