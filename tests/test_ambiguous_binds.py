"""Two pods on one node that the device plugin cannot tell apart (issue 34).

kubelet does not tell the device plugin which pod it admits: its
GetPreferredAllocation steers a container to the GPUs of the oldest pod
bound to the node and not started, with as many GPUs as asked.  kubelet
admits pods in the order their bindings reach it, which need not be the
creation order (one-second timestamps; bindings of a batch race), so two
not-started pods with same-sized containers on different GPUs could each
be steered to the other's GPUs, and PreStartContainer refuses the start for
good.  The extender's bind keeps such pods from being bound at once: a pod
goes to the other's GPUs where it fits, else it waits for the other to
start (the kubelet harness reports starts in the pod's status, as kubelet).

Real kube-scheduler, extender and device plugins on simulated nodes
(tests/cluster_sim.py), kubelet's side played by tests/kubelet_harness.py."""

from __future__ import annotations

import kubernetes.client
from gpuvisor.cluster.scheduler.wake import WOKEN

from tests.cluster_sim import limits_file
from tests.k8s_cluster import KubeTest, gpu_container
from tests.test_cluster_sim_nodes import A100_40, Cluster, allocation_of, cluster, main_gpus

__all__ = ["cluster"]  # the fixture

SPREAD = {"hami.io/gpu-scheduler-policy": "spread"}


def scheduling_message(pod: kubernetes.client.V1Pod) -> str | None:
    for c in (pod.status and pod.status.conditions) or []:
        if c.type == "PodScheduled" and c.status == "False":
            return str(c.message)
    return None


def test_spread_pods_admitted_in_reverse_order_all_start(cluster: Cluster) -> None:
    """Spread would put the second pod on the other GPU; kubelet admitting
    it first would then have it steered to the first pod's GPU and its start
    refused.  Here both start, each with its own pod's limits."""
    k = cluster.k8s
    node = cluster.node("amb-1", [A100_40, A100_40])
    k.create_pod("first", gpus=1, gpumem=3000, gpucores=30, annotations=SPREAD)
    assert k.wait_bound("first") == "amb-1"
    k.create_pod("second", gpus=1, gpumem=2000, gpucores=20, annotations=SPREAD)
    assert k.wait_bound("second") == "amb-1"
    pods = {n: k.read_pod(n) for n in ("first", "second")}
    # admitted against the plugin's guess: the newer pod first
    for name in ("second", "first"):
        _, resps = node.admit(pods[name])
        text = limits_file(resps["main"]).read_text()
        assert f"pod {k.namespace}/{name}, container main" in text
        (g,) = main_gpus(allocation_of(pods[name]))
        mib = 3000 if name == "first" else 2000
        assert f"CUDA_DEVICE_MEMORY_LIMIT={mib}m\n" in text
        assert node.run(resps["main"]) == {"init": 0, "uuids": [g["uuid"]], "mib": [mib]}
    assert k.read_pod("first").status.phase == "Running"


def test_a_pod_that_cannot_share_waits_for_the_other_to_start(cluster: Cluster) -> None:
    """Exclusive pods cannot share a GPU: the second is not scheduled (the
    extender's filter names the first; its bind would be refused) until
    kubelet (the harness) reports the first's container started; then it
    binds to the other GPU and starts."""
    k = cluster.k8s
    node = cluster.node("amb-2", [A100_40, A100_40])
    k.create_pod("first", gpus=1, gpucores=100)
    assert k.wait_bound("first") == "amb-2"
    k.create_pod("second", gpus=1, gpucores=100)
    waiting = k.wait_pod(
        "second",
        lambda p: "waits for pod" in (scheduling_message(p) or ""),
        timeout=150,
        what="the extender's reason",
    )
    message = scheduling_message(waiting) or ""
    assert f"waits for pod {k.namespace}/first on amb-2 to start its container main" in message
    assert not k.read_pod("second").spec.node_name
    node.admit(k.read_pod("first"))
    # kube-scheduler does not try a pod an extender refused again on
    # another pod's status update, only when it flushes pods unschedulable
    # for 5 minutes (a CI run waited 150 s in vain): the extender wakes it
    # (an update of its gpuvisor.io/woken annotation) when the first starts
    # (a node another test adds to the shared kube-scheduler makes it try
    # every unschedulable pod again: then the pod may bind before the wake,
    # which leaves a bound pod alone; tests/test_scheduler_wake.py checks
    # the patch itself)
    assert k.wait_bound("second", timeout=120) == "amb-2"
    woken = (k.read_pod("second").metadata.annotations or {}).get(WOKEN, "")
    assert not woken or woken.endswith(f" {k.namespace}/first started its container main"), woken
    first, second = (main_gpus(allocation_of(k.read_pod(n)))[0] for n in ("first", "second"))
    assert first["uuid"] != second["uuid"]
    _, resps = node.admit(k.read_pod("second"))
    assert node.run(resps["main"])["uuids"] == [second["uuid"]]


