"""The device plugin's PreStartContainer with the pods read from the real
kube-apiserver (`KubePods`, tests/k8s_cluster.py), kubelet's side played by
tests/kubelet_harness.py: what the API says of the pod kubelet admitted
between its bind and its container's start.  A pod gone, or a pod of the
same name that is not the one bound to this node (deleted and created
again, bound elsewhere or not yet), fails the start with one line naming
the pod; no container starts with another pod's limits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from gpuvisor.cluster.allocation import ANNOTATION
from gpuvisor.cluster.deviceplugin.api import deviceplugin_v1beta1_pb2 as dp
from gpuvisor.cluster.deviceplugin.gpus import Gpu
from gpuvisor.cluster.deviceplugin.kube import KubePods

from tests.k8s_cluster import KubeTest, gpu_container
from tests.kubelet_harness import Container, FakeKubelet, Pod
from tests.test_deviceplugin import NODE, StaticGpus, annotation, serving
from tests.test_deviceplugin import sim_gpus as sim_gpus  # the module's fixture

SCHEDULER = "nobody"  # no scheduler binds the test's pods: the test does


@dataclass
class Api:
    k8s: KubeTest
    kubelet: FakeKubelet
    gpus: list[Gpu]

    def create(self, pod: Pod, doc: str, node: str | None = NODE) -> str:
        """The pod in the API with allocation doc, bound to node (None:
        left unbound), as the extender binds it; returns its uid."""
        made = self.k8s.create_pod(
            pod.name,
            containers=[gpu_container(c.name, gpus=c.gpus) for c in pod.containers],
            scheduler_name=SCHEDULER,
            annotations={ANNOTATION: doc},
        )
        if node is not None:
            self.k8s.bind(pod.name, node)
        return str(made.metadata.uid)

    def delete(self, pod: Pod) -> None:
        # no kubelet behind the Node to confirm it: gone at once
        self.k8s.core.delete_namespaced_pod(pod.name, pod.namespace, grace_period_seconds=0)


@pytest.fixture
def api(k8s: KubeTest, tmp_path: Path, sim_gpus: list[Gpu]) -> Iterator[Api]:
    k8s.create_node(NODE)
    pods = KubePods(k8s.core, node=NODE)
    with serving(tmp_path, StaticGpus(sim_gpus), pods, health_interval=1.0) as (kubelet, _, _):
        yield Api(k8s, kubelet, sim_gpus)


def refusal(api: Api, pod: Pod) -> str:
    """kubelet's start of pod's container main: the plugin's refusal."""
    with pytest.raises(grpc.RpcError) as err:
        api.kubelet.start(pod, "main")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = str(err.value.details())
    assert "\n" not in details, details
    return details


def limits_text(resp: object) -> str:
    for m in resp.mounts:  # type: ignore[attr-defined]
        if m.container_path == "/etc/gpuvisor":
            return (Path(m.host_path) / "limits.env").read_text()
    raise AssertionError("no /etc/gpuvisor mount")


def test_a_pod_read_through_the_api_gets_its_limits(api: Api) -> None:
    pod = Pod(api.k8s.namespace, "plain", [Container("main", 1)])
    api.create(pod, annotation(pod, {"main": [(api.gpus[0], 1500, 20)]}))
    resp = api.kubelet.admit(pod)["main"]
    api.kubelet.start(pod, "main")
    assert "CUDA_DEVICE_MEMORY_LIMIT=1500m\nCUDA_DEVICE_SM_LIMIT=20\n" in limits_text(resp)


def test_a_pod_deleted_before_its_container_starts(api: Api) -> None:
    """kubelet admitted the pod (Allocate), then it was deleted: the start
    fails with one line that names the pod and says it is not there."""
    pod = Pod(api.k8s.namespace, "gone", [Container("main", 1)])
    api.create(pod, annotation(pod, {"main": [(api.gpus[0], 1000, 0)]}))
    resp = api.kubelet.admit(pod)["main"]
    api.delete(pod)
    why = refusal(api, pod)
    assert why.startswith(f"gpuvisor: pod {pod.key}: not found in the API"), why
    assert not (Path(next(iter(resp.mounts)).host_path) / "limits.env").exists()


