"""The allocator's rules, table by table (docs/placement.md), and `gpuvisor place`."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from gpuvisor.cluster.allocation import load_allocation
from gpuvisor.cluster.allocator import Allocator, Config, Conflict
from gpuvisor.cluster.inventory_model import DocumentError, load_inventory
from gpuvisor.cluster.mig import load_geometries
from gpuvisor.cluster.request import pod_request
from gpuvisor.cluster.room import (
    extinct,
    group_room,
    may_extinct,
    mig_room,
    near_last,
    supply_seen,
)
from gpuvisor.supervisor.cli import main

from tests.inventories import (
    A100_80GB_PROFILES,
    cluster,
    ctr,
    dgx,
    four_and_mig,
    gpu,
    inventory,
    links_pcie,
    mig_box,
    mig_state,
    pairs_box,
    pcie_box,
    pod,
)

BINPACK = {"hami.io/gpu-scheduler-policy": "binpack"}
SPREAD = {"hami.io/gpu-scheduler-policy": "spread"}
MIG = {"nvidia.com/vgpu-mode": "mig"}


def place(alloc: Allocator, name: str, *containers, annotations=None, init=None):
    return alloc.place(
        pod_request(pod(name, *containers, annotations=annotations, init=init)), True
    )


def indices(d, container=0):
    assert d.allocation is not None, d.reasons
    return [g.index for g in d.allocation.containers[container].gpus]


# -- topology: the three cases on an NVLink-pair box, and the other boxes -------------
@pytest.mark.parametrize(
    ("taken", "count", "annotations", "expected", "tier"),
    [
        ([], 2, {}, [0, 1], "NVLink"),  # 2 GPUs -> an NVLink pair
        ([], 4, {}, [0, 1, 2, 3], "same PCIe switch"),  # 4 -> one switch's two pairs
        ([0], 1, BINPACK, [1], "one GPU"),  # binpack, GPU 0 taken -> its partner
        ([0, 2], 2, {}, [4, 5], "NVLink"),  # broken pairs are skipped for a pair
        ([0], 2, BINPACK, [2, 3], "NVLink"),
        ([0, 1, 2, 3], 4, {}, [4, 5, 6, 7], "same PCIe switch"),
        ([0], 4, {}, [4, 5, 6, 7], "same PCIe switch"),
        ([1, 3], 1, BINPACK, [0], "one GPU"),
        ([], 8, {}, list(range(8)), "across sockets"),
    ],
)
def test_pairs_box_topology(taken, count, annotations, expected, tier):
    a = Allocator.from_cluster(cluster(pairs_box("p")))
    for i in taken:
        place(a, f"t{i}", ctr(gpu=1), annotations={"nvidia.com/use-gpuuuid": f"GPU-p-{i}"})
    d = place(a, "x", ctr(gpu=count), annotations=annotations)
    assert sorted(indices(d)) == expected
    assert d.score["gpu_sets"][0]["tier"] == tier


def test_nvswitch_and_pcie_boxes():
    a = Allocator.from_cluster(cluster(dgx("d")))
    d = place(a, "x", ctr(gpu=4))
    assert d.score["gpu_sets"][0]["tier"] == "NVLink"
    b = Allocator.from_cluster(cluster(pcie_box("c")))
    d = place(b, "y", ctr(gpu=2))
    assert d.score["gpu_sets"][0]["tier"] == "same PCIe switch"
    assert all(i < 4 for i in indices(d)) or all(i >= 4 for i in indices(d))


def test_multi_gpu_gets_best_tier_under_spread_too():
    a = Allocator.from_cluster(cluster(pairs_box("p")))
    place(a, "f", ctr(gpu=1, gpumem=1000, gpucores=10), annotations=SPREAD)
    d = place(a, "x", ctr(gpu=2), annotations=SPREAD)
    assert d.score["gpu_sets"][0]["tier"] == "NVLink"


# -- GPU and node policies ---------------------------------------------------------------
@pytest.mark.parametrize(("annotations", "expected"), [(BINPACK, 0), (SPREAD, 1)])
def test_gpu_policy(annotations, expected):
    doc = inventory("n", [gpu("n", 0, "L4", 24000), gpu("n", 1, "L4", 24000)], links_pcie(2))
    a = Allocator.from_cluster(cluster(doc))
    place(a, "first", ctr(gpu=1, gpumem=4000, gpucores=10), annotations=BINPACK)
    d = place(a, "second", ctr(gpu=1, gpumem=4000, gpucores=10), annotations=annotations)
    assert indices(d) == [expected]


@pytest.mark.parametrize(("policy", "expected"), [("binpack", "busy"), ("spread", "empty")])
def test_node_policy(policy, expected):
    a = Allocator.from_cluster(cluster(pcie_box("busy", 2), pcie_box("empty", 2)))
    place(
        a,
        "x",
        ctr(gpu=1, gpumem=4000, gpucores=10),
        annotations={"nvidia.com/use-gpuuuid": "GPU-busy-0"},
    )
    d = place(
        a,
        "y",
        ctr(gpu=1, gpumem=4000, gpucores=10),
        annotations={"hami.io/node-scheduler-policy": policy},
    )
    assert d.node == expected


def small() -> dict[str, Any]:
    """The benchmark's small cluster: the only 4-GPU box, and the only MIG box."""
    return four_and_mig("four", "mig")


