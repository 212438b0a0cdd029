"""The device plugin's pure parts: replica IDs, GetPreferredAllocation's
choice, the allocation annotation reader and the limits file it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pynvml
import pytest
from gpuvisor.cluster.deviceplugin.gpus import Gpu, NvmlGpus
from gpuvisor.cluster.deviceplugin.grant import (
    ContainerGrant,
    GpuGrant,
    GrantError,
    PodGrant,
    parse_grant,
)
from gpuvisor.cluster.deviceplugin.handover import sharing
from gpuvisor.cluster.deviceplugin.limits_file import render
from gpuvisor.cluster.deviceplugin.migdriver import MigDriverError, MigInstance
from gpuvisor.cluster.deviceplugin.migrealise import MigRealiser, MigRefused
from gpuvisor.cluster.deviceplugin.preferred import preferred
from gpuvisor.cluster.deviceplugin.publish import inventory_document
from gpuvisor.cluster.deviceplugin.replicas import Replicas, UnknownDevice

GPUS = tuple(Gpu(f"GPU-0000000{i}-0000-4000-8000-00000000000{i}", i, 16384) for i in range(4))
R = Replicas(GPUS, 4)


def ids(gpu: int, *n: int) -> list[str]:
    return [f"{GPUS[gpu].uuid}-{i}" for i in n]


def grant(*gpus: int, name: str = "c") -> ContainerGrant:
    return ContainerGrant(name, tuple(GpuGrant(GPUS[g].uuid, g, 1000, 0, None) for g in gpus))


def test_replica_ids_map_to_their_gpu() -> None:
    assert len(R.all_ids()) == 16
    assert R.gpu_of(ids(2, 3)[0]) == GPUS[2]
    assert R.physical(ids(3, 0) + ids(1, 2) + ids(3, 1)) == [GPUS[1], GPUS[3]]
    for bad in ["GPU-x-1", f"{GPUS[0].uuid}-4", f"{GPUS[0].uuid}-01", GPUS[0].uuid, "", "-1"]:
        with pytest.raises(UnknownDevice):
            R.gpu_of(bad)


def pod_of(*containers: tuple[str, int, bool]) -> PodGrant:
    """A pod's grant: (name, GPU count, init) per container, manifest order."""
    cs = []
    for name, n, init in containers:
        c = grant(*range(n), name=name)
        cs.append(ContainerGrant(c.name, c.gpus, init))
    return PodGrant("ns/p", "n", tuple(cs))


def test_hand_over_follows_kubelets_reuse_of_init_containers_devices() -> None:
    # init containers first whatever the manifest order; each takes the pool
    chain = pod_of(("main", 1, False), ("fetch", 1, True), ("warm", 1, True))
    assert sharing(chain, "main") == ["fetch", "warm", "main"]
    assert sharing(chain, "warm") == ["fetch", "warm", "main"]
    # the first app container takes the pool; the next one new devices
    two = pod_of(("setup", 1, True), ("a", 1, False), ("b", 1, False))
    assert sharing(two, "a") == ["setup", "a"]
    assert sharing(two, "b") == ["b"]
    # an app container asking more than the pool: pool + new, IDs of its own
    wider = pod_of(("setup", 1, True), ("a", 2, False))
    assert sharing(wider, "a") == ["a"]
    assert sharing(wider, "setup") == ["setup"]
    # a growing pool: the second init container takes the first's and more
    grow = pod_of(("i1", 1, True), ("i2", 2, True), ("main", 2, False))
    assert sharing(grow, "main") == ["i2", "main"]
    # a container with no GPUs is not allocated
    assert sharing(pod_of(("setup", 1, True), ("main", 0, False)), "main") is None


def test_hand_over_is_unknown_when_kubelet_picks_from_a_larger_pool() -> None:
    # kubelet takes an arbitrary one of the pool's two devices for "a"
    pod = pod_of(("setup", 2, True), ("a", 1, False), ("b", 1, False))
    assert sharing(pod, "a") is None
    assert sharing(pod, "setup") is None


def test_preferred_follows_a_bound_placement_of_the_right_size() -> None:
    avail = R.all_ids()
    got, n = preferred(R, avail, [], 2, [grant(0), grant(3, 1)])
    assert n == 1
    assert got == ids(3, 0) + ids(1, 0)
    # a placement whose GPU has no free replica is passed over
    avail = [d for d in avail if not d.startswith(GPUS[3].uuid)]
    got, n = preferred(R, avail, [], 2, [grant(3, 1)])
    assert n is None
    assert len(got) == 2


