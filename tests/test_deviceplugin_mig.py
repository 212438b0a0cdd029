"""The device plugin realising MIG placements, on a simulated MIG-capable
node (GPUVISOR_SIM_TOPOLOGY, the simulated NVML's MIG calls) against
kubelet's side of the protocol (tests/kubelet_harness.py).

The plugin runs as its own process (NVML is per process, and the simulated
one reads its node from the environment): the real service, runner, NVML
GPU source and MIG driver, with the pods' allocations read from a file the
test writes (in place of the API server).  What a container gets is checked
the way it would see it: the workload runs with exactly what Allocate
returned and reports its device's UUID and memory through CUDA; the node's
instances are read back through NVML by another process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from gpuvisor.cluster.deviceplugin.migrealise import MIG_MODE

from tests.helpers import LIBRARY, REPO_ROOT, SimNode, run_py, start_ready, stop_process
from tests.kubelet_harness import Container, FakeKubelet, Pod, container_base_env, host_env, run

NODE = "mig-node"
A100 = "NVIDIA A100-SXM4-40GB"
PROFILE_1G10 = 15  # 1g.10gb: 2 memory slices, starts 0, 2, 4, 6; 9856 MiB
PROFILE_3G = 9  # 3g.20gb: 4 memory slices, starts 0, 4; 20096 MiB

# The plugin's process: the service with NVML's GPUs and MIG driver, the
# allocations from a JSON file ({"ns/name": annotation}), kubelet's
# PodResources on the harness's socket.  argv: plugin dir, PodResources
# socket, state dir, lib dir, node dir, allocations file, fault, seconds before
# an idle GPU of the plugin's leaves MIG mode.
PLUGIN = """
import json, logging, signal, sys
from pathlib import Path
import pynvml
from gpuvisor.cluster.deviceplugin.gpus import NvmlGpus
from gpuvisor.cluster.deviceplugin.grant import GrantError, parse_grant
from gpuvisor.cluster.deviceplugin.migdriver import NvmlMig
from gpuvisor.cluster.deviceplugin.migrealise import MIG_MINE, MIG_MODE, MigRealiser
from gpuvisor.cluster.deviceplugin.owners import PodResourcesOwners
from gpuvisor.cluster.deviceplugin.runner import PluginRunner
from gpuvisor.cluster.deviceplugin.service import DevicePluginService, PluginConfig
from tests.granted_pods import pod_asking_for

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
plugin_dir, pr_sock, state, lib, node_dir, allocs, fault, off_after = sys.argv[1:]

class FilePods:
    def _all(self):
        return json.loads(Path(allocs).read_text())
    def pod(self, namespace, pod):
        text = self._all().get(f"{namespace}/{pod}")
        if text is None:
            return {"metadata": {"name": pod, "namespace": namespace}, "spec": {}}
        return pod_asking_for(namespace, pod, text)
    def bound(self, node):
        out = []
        for text in self._all().values():
            try:
                g = parse_grant(text)
            except GrantError:
                continue
            if g.node == node:
                out.append(g)
        return out

class NoComputeInstance(NvmlMig):
    # the GPU instance is made, its compute instance cannot be
    def _create_compute(self, gi):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)

gpus = NvmlGpus()
driver = NoComputeInstance() if fault == "no-compute-instance" else NvmlMig()
config = PluginConfig(node_name=NODE_NAME, state_dir=Path(state), lib_dir=Path(lib),
                      node_dir=Path(node_dir))
service = DevicePluginService(config, gpus, FilePods(), PodResourcesOwners(pr_sock),
                              MigRealiser(driver, mine=Path(state) / MIG_MINE,
                                          mode=Path(state) / MIG_MODE,
                                          off_after=float(off_after)))
runner = PluginRunner(service, Path(plugin_dir), health_interval=0.1, watch_interval=0.05)
signal.signal(signal.SIGTERM, lambda *a: runner.stop())
runner.run()
""".replace("NODE_NAME", repr(NODE))

# The node's MIG state as NVML shows it to another process.
# (The plugin may turn a GPU's MIG mode off between the two reads: its
# instances then cannot be listed, and it has none; a CI run failed so.)
INSTANCES = """
import json, pynvml
from gpuvisor.cluster.deviceplugin.migdriver import MigDriverError, NvmlMig
pynvml.nvmlInit()
d = NvmlMig()
out = {}
for i in range(pynvml.nvmlDeviceGetCount()):
    u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
    u = u.decode() if isinstance(u, bytes) else u
    enabled = d.enabled(u)
    try:
        listed = [[x.start, x.size, x.uuid, x.in_use] for x in d.instances(u)]
    except MigDriverError:
        if d.enabled(u):
            raise
        enabled, listed = False, []
    out[u] = {"enabled": enabled, "instances": listed}