def test_room_counts_by_hand():
    inv = load_inventory(pairs_box("p"))
    # 8-GPU box, NVLink pairs (0,1)...(6,7), switches {0-3} and {4-7}: groups of 8, 4, 2
    assert group_room(inv.links, 0xFF) == (1, 2, 4)
    assert group_room(inv.links, 0xFE) == (0, 1, 3)  # GPU 0 taken
    assert group_room(inv.links, 0b10101010) == (0, 0, 0)  # every pair broken
    mig = load_inventory(small()["nodes"]["mig"]).gpus[0].mig
    assert mig is not None
    # idle A100-40GB: one 7g, two 3g, four 1g.10gb, seven 1g.5gb
    assert mig_room(mig, 0) == (1, 2, 4, 7)
    # a 1g.5gb at slice 6 leaves 3g at 0, 1g.10gb at 0, 2, 4, 1g.5gb at 0-5
    assert mig_room(mig, 1 << 6) == (0, 1, 3, 6)
    assert extinct((0, 1, 0), (0, 1, 5)) == 1
    assert extinct((0, 1, 1), (3, 2, 5)) == 0


def test_a_kind_the_cluster_has_no_place_for_is_not_near_its_last_place():
    # supply: groups of 8, 4, 2, MIG instances of 1/1, 1/2, 1/4, 1/8, single GPUs
    no_mig = (10, 20, 40, 0, 0, 0, 0, 80)
    assert may_extinct(no_mig, 1)  # what plan_node's rules read: as before
    assert not near_last(no_mig, 1)
    assert near_last((10, 20, 40, 0, 0, 0, 0, 1), 1)  # the last single GPU
    assert near_last((1, 20, 40, 0, 0, 0, 0, 80), 1)  # the last group of 8
    # what a kept plan depends on: which kinds have no place, not how many
    # places the others have, unless one is near its last
    assert supply_seen(no_mig, 1) == supply_seen((9, 19, 38, 0, 0, 0, 0, 75), 1)
    assert supply_seen(no_mig, 1) != supply_seen((10, 20, 40, 1, 2, 4, 8, 80), 1)
    assert supply_seen((1, 20, 40, 0, 0, 0, 0, 80), 1) == (1, 20, 40, 0, 0, 0, 0, 80)


def test_plans_are_kept_across_binds_on_a_cluster_without_mig(monkeypatch):
    """A pod after pod of one shape: only the node the last commit changed
    is planned again.  The MIG kinds (no place for them on this cluster)
    made every plan depend on the cluster's supply, which every commit
    changes, so no plan was kept (make bench-cluster)."""
    import gpuvisor.cluster.allocator as allocator

    a = Allocator.from_cluster(cluster(*(pcie_box(f"n{i}") for i in range(20))))
    planned: list[str] = []
    real = allocator.plan_node

    def counting(node, *args, **kw):
        planned.append(node.inv.node)
        return real(node, *args, **kw)

    monkeypatch.setattr(allocator, "plan_node", counting)
    first = place(a, "p0", ctr(gpu=1, gpumem=1000, gpucores=10))
    assert len(planned) > 1  # the finalists, planned once
    for i in range(1, 6):
        planned.clear()
        d = place(a, f"p{i}", ctr(gpu=1, gpumem=1000, gpucores=10))
        assert d.node == first.node  # binpack
        assert planned == [first.node]


def test_binpack_never_takes_the_last_place_of_a_kind_of_request():
    a = Allocator.from_cluster(small())
    # a fraction that must start an idle GPU: the 4-GPU box is the only home of
    # a 4-GPU job, the MIG box has two MIG-capable GPUs: it opens one of those
    d = place(a, "frac", ctr(gpu=1, gpumem=6000, gpucores=20))
    assert d.node == "mig"
    assert mig_grant(d) is None
    # the last idle MIG-capable GPU is the last home of MIG requests now, the
    # 4-GPU box that of 4-GPU jobs: both are last places, so the old rule
    # (spare the MIG GPU) decides
    d = place(a, "whole", ctr(gpu=1))
    assert d.node == "four"
    d = place(a, "mig", ctr(gpu=1, gpumem=9000), annotations=MIG)
    assert (d.node, mig_grant(d).profile) == ("mig", "1g.10gb")
    # with a 4-GPU job waiting instead, it fits: the same opening keeps it placeable
    b = Allocator.from_cluster(small())
    place(b, "frac", ctr(gpu=1, gpumem=6000, gpucores=20))
    assert sorted(indices(place(b, "job", ctr(gpu=4)))) == [0, 1, 2, 3]
    # spread does not spare anything: the least used node
    c = Allocator.from_cluster(small())
    d = place(
        c,
        "frac",
        ctr(gpu=1, gpumem=6000, gpucores=20),
        annotations={"hami.io/node-scheduler-policy": "spread"},
    )
    assert d.node == "four"


# -- fit: slots, memory, cores, health, type and UUID filters --------------------------------
def small_node(**kw):
    return cluster(inventory("n", [gpu("n", 0, "NVIDIA A100-SXM4-40GB", 40960, **kw)], [["X"]]))


