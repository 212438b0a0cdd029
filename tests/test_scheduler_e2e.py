"""gpuvisor scheduler end to end, against the real thing: etcd,
kube-apiserver and kube-scheduler (tests/k8s_cluster.py) with the extender
configured as kube-scheduler's extender (managedResources with
ignoredByScheduler, nodeCacheCapable, filter/prioritize/bind), the device
plugin publishing each node's inventory and serving kubelet's side played
by tests/kubelet_harness.py, and the workloads running on the simulated
node with exactly what the plugin returned (cuMemGetInfo shows the quota).

Nodes without a plugin (type/UUID selection, policies, NVLink) get their
inventory annotation from the test.  The MIG pod's node is a simulated
MIG-capable node (GPUVISOR_SIM_TOPOLOGY) with `gpuvisor device-plugin`
running there as a process, reading NVML, making the MIG instances and
publishing the inventory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from gpuvisor.cluster.allocation import ANNOTATION, load_allocation
from gpuvisor.cluster.deviceplugin.gpus import Gpu
from gpuvisor.cluster.deviceplugin.kube import KubePods
from gpuvisor.cluster.deviceplugin.owners import PodResourcesOwners
from gpuvisor.cluster.deviceplugin.publish import NODE_INVENTORY, InventoryPublisher, KubeNodes
from gpuvisor.cluster.deviceplugin.runner import PluginRunner
from gpuvisor.cluster.deviceplugin.service import DevicePluginService, PluginConfig
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster_sim import admit, device_plugin_argv, limits_file
from tests.helpers import CLI as GPUVISOR
from tests.helpers import LIBRARY, REPO_ROOT, SimNode, run_py, stop_process
from tests.k8s_cluster import GPU, GPUCORES, GPUMEM, KubeTest, free_port, gpu_container
from tests.kubelet_harness import FakeKubelet, Pod, container_base_env, run
from tests.test_deviceplugin import PROBE, StaticGpus
from tests.test_deviceplugin_mig import INSTANCES as MIG_INSTANCES
from tests.test_deviceplugin_mig import MIG_PROBE

EXTENDER_START = 60.0  # seconds: the Kubernetes client's import on a loaded machine
PORT_TRIES = 5  # starts of the extender on new ports when one was taken meanwhile

LIST_GPUS = """
import json
from gpuvisor.cluster.deviceplugin.gpus import NvmlGpus
print(json.dumps([[g.uuid, g.index, g.memory_mib, g.model] for g in NvmlGpus().gpus()]))
"""


def scheduler_config(port: int, ca_file: Path | None = None) -> dict[str, Any]:
    """kube-scheduler's configuration with gpuvisor's extender
    (docs/kubernetes.md); over HTTPS, checking its certificate against
    `ca_file`, when given."""
    tls: dict[str, Any] = {}
    if ca_file is not None:
        tls = {"enableHTTPS": True, "tlsConfig": {"caFile": str(ca_file)}}
    return {
        "extenders": [
            {
                "urlPrefix": f"{'https' if ca_file else 'http'}://127.0.0.1:{port}",
                **tls,
                "filterVerb": "filter",
                "prioritizeVerb": "prioritize",
                "bindVerb": "bind",
                "weight": 1,
                "nodeCacheCapable": True,
                "httpTimeout": "30s",
                "managedResources": [
                    {"name": r, "ignoredByScheduler": True} for r in (GPU, GPUMEM, GPUCORES)
                ],
            }
        ]
    }


@dataclass(frozen=True)
class ExtenderTls:
    """The extender's serving certificate and key (given through the
    environment, as deploy/scheduler.yaml does), and the CA to check it."""

    cert: Path
    key: Path
    ca: Path

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


class Extender:
    """`gpuvisor scheduler` as a process, on fixed ports (restartable)."""

    def __init__(self, kubeconfig: Path, log: Path, tls: ExtenderTls | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.log = log
        self.tls = tls
        self.port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.served = False  # it answered once: kube-scheduler may know its port

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Starts it and waits until it answers.  free_port's ports may be
        taken by another process before the extender binds them (a CI run
        lost a test to `address already in use` on the metrics port): until
        it has served once, it starts again on new ports, up to PORT_TRIES
        times; a restart keeps its ports (kube-scheduler knows them)."""
        for _ in range(PORT_TRIES):
            if self._start():
                self.served = True
                return
            self.port, self.metrics_port = free_port(), free_port()
        pytest.fail(f"gpuvisor scheduler: its ports were taken {PORT_TRIES} times in a row")

    def _start(self) -> bool:
        """One start: True once it answers, False if a port was taken."""
        argv = [
            *GPUVISOR,
            "scheduler",
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--metrics-port={self.metrics_port}",
            f"--kubeconfig={self.kubeconfig}",
        ]
        env = dict(os.environ)
        context = None
        if self.tls is not None:
            env["GPUVISOR_SCHEDULER_TLS_CERT"] = str(self.tls.cert)
            env["GPUVISOR_SCHEDULER_TLS_KEY"] = str(self.tls.key)
            context = self.tls.client_context()
        with open(self.log, "ab") as out:
            before = out.tell()  # what earlier starts wrote
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env
            )
        deadline = time.monotonic() + EXTENDER_START
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_bytes()[before:].decode(errors="replace")[-3000:]
                if "address already in use" in tail and not self.served:
                    return False
                pytest.fail(f"gpuvisor scheduler exited: {tail}")
            url = f"{self.url}/healthz"
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(url, timeout=2, context=context),
            ):
                return True
            time.sleep(0.1)
        pytest.fail(f"gpuvisor scheduler not ready: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return str(r.read().decode())


@dataclass
class PluginNode:
    """A Node object with a simulated GPU node behind it: the device plugin
    (publishing the inventory, reading pods from the API server) and the
    kubelet harness."""

    name: str
    sim: SimNode
    gpus: list[Gpu]
    kubelet: FakeKubelet
    runner: PluginRunner
    thread: threading.Thread
    socks: Path
    base_env: dict[str, str]

    def admit(self, pod: kubernetes.client.V1Pod) -> tuple[Pod, dict[str, Any]]:
        return admit(self.kubelet, pod)

    def probe(self, resp: Any) -> dict[str, Any]:
        proc = run(resp, PROBE, self.base_env)
        assert proc.returncode == 0, proc.stderr
        out: dict[str, Any] = json.loads(proc.stdout)
        return out

    def stop(self) -> None:
        self.runner.stop()
        self.thread.join(timeout=10)
        self.kubelet.stop()
        shutil.rmtree(self.socks, ignore_errors=True)


@dataclass
class Stack:
    k8s: KubeTest
    extender: Extender
    tmp: Path
    sim_gpus: list[Gpu]
    nodes: dict[str, PluginNode]
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def plugin_node(self, name: str) -> PluginNode:
        """A Node whose inventory the device plugin publishes (2 simulated 16 GiB GPUs)."""
        self.k8s.create_node(name)
        d = self.tmp / name
        d.mkdir()
        sim = SimNode.create(d)
        (d / "node").mkdir()
        socks = Path(tempfile.mkdtemp(prefix="gvsx", dir="/tmp"))
        core = self.k8s.core
        config = PluginConfig(
            node_name=name, state_dir=d / "state", lib_dir=LIBRARY.parent, node_dir=d / "node"
        )
        kubelet = FakeKubelet(socks / "dp", socks / "pr" / "kubelet.sock", api=self.k8s.core)
        service = DevicePluginService(
            config,
            StaticGpus(self.sim_gpus),
            KubePods(core, node=name),
            PodResourcesOwners(str(socks / "pr" / "kubelet.sock")),
        )
        proc = subprocess.run(
            [*GPUVISOR, "inventory", "--simulate", "--json", f"--node={name}"],
            env=sim.env,
            capture_output=True,
            text=True,
            check=False,
            cwd=REPO_ROOT,
        )
        assert proc.returncode == 0, proc.stderr
        publisher = InventoryPublisher(name, json.loads(proc.stdout), KubeNodes(core))
        runner = PluginRunner(
            service, socks / "dp", health_interval=0.2, watch_interval=0.05, publisher=publisher
        )
        thread = threading.Thread(target=runner.run, daemon=True)
        thread.start()
        node = PluginNode(
            name, sim, self.sim_gpus, kubelet, runner, thread, socks, container_base_env(sim.env)
        )
        self.nodes[name] = node
        kubelet.wait_registered()
        wait_for(lambda: NODE_INVENTORY in (core.read_node(name).metadata.annotations or {}))
        return node

    def placed(
        self, name: str, node: str, **kwargs: Any
    ) -> tuple[kubernetes.client.V1Pod, dict[str, Any]]:
        """Creates the pod (`KubeTest.create_pod`'s arguments), waits until it
        is bound to node; the pod and its allocation record."""
        self.k8s.create_pod(name, **kwargs)
        assert self.k8s.wait_bound(name) == node
        pod = self.k8s.read_pod(name)
        return pod, allocation_of(pod)

    def inventory_node(
        self, name: str, models: Sequence[str], links: Sequence[Sequence[str]] | None = None
    ) -> list[str]:
        """A Node with an inventory annotation given directly; returns its GPU UUIDs."""
        uuids = [f"GPU-{name}-{i}" for i in range(len(models))]
        doc: dict[str, Any] = {
            "kind": "gpuvisor.io/node-inventory",
            "version": 1,
            "node": name,
            "gpus": [
                {"index": i, "uuid": uuids[i], "model": m, "memory_mib": 40960}
                for i, m in enumerate(models)
            ],
        }
        if links is not None:
            doc["links"] = [list(r) for r in links]
        self.k8s.create_node(name, annotations={NODE_INVENTORY: json.dumps(doc)})
        return uuids


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout:.0f}s", pytrace=False)
        time.sleep(0.05)


