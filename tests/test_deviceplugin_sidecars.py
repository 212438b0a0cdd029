"""The device plugin with Kubernetes sidecar containers (KEP-753: an init
container with restartPolicy: Always, which starts in the init order and
runs on beside the later containers), against kubelet's side of the API
(tests/kubelet_harness.py, which models kubelet's devicesToReuse pool: a
plain init container's devices go to the next container asking, a
sidecar keeps its own, and PodResources lists sidecars, not plain init
containers).  Every container starts with exactly its own grant's limits,
and a record that says a container is of another kind is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from gpuvisor.cluster.allocation import ANNOTATION, ContainerGrant, GpuGrant
from gpuvisor.cluster.deviceplugin import grant as dpgrant
from gpuvisor.cluster.deviceplugin.handover import heirs, sharing
from gpuvisor.cluster.deviceplugin.within import beyond_request
from gpuvisor.cluster.request import pod_request

from tests.granted_pods import pod_asking_for
from tests.inventories import ctr, pod
from tests.kubelet_harness import Container, Pod, host_env, start_order
from tests.test_deviceplugin import Cluster
from tests.test_deviceplugin import cluster as cluster  # the module's fixtures
from tests.test_deviceplugin import sim_gpus as sim_gpus

# ---- kubelet's order and pool (pure) -----------------------------------


def pod_of(*containers: tuple[str, int, str]) -> dpgrant.PodGrant:
    """A pod's grant: (name, GPU count, kind: init/sidecar/app) per container."""
    cs = []
    for name, n, kind in containers:
        gpus = tuple(dpgrant.GpuGrant(f"GPU-{i}", i, 1000, 0, None) for i in range(n))
        cs.append(dpgrant.ContainerGrant(name, gpus, kind != "app", sidecar=kind == "sidecar"))
    return dpgrant.PodGrant("ns/p", "n", tuple(cs))


def test_a_plain_init_containers_devices_go_to_the_next_sidecar() -> None:
    # kubelet: fetch's device to the pool, proxy takes it and keeps it, main new
    p = pod_of(("fetch", 1, "init"), ("proxy", 1, "sidecar"), ("main", 1, "app"))
    assert sharing(p, "proxy") == ["fetch", "proxy"]
    assert sharing(p, "main") == ["main"]
    assert {k: c.name for k, c in heirs(p).items()} == {"fetch": "proxy"}


def test_a_sidecars_devices_go_to_nobody() -> None:
    p = pod_of(("main", 1, "app"), ("proxy", 1, "sidecar"))
    assert sharing(p, "proxy") == ["proxy"]
    assert sharing(p, "main") == ["main"]
    assert heirs(p) == {}
    # a plain init container after the sidecar: its devices go to main
    p = pod_of(("main", 1, "app"), ("proxy", 1, "sidecar"), ("warm", 1, "init"))
    assert sharing(p, "main") == ["warm", "main"]
    assert sharing(p, "proxy") == ["proxy"]
    assert {k: c.name for k, c in heirs(p).items()} == {"warm": "main"}
    # a chain of plain init containers handed through to a sidecar; the
    # sidecar without GPUs is not allocated and takes nothing
    p = pod_of(("a", 1, "init"), ("b", 1, "init"), ("s0", 0, "sidecar"), ("s", 1, "sidecar"))
    assert sharing(p, "s") == ["a", "b", "s"]
    assert {k: c.name for k, c in heirs(p).items()} == {"a": "s", "b": "s"}


# ---- the record's kinds against the pod's (pure) ------------------------


def record(*kinds: tuple[str, str]) -> list[ContainerGrant]:
    """Records of one GPU of 1000 MiB, 10 % each: (name, init/sidecar/app)."""
    gpus = (GpuGrant("GPU-a", 0, 1000, 10, None),)
    return [ContainerGrant(n, k != "app", gpus, None, None, k == "sidecar") for n, k in kinds]


def sidecar_pod() -> dict[str, Any]:
    """fetch (plain init), proxy (sidecar), main: one GPU, 1000 MiB, 10 % each."""
    fetch, proxy = (ctr(n, gpu=1, gpumem=1000, gpucores=10) for n in ("fetch", "proxy"))
    proxy["restartPolicy"] = "Always"
    return pod("p", ctr("main", gpu=1, gpumem=1000, gpucores=10), init=[fetch, proxy])


@pytest.mark.parametrize(
    ("kinds", "message"),
    [
        (
            (("fetch", "init"), ("proxy", "init"), ("main", "app")),
            f"{ANNOTATION}: containers[1].sidecar=false: container proxy is a sidecar "
            "(an init container with restartPolicy: Always)",
        ),
        (
            (("fetch", "sidecar"), ("proxy", "sidecar"), ("main", "app")),
            f"{ANNOTATION}: containers[0].sidecar=true: container fetch is not a sidecar "
            "(an init container with restartPolicy: Always)",
        ),
        (
            (("proxy", "sidecar"), ("fetch", "init"), ("main", "app")),
            f'{ANNOTATION}: containers[1].name="fetch": init container fetch comes before '
            "proxy in pod default/p, not after it",
        ),
        (
            (("fetch", "init"), ("proxy", "sidecar"), ("proxy", "sidecar"), ("main", "app")),
            f'{ANNOTATION}: containers[2].name="proxy": container proxy is listed twice',
        ),
    ],
    ids=["sidecar-as-plain", "plain-as-sidecar", "out-of-order", "twice"],
)
def test_a_record_of_other_kinds_or_order_is_refused(
    kinds: tuple[tuple[str, str], ...], message: str
) -> None:
    got = beyond_request(record(*kinds), pod_request(sidecar_pod()), {"GPU-a": 40960}.get)
    assert got == message