@pytest.mark.parametrize(
    ("containers", "annotations", "reason"),
    [
        (
            [ctr(gpu=1, gpumem=50000)],
            {},
            "container main: needs 1 GPU with 50000 MiB free, has 0 (40960 MiB free)",
        ),
        ([ctr(gpu=2)], {}, "container main: needs 2 idle GPUs, has 1"),
        (
            [ctr(gpu=1)],
            {"nvidia.com/nouse-gputype": "a100"},
            "GPU type NVIDIA A100-SXM4-40GB excluded by nvidia.com/nouse-gputype",
        ),
        (
            [ctr(gpu=1)],
            {"nvidia.com/use-gputype": "H100"},
            "GPU type NVIDIA A100-SXM4-40GB not in nvidia.com/use-gputype",
        ),
        (
            [ctr(gpu=1)],
            {"nvidia.com/nouse-gpuuuid": "GPU-n-0"},
            "GPU GPU-n-0 excluded by nvidia.com/nouse-gpuuuid",
        ),
        (
            [ctr(gpu=1)],
            {"nvidia.com/use-gpuuuid": "GPU-x"},
            "GPU GPU-n-0 not in nvidia.com/use-gpuuuid",
        ),
        (
            [ctr(gpu=1)],
            MIG,
            "GPU 0 (NVIDIA A100-SXM4-40GB) cannot do MIG (nvidia.com/vgpu-mode: mig)",
        ),
    ],
)
def test_rejection_reasons(containers, annotations, reason):
    a = Allocator.from_cluster(small_node())
    d = place(a, "x", *containers, annotations=annotations)
    assert d.node is None
    assert d.reasons == {"n": reason}


def test_unhealthy_gpu_is_never_chosen():
    a = Allocator.from_cluster(small_node(healthy=False))
    assert place(a, "x", ctr(gpu=1, gpumem=100)).reasons == {"n": "GPU 0 unhealthy"}


@pytest.mark.parametrize(
    ("first", "second", "fits"),
    [
        (ctr(gpu=1), ctr(gpu=1, gpumem=100), False),  # a count alone is exclusive
        (ctr(gpu=1, gpumem=1000), ctr(gpu=1), False),  # exclusive needs an idle GPU
        (
            ctr(gpu=1, gpumem=1000, gpucores=100),
            ctr(gpu=1, gpumem=1000),
            False,
        ),  # 0 cores, none free
        (ctr(gpu=1, gpumem=1000, gpucores=60), ctr(gpu=1, gpumem=1000, gpucores=40), True),
        (ctr(gpu=1, gpumem=1000, gpucores=60), ctr(gpu=1, gpumem=1000, gpucores=41), False),
        (ctr(gpu=1, gpumem=30000), ctr(gpu=1, gpumem=10960), True),
        (ctr(gpu=1, gpumem=30000), ctr(gpu=1, gpumem=10961), False),
        (ctr(gpu=1, gpumem_percentage=50), ctr(gpu=1, gpumem=20480), True),
        (ctr(gpu=1, gpumem_percentage=50), ctr(gpu=1, gpumem_percentage=51), False),
    ],
)
def test_fit_on_one_gpu(first, second, fits):
    a = Allocator.from_cluster(small_node())
    assert place(a, "a", first).node == "n"
    assert (place(a, "b", second).node == "n") is fits


def test_split_count_caps_vgpus_per_gpu():
    a = Allocator.from_cluster(small_node(), Config(split_count=3))
    for i in range(3):
        assert place(a, f"p{i}", ctr(gpu=1, gpumem=100, gpucores=1)).node == "n"
    assert place(a, "p3", ctr(gpu=1, gpumem=100, gpucores=1)).node is None


def test_defaults_as_hami():
    r = pod_request(pod("x", ctr(gpumem=1000)))
    c = r.containers[0]
    assert (c.count, c.memory_mib, c.cores) == (1, 1000, 0)  # gpumem alone: one GPU
    c = pod_request(pod("x", ctr(gpu=2))).containers[0]
    assert (c.count, c.memory_pct, c.cores, c.exclusive) == (2, 100, 100, True)


def test_init_containers_counted_as_kubernetes_does():
    # the init container runs alone: the pod holds max(init, sum of app), not the sum
    a = Allocator.from_cluster(small_node())
    d = place(
        a,
        "x",
        ctr("app", gpu=1, gpumem=20000, gpucores=20),
        init=[ctr("init", gpu=1, gpumem=30000, gpucores=50)],
    )
    assert d.node == "n"
    assert [c.init for c in d.allocation.containers] == [True, False]
    st = a.nodes["n"]
    assert (st.slots[0], st.mem[0], st.cores[0]) == (1, 30000, 50)
    assert place(a, "y", ctr(gpu=1, gpumem=10960, gpucores=50)).node == "n"
    assert place(a, "z", ctr(gpu=1, gpumem=1, gpucores=1)).node is None


def test_sm_policy_is_passed_through():
    for key in ("gpuvisor.io/sm-policy", "metax-tech.com/sgpu-qos-policy"):
        a = Allocator.from_cluster(small_node())
        d = place(a, "x", ctr(gpu=1, gpumem=100, priority=1), annotations={key: "burst-share"})
        c = d.allocation.containers[0]
        assert (c.sm_policy, c.priority) == ("burst-share", 1)


# -- MIG ---------------------------------------------------------------------------------
def mig_grant(d):
    g = d.allocation.containers[0].gpus[0]
    return g.mig


@pytest.mark.parametrize(
    ("memory", "profile", "start"),
    [
        (9000, "1g.10gb", 6),  # least waste; slice 6 keeps every 2g, 3g@0 and 4g free
        (18000, "1g.20gb", 6),  # waste as 2g.20gb; at slice 6 it leaves every 2g placement
        (38000, "3g.40gb", 4),  # the 3g that leaves 4g.40gb possible
        (60000, "7g.80gb", 0),
    ],
)
def test_mig_least_waste_most_room(memory, profile, start):
    a = Allocator.from_cluster(cluster(mig_box("m")))
    g = mig_grant(place(a, "x", ctr(gpu=1, gpumem=memory), annotations=MIG))
    assert (g.profile, g.placement.start, g.instance) == (profile, start, None)