@pytest.fixture(scope="module")
def sim_gpus(tmp_path_factory: pytest.TempPathFactory, build_dir: Path) -> list[Gpu]:
    node = SimNode.create(tmp_path_factory.mktemp("inventory"))
    proc = run_py(LIST_GPUS, node.env)
    assert proc.returncode == 0, proc.stderr
    return [Gpu(u, i, m, None, model) for u, i, m, model in json.loads(proc.stdout)]


@pytest.fixture
def stack(k8s: KubeTest, tmp_path: Path, sim_gpus: list[Gpu]) -> Iterator[Stack]:
    ext = Extender(k8s.cluster.kubeconfig, tmp_path / "extender.log")
    st = Stack(k8s, ext, tmp_path, sim_gpus, {})
    try:
        ext.start()
        k8s.start_scheduler(scheduler_config(ext.port))
        yield st
    finally:
        ext.stop()
        for n in st.nodes.values():
            n.stop()
        for stop in st.cleanups:
            stop()


def allocation_of(pod: kubernetes.client.V1Pod) -> dict[str, Any]:
    text = (pod.metadata.annotations or {}).get(ANNOTATION)
    assert text, f"pod {pod.metadata.name} has no {ANNOTATION}"
    doc: dict[str, Any] = json.loads(text)
    load_allocation(doc)  # valid
    return doc