def test_preferred_spreads_over_the_least_shared_gpus() -> None:
    # GPU 0 has one free replica, GPU 1 two, GPUs 2 and 3 four
    avail = ids(0, 3) + ids(1, 2, 3) + ids(2, 0, 1, 2, 3) + ids(3, 0, 1, 2, 3)
    got, n = preferred(R, avail, [], 3, [])
    assert n is None
    assert got == ids(2, 0) + ids(3, 0) + ids(1, 2)
    # more than the GPUs: more replicas, each ID once
    got, _ = preferred(R, ids(0, 0, 1), [], 2, [])
    assert got == ids(0, 0, 1)


def test_preferred_keeps_must_include() -> None:
    avail = R.all_ids()
    must = ids(1, 2)
    got, n = preferred(R, avail, must, 2, [grant(0, 2), grant(1, 3)])
    assert n == 1  # the placement that contains the must-include GPU
    assert got[0] == must[0]
    assert got[1] == ids(3, 0)[0]
    got, _ = preferred(R, avail, must, 1, [grant(0)])
    assert got == must


def test_preferred_leaves_unknown_ids_to_kubelet() -> None:
    assert preferred(R, ["other-1", "other-2"], [], 1, [grant(0)]) == (["other-1"], None)


DOC = {
    "pod": "ns/p",
    "node": "n1",
    "containers": [
        {
            "name": "main",
            "gpus": [
                {"uuid": GPUS[1].uuid, "index": 1, "memory_mib": 3000, "cores": 30, "mig": None}
            ],
            "sm_policy": "burst-share",
            "priority": 0,
        }
    ],
}


def test_grant_reads_the_allocation_annotation() -> None:
    g = parse_grant(json.dumps(DOC))
    assert g.pod == "ns/p"
    assert g.node == "n1"
    c = g.container("main")
    assert c is not None
    assert c.gpus == (GpuGrant(GPUS[1].uuid, 1, 3000, 30, None),)
    assert (c.sm_policy, c.priority, c.init) == ("burst-share", 0, False)
    assert g.container("other") is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d.pop("pod"),
            "gpuvisor.io/allocation: allocation.pod=null: must be a non-empty",
        ),
        (lambda d: d.update(containers={}), "containers={}: must be a list"),
        (lambda d: d["containers"][0]["gpus"][0].update(cores=101), "cores=101: must be a whole"),
        (lambda d: d["containers"][0]["gpus"][0].update(cores=True), "cores=true"),
        (lambda d: d["containers"][0].update(sm_policy="fair"), 'sm_policy="fair": use fixed'),
        (lambda d: d["containers"][0].update(priority=2), "priority=2: must be a whole number"),
        (lambda d: d["containers"][0].update(init="yes"), 'init="yes": must be true or false'),
        (
            lambda d: d["containers"][0]["gpus"][0].update(mig={"profile": "1g.10gb"}),
            "containers[0].gpus[0].mig.placement: expected an object, got None",
        ),
        (
            lambda d: d["containers"][0]["gpus"][0].update(
                mig={"profile": "1g.10gb", "profile_id": 19, "placement": {"start": 0, "size": 0}}
            ),
            "mig.placement.size: expected an integer >= 1, got 0",
        ),
    ],
)
def test_grant_refuses_what_it_cannot_act_on(change, message) -> None:
    doc = json.loads(json.dumps(DOC))
    change(doc)
    with pytest.raises(GrantError, match=r"^gpuvisor\.io/allocation: ") as err:
        parse_grant(json.dumps(doc))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_grant_refuses_text_that_is_not_json() -> None:
    with pytest.raises(GrantError, match=r"not JSON \(Expecting value at 0\)"):
        parse_grant("nope")


def test_limits_file_text() -> None:
    same = ContainerGrant(
        "m", (GpuGrant(GPUS[2].uuid, 2, 4096, 25, None), GpuGrant(GPUS[0].uuid, 0, 4096, 25, None))
    )
    assert render("ns/p", same, [GPUS[0], GPUS[2]]) == (
        "# gpuvisor device-plugin: pod ns/p, container m\n"
        "CUDA_DEVICE_MEMORY_LIMIT=4096m\nCUDA_DEVICE_SM_LIMIT=25\n"
    )
    differ = ContainerGrant(
        "m",
        (GpuGrant(GPUS[2].uuid, 2, 1000, 0, None), GpuGrant(GPUS[0].uuid, 0, 2000, 50, None)),
        sm_policy="best-effort",
        priority=1,
    )
    # ordinals follow the visible order (GPU 0 first), not the grant's
    assert render("ns/p", differ, [GPUS[0], GPUS[2]]).splitlines()[1:] == [
        "CUDA_DEVICE_MEMORY_LIMIT_0=2000m",
        "CUDA_DEVICE_SM_LIMIT_0=50",
        "CUDA_DEVICE_MEMORY_LIMIT_1=1000m",
        "CUDA_DEVICE_SM_LIMIT_1=0",
        "GPUVISOR_SM_POLICY=best-effort",
        "CUDA_TASK_PRIORITY=1",
    ]
    with pytest.raises(GrantError, match="kubelet gave it GPUs"):
        render("ns/p", same, [GPUS[0]])


