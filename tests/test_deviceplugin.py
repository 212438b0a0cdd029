"""gpuvisor device-plugin against kubelet's side of the device plugin API
(tests/kubelet_harness.py: the real gRPC protocol over unix sockets), on a
simulated node: registration, ListAndWatch and health, Allocate and
PreStartContainer, each container's limits from its own pod's allocation,
kubelet restarts; and the workloads run with exactly what Allocate
returned, seeing their quotas through the real CUDA driver API."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from gpuvisor.cluster.allocator import Allocator
from gpuvisor.cluster.deviceplugin.gpus import Gpu, GpuSource
from gpuvisor.cluster.deviceplugin.grant import PodGrant, parse_grant
from gpuvisor.cluster.deviceplugin.owners import PodResourcesOwners
from gpuvisor.cluster.deviceplugin.publish import inventory_document
from gpuvisor.cluster.deviceplugin.runner import PluginRunner
from gpuvisor.cluster.deviceplugin.service import DevicePluginService, PluginConfig
from gpuvisor.cluster.request import pod_request

from tests.granted_pods import pod_asking_for
from tests.helpers import LIBRARY, SimNode, run_py
from tests.inventories import ctr
from tests.inventories import pod as pod_doc
from tests.kubelet_harness import Container, FakeKubelet, Pod, container_base_env, host_env, run

NODE = "node-1"
NOT_PERMITTED = 800

# The workload: cuMemGetInfo's total on every device it sees, through
# cuda-python and the preloaded library.
PROBE = """
import json
from cuda.bindings import driver as cu
from tests.cuclient import *
err = cu.cuInit(0)[0]
if err != 0:
    print(json.dumps({"init": int(err)}))