def test_a_kubelet_loop_starts_pods_bound_in_a_burst(cluster: Cluster, k8s: KubeTest) -> None:
    """Ten spread pods at once onto one node of two GPUs (5 fit per GPU):
    kubelet's loop (the harness's serve) admits each as its binding arrives;
    every one starts with its own limits, and both GPUs end up used."""
    node = cluster.node("amb-3", [A100_40, A100_40])
    serving = node.serve(k8s)
    names = [f"b{i}" for i in range(10)]
    for n in names:
        k8s.create_pod(n, gpus=1, gpumem=3000, gpucores=20, annotations=SPREAD)
    for n in names:
        assert k8s.wait_bound(n, timeout=120) == "amb-3"
    results = serving.wait(names, timeout=120)
    failed = {n: r for n, r in results.items() if isinstance(r, Exception)}
    assert failed == {}
    used = set()
    for n in names:
        (g,) = main_gpus(allocation_of(k8s.read_pod(n)))
        used.add(g["uuid"])
        resps = results[n][1]
        text = limits_file(resps["main"]).read_text()
        assert f"pod {k8s.namespace}/{n}, container main" in text
    assert len(used) == 2


def test_two_pods_init_containers_on_one_gpu_with_other_limits_both_start(
    cluster: Cluster,
) -> None:
    """Two pods whose only GPU container is a plain init container (their
    app containers run without a GPU), on the node's one GPU with other
    limits.  kubelet's PodResources lists no plain init container, so while
    both are bound and neither started the device plugin cannot tell whose
    limits a start is for and refuses both, for good: neither pod ever
    started.  The extender binds the second only once the first's init
    container has started; then each starts with its own limits."""
    k = cluster.k8s
    node = cluster.node("amb-4", [A100_40])
    k.create_pod(
        "first",
        init_containers=[gpu_container("warm", gpus=1, gpumem=3000, gpucores=30)],
        containers=[gpu_container("main")],
    )
    assert k.wait_bound("first") == "amb-4"
    k.create_pod(
        "second",
        init_containers=[gpu_container("warm", gpus=1, gpumem=2000, gpucores=20)],
        containers=[gpu_container("main")],
    )
    waiting = k.wait_pod(
        "second",
        lambda p: "waits for pod" in (scheduling_message(p) or "") or bool(p.spec.node_name),
        timeout=150,
        what="the extender's reason or a binding",
    )
    assert not waiting.spec.node_name, "bound beside the first pod's unstarted init container"
    message = scheduling_message(waiting) or ""
    assert f"waits for pod {k.namespace}/first on amb-4 to start its container warm" in message
    _, resps = node.admit(k.read_pod("first"))
    assert "CUDA_DEVICE_MEMORY_LIMIT=3000m\n" in limits_file(resps["warm"]).read_text()
    assert k.wait_bound("second", timeout=120) == "amb-4"
    _, resps = node.admit(k.read_pod("second"))
    text = limits_file(resps["warm"]).read_text()
    assert f"pod {k.namespace}/second, container warm" in text
    assert "CUDA_DEVICE_MEMORY_LIMIT=2000m\n" in text
