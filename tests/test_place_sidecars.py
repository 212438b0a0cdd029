"""Init and sidecar containers (init containers with restartPolicy: Always)
in the allocator: a sidecar is charged beside the app containers and beside
the init containers after it, as Kubernetes counts them, and kubelet's
hand-over of devices follows its rules (docs/placement.md, "Init
containers on the GPUs kubelet hands over")."""

from __future__ import annotations

import functools
import json
import operator
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from gpuvisor.cluster.allocation import load_allocation
from gpuvisor.cluster.allocator import Allocator
from gpuvisor.cluster.deviceplugin.grant import GrantError, parse_grant
from gpuvisor.cluster.inventory_model import DocumentError
from gpuvisor.cluster.request import ContainerKind, pod_request
from gpuvisor.supervisor.cli import main

from tests.inventories import cluster, ctr, gpu, inventory, links_pcie, mig_box, pod


def sidecar(name: str, **limits: Any) -> dict[str, Any]:
    return {**ctr(name, **limits), "restartPolicy": "Always"}


def one_gpu() -> dict[str, Any]:
    return cluster(inventory("n", [gpu("n", 0, "NVIDIA A100-SXM4-40GB", 40960)], [["X"]]))


def two_gpus() -> dict[str, Any]:
    gpus = [gpu("n", i, "NVIDIA L40S", 46068) for i in range(2)]
    return cluster(inventory("n", gpus, links_pcie(2)))


def place(a: Allocator, name: str, *containers: dict[str, Any], init=None):
    return a.place(pod_request(pod(name, *containers, init=init)), True)


def held(a: Allocator, i: int = 0) -> tuple[int, int, int]:
    st = a.nodes["n"]
    return st.slots[i], st.mem[i], st.cores[i]


def test_the_request_reads_restart_policy():
    r = pod_request(
        pod(
            "x",
            ctr("app", gpu=1, gpumem=1000),
            init=[ctr("setup", gpu=1, gpumem=1000), sidecar("proxy", gpu=1, gpumem=1000)],
        )
    )
    assert [c.kind for c in r.containers] == [
        ContainerKind.INIT,
        ContainerKind.SIDECAR,
        ContainerKind.APP,
    ]
    # restartPolicy on an app container changes nothing (it runs on anyway)
    app = {**ctr("app", gpu=1), "restartPolicy": "Always"}
    assert pod_request(pod("y", app)).containers[0].kind is ContainerKind.APP


@pytest.mark.parametrize("value", ["always", "Sometimes", 1, True])
def test_a_bad_restart_policy_is_named(value):
    p = pod("x", ctr("app", gpu=1), init=[{**ctr("proxy", gpu=1), "restartPolicy": value}])
    with pytest.raises(DocumentError) as e:
        pod_request(p)
    msg = str(e.value)
    assert "spec.initContainers[0].restartPolicy" in msg
    assert "\n" not in msg


def test_a_sidecar_is_charged_beside_the_app_container():
    """Counted as a plain init container (before), the pod held max(app,
    sidecar) = 20000 MiB and a 20000 MiB pod was placed next to it: 55000
    MiB of grants on a 40960 MiB GPU while both ran."""
    a = Allocator.from_cluster(one_gpu())
    d = place(
        a,
        "x",
        ctr("app", gpu=1, gpumem=20000, gpucores=20),
        init=[sidecar("proxy", gpu=1, gpumem=15000, gpucores=30)],
    )
    assert d.node == "n", d.reasons
    proxy, app = d.allocation.containers
    assert (proxy.name, proxy.init, proxy.sidecar) == ("proxy", True, True)
    assert (app.init, app.sidecar) == (False, False)
    assert held(a) == (2, 35000, 50)
    assert place(a, "big", ctr(gpu=1, gpumem=20000, gpucores=10)).node is None
    assert place(a, "fits", ctr(gpu=1, gpumem=5960, gpucores=50)).node == "n"
    assert held(a) == (3, 40960, 100)