else:
    n = ok(cu.cuDeviceGetCount)
    totals = []
    for d in range(n):
        init(d)
        totals.append(mem_info()[1] // (1 << 20))
    print(json.dumps({"init": 0, "uuids": [uuid(d) for d in range(n)], "mib": totals}))
"""

LIST_GPUS = """
import json
from gpuvisor.cluster.deviceplugin.gpus import NvmlGpus
print(json.dumps([[g.uuid, g.index, g.memory_mib] for g in NvmlGpus().gpus()]))
"""


def eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class StaticGpus:
    def __init__(self, gpus: list[Gpu]) -> None:
        self._gpus = gpus
        self.bad: dict[str, str] = {}

    def gpus(self) -> list[Gpu]:
        return list(self._gpus)

    def unhealthy(self) -> dict[str, str]:
        return dict(self.bad)


class DictPods:
    """The pods' allocation annotations, as a test sets them; each pod asks
    for what its annotation grants, or has the spec in `specs` (a forged
    record: not what the pod asks for)."""

    def __init__(self) -> None:
        self.annotations: dict[tuple[str, str], str] = {}
        self.specs: dict[tuple[str, str], dict[str, Any]] = {}

    def pod(self, namespace: str, pod: str) -> dict[str, Any]:
        text = self.annotations.get((namespace, pod))
        if text is None:
            return {"metadata": {"name": pod, "namespace": namespace}, "spec": {}}
        doc = pod_asking_for(namespace, pod, text)
        if (namespace, pod) in self.specs:
            doc["spec"] = self.specs[(namespace, pod)]
        return doc

    def bound(self, node: str) -> list[PodGrant]:
        grants = [parse_grant(t) for t in self.annotations.values()]
        return [g for g in grants if g.node == node]


def annotation(pod: Pod, containers: dict[str, list[tuple[Gpu, int, int]]]) -> str:
    init = {c.name for c in pod.containers if c.init}
    sidecars = {c.name for c in pod.containers if c.sidecar}
    return json.dumps(
        {
            "pod": pod.key,
            "node": NODE,
            "containers": [
                {
                    "name": name,
                    "init": name in init,
                    **({"sidecar": True} if name in sidecars else {}),
                    "gpus": [
                        {"uuid": g.uuid, "index": g.index, "memory_mib": m, "cores": c, "mig": None}
                        for g, m, c in gpus
                    ],
                }
                for name, gpus in containers.items()
            ],
        }
    )


@dataclass
class Cluster:
    node: SimNode
    gpus: list[Gpu]
    source: StaticGpus
    pods: DictPods
    kubelet: FakeKubelet
    runner: PluginRunner
    service: DevicePluginService
    base_env: dict[str, str]

    def place(self, pod: Pod, containers: dict[str, list[tuple[Gpu, int, int]]]) -> None:
        self.pods.annotations[(pod.namespace, pod.name)] = annotation(pod, containers)

    def probe(self, resp) -> dict[str, Any]:
        proc = run(resp, PROBE, self.base_env)
        assert proc.returncode == 0, proc.stderr
        out: dict[str, Any] = json.loads(proc.stdout)
        return out


@pytest.fixture(scope="module")
def sim_gpus(tmp_path_factory, build_dir) -> list[Gpu]:
    node = SimNode.create(tmp_path_factory.mktemp("inventory"))
    proc = run_py(LIST_GPUS, node.env)
    assert proc.returncode == 0, proc.stderr
    return [Gpu(u, i, m) for u, i, m in json.loads(proc.stdout)]


@contextmanager
def serving(
    tmp_path: Path, source: GpuSource, pods: DictPods, health_interval: float
) -> Iterator[tuple[FakeKubelet, PluginRunner, DevicePluginService]]:
    """The plugin for source's GPUs and pods' allocations, serving kubelet's
    side of the API (registered) in a thread, with its state and node
    directories under tmp_path."""
    socks = Path(tempfile.mkdtemp(prefix="gvdp", dir="/tmp"))  # unix socket paths stay short
    (tmp_path / "node").mkdir()
    config = PluginConfig(
        node_name=NODE,
        state_dir=tmp_path / "state",
        lib_dir=LIBRARY.parent,
        node_dir=tmp_path / "node",
    )
    kubelet = FakeKubelet(socks / "dp", socks / "pr" / "kubelet.sock")
    service = DevicePluginService(
        config, source, pods, PodResourcesOwners(str(socks / "pr" / "kubelet.sock"))
    )
    runner = PluginRunner(
        service, socks / "dp", health_interval=health_interval, watch_interval=0.05
    )
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        kubelet.wait_registered()
        yield kubelet, runner, service
    finally:
        runner.stop()
        thread.join(timeout=10)
        kubelet.stop()
        shutil.rmtree(socks, ignore_errors=True)


@pytest.fixture
def cluster(node: SimNode, tmp_path: Path, sim_gpus: list[Gpu]) -> Iterator[Cluster]:
    source = StaticGpus(sim_gpus)
    pods = DictPods()
    with serving(tmp_path, source, pods, health_interval=0.05) as (kubelet, runner, service):
        base = container_base_env(node.env)
        yield Cluster(node, sim_gpus, source, pods, kubelet, runner, service, base)


def test_registers_with_options_and_lists_replicas(cluster: Cluster) -> None:
    reg = cluster.kubelet.registered
    assert reg is not None
    assert reg.request.version == "v1beta1"
    assert reg.request.endpoint == "gpuvisor.sock"
    assert reg.request.resource_name == "nvidia.com/gpu"
    assert reg.request.options.pre_start_required
    assert reg.request.options.get_preferred_allocation_available
    assert reg.options == reg.request.options  # GetDevicePluginOptions agrees
    want = {f"{g.uuid}-{i}": "Healthy" for g in cluster.gpus for i in range(10)}
    assert cluster.kubelet.state.devices == want
    assert cluster.kubelet.refused == []


def test_listandwatch_streams_health_changes(cluster: Cluster) -> None:
    k = cluster.kubelet
    bad = cluster.gpus[1].uuid
    cluster.source.bad = {bad: "fell off the bus"}
    k.wait(lambda: k.state.devices.get(f"{bad}-0") == "Unhealthy")
    devices = dict(k.state.devices)
    assert {d for d, h in devices.items() if h == "Unhealthy"} == {f"{bad}-{i}" for i in range(10)}
    cluster.source.bad = {}
    k.wait(lambda: all(h == "Healthy" for h in k.state.devices.values()))
    # kubelet admits onto healthy devices only
    cluster.source.bad = {cluster.gpus[0].uuid: "lost"}
    k.wait(lambda: k.state.devices.get(f"{cluster.gpus[0].uuid}-0") == "Unhealthy")
    pod = Pod("default", "h", [Container("main", 1)])
    cluster.place(pod, {"main": [(cluster.gpus[1], 1000, 0)]})
    k.admit(pod)
    assert k.state.assigned[(pod.key, "main")][0].startswith(cluster.gpus[1].uuid)


def test_one_pod_gets_its_quota_through_allocate_and_prestart(cluster: Cluster) -> None:
    """The environment/mounts contract of Allocate, and the workload seeing
    the 3000 MiB its pod's allocation gives it (nvidia.com/gpumem: 3000)."""
    k = cluster.kubelet
    gpu = cluster.gpus[1]
    pod = Pod("default", "train", [Container("main", 1)])
    cluster.place(pod, {"main": [(gpu, 3000, 30)]})
    resp = k.admit(pod)["main"]
    # GetPreferredAllocation steered kubelet to the placed GPU
    assert k.state.assigned[(pod.key, "main")][0].startswith(gpu.uuid + "-")
    envs = dict(resp.envs)
    assert envs == {
        "NVIDIA_VISIBLE_DEVICES": gpu.uuid,
        "CUDA_VISIBLE_DEVICES": gpu.uuid,
        "LD_PRELOAD": "/usr/local/gpuvisor/lib/libgpuvisor.so",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/var/lib/gpuvisor/region.shr",
        "GPUVISOR_LIMITS_FILE": "/etc/gpuvisor/limits.env",
        "GPUVISOR_NODE_SOCKET": "/run/gpuvisor/node.sock",
        "GPUVISOR_NODE_LOCK": "/run/gpuvisor/context.lock",
    }
    mounts = {m.container_path: (m.host_path, m.read_only) for m in resp.mounts}
    assert mounts["/usr/local/gpuvisor/lib"] == (str(LIBRARY.parent), True)
    assert mounts["/run/gpuvisor"] == (str(cluster.node.dir / "node"), False)
    region_dir, ro = mounts["/var/lib/gpuvisor"]
    limits_dir, limits_ro = mounts["/etc/gpuvisor"]
    assert (ro, limits_ro) == (False, True)
    assert Path(region_dir).parent == Path(limits_dir).parent
    assert Path(region_dir).parent.parent == cluster.node.dir / "state"
    # No limits before PreStartContainer: the library refuses to run
    assert not (Path(limits_dir) / "limits.env").exists()
    assert cluster.probe(resp) == {"init": NOT_PERMITTED}
    k.start(pod, "main")
    text = (Path(limits_dir) / "limits.env").read_text()
    assert "CUDA_DEVICE_MEMORY_LIMIT=3000m\nCUDA_DEVICE_SM_LIMIT=30\n" in text
    got = cluster.probe(resp)
    assert got == {"init": 0, "uuids": [gpu.uuid], "mib": [3000]}
    assert (Path(region_dir) / "region.shr").exists()


def test_two_containers_and_an_init_container_each_get_their_own_limits(
    cluster: Cluster,
) -> None:
    """An init container and two app containers of one pod, each with its
    own limits: "a" on both GPUs with a different limit per GPU, reusing
    the init container's device as kubelet does (PodResources then names
    "a" as the holder of the init container's ID), "b" on one."""
    k = cluster.kubelet
    g0, g1 = cluster.gpus
    pod = Pod(
        "ml",
        "pair",
        [Container("a", 2), Container("b", 1), Container("setup", 1, init=True)],
    )
    cluster.place(
        pod,
        {
            "setup": [(g0, 500, 10)],
            "a": [(g0, 2000, 50), (g1, 5000, 50)],
            "b": [(g1, 1500, 20)],
        },
    )
    resp = k.admit(pod)
    setup_ids = k.state.assigned[(pod.key, "setup")]
    assert setup_ids[0].startswith(g0.uuid)
    assert setup_ids[0] in k.state.assigned[(pod.key, "a")]  # reused
    k.start(pod, "setup")
    assert cluster.probe(resp["setup"]) == {"init": 0, "uuids": [g0.uuid], "mib": [500]}
    for name in ("a", "b"):
        k.start(pod, name)
    a = cluster.probe(resp["a"])
    b = cluster.probe(resp["b"])
    assert a == {"init": 0, "uuids": [g0.uuid, g1.uuid], "mib": [2000, 5000]}
    assert b == {"init": 0, "uuids": [g1.uuid], "mib": [1500]}


def test_an_app_container_reusing_exactly_its_init_containers_devices(cluster: Cluster) -> None:
    """kubelet hands the init container's one device on to the app container:
    both are allocated the same IDs (two Allocate calls, two directories),
    PodResources names the app container, and each still gets its own
    limits."""
    k = cluster.kubelet
    g0 = cluster.gpus[0]
    pod = Pod("ml", "same", [Container("main", 1), Container("setup", 1, init=True)])
    cluster.place(pod, {"setup": [(g0, 500, 0)], "main": [(g0, 2000, 0)]})
    resp = k.admit(pod)
    assert k.state.assigned[(pod.key, "setup")] == k.state.assigned[(pod.key, "main")]
    k.start(pod, "setup")
    assert cluster.probe(resp["setup"])["mib"] == [500]
    k.start(pod, "main")
    assert cluster.probe(resp["main"])["mib"] == [2000]
    # a restart of the app container (PreStartContainer again) keeps both right
    k.start(pod, "main")
    assert cluster.probe(resp["main"])["mib"] == [2000]
    assert cluster.probe(resp["setup"])["mib"] == [500]


def init_chain(cluster: Cluster, name: str, fetch: int, warm: int, main: int) -> Pod:
    """Pod ml/name placed on GPU 0: init containers fetch and warm, then the
    app container main, one GPU each, with these MiB (kubelet hands the one
    device from each to the next)."""
    g0 = cluster.gpus[0]
    pod = Pod(
        "ml",
        name,
        [Container("main", 1), Container("fetch", 1, init=True), Container("warm", 1, init=True)],
    )
    mib = {"fetch": fetch, "warm": warm, "main": main}
    cluster.place(pod, {c: [(g0, m, 0)] for c, m in mib.items()})
    return pod


def test_two_init_containers_and_an_app_container_on_one_device(cluster: Cluster) -> None:
    """kubelet hands the first init container's device to the second init
    container and then to the app container (three Allocate calls of the
    same IDs, only the first after GetPreferredAllocation); each starts with
    its own limits, the second init container's not the app container's."""
    k = cluster.kubelet
    pod = init_chain(cluster, "chain", 700, 3000, 900)
    resp = k.admit(pod)
    ids = k.state.assigned[(pod.key, "fetch")]
    assert k.state.assigned[(pod.key, "warm")] == ids == k.state.assigned[(pod.key, "main")]
    for name, mib in (("fetch", 700), ("warm", 3000), ("main", 900)):
        k.start(pod, name)
        assert cluster.probe(resp[name])["mib"] == [mib], name
    # a restart of the app container keeps every directory right
    k.start(pod, "main")
    assert [cluster.probe(resp[n])["mib"] for n in ("fetch", "warm", "main")] == [
        [700],
        [3000],
        [900],
    ]


def test_pods_with_init_containers_admitted_newest_first(cluster: Cluster) -> None:
    """Two pods, each an init container and an app container on GPU 0, the
    same sizes: kubelet admits the newer first, so GetPreferredAllocation
    names the older pod for the newer one's init container (and the newer
    pod for the older one's).  Each init container still starts with its
    own pod's init limits, not its app container's."""
    k = cluster.kubelet
    g0 = cluster.gpus[0]
    older, newer = (
        Pod("team", n, [Container("main", 1), Container("setup", 1, init=True)])
        for n in ("older", "newer")
    )
    cluster.place(older, {"setup": [(g0, 2100, 0)], "main": [(g0, 600, 0)]})
    cluster.place(newer, {"setup": [(g0, 2400, 0)], "main": [(g0, 800, 0)]})
    for pod, setup, main in ((newer, 2400, 800), (older, 2100, 600)):
        resp = k.admit(pod)
        k.start(pod, "setup")
        assert cluster.probe(resp["setup"])["mib"] == [setup], pod.name
        k.start(pod, "main")
        assert cluster.probe(resp["main"])["mib"] == [main], pod.name


def test_init_only_pods_admitted_newest_first_never_take_each_others_limits(
    cluster: Cluster,
) -> None:
    """Two pods whose only GPU container is an init container, on GPU 0,
    the same size: kubelet admits the newer first, then the older, then
    starts them.  PodResources lists neither init container's IDs and the
    preferences named the pods the other way round: no init container may
    start with the other pod's limits."""
    k = cluster.kubelet
    g0 = cluster.gpus[0]
    older, newer = (
        Pod("team", n, [Container("main", 0), Container("setup", 1, init=True)])
        for n in ("older", "newer")
    )
    cluster.place(older, {"setup": [(g0, 2100, 0)], "main": []})
    cluster.place(newer, {"setup": [(g0, 2400, 0)], "main": []})
    resp = {pod.name: k.admit(pod)["setup"] for pod in (newer, older)}
    for pod in (newer, older):
        with pytest.raises(grpc.RpcError) as err:
            k.start(pod, "setup")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        why = err.value.details()
        assert "the init container setup of pod team/" in why, why
        assert "whose limits differ: not started" in why, why
        assert not (Path(host_env(resp[pod.name], {})["GPUVISOR_LIMITS_FILE"])).exists()


def test_init_only_pods_of_equal_limits_admitted_newest_first_start(cluster: Cluster) -> None:
    """As above, with the same limits (two replicas of one workload): which
    pod's init container the devices are for does not change the limits,
    and both start."""
    k = cluster.kubelet
    g0 = cluster.gpus[0]
    older, newer = (
        Pod("team", n, [Container("main", 0), Container("setup", 1, init=True)])
        for n in ("r1", "r2")
    )
    for pod in (older, newer):
        cluster.place(pod, {"setup": [(g0, 1300, 0)], "main": []})
    resp = {pod.name: k.admit(pod)["setup"] for pod in (newer, older)}
    for pod in (newer, older):
        k.start(pod, "setup")
        assert cluster.probe(resp[pod.name])["mib"] == [1300], pod.name


def test_pod_placed_by_the_allocator_starts_with_kubelets_hand_over(cluster: Cluster) -> None:
    """The allocator's plan meets kubelet's reuse of init containers'
    devices: kubelet hands the init container's device to the first app
    container ("big") without asking the plugin, so the allocator puts the
    init container on big's GPU, not on the busier GPU of "small" that
    fits it too; every container then starts with its own limits."""
    k = cluster.kubelet
    g0, g1 = cluster.gpus
    doc = inventory_document(NODE, cluster.gpus, {})
    alloc = Allocator.from_cluster({"nodes": {NODE: doc}})
    busy = pod_request(pod_doc("busy", ctr(gpu=1, gpumem=g0.memory_mib * 3 // 4)))
    assert alloc.place(busy).node == NODE
    request = pod_doc(
        "x",
        ctr("big", gpu=1, gpumem=g1.memory_mib // 2),  # only the other GPU has room
        ctr("small", gpu=1, gpumem=1000),  # binpack: the busier GPU
        init=[ctr("setup", gpu=1, gpumem=500)],
    )
    d = alloc.place(pod_request(request))
    assert d.allocation is not None, d.reasons
    busy_gpu = alloc.allocations(NODE)[0].containers[0].gpus[0].uuid
    other = g1 if busy_gpu == g0.uuid else g0
    p = Pod(
        "default", "x", [Container("big", 1), Container("small", 1), Container("setup", 1, True)]
    )
    cluster.pods.annotations[("default", "x")] = d.allocation.annotation()
    resp = k.admit(p)
    assert k.state.assigned[(p.key, "setup")] == k.state.assigned[(p.key, "big")]
    k.start(p, "setup")
    assert cluster.probe(resp["setup"]) == {"init": 0, "uuids": [other.uuid], "mib": [500]}
    for name in ("big", "small"):
        k.start(p, name)
    assert cluster.probe(resp["big"]) == {
        "init": 0,
        "uuids": [other.uuid],
        "mib": [other.memory_mib // 2],
    }
    assert cluster.probe(resp["small"]) == {"init": 0, "uuids": [busy_gpu], "mib": [1000]}


def test_an_init_container_of_its_own_devices(cluster: Cluster) -> None:
    """An init container whose devices no app container reuses (the app
    containers ask for none): PodResources lists none of its IDs, and the
    limits come from the placement GetPreferredAllocation steered them to."""
    k = cluster.kubelet
    g1 = cluster.gpus[1]
    pod = Pod("ml", "prep", [Container("main", 0), Container("fetch", 1, init=True)])
    cluster.place(pod, {"fetch": [(g1, 700, 0)], "main": []})
    resp = k.admit(pod)
    k.start(pod, "fetch")
    assert cluster.probe(resp["fetch"]) == {"init": 0, "uuids": [g1.uuid], "mib": [700]}


def test_an_init_containers_directory_is_kept_until_it_starts(cluster: Cluster) -> None:
    """An init container of its own devices whose start comes late (a long
    image pull): PodResources lists none of its IDs, yet its directory is
    not collected while its pod is listed, and it starts with its limits;
    once the pod is gone the directory goes."""
    k = cluster.kubelet
    g1 = cluster.gpus[1]
    pod = Pod("ml", "slow", [Container("main", 0), Container("fetch", 1, init=True)])
    cluster.place(pod, {"fetch": [(g1, 800, 0)], "main": []})
    resp = k.admit(pod)["fetch"]
    top = Path(host_env(resp, {})["GPUVISOR_LIMITS_FILE"]).parent.parent
    assert cluster.service.collect_garbage(grace=-1) == []  # any age
    assert top.is_dir()
    k.start(pod, "fetch")
    assert cluster.probe(resp) == {"init": 0, "uuids": [g1.uuid], "mib": [800]}
    k.release(pod)
    assert cluster.service.collect_garbage(grace=-1) == [top]


def test_pods_on_one_gpu_admitted_newest_first_both_start(cluster: Cluster) -> None:
    """kubelet may admit pods in another order than the plugin's (oldest
    first): the newer pod is steered to the older one's placement, the same
    GPU (the extender binds no other beside it).  Once the newer one starts,
    the preference is used up and the older one finds its placement open
    again; a claim left on it sent it to the other GPU, its start refused."""
    k = cluster.kubelet
    older, newer = (Pod("team", n, [Container("main", 1)]) for n in ("older", "newer"))
    cluster.place(older, {"main": [(cluster.gpus[0], 900, 10)]})
    cluster.place(newer, {"main": [(cluster.gpus[0], 700, 10)]})
    for pod, mib in ((newer, 700), (older, 900)):
        resp = k.admit(pod)["main"]
        k.start(pod, "main")
        assert cluster.probe(resp) == {"init": 0, "uuids": [cluster.gpus[0].uuid], "mib": [mib]}


def test_many_pods_start_at_once_each_with_its_own_limits(cluster: Cluster) -> None:
    """16 pods on the node's two GPUs, admitted one after another as kubelet
    does, then started and run all at once: every container gets its own
    pod's memory quota; no lock serialises them."""
    k = cluster.kubelet
    pods = [Pod("team", f"p{i}", [Container("main", 1)]) for i in range(16)]
    for i, pod in enumerate(pods):
        cluster.place(pod, {"main": [(cluster.gpus[i % 2], 600 + 37 * i, 5)]})
    responses = [k.admit(pod)["main"] for pod in pods]

    def start_and_run(i: int) -> tuple[int, dict[str, Any]]:
        k.start(pods[i], "main")
        return i, cluster.probe(responses[i])

    with futures.ThreadPoolExecutor(max_workers=16) as ex:
        results = dict(ex.map(start_and_run, range(16)))
    for i in range(16):
        gpu = cluster.gpus[i % 2]
        assert results[i] == {"init": 0, "uuids": [gpu.uuid], "mib": [600 + 37 * i]}, i
    # every container has a directory of its own
    dirs = {host_env(r, {})["CUDA_DEVICE_MEMORY_SHARED_CACHE"] for r in responses}
    assert len(dirs) == 16


def test_a_pod_without_allocation_fails_closed(cluster: Cluster) -> None:
    k = cluster.kubelet
    pod = Pod("default", "stray", [Container("main", 1)])
    resp = k.admit(pod)["main"]
    with pytest.raises(grpc.RpcError) as err:
        k.start(pod, "main")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == (
        "gpuvisor: pod default/stray has no gpuvisor.io/allocation annotation (it was not "
        "placed by gpuvisor's scheduler): container main is not started without limits"
    )
    # had it been started anyway, the library refuses it: no limits file
    proc = run(resp, PROBE, cluster.base_env)
    assert json.loads(proc.stdout) == {"init": NOT_PERMITTED}
    assert 'GPUVISOR_LIMITS_FILE="' in proc.stderr
    assert "cannot open: no such file" in proc.stderr


@pytest.mark.parametrize(
    ("containers", "why"),
    [
        ({"other": "g0"}, "its allocation has no container main"),
        ({"main": "g1"}, "but its allocation places it on"),
        ({"main": "mig"}, "a MIG placement, but no MIG instance was made for it at Allocate"),
        ({"main": "bad"}, "memory_mib=0: must be a whole number from 1"),
    ],
)
def test_an_allocation_that_does_not_fit_fails_closed(cluster: Cluster, containers, why) -> None:
    k = cluster.kubelet
    g0, g1 = cluster.gpus
    pod = Pod("default", "odd", [Container("main", 1)])
    # kubelet chooses GPU 0 (nothing steers it elsewhere)
    k.admit(pod)
    assert k.state.assigned[(pod.key, "main")][0].startswith(g0.uuid)
    gpu = {"uuid": g0.uuid, "index": 0, "memory_mib": 1000, "cores": 0, "mig": None}
    kinds = {
        "g0": gpu,
        "g1": dict(gpu, uuid=g1.uuid, index=1),
        "mig": dict(
            gpu,
            mig={"profile": "1g.10gb", "profile_id": 19, "placement": {"start": 0, "size": 1}},
        ),
        "bad": dict(gpu, memory_mib=0),
    }
    doc = {
        "pod": pod.key,
        "node": NODE,
        "containers": [{"name": n, "gpus": [kinds[v]]} for n, v in containers.items()],
    }
    cluster.pods.annotations[("default", "odd")] = json.dumps(doc)
    with pytest.raises(grpc.RpcError) as err:
        k.start(pod, "main")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert why in err.value.details()


def test_kubelet_restart_makes_the_plugin_register_again(cluster: Cluster) -> None:
    k = cluster.kubelet
    assert eventually(lambda: cluster.runner.registrations == 1)
    k.restart()
    k.wait_registered(count=2, timeout=15)
    assert eventually(lambda: cluster.runner.registrations == 2)
    assert [r.endpoint for r in k.registrations] == ["gpuvisor.sock"] * 2
    assert len(k.state.devices) == 20
    # and it serves the new kubelet: a pod starts with its limits
    pod = Pod("default", "after", [Container("main", 1)])
    cluster.place(pod, {"main": [(cluster.gpus[0], 2500, 0)]})
    resp = k.admit(pod)["main"]
    k.start(pod, "main")
    assert cluster.probe(resp)["mib"] == [2500]


def test_a_plugin_restart_between_allocate_and_prestart(cluster: Cluster) -> None:
    """The per-container directories survive a restart of the plugin: a
    container allocated before it still gets its limits after it."""
    k = cluster.kubelet
    pod = Pod("default", "span", [Container("main", 1)])
    cluster.place(pod, {"main": [(cluster.gpus[0], 1234, 0)]})
    resp = k.admit(pod)["main"]
    fresh = DevicePluginService(
        cluster.service.config, cluster.source, cluster.pods, cluster.service.owners
    )
    fresh.prestart(k.state.assigned[(pod.key, "main")])
    assert cluster.probe(resp)["mib"] == [1234]


def test_a_plugin_restart_in_the_middle_of_a_hand_over(cluster: Cluster) -> None:
    """Two init containers and the app container on one device, the plugin
    restarted after kubelet allocated them and before any started: the new
    plugin still tells the three directories apart (Allocate's order is kept
    in each), and each container gets its own limits."""
    k = cluster.kubelet
    pod = init_chain(cluster, "span2", 600, 2600, 1100)
    resp = k.admit(pod)
    fresh = DevicePluginService(
        cluster.service.config, cluster.source, cluster.pods, cluster.service.owners
    )
    fresh.prestart(k.state.assigned[(pod.key, "fetch")])
    for name, mib in (("fetch", 600), ("warm", 2600), ("main", 1100)):
        assert cluster.probe(resp[name])["mib"] == [mib], name


def test_a_kubelet_restart_between_allocate_and_start(cluster: Cluster) -> None:
    """kubelet restarts after admitting a pod and before starting it (it
    keeps its allocations in its checkpoint): the plugin registers again,
    and the container starts with its own limits in its own directory."""
    k = cluster.kubelet
    pod = Pod("default", "across", [Container("main", 1)])
    cluster.place(pod, {"main": [(cluster.gpus[1], 1700, 0)]})
    resp = k.admit(pod)["main"]
    k.restart()
    k.wait_registered(count=2, timeout=15)
    k.start(pod, "main")
    assert cluster.probe(resp) == {"init": 0, "uuids": [cluster.gpus[1].uuid], "mib": [1700]}


def test_nvml_inventory_on_the_simulated_node(node: SimNode) -> None:
    proc = run_py(LIST_GPUS, node.env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert [(i, m) for _, i, m in got] == [(0, 16384), (1, 16384)]
    assert all(u.startswith("GPU-") for u, _, _ in got)
    assert len({u for u, _, _ in got}) == 2


def test_directories_of_gone_containers_are_collected(cluster: Cluster) -> None:
    k = cluster.kubelet
    g0 = cluster.gpus[0]
    live = Pod("default", "live", [Container("main", 1)])
    gone = Pod("default", "gone", [Container("main", 1)])
    never = Pod("default", "never", [Container("main", 1)])
    for pod in (live, gone, never):
        cluster.place(pod, {"main": [(g0, 1000, 0)]})
    dirs = {}
    for pod in (live, gone, never):
        resp = k.admit(pod)["main"]
        dirs[pod.name] = Path(host_env(resp, {})["GPUVISOR_LIMITS_FILE"]).parent.parent
    k.start(live, "main")
    k.start(gone, "main")
    # nothing is collected while young
    assert cluster.service.collect_garbage() == []
    k.release(gone)
    k.release(never)
    removed = cluster.service.collect_garbage(grace=-1)  # any age
    assert sorted(removed) == sorted([dirs["gone"], dirs["never"]])
    assert dirs["live"].is_dir()
    assert not dirs["gone"].exists()
    assert not dirs["never"].exists()


KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:9"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def test_the_command_on_the_simulated_node(node: SimNode, tmp_path: Path) -> None:
    """`gpuvisor device-plugin` as a process: the GPUs from NVML (the
    simulated driver's), registration with the harness, a container start
    failing closed while the Kubernetes API cannot be reached, and a clean
    stop on SIGTERM that removes its socket."""
    socks = Path(tempfile.mkdtemp(prefix="gvdp", dir="/tmp"))
    kubelet = FakeKubelet(socks / "dp", socks / "pr" / "kubelet.sock")
    (tmp_path / "kubeconfig").write_text(KUBECONFIG)
    env = dict(node.env, KUBECONFIG=str(tmp_path / "kubeconfig"), NODE_NAME=NODE)
    args = [
        sys.executable,
        "-m",
        "gpuvisor.supervisor",
        "device-plugin",
        "--plugin-dir",
        str(socks / "dp"),
        "--pod-resources-socket",
        str(socks / "pr" / "kubelet.sock"),
        "--state-dir",
        str(tmp_path / "state"),
        "--split-count",
        "3",
    ]
    proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
    try:
        kubelet.wait_registered(timeout=30)
        devices = kubelet.state.devices
        assert len(devices) == 6
        assert all(d.startswith("GPU-") and h == "Healthy" for d, h in devices.items())
        pod = Pod("default", "p", [Container("main", 1)])
        kubelet.admit(pod)
        with pytest.raises(grpc.RpcError) as err:
            kubelet.start(pod, "main")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details().startswith(
            "gpuvisor: pod default/p: cannot read its allocation from the API: "
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not (socks / "dp" / "gpuvisor.sock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kubelet.stop()
        shutil.rmtree(socks, ignore_errors=True)
    assert "registered nvidia.com/gpu with kubelet (6 devices" in (
        proc.stderr.read() if proc.stderr else ""
    )


def test_the_command_refuses_to_start_without_kubernetes(node: SimNode, tmp_path: Path) -> None:
    env = dict(node.env, KUBECONFIG=str(tmp_path / "none"), HOME=str(tmp_path))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuvisor.supervisor",
            "device-plugin",
            "--state-dir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: cannot configure the Kubernetes client: ")


def test_requests_for_devices_it_does_not_have_are_refused(cluster: Cluster) -> None:
    from gpuvisor.cluster.deviceplugin.api import deviceplugin_v1beta1_pb2 as dp

    reg = cluster.kubelet.registered
    assert reg is not None
    with pytest.raises(grpc.RpcError) as err:
        reg.stub.Allocate(
            dp.AllocateRequest(
                container_requests=[dp.ContainerAllocateRequest(devices_ids=["GPU-bogus-1"])]
            ),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'GPU-bogus-1' is not a replica of a GPU of this node" in err.value.details()
    for ids, why in [
        (["GPU-bogus-1"], "is not a replica of a GPU of this node"),
        ([f"{cluster.gpus[0].uuid}-9"], "no Allocate was seen for them"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            reg.stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=ids), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert why in err.value.details()
    # nothing was created for them
    assert list((cluster.node.dir / "state").iterdir()) == []