print(json.dumps(out))
"""

# The workload's view of what it was given: each CUDA device's name, UUID
# (cuDeviceGetUuid's bytes in NVML's form: MIG- on a MIG device, whose
# name says so) and cuMemGetInfo's total, through the preloaded library.
MIG_PROBE = """
import json
from tests.cuclient import *
ok(cu.cuInit, 0)
out = []
for d in range(ok(cu.cuDeviceGetCount)):
    init(d)
    name = ok(cu.cuDeviceGetName, 128, ok(cu.cuDeviceGet, d)).split(b"\\0")[0].decode()
    kind = "MIG" if " MIG " in name else "GPU"
    out.append([name, kind + uuid(d)[3:], mem_info()[1] // MiB])
print(json.dumps(out))
"""

# A workload that holds 1 GiB on its device until its stdin closes.
HOLD = """
import sys
from tests.cuclient import *
init(0)
ok(cu.cuMemAlloc, 1 << 30)
print("ready", flush=True)
sys.stdin.read()
"""


@dataclass
class MigNode:
    sim: SimNode
    gpus: list[str]  # UUIDs by index
    kubelet: FakeKubelet
    allocs: Path
    base_env: dict[str, str]
    plugin: subprocess.Popen[bytes]
    log: Path
    argv: list[str]

    def start_plugin(self) -> None:
        with open(self.log, "ab") as out:
            self.plugin = subprocess.Popen(
                [sys.executable, "-c", PLUGIN, *self.argv],
                env=self.sim.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
            )

    def kill_plugin(self) -> None:
        self.plugin.kill()
        self.plugin.wait(10)

    def place(self, pod: Pod, container: str, gpu: int, mig: dict[str, Any], mib: int) -> None:
        doc = json.loads(self.allocs.read_text())
        doc[pod.key] = json.dumps(
            {
                "pod": pod.key,
                "node": NODE,
                "containers": [
                    {
                        "name": container,
                        "gpus": [
                            {
                                "uuid": self.gpus[gpu],
                                "index": gpu,
                                "memory_mib": mib,
                                "cores": 15,
                                "mig": mig,
                            }
                        ],
                    }
                ],
            }
        )
        self.allocs.write_text(json.dumps(doc))

    def gone(self, pod: Pod) -> None:
        """The pod is deleted: kubelet drops it, the API no longer has it."""
        self.kubelet.release(pod)
        doc = json.loads(self.allocs.read_text())
        doc.pop(pod.key, None)
        self.allocs.write_text(json.dumps(doc))

    def instances(self) -> dict[str, Any]:
        proc = run_py(INSTANCES, self.sim.env)
        assert proc.returncode == 0, proc.stderr
        out: dict[str, Any] = json.loads(proc.stdout)
        return out

    def plugin_log(self) -> str:
        return self.log.read_text()


def mig_plan(
    profile_id: int,
    start: int,
    size: int,
    *,
    instance: str | None = None,
    destroy: tuple[str, ...] = (),
    enable: bool = False,
) -> dict[str, Any]:
    return {
        "profile": {PROFILE_1G10: "1g.10gb", PROFILE_3G: "3g.20gb"}[profile_id],
        "profile_id": profile_id,
        "placement": {"start": start, "size": size},
        "instance": instance,
        "destroy": list(destroy),
        "enable_mig_mode": enable,
    }


def eventually(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


OFF_AFTER = 1.5  # seconds an idle GPU of the plugin's stays in MIG mode


def start_node(tmp_path: Path, fault: str = "") -> Iterator[MigNode]:
    topo = tmp_path / "topology.json"
    topo.write_text(json.dumps({"gpus": [{"model": A100}, {"model": A100}]}))
    sim = SimNode.create(tmp_path)
    del sim.env["GPUVISOR_SIM_DEVICES"]
    sim.env["GPUVISOR_SIM_TOPOLOGY"] = str(topo)
    socks = Path(tempfile.mkdtemp(prefix="gvmg", dir="/tmp"))
    kubelet = FakeKubelet(socks / "dp", socks / "pr" / "kubelet.sock")
    allocs = tmp_path / "allocations.json"
    allocs.write_text("{}")
    (tmp_path / "node").mkdir()
    log = tmp_path / "plugin.log"
    argv = [
        *(str(socks / "dp"), str(socks / "pr" / "kubelet.sock"), str(tmp_path / "state")),
        *(str(LIBRARY.parent), str(tmp_path / "node"), str(allocs), fault, str(OFF_AFTER)),
    ]
    base = container_base_env(sim.env)
    node = MigNode(sim, [], kubelet, allocs, base, None, log, argv)  # type: ignore[arg-type]
    node.start_plugin()
    try:
        kubelet.wait_registered(timeout=60)
        uuids = {d.rsplit("-", 1)[0] for d in kubelet.state.devices}
        # NVML's order (the simulator's UUIDs end in the index)
        node.gpus = sorted(uuids, key=lambda u: int(u.rsplit("-", 1)[1], 16))
        yield node
    finally:
        stop_process(node.plugin)
        kubelet.stop()
        shutil.rmtree(socks, ignore_errors=True)


@pytest.fixture
def mig_node(tmp_path: Path, build_dir: Path) -> Iterator[MigNode]:
    yield from start_node(tmp_path)


@pytest.fixture
def faulty_node(tmp_path: Path, build_dir: Path) -> Iterator[MigNode]:
    yield from start_node(tmp_path, "no-compute-instance")


def test_a_mig_placement_is_realised_and_undone(mig_node: MigNode) -> None:
    """MIG mode turned on, the planned instance made at its placement, the
    container given its MIG device (UUID and memory) and its limits; the
    instance destroyed once kubelet no longer lists the pod."""
    n = mig_node
    g0 = n.gpus[0]
    assert n.instances()[g0] == {"enabled": False, "instances": []}
    pod = Pod("default", "mig", [Container("main", 1)])
    n.place(pod, "main", 0, mig_plan(PROFILE_1G10, 2, 2, enable=True), 9856)
    resp = n.kubelet.admit(pod)["main"]
    state = n.instances()[g0]
    assert state["enabled"]
    ((start, size, uuid, in_use),) = state["instances"]
    assert (start, size, in_use) == (2, 2, False)
    assert uuid.startswith("MIG-")
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == uuid
    assert resp.envs["CUDA_VISIBLE_DEVICES"] == uuid
    n.kubelet.start(pod, "main")
    limits = Path(host_env(resp, {})["GPUVISOR_LIMITS_FILE"]).read_text()
    assert "CUDA_DEVICE_MEMORY_LIMIT=9856m\nCUDA_DEVICE_SM_LIMIT=0\n" in limits
    proc = run(resp, MIG_PROBE, n.base_env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[f"{A100} MIG 1g.10gb", uuid, 9856]]
    # the pod is gone: its instance goes, then, after the grace, MIG mode
    # (the plugin turned it on): the GPU can be given whole or shared again
    n.gone(pod)
    assert eventually(lambda: n.instances()[g0]["instances"] == []), n.plugin_log()
    assert f"destroyed MIG instance {uuid}" in n.plugin_log()
    assert eventually(lambda: not n.instances()[g0]["enabled"]), n.plugin_log()
    assert f"GPU {g0}: MIG mode turned off" in n.plugin_log()
    # a plan made while the GPU was in MIG mode (no enable_mig_mode): the
    # plugin turned it off itself, so it turns it on again for the plan
    late = Pod("default", "late", [Container("main", 1)])
    n.place(late, "main", 0, mig_plan(PROFILE_1G10, 2, 2), 9856)
    resp = n.kubelet.admit(late)["main"]
    assert n.instances()[g0]["enabled"]
    assert resp.envs["CUDA_VISIBLE_DEVICES"].startswith("MIG-")
    n.kubelet.start(late, "main")
    n.gone(late)
    assert eventually(lambda: not n.instances()[g0]["enabled"]), n.plugin_log()


def test_an_instance_in_use_is_never_destroyed(mig_node: MigNode) -> None:
    n = mig_node
    g0 = n.gpus[0]
    pod = Pod("default", "busy", [Container("main", 1)])
    n.place(pod, "main", 0, mig_plan(PROFILE_1G10, 0, 2, enable=True), 9856)
    resp = n.kubelet.admit(pod)["main"]
    n.kubelet.start(pod, "main")
    uuid = resp.envs["CUDA_VISIBLE_DEVICES"]
    holder = start_ready(HOLD, host_env(resp, n.base_env))
    try:
        assert eventually(lambda: n.instances()[g0]["instances"] == [[0, 2, uuid, True]])
        # another pod's plan names it for destruction (a stale plan): refused,
        # and kubelet hears why
        other = Pod("default", "stale", [Container("main", 1)])
        n.place(other, "main", 0, mig_plan(PROFILE_3G, 0, 4, destroy=(uuid,)), 20096)
        with pytest.raises(grpc.RpcError) as err:
            n.kubelet.admit(other)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"MIG instance {uuid} is in use: not destroyed" in str(err.value.details())
        # the pod is gone while its process still runs: the instance stays
        n.gone(pod)
        assert eventually(lambda: "still in use: kept for now" in n.plugin_log())
        assert n.instances()[g0]["instances"] == [[0, 2, uuid, True]]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    # once nothing uses it, it goes
    assert eventually(lambda: n.instances()[g0]["instances"] == []), n.plugin_log()


def test_a_failed_creation_leaves_no_half_made_instance(faulty_node: MigNode) -> None:
    """The GPU instance is made but its compute instance is not: kubelet
    gets the reason, and the GPU instance is destroyed again."""
    n = faulty_node
    g1 = n.gpus[1]
    pod = Pod("default", "nope", [Container("main", 1)])
    n.place(pod, "main", 1, mig_plan(PROFILE_3G, 4, 4, enable=True), 20096)
    with pytest.raises(grpc.RpcError) as err:
        n.kubelet.admit(pod)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    why = str(err.value.details())
    assert why.startswith(f"gpuvisor: pod default/nope container main: GPU {g1}: profile 9 at 4+4")
    assert "nvmlGpuInstanceCreateComputeInstance" in why
    assert "destroyed again" in why
    assert n.instances()[g1] == {"enabled": True, "instances": []}
    # nothing was left for the container either: no directory
    assert not any((d / "mig.json").exists() for d in (n.sim.dir / "state").iterdir())


def test_an_overlapping_plan_is_refused_and_nothing_changes(mig_node: MigNode) -> None:
    n = mig_node
    g0 = n.gpus[0]
    first = Pod("default", "first", [Container("main", 1)])
    n.place(first, "main", 0, mig_plan(PROFILE_1G10, 4, 2, enable=True), 9856)
    n.kubelet.admit(first)
    (inst,) = n.instances()[g0]["instances"]
    # a plan made before the first instance was seen, overlapping it
    second = Pod("default", "second", [Container("main", 1)])
    n.place(second, "main", 0, mig_plan(PROFILE_3G, 4, 4), 20096)
    with pytest.raises(grpc.RpcError) as err:
        n.kubelet.admit(second)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"overlaps MIG instance {inst[2]} at 4+2" in str(err.value.details())
    assert n.instances()[g0]["instances"] == [inst]


def test_a_container_kubelet_gave_other_devices_is_not_started(mig_node: MigNode) -> None:
    """PreStartContainer checks the fact (PodResources): a container whose
    placement is MIG but for which Allocate made no instance (kubelet did
    not follow the preference) fails its start with the reason."""
    n = mig_node
    pod = Pod("default", "unsteered", [Container("main", 1)])
    n.kubelet.registered.options.get_preferred_allocation_available = False  # type: ignore[union-attr]
    n.place(pod, "main", 0, mig_plan(PROFILE_1G10, 0, 2, enable=True), 9856)
    resp = n.kubelet.admit(pod)["main"]
    assert resp.envs["CUDA_VISIBLE_DEVICES"] == n.gpus[0]
    with pytest.raises(grpc.RpcError) as err:
        n.kubelet.start(pod, "main")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no MIG instance was made for it at Allocate" in str(err.value.details())
    assert n.instances()[n.gpus[0]]["instances"] == []


def test_a_plugin_restart_forgets_nothing(mig_node: MigNode) -> None:
    """The instances a pod holds are recorded in its directory: a plugin
    killed and started again still destroys them once the pod is gone."""
    n = mig_node
    g0 = n.gpus[0]
    pod = Pod("default", "kept", [Container("main", 1)])
    n.place(pod, "main", 0, mig_plan(PROFILE_1G10, 6, 2, enable=True), 9856)
    n.kubelet.admit(pod)
    n.kubelet.start(pod, "main")
    ((_, _, uuid, _),) = n.instances()[g0]["instances"]
    n.kill_plugin()
    n.start_plugin()
    n.kubelet.wait_registered(count=2, timeout=60)
    n.gone(pod)
    assert eventually(lambda: n.instances()[g0]["instances"] == []), n.plugin_log()
    assert f"destroyed MIG instance {uuid}" in n.plugin_log()


def test_an_instance_is_handed_over_and_one_not_made_here_is_kept(mig_node: MigNode) -> None:
    """An instance the plugin made for a pod that is gone, which another
    bound pod's plan reuses, is left for that pod and destroyed when that
    one is gone too; an instance someone else made is used and never
    destroyed."""
    n = mig_node
    g0, g1 = n.gpus
    first = Pod("default", "first", [Container("main", 1)])
    n.place(first, "main", 0, mig_plan(PROFILE_1G10, 0, 2, enable=True), 9856)
    uuid = n.kubelet.admit(first)["main"].envs["CUDA_VISIBLE_DEVICES"]
    n.kubelet.start(first, "main")
    second = Pod("default", "second", [Container("main", 1)])
    n.place(second, "main", 0, mig_plan(PROFILE_1G10, 0, 2, instance=uuid), 9856)
    n.gone(first)
    time.sleep(1.0)  # ten health polls
    assert n.instances()[g0]["instances"] == [[0, 2, uuid, False]]
    resp = n.kubelet.admit(second)["main"]
    assert resp.envs["CUDA_VISIBLE_DEVICES"] == uuid
    n.kubelet.start(second, "main")
    n.gone(second)
    assert eventually(lambda: n.instances()[g0]["instances"] == []), n.plugin_log()
    # an instance made by someone else on GPU 1
    made = run_py(
        """
        import ctypes, pynvml as n
        n.nvmlInit()
        d = n.nvmlDeviceGetHandleByIndex(1)
        n.nvmlDeviceSetMigMode(d, n.NVML_DEVICE_MIG_ENABLE)
        p = n.c_nvmlGpuInstancePlacement_t(4, 4)
        gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(d, 9, ctypes.byref(p))
        n.nvmlGpuInstanceCreateComputeInstance(gi, n.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
        """,
        n.sim.env,
    )
    assert made.returncode == 0, made.stderr
    ((_, _, other, _),) = n.instances()[g1]["instances"]
    third = Pod("default", "third", [Container("main", 1)])
    n.place(third, "main", 1, mig_plan(PROFILE_3G, 4, 4, instance=other), 20096)
    resp = n.kubelet.admit(third)["main"]
    assert resp.envs["CUDA_VISIBLE_DEVICES"] == other
    n.kubelet.start(third, "main")
    n.gone(third)
    assert eventually(lambda: "default/third" not in json.dumps(_dirs(n)))
    assert n.instances()[g1]["instances"] == [[4, 4, other, False]]


def _dirs(n: MigNode) -> list[Any]:
    """The owners of the plugin's container directories."""
    return [
        (d / "owner.json").read_text()
        for d in (n.sim.dir / "state").iterdir()
        if (d / "owner.json").exists()
    ]


def test_an_app_container_reusing_its_init_containers_devices_gets_its_instance(
    mig_node: MigNode,
) -> None:
    """kubelet gives an app container its init container's devices without
    asking GetPreferredAllocation: the plugin still realises the app
    container's own MIG placement (the init container's preference names
    the pod), and each runs on its own instance with its own limits."""
    n = mig_node
    g0 = n.gpus[0]
    pod = Pod("default", "initmig", [Container("setup", 1, init=True), Container("main", 1)])

    def grant(name: str, init: bool, start: int, mib: int) -> dict[str, Any]:
        plan = mig_plan(PROFILE_1G10, start, 2, enable=init)
        gpu = {"uuid": g0, "index": 0, "memory_mib": mib, "cores": 15, "mig": plan}
        return {"name": name, "init": init, "gpus": [gpu]}

    doc = json.loads(n.allocs.read_text())
    containers = [grant("setup", True, 0, 9856), grant("main", False, 2, 9856)]
    doc[pod.key] = json.dumps({"pod": pod.key, "node": NODE, "containers": containers})
    n.allocs.write_text(json.dumps(doc))
    resps = n.kubelet.admit(pod)
    assert (
        n.kubelet.state.assigned[(pod.key, "main")] == n.kubelet.state.assigned[(pod.key, "setup")]
    )
    by_start = {start: uuid for start, _, uuid, _ in n.instances()[g0]["instances"]}
    assert set(by_start) == {0, 2}, n.plugin_log()
    for name, start in (("setup", 0), ("main", 2)):
        assert resps[name].envs["CUDA_VISIBLE_DEVICES"] == by_start[start]
        n.kubelet.start(pod, name)
        proc = run(resps[name], MIG_PROBE, n.base_env)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == [[f"{A100} MIG 1g.10gb", by_start[start], 9856]]
    n.gone(pod)
    assert eventually(lambda: n.instances()[g0]["instances"] == []), n.plugin_log()


def test_mig_mode_stays_on_while_a_bound_pod_plans_on_it(mig_node: MigNode) -> None:
    """An idle GPU in MIG mode is not turned off while a pod bound to the
    node (not started yet) has a MIG grant on it, nor while a process runs
    on it; once neither holds, it goes off after the grace."""
    n = mig_node
    g0 = n.gpus[0]
    first = Pod("default", "first", [Container("main", 1)])
    n.place(first, "main", 0, mig_plan(PROFILE_1G10, 0, 2, enable=True), 9856)
    n.kubelet.admit(first)
    n.kubelet.start(first, "main")
    waiting = Pod("default", "waiting", [Container("main", 1)])
    n.place(waiting, "main", 0, mig_plan(PROFILE_1G10, 6, 2), 9856)
    n.gone(first)
    assert eventually(lambda: n.instances()[g0]["instances"] == []), n.plugin_log()
    time.sleep(OFF_AFTER * 2)
    assert n.instances()[g0]["enabled"], n.plugin_log()
    resp = n.kubelet.admit(waiting)["main"]
    n.kubelet.start(waiting, "main")
    uuid = resp.envs["CUDA_VISIBLE_DEVICES"]
    assert n.instances()[g0]["instances"] == [[6, 2, uuid, False]]
    n.gone(waiting)
    assert eventually(lambda: not n.instances()[g0]["enabled"]), n.plugin_log()


def test_a_restarted_plugin_still_turns_off_the_mig_mode_it_turned_on(
    mig_node: MigNode,
) -> None:
    """Which GPUs' MIG mode is the plugin's is remembered in its state
    directory; a GPU an operator put in MIG mode is never turned off."""
    n = mig_node
    g0, g1 = n.gpus
    operator = run_py(
        """
        import pynvml as n
        n.nvmlInit()
        n.nvmlDeviceSetMigMode(n.nvmlDeviceGetHandleByIndex(1), n.NVML_DEVICE_MIG_ENABLE)
        """,
        n.sim.env,
    )
    assert operator.returncode == 0, operator.stderr
    pod = Pod("default", "kept", [Container("main", 1)])
    n.place(pod, "main", 0, mig_plan(PROFILE_1G10, 6, 2, enable=True), 9856)
    n.kubelet.admit(pod)
    n.kubelet.start(pod, "main")
    n.kill_plugin()
    assert json.loads((n.sim.dir / "state" / MIG_MODE).read_text()) == [g0]
    n.start_plugin()
    n.kubelet.wait_registered(count=2, timeout=60)
    n.gone(pod)
    assert eventually(lambda: not n.instances()[g0]["enabled"]), n.plugin_log()
    time.sleep(OFF_AFTER * 2)
    assert n.instances()[g1] == {"enabled": True, "instances": []}
    assert f"GPU {g1}: MIG mode turned off" not in n.plugin_log()