def test_a_record_of_the_pods_kinds_passes() -> None:
    kinds = (("fetch", "init"), ("proxy", "sidecar"), ("main", "app"))
    assert beyond_request(record(*kinds), pod_request(sidecar_pod()), {"GPU-a": 40960}.get) is None


# ---- through kubelet's side of the API ---------------------------------


def limits(resp: Any) -> str:
    return Path(host_env(resp, {})["GPUVISOR_LIMITS_FILE"]).read_text()


def own(mib: int, cores: int) -> str:
    return f"CUDA_DEVICE_MEMORY_LIMIT={mib}m\nCUDA_DEVICE_SM_LIMIT={cores}\n"


def test_a_sidecar_beside_an_app_container_on_one_gpu(cluster: Cluster) -> None:
    """A GPU sidecar ("proxy") and an app container ("main") on GPU 0:
    kubelet allocates the sidecar first and keeps its devices out of the
    pool, so main gets other IDs after asking GetPreferredAllocation
    (nothing is handed to it: its placement must not be claimed away for
    the sidecar's sake); PodResources names the sidecar; each starts with
    its own memory and SM limits."""
    k = cluster.kubelet
    g0 = cluster.gpus[0]
    pod = Pod("ml", "side", [Container("main", 1), Container("proxy", 1, True, sidecar=True)])
    cluster.place(pod, {"proxy": [(g0, 1500, 20)], "main": [(g0, 2500, 40)]})
    resp = k.admit(pod)
    proxy, main = (k.state.assigned[(pod.key, n)] for n in ("proxy", "main"))
    assert proxy != main  # the sidecar keeps its own: nothing handed to main
    assert proxy[0].startswith(g0.uuid)
    assert main[0].startswith(g0.uuid)  # main's placement, not claimed away
    listed = {c.name for p in k.pod_resources() for c in p.containers}
    assert listed == {"proxy", "main"}
    k.start_all(pod)
    assert limits(resp["proxy"]).endswith(own(1500, 20))
    assert limits(resp["main"]).endswith(own(2500, 40))
    assert cluster.probe(resp["proxy"]) == {"init": 0, "uuids": [g0.uuid], "mib": [1500]}
    assert cluster.probe(resp["main"]) == {"init": 0, "uuids": [g0.uuid], "mib": [2500]}


def chain(cluster: Cluster) -> Pod:
    """Pod ml/chain on GPU 0: plain init fetch, sidecar proxy, app main."""
    g0 = cluster.gpus[0]
    pod = Pod(
        "ml",
        "chain",
        [
            Container("main", 1),
            Container("fetch", 1, init=True),
            Container("proxy", 1, init=True, sidecar=True),
        ],
    )
    cluster.place(
        pod,
        {"fetch": [(g0, 700, 10)], "proxy": [(g0, 1200, 20)], "main": [(g0, 2600, 30)]},
    )
    return pod


def test_a_plain_init_containers_devices_are_handed_to_the_sidecar(cluster: Cluster) -> None:
    """fetch (plain init), then proxy (sidecar), then main: kubelet hands
    fetch's device to proxy without asking GetPreferredAllocation (two
    Allocate calls of the same IDs, PodResources naming proxy), and proxy
    keeps it, so main asks for new IDs.  fetch, proxy and main each start
    with their own limits, in kubelet's order, and again on a restart of
    the sidecar."""
    k = cluster.kubelet
    g0 = cluster.gpus[0]
    pod = chain(cluster)
    resp = k.admit(pod)
    fetch, proxy, main = (k.state.assigned[(pod.key, n)] for n in ("fetch", "proxy", "main"))
    assert fetch == proxy != main
    assert [c.name for c in start_order(pod)] == ["fetch", "proxy", "main"]
    want = {"fetch": (700, 10), "proxy": (1200, 20), "main": (2600, 30)}
    for c in start_order(pod):
        k.start(pod, c.name)
        assert limits(resp[c.name]).endswith(own(*want[c.name])), c.name
    k.start(pod, "proxy")  # the sidecar restarts (PreStartContainer again)
    for name, (mib, cores) in want.items():
        assert limits(resp[name]).endswith(own(mib, cores)), name
        assert cluster.probe(resp[name]) == {"init": 0, "uuids": [g0.uuid], "mib": [mib]}, name


@pytest.mark.parametrize("flip", ["proxy", "fetch"])
def test_a_record_flipping_sidecar_is_refused(cluster: Cluster, flip: str) -> None:
    """The pod asks for fetch (plain init), proxy (sidecar), main; its
    record says the other kind of one of the init containers: kubelet's
    hand-over read from it would be wrong, so no container starts, the
    refusal one line naming the field and its value."""
    k = cluster.kubelet
    pod = chain(cluster)
    key = (pod.namespace, pod.name)
    honest = cluster.pods.annotations[key]
    cluster.pods.specs[key] = pod_asking_for(*key, honest)["spec"]
    assert cluster.pods.specs[key]["initContainers"][1]["restartPolicy"] == "Always"
    doc = json.loads(honest)
    k_ = next(i for i, c in enumerate(doc["containers"]) if c["name"] == flip)
    doc["containers"][k_]["sidecar"] = flip == "fetch"
    cluster.pods.annotations[key] = json.dumps(doc)
    resp = k.admit(pod)
    field = f"containers[{k_}].sidecar={json.dumps(flip == 'fetch')}"
    for c in start_order(pod):
        with pytest.raises(grpc.RpcError) as err:
            k.start(pod, c.name)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        why = str(err.value.details())
        assert f"gpuvisor: pod {pod.key}: {ANNOTATION}: {field}: container {flip} is " in why
        assert "\n" not in why
    for name, r in resp.items():
        assert not Path(host_env(r, {})["GPUVISOR_LIMITS_FILE"]).exists(), name