def test_a_plain_init_container_after_a_sidecar_runs_beside_it():
    """kubelet starts the sidecar first and keeps it up while the next init
    container runs: 15000 + 30000 MiB do not fit a 40960 MiB GPU.  The other
    way round the init container ends before the sidecar starts."""
    a = Allocator.from_cluster(one_gpu())
    d = place(
        a,
        "after",
        ctr("app", gpu=1, gpumem=1000),
        init=[sidecar("proxy", gpu=1, gpumem=15000), ctr("setup", gpu=1, gpumem=30000)],
    )
    assert d.node is None
    assert "container setup" in d.reasons["n"], d.reasons
    d = place(
        a,
        "before",
        ctr("app", gpu=1, gpumem=1000),
        init=[ctr("setup", gpu=1, gpumem=30000), sidecar("proxy", gpu=1, gpumem=15000)],
    )
    assert d.node == "n", d.reasons
    # max(setup 30000, proxy + app 16000); two slots while proxy and app run
    assert held(a) == (2, 30000, 0)


def test_a_sidecar_and_an_app_container_that_do_not_fit_one_gpu_get_two():
    """Before, the sidecar went onto the app container's GPU (where kubelet
    hands a plain init container's devices) and was charged max(30000,
    30000): 60000 MiB on a 46068 MiB GPU."""
    a = Allocator.from_cluster(two_gpus())
    d = place(
        a,
        "x",
        ctr("app", gpu=1, gpumem=30000),
        init=[sidecar("proxy", gpu=1, gpumem=30000)],
    )
    assert d.node == "n", d.reasons
    proxy, app = d.allocation.containers
    assert {proxy.gpus[0].index, app.gpus[0].index} == {0, 1}
    assert held(a, 0)[1] == held(a, 1)[1] == 30000


def test_kubelet_hands_a_plain_init_containers_devices_to_the_next_sidecar():
    """devicesToReuse: the sidecar after a plain init container takes its
    devices (and keeps them); the app container gets new ones.  So the init
    container goes on the sidecar's GPU, not on the app container's."""
    a = Allocator.from_cluster(two_gpus())
    assert place(a, "busy", ctr(gpu=1, gpumem=30000)).node == "n"  # GPU 0 or 1
    busy = 0 if held(a, 0)[1] else 1
    d = place(
        a,
        "x",
        ctr("app", gpu=1, gpumem=1000),  # binpack: the busy GPU
        init=[ctr("setup", gpu=1, gpumem=1000), sidecar("proxy", gpu=1, gpumem=20000)],
    )
    assert d.node == "n", d.reasons
    setup, proxy, app = d.allocation.containers
    assert [g.index for g in app.gpus] == [busy]
    assert [g.index for g in proxy.gpus] == [1 - busy]
    assert [g.index for g in setup.gpus] == [1 - busy]


def test_a_plain_init_container_that_fits_no_gpu_of_the_next_sidecar_is_refused():
    a = Allocator.from_cluster(two_gpus())
    assert place(a, "busy", ctr(gpu=1, gpumem=30000)).node == "n"
    d = place(
        a,
        "x",
        ctr("app", gpu=1, gpumem=1000),
        init=[ctr("setup", gpu=1, gpumem=20000), sidecar("proxy", gpu=1, gpumem=1000)],
    )
    # setup fits only the idle GPU; proxy (binpack) goes to the busy one,
    # and kubelet would hand setup's device to proxy: refused, with why
    assert d.node is None
    assert "container setup: kubelet hands its GPUs to container proxy" in d.reasons["n"]