def test_limits_file_of_a_mig_instance() -> None:
    """On its MIG device a container gets the instance's memory and no SM
    limit (the instance's SMs are its own), beside a shared GPU's limits."""
    doc = json.loads(json.dumps(DOC))
    doc["containers"][0]["gpus"] = [
        {
            "uuid": GPUS[0].uuid,
            "index": 0,
            "memory_mib": 9856,
            "cores": 15,
            "mig": {"profile": "1g.10gb", "profile_id": 15, "placement": {"start": 2, "size": 2}},
        },
        {"uuid": GPUS[1].uuid, "index": 1, "memory_mib": 3000, "cores": 30, "mig": None},
    ]
    c = parse_grant(json.dumps(doc)).container("main")
    assert c is not None
    mig = c.gpus[0].mig
    assert mig is not None
    assert (mig.profile_id, mig.placement.start, mig.placement.size) == (15, 2, 2)
    assert (mig.instance, mig.destroy, mig.enable) == (None, (), False)
    assert render("ns/p", c, [GPUS[0], GPUS[1]]).splitlines()[1:5] == [
        "CUDA_DEVICE_MEMORY_LIMIT_0=9856m",
        "CUDA_DEVICE_SM_LIMIT_0=0",
        "CUDA_DEVICE_MEMORY_LIMIT_1=3000m",
        "CUDA_DEVICE_SM_LIMIT_1=30",
    ]