def gpus_of_container(doc: Mapping[str, Any], name: str) -> list[dict[str, Any]]:
    for c in doc["containers"]:
        if c["name"] == name:
            return list(c["gpus"])
    raise AssertionError(f"no container {name} in {doc}")


def test_a_single_pod_runs_with_its_quota(stack: Stack) -> None:
    """Placed by kube-scheduler through the extender, annotated, started by
    kubelet through the plugin: the workload sees 3000 MiB."""
    k = stack.k8s
    node = stack.plugin_node("sx-1")
    k.create_pod("train", gpus=1, gpumem=3000, gpucores=30)
    assert k.wait_bound("train") == "sx-1"
    pod = k.read_pod("train")
    doc = allocation_of(pod)
    assert doc["node"] == "sx-1"
    assert doc["uid"] == pod.metadata.uid
    (g,) = gpus_of_container(doc, "main")
    assert (g["memory_mib"], g["cores"]) == (3000, 30)
    _, resps = node.admit(pod)
    got = node.probe(resps["main"])
    assert got == {"init": 0, "uuids": [g["uuid"]], "mib": [3000]}
    metrics = stack.extender.metrics()
    assert f'GPUDeviceMemoryAllocated{{devicecores="30",deviceidx="{g["index"]}"' in metrics
    assert "nodeGPUMigInstance" in metrics


def test_two_containers_and_an_init_container(stack: Stack) -> None:
    k = stack.k8s
    node = stack.plugin_node("sx-2")
    k.create_pod(
        "multi",
        init_containers=[gpu_container("setup", gpus=1, gpumem=2000, gpucores=10)],
        containers=[
            gpu_container("a", gpus=1, gpumem=3000, gpucores=20),
            gpu_container("b", gpus=1, gpumem=4000, gpucores=20),
        ],
    )
    assert k.wait_bound("multi") == "sx-2"
    pod = k.read_pod("multi")
    doc = allocation_of(pod)
    _, resps = node.admit(pod)
    for name, mib in (("setup", 2000), ("a", 3000), ("b", 4000)):
        (g,) = gpus_of_container(doc, name)
        assert node.probe(resps[name]) == {"init": 0, "uuids": [g["uuid"]], "mib": [mib]}


def sm_limit(resp: Any) -> str:
    """CUDA_DEVICE_SM_LIMIT of the container's limits file (Allocate's mount)."""
    for line in limits_file(resp).read_text().splitlines():
        if line.startswith("CUDA_DEVICE_SM_LIMIT="):
            return line.split("=", 1)[1]
    raise AssertionError(f"no CUDA_DEVICE_SM_LIMIT in {limits_file(resp)}")