def test_mig_never_touches_an_instance_in_use():
    a = Allocator.from_cluster(cluster(mig_box("m", instances=[("3g.40gb", 4, True)])))
    g = mig_grant(place(a, "x", ctr(gpu=1, gpumem=38000), annotations=MIG))
    assert (g.profile, g.placement.start) == ("3g.40gb", 0)
    assert place(a, "y", ctr(gpu=1, gpumem=1000), annotations=MIG).node is None


def test_mig_reuses_an_idle_instance_and_destroys_only_on_an_idle_gpu():
    inst = [("1g.10gb", 0, False)]
    a = Allocator.from_cluster(cluster(mig_box("m", instances=inst)))
    g = mig_grant(place(a, "x", ctr(gpu=1, gpumem=9000), annotations=MIG))
    assert g.instance == "MIG-m-0-1-1g.10gb"
    assert g.placement.start == 0
    # idle GPU: a 7g needs slice 0, so the idle 1g goes
    b = Allocator.from_cluster(cluster(mig_box("m", instances=inst)))
    g = mig_grant(place(b, "x", ctr(gpu=1, gpumem=60000), annotations=MIG))
    assert (g.profile, g.destroy) == ("7g.80gb", ("MIG-m-0-1-1g.10gb",))
    # busy GPU (another instance in use): the idle 1g stays and blocks the 7g
    c = Allocator.from_cluster(
        cluster(mig_box("m", instances=[("1g.10gb", 0, False), ("1g.10gb", 6, True)]))
    )
    assert place(c, "x", ctr(gpu=1, gpumem=60000), annotations=MIG).node is None


def test_mig_never_reuses_an_instance_whose_slices_are_granted():
    # an allocation made before the device plugin created its instance holds slice 0
    doc = cluster(mig_box("m", instances=[("1g.10gb", 0, False), ("1g.10gb", 6, True)]))
    first: dict[str, Any] = {
        "pod": "default/a",
        "containers": [
            {
                "name": "c",
                "gpus": [
                    {
                        "uuid": "GPU-m-0",
                        "index": 0,
                        "memory_mib": 9728,
                        "cores": 15,
                        "mig": {
                            "profile": "1g.10gb",
                            "profile_id": 19,
                            "placement": {"start": 0, "size": 1},
                            "instance": None,
                        },
                    }
                ],
            }
        ],
    }
    doc["nodes"]["m"]["allocations"] = [first]
    a = Allocator.from_cluster(doc)
    g = mig_grant(place(a, "x", ctr(gpu=1, gpumem=9000), annotations=MIG))
    assert g.instance is None
    assert g.placement.start not in (0, 6)
    first["containers"][0]["gpus"][0]["mig"]["placement"] = {"start": 1, "size": 2}
    with pytest.raises(DocumentError, match=r"gpus\[0\]\.mig: not a legal placement"):
        Allocator.from_cluster(doc)


def test_mig_mode_turned_on_only_on_an_idle_gpu():
    a = Allocator.from_cluster(cluster(mig_box("m", enabled=False)))
    place(a, "shared", ctr(gpu=1, gpumem=1000, gpucores=10))
    assert place(a, "x", ctr(gpu=1, gpumem=9000), annotations=MIG).node is None
    b = Allocator.from_cluster(cluster(mig_box("m", enabled=False)))
    g = mig_grant(place(b, "x", ctr(gpu=1, gpumem=9000), annotations=MIG))
    assert g.enable
    assert g.profile == "1g.10gb"
    # now in MIG mode: no shared grants on it
    assert (
        place(
            b, "y", ctr(gpu=1, gpumem=1000), annotations={"nvidia.com/vgpu-mode": "hami-core"}
        ).node
        is None
    )


def test_mig_reconfiguration_goes_with_the_init_container_made_first():
    """The app containers are planned first, but kubelet starts (and the
    device plugin realises) the init containers first: MIG mode is turned
    on, and idle instances destroyed, by the first grant on the GPU."""
    a = Allocator.from_cluster(cluster(mig_box("m", enabled=False)))
    d = place(
        a,
        "x",
        ctr("main", gpu=1, gpumem=8000),
        annotations=MIG,
        init=[ctr("setup", gpu=1, gpumem=4000)],
    )
    setup, main = d.allocation.containers
    assert (setup.name, main.name) == ("setup", "main")
    assert setup.gpus[0].mig.enable
    assert not main.gpus[0].mig.enable
    # a GPU full of idle 1g.10gb instances: the app container's 3g.40gb
    # needs three destroyed, the init container reuses another
    idle = [("1g.10gb", i, False) for i in range(7)]
    b = Allocator.from_cluster(cluster(mig_box("m", instances=idle)))
    d = place(
        b,
        "y",
        ctr("main", gpu=1, gpumem=40000),
        annotations=MIG,
        init=[ctr("setup", gpu=1, gpumem=4000)],
    )
    setup, main = (c.gpus[0].mig for c in d.allocation.containers)
    assert (main.profile, main.instance, main.destroy) == ("3g.40gb", None, ())
    assert setup.instance is not None
    assert len(setup.destroy) == 3
    assert setup.instance not in setup.destroy