def test_a_restored_record_is_charged_as_it_was_planned():
    """The extender rebuilds its reservations from the records (charge_of):
    the same charge as the plan, sidecar included."""
    a = Allocator.from_cluster(one_gpu())
    d = place(
        a,
        "x",
        ctr("app", gpu=1, gpumem=20000, gpucores=20),
        init=[
            ctr("setup", gpu=1, gpumem=39000, gpucores=5),
            sidecar("proxy", gpu=1, gpumem=15000, gpucores=30),
            ctr("late", gpu=1, gpumem=10000, gpucores=60),
        ],
    )
    assert d.node == "n", d.reasons
    planned = held(a)
    # setup 39000 alone; proxy + late: 25000 MiB, 90 %; proxy + app 35000, 50 %
    assert planned == (2, 39000, 90)
    record = json.loads(d.allocation.annotation())
    assert [c.get("sidecar", False) for c in record["containers"]] == [False, True, False, False]
    assert load_allocation(record).containers[1].sidecar
    doc = one_gpu()
    doc["nodes"]["n"]["allocations"] = [record]
    b = Allocator.from_cluster(doc)
    assert held(b) == planned


def test_a_record_with_a_sidecar_that_is_no_init_container_is_refused():
    a = Allocator.from_cluster(one_gpu())
    d = place(a, "x", ctr("app", gpu=1, gpumem=1000))
    record = d.allocation.to_json()
    record["containers"][0]["sidecar"] = True
    with pytest.raises(DocumentError) as e:
        load_allocation(record)
    assert "containers[0].sidecar" in str(e.value)


def test_two_plain_init_containers_never_plan_one_mig_placement():
    """kubelet allocates every container at admission, so the device plugin
    makes all of a pod's MIG instances at once: two init containers that
    each planned a new 1g.10gb at slice 1 (before) could not both be made."""
    a = Allocator.from_cluster(
        cluster(mig_box("n", 2, instances=[("3g.40gb", 4, True), ("1g.10gb", 0, False)]))
    )
    d = place(
        a,
        "x",
        ctr("app", gpu=1, gpumem=500),
        init=[ctr("first", gpu=1, gpumem=500), ctr("second", gpu=1, gpumem=500)],
    )
    assert d.node == "n", d.reasons
    grants = [(g.index, g.mig) for c in d.allocation.containers for g in c.gpus]
    assert all(m is not None for _, m in grants)
    for i in {i for i, _ in grants}:
        masks = [m.placement.mask for j, m in grants if j == i]
        assert sum(masks) == functools.reduce(operator.or_, masks), masks


def test_gpuvisor_place_shows_the_sidecar(tmp_path):
    c = tmp_path / "cluster.json"
    c.write_text(json.dumps(one_gpu()))
    p = tmp_path / "pod.yaml"
    manifest = pod(
        "x",
        ctr("main", gpu=1, gpumem=20000),
        init=[ctr("setup", gpu=1, gpumem=1000), sidecar("proxy", gpu=1, gpumem=15000)],
    )
    p.write_text(yaml.safe_dump(manifest))
    r = CliRunner().invoke(main, ["place", "--cluster", str(c), str(p)])
    assert r.exit_code == 0, r.output
    assert "container setup (init): GPU 0" in r.output
    assert "container proxy (sidecar): GPU 0" in r.output
    assert "container main: GPU 0" in r.output
    r = CliRunner().invoke(main, ["place", "--cluster", str(c), str(p), "--json"])
    (out,) = json.loads(r.output)
    assert [(x["name"], x["init"], x.get("sidecar", False)) for x in out["containers"]] == [
        ("setup", True, False),
        ("proxy", True, True),
        ("main", False, False),
    ]


def test_a_record_that_lists_a_container_twice_is_refused():
    """Container names are unique in a pod; a record listing one twice (a
    forged one) could give it two grants: both readers refuse it."""
    a = Allocator.from_cluster(one_gpu())
    d = place(a, "x", ctr("app", gpu=1, gpumem=1000))
    record = d.allocation.to_json()
    record["containers"].append(dict(record["containers"][0]))
    with pytest.raises(DocumentError) as e:
        load_allocation(record)
    assert "containers[1].name: listed twice" in str(e.value)
    with pytest.raises(GrantError) as g:
        parse_grant(json.dumps(record))
    assert "containers[1].name=" in str(g.value)
    assert "listed twice" in str(g.value)