def test_an_init_containers_gpu_is_charged_once_with_the_app_containers(stack: Stack) -> None:
    """kubelet hands an init container's devices to the first app container,
    so the allocator places the init container on that container's GPU and
    charges the GPU as Kubernetes counts init containers: per dimension the
    larger of the two, never their sum.  Through kube-scheduler, the
    extender and the device plugin: each container runs with its own
    limits on the one GPU; a pod that needs the init container's memory
    counted (9000 MiB, not the app's 6000) does not fit beside it, and one
    that fits only if the two were not added up (15000 MiB, 70 % cores on
    a 16384 MiB GPU) does."""
    k = stack.k8s
    node = stack.plugin_node("sx-init")
    assert {g.memory_mib for g in node.gpus} == {16384}
    pod, doc = stack.placed(
        "warm",
        "sx-init",
        init_containers=[gpu_container("setup", gpus=1, gpumem=9000, gpucores=20)],
        containers=[gpu_container("main", gpus=1, gpumem=6000, gpucores=50)],
    )
    (setup,) = gpus_of_container(doc, "setup")
    (main,) = gpus_of_container(doc, "main")
    assert setup["uuid"] == main["uuid"]
    (other,) = {g.uuid for g in node.gpus} - {main["uuid"]}
    _, resps = node.admit(pod)
    for name, mib, cores in (("setup", 9000, "20"), ("main", 6000, "50")):
        got = node.probe(resps[name])
        assert got == {"init": 0, "uuids": [main["uuid"]], "mib": [mib]}, name
        assert sm_limit(resps[name]) == cores, name
    # The GPU has 16384 - 9000 = 7384 MiB left: had the init container's
    # charge been left out (the app's 6000 only), 7500 would fit there.
    k.create_pod("over", containers=[gpu_container("main", gpus=2, gpumem=7500, gpucores=10)])
    why = k.wait_unschedulable("over")
    assert "needs 2 GPUs with 7500 MiB and 10% cores free, has 1" in why, why
    k.core.delete_namespaced_pod("over", k.namespace, grace_period_seconds=0)
    # 7000 MiB and 50 % cores fit beside max(9000, 6000) MiB and
    # max(20, 50) % cores; beside their sum (15000 MiB, 70 %) they would not.
    k.create_pod("pair", containers=[gpu_container("main", gpus=2, gpumem=7000, gpucores=50)])
    assert k.wait_bound("pair") == "sx-init"
    pair = k.read_pod("pair")
    gpus = gpus_of_container(allocation_of(pair), "main")
    assert {g["uuid"] for g in gpus} == {main["uuid"], other}
    _, resps = node.admit(pair)
    got = node.probe(resps["main"])
    assert got["init"] == 0
    assert sorted(got["uuids"]) == sorted([main["uuid"], other])
    assert got["mib"] == [7000, 7000]
    assert sm_limit(resps["main"]) == "50"


def test_type_and_uuid_selection(stack: Stack) -> None:
    k = stack.k8s
    a100 = stack.inventory_node("sx-a100", ["NVIDIA A100-SXM4-40GB"] * 2)
    h100 = stack.inventory_node("sx-h100", ["NVIDIA H100 80GB HBM3"] * 2)
    k.create_pod("want-h100", gpus=1, gpumem=1000, annotations={"nvidia.com/use-gputype": "h100"})
    k.create_pod("not-a100", gpus=1, gpumem=1000, annotations={"nvidia.com/nouse-gputype": "A100"})
    k.create_pod("by-uuid", gpus=1, gpumem=1000, annotations={"nvidia.com/use-gpuuuid": a100[1]})
    k.create_pod("no-such", gpus=1, gpumem=1000, annotations={"nvidia.com/use-gputype": "V100"})
    assert k.wait_bound("want-h100") == "sx-h100"
    assert k.wait_bound("not-a100") == "sx-h100"
    assert k.wait_bound("by-uuid") == "sx-a100"
    assert gpus_of_container(allocation_of(k.read_pod("by-uuid")), "main")[0]["uuid"] == a100[1]
    assert {
        g["uuid"] for g in gpus_of_container(allocation_of(k.read_pod("want-h100")), "main")
    } <= set(h100)
    message = k.wait_unschedulable("no-such")
    assert "use-gputype" in message, message


def test_binpack_against_spread(stack: Stack) -> None:
    k = stack.k8s
    stack.inventory_node("sx-p1", ["NVIDIA A100-SXM4-40GB"] * 2)
    stack.inventory_node("sx-p2", ["NVIDIA A100-SXM4-40GB"] * 2)
    k.create_pod("first", gpus=1, gpumem=4000, gpucores=20)
    first = k.wait_bound("first")
    other = ({"sx-p1", "sx-p2"} - {first}).pop()
    policy = "hami.io/node-scheduler-policy"
    k.create_pod("packed", gpus=1, gpumem=4000, gpucores=20, annotations={policy: "binpack"})
    assert k.wait_bound("packed") == first
    k.create_pod("spread", gpus=1, gpumem=4000, gpucores=20, annotations={policy: "spread"})
    assert k.wait_bound("spread") == other