def test_no_vgpu_mode_takes_shared_or_mig_whichever_fits():
    doc = inventory("n", [gpu("n", 0, "L4", 24000)], [["X"]])
    a = Allocator.from_cluster(cluster(doc, mig_box("m")))
    d = place(a, "x", ctr(gpu=1, gpumem=9000, gpucores=10))
    assert d.node == "n"
    assert mig_grant(d) is None
    d = place(a, "y", ctr(gpu=1, gpumem=19000, gpucores=10))
    assert d.node == "m"
    assert mig_grant(d).profile == "1g.20gb"


def test_no_vgpu_mode_shares_a_gpu_before_taking_a_mig_instance():
    """MIG instances are the only home of vgpu-mode: mig pods: near the last
    places, a pod that may share a GPU takes one only when no node can share,
    even when sharing opens an idle GPU and the instance would go to a GPU
    already in MIG use (here no choice takes the last place of a kind)."""
    doc = inventory("n", [gpu("n", i, "L4", 24000) for i in range(3)], links_pcie(3))
    a = Allocator.from_cluster(cluster(doc, mig_box("m", n=2)))
    d = place(a, "mig", ctr(gpu=1, gpumem=9000), annotations=MIG)
    assert d.node == "m"
    d = place(a, "x", ctr(gpu=1, gpumem=9000, gpucores=10))
    assert d.node == "n"
    assert mig_grant(d) is None
    # on one node, the same: GPU 0 in MIG mode with an instance in use, GPU 1 shares
    a100 = gpu("h", 0, "NVIDIA A100-SXM4-80GB", 81920, 0, mig_state(A100_80GB_PROFILES, True))
    both = inventory("h", [a100, gpu("h", 1, "L4", 24000)], links_pcie(2))
    b = Allocator.from_cluster(cluster(both, *(pcie_box(f"p{i}") for i in range(4))))
    assert indices(place(b, "mig", ctr(gpu=1, gpumem=9000), annotations=MIG)) == [0]
    d = place(b, "y", ctr(gpu=1, gpumem=9000, gpucores=10))
    assert (d.node, indices(d), mig_grant(d)) == ("h", [1], None)


def near_last_with_mig_half_free(wholes: int) -> Allocator:
    """The small cluster near its last places: MIG box GPU 0 in MIG mode with
    a 1g.10gb at slice 6 and a 2g.10gb at 4 (slices 0-3 free: its last half),
    GPU 1 idle; `wholes` whole-GPU pods on the 4-GPU box (then the MIG box)."""
    a = Allocator.from_cluster(small())
    place(a, "mig", ctr(gpu=1, gpumem=9000), annotations=MIG)
    assert mig_grant(place(a, "frac", ctr(gpu=1, gpumem=1000, gpucores=20))).placement.start == 4
    for i in range(wholes):
        assert place(a, f"whole{i}", ctr(gpu=1)).node == ("four" if i < 4 else "mig")
    return a


@pytest.mark.parametrize(
    ("wholes", "memory", "cores", "expected"),
    [
        # a half-GPU instance (4g.20gb) only for the cores: shared on the 4-GPU box
        (2, 6000, 50, ("four", [2], None)),
        (2, 1000, 50, ("four", [2], None)),
        # quarter-sized (2g.10gb for 20 % cores): the rule does not apply
        (2, 6000, 20, ("mig", [0], "2g.10gb")),
        # the memory alone needs a half: 4g.20gb for 50 % cores, 3g.20gb for 10 %
        (2, 12000, 50, ("mig", [0], "4g.20gb")),
        (2, 19000, 10, ("mig", [0], "3g.20gb")),
        # the 4-GPU box full: the MIG box's idle GPU can still share it
        (4, 6000, 50, ("mig", [1], None)),
        # no GPU can share: the half instance it is
        (5, 6000, 50, ("mig", [0], "4g.20gb")),
    ],
)
def test_no_vgpu_mode_takes_no_half_gpu_instance_only_for_its_cores(
    wholes, memory, cores, expected
):
    """Near the last places, a pod without vgpu-mode takes a MIG instance of
    half the GPU or more that only its cores ask for (a smaller profile
    holds its memory) only when no GPU can share with it, before the
    last-place rule: the half is the last home of 19000 MiB MIG requests."""
    a = near_last_with_mig_half_free(wholes)
    d = place(a, "x", ctr(gpu=1, gpumem=memory, gpucores=cores))
    g = mig_grant(d)
    assert (d.node, indices(d), g.profile if g else None) == expected


def test_a_half_gpu_instance_for_cores_on_a_cluster_with_room_to_spare():
    """Far from the last places the rule is skipped: a fraction fills a MIG-mode GPU."""
    a = Allocator.from_cluster(
        cluster(mig_box("m", n=8, enabled=True), *(pcie_box(f"p{i}") for i in range(4)))
    )
    place(a, "mig", ctr(gpu=1, gpumem=9000), annotations=MIG)
    d = place(a, "x", ctr(gpu=1, gpumem=6000, gpucores=50))
    assert (d.node, indices(d), mig_grant(d).profile) == ("m", [0], "4g.40gb")


HAMI_YAML = """
nvidia:
  resourceCountName: nvidia.com/gpu
  deviceSplitCount: 10
  knownMigGeometries:
  - models: [ "A100-SXM4-80GB", "A100-80GB-PCIe" ]
    allowedGeometries:
      -
        - name: 1g.10gb
          memory: 10240
          count: 7
      -
        - name: 2g.20gb
          memory: 20480
          count: 3
        - name: 1g.10gb
          memory: 10240
          count: 1
"""

