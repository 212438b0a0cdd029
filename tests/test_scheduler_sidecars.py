"""Sidecar containers (init containers with restartPolicy: Always) through
the real kube-apiserver and kube-scheduler with gpuvisor's extender
(tests/test_scheduler_e2e.py's stack): the extender charges a sidecar
beside the app containers, as Kubernetes counts the pod, so the next pod
on its GPU is not over-committed."""

from __future__ import annotations

from typing import Any

from tests import test_scheduler_e2e as e2e
from tests.k8s_cluster import gpu_container
from tests.test_scheduler_e2e import Stack, allocation_of, gpus_of_container

# the fixtures of tests/test_scheduler_e2e.py
sim_gpus = e2e.sim_gpus
stack = e2e.stack


def sidecar(name: str, **kw: Any) -> dict[str, Any]:
    return {**gpu_container(name, **kw), "restartPolicy": "Always"}


def test_a_gpu_sidecar_is_charged_beside_the_app_container(stack: Stack) -> None:
    """One 40960 MiB GPU; a pod with a 15000 MiB sidecar and a 20000 MiB app
    container holds 35000 MiB there.  Counted as a plain init container
    (before: max(15000, 20000)), a 10000 MiB pod was bound beside it, and
    45000 MiB of limits ran on the GPU."""
    k = stack.k8s
    (uuid,) = stack.inventory_node("sc-1", ["NVIDIA A100-SXM4-40GB"])
    k.create_pod(
        "mesh",
        init_containers=[sidecar("proxy", gpus=1, gpumem=15000, gpucores=30)],
        containers=[gpu_container("main", gpus=1, gpumem=20000, gpucores=20)],
    )
    assert k.wait_bound("mesh") == "sc-1"
    doc = allocation_of(k.read_pod("mesh"))
    proxy = next(c for c in doc["containers"] if c["name"] == "proxy")
    assert (proxy["init"], proxy.get("sidecar")) == (True, True)
    assert [g["uuid"] for g in gpus_of_container(doc, "proxy")] == [uuid]
    assert [g["uuid"] for g in gpus_of_container(doc, "main")] == [uuid]
    k.create_pod("next", gpus=1, gpumem=10000, gpucores=10)
    why = k.wait_unschedulable("next")
    assert "needs 1 GPU with 10000 MiB and 10% cores free, has 0" in why, why
    k.create_pod("small", gpus=1, gpumem=5960, gpucores=50)
    assert k.wait_bound("small") == "sc-1"


def test_an_init_container_after_a_sidecar_runs_beside_it(stack: Stack) -> None:
    """kubelet keeps the sidecar up while the next init container runs:
    15000 + 30000 MiB do not fit the 40960 MiB GPU, and the node says which
    container; declared the other way round, the pod fits."""
    k = stack.k8s
    stack.inventory_node("sc-2", ["NVIDIA A100-SXM4-40GB"])
    setup = gpu_container("setup", gpus=1, gpumem=30000)
    proxy = sidecar("proxy", gpus=1, gpumem=15000)
    main = gpu_container("main", gpus=1, gpumem=1000)
    k.create_pod("after", init_containers=[proxy, setup], containers=[main])
    why = k.wait_unschedulable("after")
    assert "container setup" in why, why
    k.create_pod("before", init_containers=[setup, proxy], containers=[main])
    assert k.wait_bound("before") == "sc-2"
    doc = allocation_of(k.read_pod("before"))
    assert [c.get("sidecar", False) for c in doc["containers"]] == [False, True, False]


def test_a_sidecar_pod_starts_each_container_with_its_own_limits(stack: Stack) -> None:
    """From kube-scheduler through the extender to the device plugin and
    kubelet's side (the harness, handing devices on as kubelet does): a
    plain init container, then a sidecar (which takes the init container's
    devices), then the app container; each runs with its own memory and
    SM limit."""
    node = stack.plugin_node("sc-3")
    pod, doc = stack.placed(
        "mesh",
        "sc-3",
        init_containers=[
            gpu_container("fetch", gpus=1, gpumem=1000, gpucores=10),
            sidecar("proxy", gpus=1, gpumem=2000, gpucores=20),
        ],
        containers=[gpu_container("main", gpus=1, gpumem=3000, gpucores=30)],
    )
    (fetch,) = gpus_of_container(doc, "fetch")
    (proxy,) = gpus_of_container(doc, "proxy")
    assert fetch["uuid"] == proxy["uuid"]  # kubelet hands fetch's devices to proxy
    _, resps = node.admit(pod)
    for name, mib, cores in (("fetch", 1000, "10"), ("proxy", 2000, "20"), ("main", 3000, "30")):
        (g,) = gpus_of_container(doc, name)
        assert node.probe(resps[name]) == {"init": 0, "uuids": [g["uuid"]], "mib": [mib]}, name
        assert e2e.sm_limit(resps[name]) == cores, name