def test_gpu_binpack_against_spread(stack: Stack) -> None:
    """hami.io/gpu-scheduler-policy through kube-scheduler, the extender and
    the device plugin, each pod started before the next is created: spread
    puts a pod on the idle GPU, binpack on the fuller one; each workload
    runs on the GPU its pod was given."""
    k = stack.k8s
    node = stack.plugin_node("sx-gp")
    policy = "hami.io/gpu-scheduler-policy"

    def place(name: str, mib: int, gpu_policy: str) -> str:
        k.create_pod(name, gpus=1, gpumem=mib, gpucores=10, annotations={policy: gpu_policy})
        assert k.wait_bound(name) == "sx-gp"
        pod = k.read_pod(name)
        (g,) = gpus_of_container(allocation_of(pod), "main")
        _, resps = node.admit(pod)
        assert node.probe(resps["main"]) == {"init": 0, "uuids": [g["uuid"]], "mib": [mib]}
        return str(g["uuid"])

    first = place("first", 6000, "binpack")
    spread = place("spread", 1000, "spread")
    assert spread != first
    assert {first, spread} == {g.uuid for g in node.gpus}
    assert place("packed", 1000, "binpack") == first
    assert place("spread-2", 1000, "spread") == spread


def test_a_two_gpu_pod_gets_an_nvlink_pair(stack: Stack) -> None:
    """4 GPUs, NVLink pairs (0,1) and (2,3), SYS between the pairs: with
    GPU 0 taken, a 2-GPU pod gets the intact pair (2,3)."""
    k = stack.k8s
    nv, sys_ = "NV12", "SYS"
    links = [
        ["X", nv, sys_, sys_],
        [nv, "X", sys_, sys_],
        [sys_, sys_, "X", nv],
        [sys_, sys_, nv, "X"],
    ]
    uuids = stack.inventory_node("sx-nv", ["NVIDIA A100-SXM4-40GB"] * 4, links)
    k.create_pod("small", gpus=1, gpumem=1000, gpucores=100)  # an exclusive GPU
    assert k.wait_bound("small") == "sx-nv"
    (taken,) = gpus_of_container(allocation_of(k.read_pod("small")), "main")
    k.create_pod("pair", gpus=2, gpumem=8000, gpucores=50)
    assert k.wait_bound("pair") == "sx-nv"
    got = sorted(g["index"] for g in gpus_of_container(allocation_of(k.read_pod("pair")), "main"))
    assert got in ([0, 1], [2, 3]), got
    assert taken["index"] not in got, (got, taken, uuids)


def over_commits(stack: Stack, pods: Sequence[kubernetes.client.V1Pod]) -> dict[str, Any]:
    """Per node and GPU: slots, MiB and cores of every pod's annotation."""
    used: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for pod in pods:
        doc = allocation_of(pod)
        assert doc["node"] == pod.spec.node_name
        for c in doc["containers"]:
            for g in c["gpus"]:
                u = used[(doc["node"], g["uuid"])]
                u[0] += 1
                u[1] += g["memory_mib"]
                u[2] += g["cores"]
    total = {g.uuid: g.memory_mib for g in stack.sim_gpus}
    return {
        f"{n}/{u}": v for (n, u), v in used.items() if v[0] > 10 or v[1] > total[u] or v[2] > 100
    }


def test_fifty_pods_at_once_onto_five_nodes(stack: Stack) -> None:
    """Exactly a full cluster: 5 nodes x 2 GPUs x 5 pods of 3000 MiB and 20 %.
    Every pod is placed, no GPU is over-committed, and every container gets
    its own pod's limits through the plugin (the workload of one pod per
    node is run and sees its 3000 MiB)."""
    k = stack.k8s
    nodes = [stack.plugin_node(f"sx-f{i}") for i in range(5)]
    # each node's kubelet admits and starts the pods as they are bound (the
    # extender holds back a bind the device plugin could confuse with a
    # not-started pod's until that one starts)
    serving = {n.name: n.kubelet.serve(n.name, k.namespace, n.admit) for n in nodes}
    names = [f"p{i:02d}" for i in range(50)]
    start = time.monotonic()
    with futures_pool() as pool:
        list(pool.map(lambda n: k.create_pod(n, gpus=1, gpumem=3000, gpucores=20), names))
    bound = {n: k.wait_bound(n, timeout=180) for n in names}
    elapsed = time.monotonic() - start
    pods = [k.read_pod(n) for n in names]
    assert over_commits(stack, pods) == {}
    assert sorted(list(bound.values()).count(f"sx-f{i}") for i in range(5)) == [10] * 5
    ran: set[str] = set()
    for pod in pods:
        node = pod.spec.node_name
        result = serving[node].wait([pod.metadata.name], timeout=120)[pod.metadata.name]
        assert not isinstance(result, Exception), f"{pod.metadata.name}: {result}"
        _, resps = result
        doc = allocation_of(pod)
        (g,) = gpus_of_container(doc, "main")
        limits = Path(limits_dir(resps["main"])) / "limits.env"
        text = limits.read_text()
        assert f"pod {pod.metadata.namespace}/{pod.metadata.name}," in text
        assert "CUDA_DEVICE_MEMORY_LIMIT=3000m\nCUDA_DEVICE_SM_LIMIT=20\n" in text
        if node not in ran:
            ran.add(node)
            assert stack.nodes[node].probe(resps["main"]) == {
                "init": 0,
                "uuids": [g["uuid"]],
                "mib": [3000],
            }
    k.create_pod("one-too-many", gpus=1, gpumem=3000, gpucores=20)
    message = k.wait_unschedulable("one-too-many")
    print(f"50 pods bound in {elapsed:.1f}s; the 51st: {message}")