VOLCANO_YAML = """
knownMigGeometries:
- models: [ "A100-SXM4-80GB" ]
  allowedGeometries:
    - group: group1
      geometries:
      - name: 1g.10gb
        memory: 10240
        count: 7
"""


def test_known_mig_geometries_restrict_the_mix():
    rules = load_geometries(yaml.safe_load(HAMI_YAML))
    a = Allocator.from_cluster(cluster(mig_box("m")), Config(geometries=rules))
    assert mig_grant(place(a, "x", ctr(gpu=1, gpumem=18000), annotations=MIG)).profile == "2g.20gb"
    assert place(a, "y", ctr(gpu=1, gpumem=38000), annotations=MIG).node is None  # no 3g allowed
    for i in range(3):  # 2 more 2g + one 1g fit the second geometry
        assert place(a, f"z{i}", ctr(gpu=1, gpumem=9000 if i == 2 else 18000), annotations=MIG).node
    assert place(a, "w", ctr(gpu=1, gpumem=9000), annotations=MIG).node is None
    v = load_geometries(yaml.safe_load(VOLCANO_YAML))
    b = Allocator.from_cluster(cluster(mig_box("m")), Config(geometries=v))
    assert place(b, "x", ctr(gpu=1, gpumem=18000), annotations=MIG).node is None


# -- reservations and concurrency ------------------------------------------------------------
def test_back_to_back_decisions_never_overcommit():
    a = Allocator.from_cluster(cluster(pcie_box("a", 1), pcie_box("b", 1)))
    first = a.decide(pod_request(pod("x", ctr(gpu=1))))
    second = a.decide(pod_request(pod("y", ctr(gpu=1))))
    assert first.node == second.node  # both decided on the same state
    a.commit(first)
    with pytest.raises(Conflict):
        a.commit(second)
    d = a.place(pod_request(pod("y", ctr(gpu=1))))
    assert d.node != first.node


def test_threads_placing_at_once_never_overcommit():
    a = Allocator.from_cluster(cluster(*(pcie_box(f"n{i}", 2, memory_mib=10000) for i in range(4))))
    placed: list[str] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        for j in range(40):
            d = a.place(pod_request(pod(f"p{k}-{j}", ctr(gpu=1, gpumem=1000, gpucores=10))))
            if d.node:
                with lock:
                    placed.append(d.pod.name)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(placed) == 8 * 10  # 10 per GPU by memory, cores and slots
    for st in a.nodes.values():
        assert all(m <= 10000 for m in st.mem)
        assert all(c <= 100 for c in st.cores)


def test_release_and_restore_round_trip():
    a = Allocator.from_cluster(cluster(pairs_box("p"), mig_box("m")))
    d1 = place(a, "x", ctr(gpu=2))
    d2 = place(a, "y", ctr(gpu=1, gpumem=9000), annotations=MIG)
    doc = cluster(pairs_box("p"), mig_box("m"))
    doc["nodes"]["p"]["allocations"] = [json.loads(d1.allocation.annotation())]
    doc["nodes"]["m"]["allocations"] = [d2.allocation.to_json()]
    b = Allocator.from_cluster(doc)
    for name in ("p", "m"):
        sa, sb = a.nodes[name], b.nodes[name]
        assert (sa.slots, sa.mem, sa.cores, sa.mig_used) == (
            sb.slots,
            sb.mem,
            sb.cores,
            sb.mig_used,
        )
    assert load_allocation(d1.allocation.annotation()) == d1.allocation
    assert b.release("default/x")
    assert not b.release("default/x")
    assert b.nodes["p"].slots == [0] * 8


