"""`within.beyond_request`: an allocation record checked against its pod's
own requests (the pure logic behind the device plugin's and the
extender's refusal of a record a tenant raised; end to end in
tests/test_allocation_forgery.py)."""

from __future__ import annotations

from typing import Any

import pytest
from gpuvisor.cluster.allocation import ContainerGrant, GpuGrant, MigGrant
from gpuvisor.cluster.deviceplugin.within import beyond_request
from gpuvisor.cluster.inventory_model import Placement
from gpuvisor.cluster.request import pod_request

from tests.inventories import ctr, pod

MEMORY = {"GPU-a": 40960, "GPU-b": 40960}


def grant(*gpus: tuple[str, int, int], name: str = "main", **kw: Any) -> ContainerGrant:
    return ContainerGrant(
        name,
        kw.pop("init", False),
        tuple(GpuGrant(u, i, m, c, kw.get("mig")) for i, (u, m, c) in enumerate(gpus)),
        None,
        kw.get("priority"),
    )


def why(containers: list[ContainerGrant], manifest: dict[str, Any], known: bool = True) -> Any:
    return beyond_request(containers, pod_request(manifest), MEMORY.get, known)


def test_a_grant_of_exactly_the_request_passes() -> None:
    manifest = pod("p", ctr(gpu=2, gpumem=3000, gpucores=30))
    assert why([grant(("GPU-a", 3000, 30), ("GPU-b", 3000, 30))], manifest) is None
    assert why([grant(("GPU-a", 2000, 10))], manifest) is None  # less is no harm


@pytest.mark.parametrize(
    ("containers", "message"),
    [
        (
            [grant(("GPU-a", 3001, 30))],
            "gpuvisor.io/allocation: containers[0].gpus[0].memory_mib=3001: beyond the "
            "container's request of 3000 MiB (nvidia.com/gpumem)",
        ),
        (
            [grant(("GPU-a", 3000, 31))],
            "containers[0].gpus[0].cores=31: beyond the container's request of 30% "
            "(nvidia.com/gpucores)",
        ),
        (
            [grant(("GPU-a", 3000, 0))],  # 0: no SM limit at all
            "containers[0].gpus[0].cores=0: beyond",
        ),
        (
            [grant(("GPU-a", 3000, 30), ("GPU-b", 3000, 30))],
            'containers[0].gpus=["GPU-a", "GPU-b"]: 2 GPUs, beyond the container\'s request '
            "(nvidia.com/gpu: 1)",
        ),
        (
            [grant(("GPU-a", 3000, 30), name="sidecar")],
            'containers[0].name="sidecar": pod default/p has no such container',
        ),
        (
            [grant(("GPU-a", 3000, 30), init=True)],
            "containers[0].init=true: container main is not an init container",
        ),
        (
            [grant(("GPU-a", 3000, 30), priority=0)],
            "containers[0].priority=0: not the container's request (nvidia.com/priority: none)",
        ),
        (
            [grant(("GPU-c", 3000, 30))],
            'containers[0].gpus[0].uuid="GPU-c": no such GPU on the node',
        ),
    ],
)
def test_a_grant_beyond_the_request_is_named(
    containers: list[ContainerGrant], message: str
) -> None:
    got = why(containers, pod("p", ctr(gpu=1, gpumem=3000, gpucores=30)))
    assert message in str(got), got


def test_percent_requests_are_read_on_the_gpus_memory() -> None:
    manifest = pod("p", ctr(gpu=1, gpumem_percentage=50, gpucores=10))
    assert why([grant(("GPU-a", 20480, 10))], manifest) is None
    got = why([grant(("GPU-a", 20481, 10))], manifest)
    assert "memory_mib=20481: beyond the container's request of 20480" in str(got)
    # the node's GPUs not known yet (the extender before its inventory):
    # only a request in MiB is checked, the rest of the record still is
    assert why([grant(("GPU-c", 40960, 10))], manifest, known=False) is None
    assert "cores=100" in str(why([grant(("GPU-c", 100, 100))], manifest, known=False))


def test_a_mig_grant_is_refused_only_to_a_hami_core_pod() -> None:
    mig = MigGrant("1g.10gb", 19, Placement(0, 1), None, (), False)
    containers = [grant(("GPU-a", 9728, 15), mig=mig)]
    assert why(containers, pod("p", ctr(gpu=1, gpumem=5000))) is None
    hami = pod("p", ctr(gpu=1, gpumem=5000), annotations={"nvidia.com/vgpu-mode": "hami-core"})
    got = why(containers, hami)
    assert 'mig.profile="1g.10gb": a MIG instance' in str(got), got