def limits_dir(resp: Any) -> str:
    return str(next(m.host_path for m in resp.mounts if m.container_path == "/etc/gpuvisor"))


@contextlib.contextmanager
def futures_pool() -> Iterator[Any]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=8) as pool:
        yield pool


def test_an_extender_restart_in_the_middle(stack: Stack) -> None:
    """Pods bound before a SIGKILL of the extender keep their GPUs: the new
    one rebuilds its reservations from their annotations, so the pods
    after the restart fill exactly what is left, and a deleted pod's share
    is free again, for exactly one more pod."""
    k = stack.k8s
    stack.inventory_node("sx-r1", ["NVIDIA A100-SXM4-40GB"])  # 40960 MiB
    for i in range(5):
        k.create_pod(f"before-{i}", gpus=1, gpumem=5000, gpucores=10)
    for i in range(5):
        k.wait_bound(f"before-{i}")
    stack.extender.kill()
    for i in range(4):
        k.create_pod(f"after-{i}", gpus=1, gpumem=5000, gpucores=10)
    time.sleep(1.0)  # kube-scheduler meets a dead extender meanwhile
    stack.extender.start()

    def bound(names: Sequence[str]) -> list[str]:
        return [n for n in names if k.read_pod(n).spec.node_name]

    # 8 x 5000 of 40960: three of the four fit, the fourth does not
    after = [f"after-{i}" for i in range(4)]
    wait_for(lambda: len(bound(after)) == 3, timeout=60, what="3 binds after the restart")
    (waiting,) = set(after) - set(bound(after))
    message = k.wait_unschedulable(waiting, timeout=60)
    assert "needs 1 GPU with 5000 MiB and 10% cores free, has 0 (960 MiB free)" in message
    pods = [k.read_pod(n) for n in [f"before-{i}" for i in range(5)] + bound(after)]
    assert {gpus_of_container(allocation_of(p), "main")[0]["uuid"] for p in pods} == {"GPU-sx-r1-0"}
    shared = 'GPUDeviceSharedNum{deviceidx="0",deviceuuid="GPU-sx-r1-0",nodeid="sx-r1",zone="vGPU"}'
    assert f"{shared} 8.0" in stack.extender.metrics()
    # a deleted pod's share is released: a new pod fits again
    k.core.delete_namespaced_pod("before-0", k.namespace, grace_period_seconds=0)
    # the waiting pod (requeued by the deletion) or a new one takes it, not both
    k.create_pod("late", gpus=1, gpumem=5000, gpucores=10)
    wait_for(lambda: bool(bound([waiting, "late"])), timeout=60, what="a bind of the freed share")
    time.sleep(3.0)
    assert len(bound([waiting, "late"])) == 1
    assert f"{shared} 8.0" in stack.extender.metrics()


@dataclass
class MigPluginNode:
    """A Node with a simulated MIG-capable node behind it (an A100 40GB
    out of MIG mode, GPUVISOR_SIM_TOPOLOGY), and `gpuvisor device-plugin`
    itself running there as a process: NVML for its GPUs, inventory and
    MIG instances, the API server (kubeconfig) for pods and the Node."""

    sim: SimNode
    kubelet: FakeKubelet
    plugin: subprocess.Popen[bytes]
    log: Path
    socks: Path
    base_env: dict[str, str]

    def instances(self) -> dict[str, Any]:
        proc = run_py(MIG_INSTANCES, self.sim.env)
        assert proc.returncode == 0, proc.stderr
        out: dict[str, Any] = json.loads(proc.stdout)
        return out

    def stop(self) -> None:
        stop_process(self.plugin)
        self.kubelet.stop()
        shutil.rmtree(self.socks, ignore_errors=True)