# -- bad input: one line naming the field ----------------------------------------------------
def broken(path, value):
    doc = cluster(pcie_box("n", 2))
    node = doc["nodes"]["n"]
    *head, last = path
    for k in head:
        node = node[k]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["gpus", 0, "memory_mib"], KeyError, "cluster.nodes[n].gpus[0].memory_mib: missing"),
        (
            ["gpus", 1, "memory_mib"],
            -5,
            "cluster.nodes[n].gpus[1].memory_mib: expected an integer >= 1, got -5",
        ),
        (
            ["kind"],
            "Node",
            "cluster.nodes[n].kind: expected 'gpuvisor.io/node-inventory', got 'Node'",
        ),
        (["version"], 2, "cluster.nodes[n].version: expected an integer 1..1, got 2"),
        (
            ["links", 0, 1],
            "NVX",
            "cluster.nodes[n].links[0][1]: expected X, NV<n>, PIX, PXB, PHB, NODE or SYS, got"
            " 'NVX'",
        ),
        (
            ["links", 1, 0],
            "PHB",
            "cluster.nodes[n].links[1][0]: not symmetric with [0][1], got 'PHB'",
        ),
        (["node"], "other", "cluster.nodes[n].node: expected 'n' (its key), got 'other'"),
        (
            ["allocations"],
            [
                {
                    "pod": "a/b",
                    "containers": [
                        {
                            "name": "c",
                            "gpus": [
                                {
                                    "uuid": "GPU-x",
                                    "index": 0,
                                    "memory_mib": 1,
                                    "cores": 0,
                                    "mig": None,
                                }
                            ],
                        }
                    ],
                }
            ],
            "cluster.nodes[n].allocations[0].containers[0].gpus[0].uuid: not GPU 0 of node n,"
            " got 'GPU-x'",
        ),
        (
            ["allocations"],
            [
                {
                    "pod": "a/b",
                    "containers": [
                        {
                            "name": "c",
                            "gpus": [
                                {
                                    "uuid": "GPU-n-0",
                                    "index": 0,
                                    "memory_mib": 99999,
                                    "cores": 0,
                                    "mig": None,
                                }
                            ],
                        }
                    ],
                }
            ],
            "cluster.nodes[n].allocations[0]: over-commits the node: GPU 0 has not enough memory",
        ),
    ],
)
def test_malformed_cluster(path, value, message):
    with pytest.raises(DocumentError) as e:
        Allocator.from_cluster(broken(path, value))
    assert str(e.value) == message
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (
            pod("x", ctr(gpu=1, gpumem=100, gpumem_percentage=50)),
            "spec.containers[0].resources.limits[nvidia.com/gpumem-percentage]: set together"
            " with nvidia.com/gpumem; give one of the two",
        ),
        (
            pod("x", ctr(gpu=1), annotations={"hami.io/gpu-scheduler-policy": "packed"}),
            "metadata.annotations[hami.io/gpu-scheduler-policy]: unknown value 'packed',"
            " expected one of binpack, spread, topology-aware",
        ),
        (
            pod("x", ctr(gpu=1), annotations={"nvidia.com/vgpu-mode": "vgpu"}),
            "metadata.annotations[nvidia.com/vgpu-mode]: unknown value 'vgpu', expected"
            " hami-core or mig",
        ),
        (
            pod("x", ctr(gpu=1), annotations={"metax-tech.com/sgpu-qos-policy": "fast"}),
            "metadata.annotations[metax-tech.com/sgpu-qos-policy]: unknown value 'fast',"
            " expected one of fixed-share, burst-share, best-effort",
        ),
        (
            pod("x", ctr(gpu=1, gpumem_percentage=150)),
            "spec.containers[0].resources.limits[nvidia.com/gpumem-percentage]: expected 1..100,"
            " got 150",
        ),
        (
            pod("x", ctr(gpu=1, gpumem="8Gi")),
            "spec.containers[0].resources.limits[nvidia.com/gpumem]: expected a whole number,"
            " got '8Gi'",
        ),
        (
            pod("x", ctr(gpu=1, gpucores=101)),
            "spec.containers[0].resources.limits[nvidia.com/gpucores]: expected 0..100, got 101",
        ),
    ],
)
def test_bad_pod(manifest, message):
    with pytest.raises(DocumentError) as e:
        pod_request(manifest)
    assert str(e.value) == message


# -- the command ---------------------------------------------------------------------------
def write(tmp_path, cluster_doc, *pods_):
    c = tmp_path / "cluster.json"
    c.write_text(json.dumps(cluster_doc))
    p = tmp_path / "pods.yaml"
    p.write_text(yaml.safe_dump_all(list(pods_)))
    return str(c), str(p)


def test_place_command_json(tmp_path):
    c, p = write(
        tmp_path,
        cluster(pairs_box("p")),
        pod("a", ctr(gpu=4)),
        pod("b", ctr(gpu=4)),
        pod("c", ctr(gpu=1)),
    )
    r = CliRunner().invoke(main, ["place", "--cluster", c, p, "--json"])
    assert r.exit_code == 1, r.output
    out = json.loads(r.output)
    assert [o["pod"] for o in out] == ["default/a", "default/b", "default/c"]
    assert [o["node"] for o in out] == ["p", "p", None]  # each sees those before it
    g = out[0]["containers"][0]["gpus"][0]
    assert set(g) >= {"uuid", "index", "memory_mib", "cores", "mig"}
    assert out[2]["reasons"] == {"p": "container main: needs 1 idle GPU, has 0 (0 MiB free)"}


def test_place_command_text_and_exit_codes(tmp_path):
    c, p = write(
        tmp_path, cluster(mig_box("m")), pod("a", ctr(gpu=1, gpumem=9000), annotations=MIG)
    )
    r = CliRunner().invoke(main, ["place", "--cluster", c, p])
    assert r.exit_code == 0, r.output
    assert "pod default/a -> m" in r.output
    assert "MIG 1g.10gb at 6+1 (create)" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": {"m": {"kind": "gpuvisor.io/node-inventory"')
    r = CliRunner().invoke(main, ["place", "--cluster", str(bad), p])
    assert r.exit_code == 2
    assert r.output.strip().count("\n") == 0
    assert "not JSON" in r.output
    _c, p2 = write(
        tmp_path, cluster(), pod("a", ctr(gpu=1), annotations={"nvidia.com/vgpu-mode": "x"})
    )
    r = CliRunner().invoke(main, ["place", "--cluster", c, p2])
    assert r.exit_code == 2
    assert "metadata.annotations[nvidia.com/vgpu-mode]" in r.output


def test_an_unhealthy_gpu_that_answers_nothing_is_read_and_never_chosen():
    """The inventory writes null model, memory and bus id for a GPU NVML
    cannot read; the reader took that document as malformed."""
    doc = small_node(healthy=False)
    g = doc["nodes"]["n"]["gpus"][0]
    g["model"] = g["memory_mib"] = g["pci_bus_id"] = None
    a = Allocator.from_cluster(doc)
    assert place(a, "x", ctr(gpu=1, gpumem=100)).reasons == {"n": "GPU 0 unhealthy"}


