"""What the scheduler extender's state holds, for the tests that drive it
against a real kube-apiserver (tests/test_scheduler_relist.py,
tests/test_scheduler_bind_unanswered.py): one-GPU nodes (tests/inventories.py
`pcie_box(node, n=1)`) and pods that take the whole GPU."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from gpuvisor.cluster.request import pod_request
from gpuvisor.cluster.scheduler.state import ClusterState

from tests.k8s_cluster import KubeTest, gpu_pod

WHOLE_MIB = 46068  # pcie_box's L40S: a pod of this much memory takes the GPU


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "it") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout:.0f} s", pytrace=False)
        time.sleep(0.05)


def whole_gpu_pod(k: KubeTest, name: str) -> dict[str, Any]:
    """The manifest of a pod of one whole GPU in the test's namespace."""
    doc = gpu_pod(name, gpus=1, gpumem=WHOLE_MIB)
    doc["metadata"]["namespace"] = k.namespace
    return doc


def fits_on(state: ClusterState, k: KubeTest, node: str) -> bool:
    """Whether the allocator would place another whole-GPU pod on `node`."""
    probe = pod_request(whole_gpu_pod(k, "probe"))
    return bool(state.allocator.decide(probe, nodes=[node]).node == node)


def held_on(state: ClusterState, node: str) -> list[str]:
    """The pods the allocator holds room for on `node`."""
    if node not in state.allocator.nodes:
        return []
    return sorted(a.pod for a in state.allocator.allocations(node))