def start_mig_plugin_node(stack: Stack, name: str) -> MigPluginNode:
    stack.k8s.create_node(name)
    d = stack.tmp / name
    d.mkdir()
    topo = d / "topology.json"
    topo.write_text(json.dumps({"gpus": [{"model": "NVIDIA A100-SXM4-40GB"}]}))
    sim = SimNode.create(d)
    del sim.env["GPUVISOR_SIM_DEVICES"]
    sim.env["GPUVISOR_SIM_TOPOLOGY"] = str(topo)
    (d / "node").mkdir()
    socks = Path(tempfile.mkdtemp(prefix="gvsm", dir="/tmp"))
    kubelet = FakeKubelet(socks / "dp", socks / "pr" / "kubelet.sock", api=stack.k8s.core)
    argv = device_plugin_argv(name, d, socks, health_interval=0.2)
    argv.append("--mig-mode-off-after=1")
    env = dict(sim.env, KUBECONFIG=str(stack.k8s.cluster.kubeconfig))
    log = d / "plugin.log"
    with open(log, "wb") as out:
        plugin = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
    node = MigPluginNode(sim, kubelet, plugin, log, socks, container_base_env(sim.env))
    stack.cleanups.append(node.stop)
    try:
        kubelet.wait_registered(timeout=EXTENDER_START)
    except TimeoutError:
        pytest.fail(f"the device plugin did not register: {log.read_text()[-3000:]}")
    return node


def node_inventory(k: KubeTest, name: str) -> dict[str, Any]:
    text = (k.core.read_node(name).metadata.annotations or {}).get(NODE_INVENTORY)
    doc: dict[str, Any] = json.loads(text) if text else {}
    return doc


def mig_instances(metrics: str, node: str) -> list[tuple[dict[str, str], float]]:
    """The nodeGPUMigInstance samples of `node` in the extender's metrics."""
    return [
        (dict(s.labels), s.value)
        for fam in text_string_to_metric_families(metrics)
        if fam.name == "nodeGPUMigInstance"
        for s in fam.samples
        if s.labels.get("nodeid") == node
    ]


def test_a_mig_pod(stack: Stack) -> None:
    """A pod with vgpu-mode: mig is placed by kube-scheduler through the
    extender onto a MIG-capable node as a MIG instance; the device plugin
    turns MIG mode on and makes the instance, republishes the node's
    inventory with it, and the workload runs on the MIG device (its UUID,
    its memory).  Once the pod is deleted, the instance is destroyed, MIG
    mode turned off again, the inventory says so, and a shared pod is
    placed on the GPU."""
    k = stack.k8s
    node = start_mig_plugin_node(stack, "mx-1")
    wait_for(lambda: bool(node_inventory(k, "mx-1")), what="the published inventory")
    (gpu,) = node_inventory(k, "mx-1")["gpus"]
    assert (gpu["mig"]["mode"], gpu["mig"]["instances"]) == ("disabled", [])
    k.create_pod("mig", gpus=1, gpumem=8000, annotations={"nvidia.com/vgpu-mode": "mig"})
    assert k.wait_bound("mig") == "mx-1"
    pod = k.read_pod("mig")
    (g,) = gpus_of_container(allocation_of(pod), "main")
    plan = g["mig"]
    assert plan is not None
    assert plan["enable_mig_mode"]
    assert plan["instance"] is None
    # the smallest profiles of at least 8000 MiB: 1g.10gb or 2g.10gb (9856 MiB)
    assert plan["profile"] in ("1g.10gb", "2g.10gb")
    assert g["memory_mib"] == 9856
    where = [plan["placement"]["start"], plan["placement"]["size"]]
    # the cluster metrics (HAMi's nodeGPUMigInstance) show the instance as
    # allocated from the bind on, before the plugin has made it
    instance = {
        "nodeid": "mx-1",
        "deviceuuid": gpu["uuid"],
        "deviceidx": "0",
        "migname": plan["profile"],
        "placement": f"{where[0]}:{where[1]}",
        "zone": "vGPU",
    }
    assert mig_instances(stack.extender.metrics(), "mx-1") == [(instance, 1.0)]
    hp, resps = admit(node.kubelet, pod)
    (inst,) = node.instances()[gpu["uuid"]]["instances"]
    mig_uuid = inst[2]
    assert inst[:2] == where
    assert mig_uuid.startswith("MIG-")
    assert resps["main"].envs["CUDA_VISIBLE_DEVICES"] == mig_uuid
    assert resps["main"].envs["NVIDIA_VISIBLE_DEVICES"] == mig_uuid
    proc = run(resps["main"], MIG_PROBE, node.base_env)
    assert proc.returncode == 0, proc.stderr
    name = f"NVIDIA A100-SXM4-40GB MIG {plan['profile']}"
    assert json.loads(proc.stdout) == [[name, mig_uuid, 9856]]

    # the extender's view: the node's inventory with MIG mode on, the
    # instance, and what room is left (no 7g.40gb beside it)
    def published() -> list[Any]:
        mig = node_inventory(k, "mx-1")["gpus"][0]["mig"]
        return [mig["mode"], [(i["uuid"], i["placement"]) for i in mig["instances"]]]

    want = ["enabled", [(mig_uuid, {"start": where[0], "size": where[1]})]]
    wait_for(lambda: published() == want, what="the inventory with the instance")
    remaining = node_inventory(k, "mx-1")["gpus"][0]["mig"]["remaining"]
    assert remaining["7g.40gb"] == 0
    assert remaining[plan["profile"]] >= 1
    # the pod is deleted (kubelet no longer lists it): the instance goes
    k.core.delete_namespaced_pod("mig", k.namespace, grace_period_seconds=0)
    node.kubelet.release(hp)
    wait_for(lambda: node.instances()[gpu["uuid"]]["instances"] == [], what="the destruction")
    assert f"destroyed MIG instance {mig_uuid}" in node.log.read_text()
    # nothing left on the GPU and nothing planned for it: after the wait the
    # plugin turns MIG mode off (it turned it on) and republishes; the
    # extender places a shared pod on the GPU again
    wait_for(lambda: published() == ["disabled", []], what="the inventory out of MIG mode")
    wait_for(
        lambda: mig_instances(stack.extender.metrics(), "mx-1") == [],
        what="the metrics without the instance",
    )
    assert node.instances()[gpu["uuid"]] == {"enabled": False, "instances": []}
    assert f"GPU {gpu['uuid']}: MIG mode turned off" in node.log.read_text()
    k.create_pod(
        "shared",
        gpus=1,
        gpumem=3000,
        annotations={"nvidia.com/use-gpuuuid": gpu["uuid"], "nvidia.com/vgpu-mode": "hami-core"},
    )
    assert k.wait_bound("shared") == "mx-1"
    (g,) = gpus_of_container(allocation_of(k.read_pod("shared")), "main")
    assert (g["uuid"], g["memory_mib"], g["mig"]) == (gpu["uuid"], 3000, None)