def test_mig_keeps_the_slices_of_an_instance_without_a_mig_device():
    """A GPU instance with no compute instance has no MIG device (uuid null in
    the inventory): it is neither handed out nor destroyed, and its slices stay taken."""
    doc = cluster(mig_box("m", instances=[("7g.80gb", 0, False)]))
    doc["nodes"]["m"]["gpus"][0]["mig"]["instances"][0]["uuid"] = None
    a = Allocator.from_cluster(doc)
    assert place(a, "x", ctr(gpu=1, gpumem=9000), annotations=MIG).node is None


def test_quantities_in_the_api_servers_canonical_form() -> None:
    """The API server stores `gpumem: 3000` as `3k` (kube-scheduler sends
    that to the extender): read as 3000; binary suffixes and fractions refused."""
    from gpuvisor.cluster.request import pod_request

    def pod(gpumem: str) -> dict[str, Any]:
        limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": gpumem, "nvidia.com/gpucores": "30"}
        return {
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
        }

    c = pod_request(pod("3k")).containers[0]
    assert (c.memory_mib, c.cores) == (3000, 30)
    for bad in ("3Ki", "1500m"):
        with pytest.raises(DocumentError, match=rf"gpumem\]: expected a whole number, got '{bad}'"):
            pod_request(pod(bad))


def test_restore_accounts_a_mig_plan_already_carried_out():
    """A restarted extender restores a pod whose plan turned MIG mode on and
    made an instance, from the inventory published after the plugin carried
    it out (MIG mode on, the instance in use by the pod itself): the plan's
    "reconfigure only an idle GPU" rule is for deciding, not for accounting
    what was done; it refused such pods with "GPU 0 is not idle"."""
    a = Allocator.from_cluster(cluster(mig_box("m", enabled=False)))
    d = place(a, "y", ctr(gpu=1, gpumem=9000), annotations=MIG)
    (grant,) = d.allocation.containers[0].gpus
    assert grant.mig is not None
    assert grant.mig.enable
    start = grant.mig.placement.start
    after = mig_box("m", enabled=True, instances=[(grant.mig.profile, start, True)])
    b = Allocator.from_cluster(cluster(after))
    b.restore(d.allocation)
    assert b.nodes["m"].mig_used == a.nodes["m"].mig_used
    # a second pod is decided around it, never onto its placement
    d2 = place(b, "z", ctr(gpu=1, gpumem=9000), annotations=MIG)
    (g2,) = d2.allocation.containers[0].gpus
    assert g2.mig is not None
    assert not (g2.mig.placement.mask & grant.mig.placement.mask)


def two_gpus():
    gpus = [gpu("n", i, "NVIDIA L40S", 46068) for i in range(2)]
    return cluster(inventory("n", gpus, links_pcie(2)))


def test_app_container_gets_its_init_containers_gpus_as_kubelet_hands_them_over():
    """kubelet gives the first app container (manifest order) the devices
    its pod's init containers held, without asking the plugin: the init
    container must be placed on that app container's GPU, not on the GPU
    of another app container that merely fits it better."""
    a = Allocator.from_cluster(two_gpus())
    assert place(a, "busy", ctr(gpu=1, gpumem=30000)).node == "n"
    d = place(
        a,
        "x",
        ctr("big", gpu=1, gpumem=20000),  # only GPU 1 has room
        ctr("small", gpu=1, gpumem=1000),  # binpack: the busier GPU 0
        init=[ctr("setup", gpu=1, gpumem=1000)],
    )
    setup, big, small = d.allocation.containers
    assert [g.index for g in big.gpus] == [1]
    assert [g.index for g in small.gpus] == [0]
    assert [g.index for g in setup.gpus] == [1]


def test_init_container_that_fits_no_gpu_of_the_first_app_container_is_refused():
    """Placed elsewhere, kubelet would still hand its GPU to the app
    container, whose start would then be refused: the node says why."""
    a = Allocator.from_cluster(two_gpus())
    assert place(a, "busy", ctr(gpu=1, gpumem=30000)).node == "n"
    d = place(
        a,
        "x",
        ctr("small", gpu=1, gpumem=1000),  # binpack: the busier GPU 0
        init=[ctr("setup", gpu=1, gpumem=20000)],  # fits only GPU 1
    )
    assert d.node is None
    assert "container setup" in d.reasons["n"]
    assert "kubelet hands" in d.reasons["n"]


def test_a_mig_grant_keeps_its_gpu_in_mig_mode_when_the_inventory_says_off():
    """The device plugin turns an idle GPU's MIG mode off; a plan made just
    before, counting on MIG mode (no enable_mig_mode), is realised by
    turning it on again.  Until then the GPU takes no shared grant: the
    allocator counts it in MIG mode while a MIG grant is on it."""
    a = Allocator.from_cluster(cluster(mig_box("m", n=2)))
    d = place(a, "x", ctr(gpu=1, gpumem=8000), annotations=MIG)
    (g,) = d.allocation.containers[0].gpus
    assert g.mig is not None
    assert not g.mig.enable
    a.replace_node(load_inventory(mig_box("m", n=2, enabled=False)))
    shared = place(
        a, "y", ctr(gpu=1, gpumem=1000), annotations={"nvidia.com/vgpu-mode": "hami-core"}
    )
    assert shared.node == "m"
    assert indices(shared) != [g.index]
    assert a.release("default/x")
