"""Fixtures shared by every test module.

- repo_root, build_dir: the checkout and its make outputs (fails with
  "run make first" when they are missing);
- node: a fresh simulated node (own state and region files under tmp_path);
  small: one with a single 4 GiB device;
- run_py: run Python code in a child process with a given environment;
- k8s_cluster: a real etcd + kube-apiserver (tests/k8s_cluster.py), one per
  xdist worker, started by the first test that asks for it; k8s: one test's
  namespace on it, with Node/Pod/scheduler helpers and cleanup;
- the `gpu` marker skips tests when no real GPU is present.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from gpuvisor.shim.hardware import real_gpu_present

from tests.helpers import BUILD_DIR, REPO_ROOT, SimNode, missing_build_outputs
from tests.helpers import run_py as _run_py

if TYPE_CHECKING:
    # Imported where used: the Kubernetes client takes seconds to import.
    from tests.k8s_cluster import KubeCluster, KubeTest


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def build_dir() -> Path:
    missing = missing_build_outputs()
    if missing:
        pytest.fail(f"run make first: missing {', '.join(str(p) for p in missing)}", pytrace=False)
    return BUILD_DIR


@pytest.fixture
def node(tmp_path: Path, build_dir: Path) -> SimNode:
    """A fresh simulated node with two 16 GiB devices (GPUVISOR_SIM_DEVICES=2x16g)."""
    return SimNode.create(tmp_path)


@pytest.fixture
def small(tmp_path: Path, build_dir: Path) -> SimNode:
    """A fresh simulated node with one 4 GiB device (the oversubscription
    tests' setting: tests/helpers_oversub.py)."""
    return SimNode.create(tmp_path, devices="1x4g")


@pytest.fixture(scope="session")
def run_py() -> Callable[..., subprocess.CompletedProcess[str]]:
    return _run_py


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """etcd + kube-apiserver for this worker (skips or fails as k8s_cluster.binaries says)."""
    from tests.k8s_cluster import running_cluster

    with running_cluster(tmp_path_factory.mktemp("k8s")) as cluster:
        yield cluster


@pytest.fixture
def k8s(k8s_cluster: KubeCluster) -> Iterator[KubeTest]:
    """This test's namespace on the worker's cluster; what it creates is removed after."""
    from tests.k8s_cluster import KubeTest

    test = KubeTest(k8s_cluster)
    try:
        yield test
    finally:
        test.teardown()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not real_gpu_present():
        pytest.skip("no real GPU (nvidia-smi missing or failing, or no libcuda.so.1)")