def test_a_mig_pod_with_an_init_container(stack: Stack) -> None:
    """An init container and an app container each asking for a MIG slice:
    kube-scheduler places the pod through the extender, each container gets
    its own MIG instance on the GPU (kubelet gives the app container the
    init container's devices without asking the preference), and each
    workload runs on its own instance with its own memory."""
    k = stack.k8s
    node = start_mig_plugin_node(stack, "mx-2")
    wait_for(lambda: bool(node_inventory(k, "mx-2")), what="the published inventory")
    k.create_pod(
        "initmig",
        containers=[gpu_container("main", gpus=1, gpumem=8000)],
        init_containers=[gpu_container("setup", gpus=1, gpumem=4000)],
        annotations={"nvidia.com/vgpu-mode": "mig"},
    )
    assert k.wait_bound("initmig") == "mx-2"
    pod = k.read_pod("initmig")
    doc = allocation_of(pod)
    plans = {c: gpus_of_container(doc, c)[0] for c in ("setup", "main")}
    assert all(g["mig"] is not None for g in plans.values())
    _, resps = admit(node.kubelet, pod)
    (gpu_uuid,) = {g["uuid"] for g in plans.values()}
    made = {(i[0], i[1]): i[2] for i in node.instances()[gpu_uuid]["instances"]}
    for c, g in plans.items():
        where = (g["mig"]["placement"]["start"], g["mig"]["placement"]["size"])
        mig_uuid = made[where]
        assert resps[c].envs["CUDA_VISIBLE_DEVICES"] == mig_uuid
        proc = run(resps[c], MIG_PROBE, node.base_env)
        assert proc.returncode == 0, proc.stderr
        name = f"NVIDIA A100-SXM4-40GB MIG {g['mig']['profile']}"
        assert json.loads(proc.stdout) == [[name, mig_uuid, g["memory_mib"]]]
    assert len(made) == 2


def test_the_extender_moves_to_other_ports_when_one_was_taken(
    k8s: KubeTest, tmp_path: Path
) -> None:
    """The harness itself: free_port's port can be taken before the
    extender binds it (a CI run lost a test to `address already in use`).
    A first start moves to other ports; the extender then serves there."""
    ext = Extender(k8s.cluster.kubeconfig, tmp_path / "extender.log")
    taken = ext.metrics_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", taken))
        s.listen()
        try:
            ext.start()
            assert ext.metrics_port != taken
            assert "address already in use" in (tmp_path / "extender.log").read_text()
            assert "gpuvisor_scheduler" in ext.metrics()
        finally:
            ext.stop()