def test_the_command_line_does_not_load_grpc() -> None:
    """`gpuvisor run` starts every container: registering device-plugin in
    the same command group must not make it load gRPC, NVML or the
    Kubernetes client."""
    code = (
        "import sys, gpuvisor.supervisor.cli\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('grpc', 'pynvml', 'kubernetes', 'google')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert proc.stdout.strip() == "[]"


# -- MIG mode off again (MigRealiser.idle / settle), on an in-memory driver --------------------
class FakeMig:
    """MigDriver in memory: MIG mode, instances (gi_id -> placement), processes."""

    def __init__(self, *gpus: str) -> None:
        self.on = dict.fromkeys(gpus, False)
        self.made: dict[str, dict[int, tuple[int, int]]] = {g: {} for g in gpus}
        self.busy_gpus: set[str] = set()
        self.refuse_off: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def enabled(self, gpu: str) -> bool:
        return self.on[gpu]

    def busy(self, gpu: str) -> bool:
        return gpu in self.busy_gpus

    def enable(self, gpu: str) -> None:
        self.calls.append(("enable", gpu))
        self.on[gpu] = True

    def disable(self, gpu: str) -> None:
        self.calls.append(("disable", gpu))
        if gpu in self.refuse_off or self.made[gpu]:
            raise MigDriverError(f"GPU {gpu}: nvmlDeviceSetMigMode(disable): In use")
        self.on[gpu] = False

    def instances(self, gpu: str) -> list[MigInstance]:
        return [
            MigInstance(gpu, gi, 15, start, size, f"MIG-{gpu}-{gi}", 9856, False)
            for gi, (start, size) in sorted(self.made[gpu].items())
        ]

    def create(self, gpu: str, profile_id: int, start: int, size: int) -> MigInstance:
        gi = len(self.made[gpu]) + 1
        self.made[gpu][gi] = (start, size)
        return next(i for i in self.instances(gpu) if i.gi_id == gi)

    def destroy(self, gpu: str, gi_id: int) -> None:
        del self.made[gpu][gi_id]


def mig_grant(gpu: str, start: int, enable: bool) -> list[GpuGrant]:
    plan = {
        "profile": "1g.10gb",
        "profile_id": 15,
        "placement": {"start": start, "size": 2},
        "instance": None,
        "destroy": [],
        "enable_mig_mode": enable,
    }
    doc = {
        "pod": "ns/p",
        "node": "n",
        "containers": [
            {
                "name": "c",
                "gpus": [{"uuid": gpu, "index": 0, "memory_mib": 9856, "cores": 15, "mig": plan}],
            }
        ],
    }
    return list(parse_grant(json.dumps(doc)).containers[0].gpus)


def test_mig_mode_goes_off_after_the_wait_only_on_the_plugins_gpus(tmp_path) -> None:
    d = FakeMig("GPU-a", "GPU-b")
    d.on["GPU-b"] = True  # an operator's
    changes: list[int] = []
    m = MigRealiser(
        d, lambda: changes.append(1), tmp_path / "mine", tmp_path / "mode", off_after=10.0
    )
    (made,) = m.realise("p", mig_grant("GPU-a", 0, True), set())
    assert json.loads((tmp_path / "mode").read_text()) == ["GPU-a"]
    assert m.idle() == []  # an instance on it
    m.release("p", [made], set())
    assert m.idle() == ["GPU-a"]
    assert m.settle(set(), 100.0) == []  # the wait starts
    assert m.settle({"GPU-a"}, 105.0) == []  # a bound pod plans a MIG grant on it
    assert m.settle(set(), 106.0) == []  # the wait starts over
    assert m.settle(set(), 115.9) == []
    n = len(changes)
    assert m.settle(set(), 116.0) == ["GPU-a"]
    assert (d.on, len(changes)) == ({"GPU-a": False, "GPU-b": True}, n + 1)
    assert m.settle(set(), 1000.0) == []  # the operator's GPU stays in MIG mode


def test_mig_mode_wait_starts_over_when_the_gpu_was_used(tmp_path) -> None:
    d = FakeMig("GPU-a")
    m = MigRealiser(d, mode=tmp_path / "mode", off_after=10.0)
    m.realise("p", mig_grant("GPU-a", 0, True), set())
    d.made["GPU-a"].clear()
    assert m.settle(set(), 0.0) == []  # idle since 0
    (made,) = m.realise("q", mig_grant("GPU-a", 2, False), set())  # used again
    assert m.idle() == []
    m.release("q", [made], set())
    assert m.settle(set(), 50.0) == []  # idle since 50, not 0
    d.busy_gpus.add("GPU-a")  # a process: never off
    assert m.settle(set(), 70.0) == []
    d.busy_gpus.clear()
    assert m.settle(set(), 71.0) == []
    assert m.settle(set(), 81.0) == ["GPU-a"]


def test_a_plan_counting_on_mig_mode_turns_it_on_again_only_on_the_plugins_gpus(
    tmp_path,
) -> None:
    d = FakeMig("GPU-a", "GPU-b")
    m = MigRealiser(d, mode=tmp_path / "mode", off_after=0.0, manage=["GPU-a"])
    assert json.loads((tmp_path / "mode").read_text()) == ["GPU-a"]
    (made,) = m.realise("p", mig_grant("GPU-a", 0, False), set())
    assert d.on["GPU-a"]
    assert made.created
    with pytest.raises(MigRefused, match="MIG mode is off and the plan does not turn it on"):
        m.realise("q", mig_grant("GPU-b", 0, False), set())
    d.busy_gpus.add("GPU-a")
    d.on["GPU-a"] = False
    d.made["GPU-a"].clear()
    with pytest.raises(MigRefused, match="work is running on it"):
        m.realise("r", mig_grant("GPU-a", 0, False), set())
    # remembered: a new realiser (a plugin restart) manages the same GPUs
    assert MigRealiser(d, mode=tmp_path / "mode").modes() == {"GPU-a"}


def test_mig_mode_that_cannot_go_off_is_tried_once(tmp_path, caplog) -> None:
    d = FakeMig("GPU-a")
    m = MigRealiser(d, mode=tmp_path / "mode", off_after=0.0)
    m.realise("p", mig_grant("GPU-a", 0, True), set())
    d.made["GPU-a"].clear()
    d.refuse_off.add("GPU-a")
    assert m.settle(set(), 1.0) == []
    assert m.settle(set(), 2.0) == []
    assert m.idle() == []
    assert d.calls.count(("disable", "GPU-a")) == 1
    assert "MIG mode left on" in caplog.text
    # turned on again by a plan: tried again once idle
    d.refuse_off.clear()
    d.on["GPU-a"] = False
    (made,) = m.realise("q", mig_grant("GPU-a", 0, True), set())
    m.release("q", [made], set())
    assert m.settle(set(), 3.0) == ["GPU-a"]


def test_mig_mode_never_goes_off_without_a_wait(tmp_path) -> None:
    d = FakeMig("GPU-a")
    m = MigRealiser(d, mode=tmp_path / "mode", off_after=None)
    m.realise("p", mig_grant("GPU-a", 0, True), set())
    d.made["GPU-a"].clear()
    assert m.idle() == []
    assert m.settle(set(), 1e9) == []
    assert d.on["GPU-a"]


def test_a_gpu_without_a_numa_node_gets_no_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML's -1 for "no NUMA node" (an H200 in a VM) is not a node: kubelet
    gets no topology for the GPU's devices, and the published inventory says
    -1, as docs/inventory.md has it (before: NUMA node -1 to kubelet, and 0
    published)."""
    mem = pynvml.c_nvmlMemory_t()
    mem.total = 16 << 30
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNumaNodeId", lambda h: -1)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: mem)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: f"GPU-{h}")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: "NVIDIA H200")
    gpu = NvmlGpus._read(0)
    assert gpu.numa_node is None
    assert inventory_document("n", [gpu], {})["gpus"][0]["numa"] == -1
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNumaNodeId", lambda h: 1)
    assert NvmlGpus._read(0).numa_node == 1