@pytest.mark.parametrize("again", ["bound elsewhere", "not bound"])
def test_a_pod_created_again_under_the_same_name(api: Api, again: str) -> None:
    """kubelet admitted pod p (uid 1) on this node; p is deleted and created
    again (uid 2, as a StatefulSet or `kubectl replace` does) before the
    container starts, with an allocation on the same GPU and more memory:
    bound to another node, or not bound yet and carrying a copy of an
    allocation for this node.  Neither is the pod kubelet admitted: the
    container must not start with uid 2's limits."""
    pod = Pod(api.k8s.namespace, "twice", [Container("main", 1)])
    first = api.create(pod, annotation(pod, {"main": [(api.gpus[0], 1000, 0)]}))
    resp = api.kubelet.admit(pod)["main"]
    api.delete(pod)
    doc = json.loads(annotation(pod, {"main": [(api.gpus[0], 9000, 0)]}))
    if again == "bound elsewhere":
        api.k8s.create_node("node-2")
        doc["node"] = "node-2"
        second = api.create(pod, json.dumps(doc), node="node-2")
        expect = "is bound to node node-2, not to this node node-1"
    else:
        second = api.create(pod, json.dumps(doc), node=None)
        expect = "is not bound to a node"
    assert second != first
    why = refusal(api, pod)
    assert expect in why, why
    assert why.startswith(f"gpuvisor: pod {pod.key} "), why
    assert not (Path(next(iter(resp.mounts)).host_path) / "limits.env").exists()


def test_an_allocation_for_another_node_on_a_pod_bound_here(api: Api) -> None:
    """The pod is bound here but its allocation names another node (a stale
    copy): the start fails naming the field and its value."""
    pod = Pod(api.k8s.namespace, "stale", [Container("main", 1)])
    doc = json.loads(annotation(pod, {"main": [(api.gpus[0], 1000, 0)]}))
    doc["node"] = "node-9"
    api.create(pod, json.dumps(doc))
    api.kubelet.admit(pod)
    why = refusal(api, pod)
    assert why == (
        f'gpuvisor: pod {pod.key}: {ANNOTATION}: allocation.node="node-9": not this node '
        f"({NODE}): container main is not started with it"
    ), why


def test_a_pod_created_again_on_this_node_while_the_old_one_is_listed(api: Api) -> None:
    """Pod p (uid 1) admitted here, deleted, created again (uid 2) and bound
    here too, with more memory on the same GPU; kubelet admits uid 2 while
    uid 1 is still terminating, so PodResources lists p twice (it names pods
    by name, not UID).  uid 1's container must not start with uid 2's
    limits; uid 2's starts once uid 1 is gone."""
    k = api.kubelet
    pod = Pod(api.k8s.namespace, "again", [Container("main", 1)])
    api.create(pod, annotation(pod, {"main": [(api.gpus[0], 1000, 100)]}))
    old_resp = k.admit(pod)["main"]
    old_ids = list(k.state.assigned[(pod.key, "main")])
    old_entry = k.pod_resources()
    api.delete(pod)
    api.create(pod, annotation(pod, {"main": [(api.gpus[0], 5000, 100)]}))
    k.release(pod)  # kubelet's record of uid 1 kept aside: old_entry
    k.state.assigned[("uid-1", "main")] = old_ids  # still held while uid 1 terminates
    new_resp = k.admit(pod)["main"]
    del k.state.assigned[("uid-1", "main")]
    assert k.state.assigned[(pod.key, "main")] != old_ids
    listed = k.pod_resources
    k.pod_resources = lambda: listed() + old_entry  # type: ignore[method-assign]
    assert k.registered is not None
    stub = k.registered.stub
    with pytest.raises(grpc.RpcError) as err:
        stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=old_ids), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    why = str(err.value.details())
    assert why.startswith(f"gpuvisor: pod {pod.key}: kubelet lists two pods of this name"), why
    assert "\n" not in why
    assert not (Path(next(iter(old_resp.mounts)).host_path) / "limits.env").exists()
    # the new one waits until the old one is gone, then starts with its own
    with pytest.raises(grpc.RpcError):
        k.start(pod, "main")
    k.pod_resources = listed  # type: ignore[method-assign]
    k.start(pod, "main")
    assert "CUDA_DEVICE_MEMORY_LIMIT=5000m\n" in limits_text(new_resp)


def test_a_pod_created_again_on_this_node_after_it_ran(api: Api) -> None:
    """A StatefulSet's pod: p ran here (its container started), was
    deleted, and is created again under its name (new UID), placed on the
    other GPU of this node.  kubelet asks GetPreferredAllocation for it: the
    new pod's placement is not taken for the old one's, already started,
    and it starts with its limits on the GPU placed."""
    k = api.kubelet
    g0, g1 = api.gpus
    pod = Pod(api.k8s.namespace, "web-0", [Container("main", 1)])
    api.create(pod, annotation(pod, {"main": [(g0, 1000, 100)]}))
    k.admit(pod)
    k.start(pod, "main")
    api.delete(pod)
    k.release(pod)
    api.create(pod, annotation(pod, {"main": [(g1, 3000, 100)]}))
    resp = k.admit(pod)["main"]
    assert k.state.assigned[(pod.key, "main")][0].startswith(g1.uuid)
    k.start(pod, "main")
    assert "CUDA_DEVICE_MEMORY_LIMIT=3000m\n" in limits_text(resp)
