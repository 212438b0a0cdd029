"""Simulated GPU nodes behind real `gpuvisor device-plugin` processes, for the
cluster tests (tests/test_cluster_sim_nodes.py) and `make demo-cluster`
(tests/demo_cluster.py).

A `SimTopologyNode` is one Node object of the test cluster with, behind it:

- a simulated node described by a `GPUVISOR_SIM_TOPOLOGY` file (its GPUs'
  UUIDs made unique to the node, so two nodes never name the same GPU);
- `gpuvisor device-plugin` as a process of its own, on the simulated
  driver's NVML, with the cluster's kubeconfig: it reads the node's
  inventory (models, memory, links) through NVML and publishes it in the
  Node's `gpuvisor.io/node-inventory` annotation, where the extender reads
  it; nothing here writes that annotation;
- kubelet's side of the device plugin API (tests/kubelet_harness.py):
  registration, admission (GetPreferredAllocation, Allocate),
  PreStartContainer, the PodResources API, and the pod's status once its
  containers start (the extender holds back an ambiguous bind until then);
  `serve` runs kubelet's sync loop, admitting pods as they are bound;
- `run`: a container's command on the simulated node with exactly the
  environment and mounts Allocate returned (the library preloaded from it).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes.client
from gpuvisor.cluster.deviceplugin.publish import NODE_INVENTORY

from tests.helpers import CLI as GPUVISOR
from tests.helpers import LIBRARY, REPO_ROOT, SIM_DIR, clean_env, stop_process
from tests.k8s_cluster import GPU, KubeTest
from tests.kubelet_harness import Container, FakeKubelet, Pod, Serving, run
from tests.test_deviceplugin import PROBE

PLUGIN_START = 90.0  # seconds: grpc, NVML and the Kubernetes client load on a loaded machine

# PROBE (tests/test_deviceplugin.py): what a workload reports, cuMemGetInfo's
# total per visible GPU and their UUIDs.


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: the plugin dies with the thread that started it
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def node_uuid(node: int, gpu: int) -> str:
    """A GPU UUID unique to (node, gpu), in NVML's form."""
    return f"GPU-6776a51d-5e11-4000-8000-{node:04x}{gpu:08x}"


def topology(
    models: Sequence[str], node: int, nvlink: Sequence[Sequence[int]] = ()
) -> dict[str, Any]:
    """A GPUVISOR_SIM_TOPOLOGY document: one GPU per model, UUIDs of node `node`."""
    doc: dict[str, Any] = {
        "gpus": [
            {"model": m, "uuid": node_uuid(node, i), "numa": 0, "pcie_switch": i // 2}
            for i, m in enumerate(models)
        ]
    }
    if nvlink:
        doc["nvlink"] = [list(p) for p in nvlink]
    return doc


def gpus_of(c: kubernetes.client.V1Container) -> int:
    limits = (c.resources and c.resources.limits) or {}
    return int(limits.get(GPU, 0))


def admit(kubelet: FakeKubelet, pod: kubernetes.client.V1Pod) -> tuple[Pod, dict[str, Any]]:
    """kubelet admits the pod (GetPreferredAllocation, Allocate), then
    starts each container in kubelet's order (PreStartContainer for those
    with GPUs; a sidecar, an init container with restartPolicy Always, runs
    on) and reports it in the pod's status; the Allocate answers by
    container name."""
    containers = [
        Container(c.name, gpus_of(c), init=init, sidecar=init and c.restart_policy == "Always")
        for cs, init in ((pod.spec.init_containers or [], True), (pod.spec.containers, False))
        for c in cs
    ]
    hp = Pod(pod.metadata.namespace, pod.metadata.name, containers)
    resps = kubelet.admit(hp)
    kubelet.start_all(hp)
    return hp, resps


def device_plugin_argv(name: str, d: Path, socks: Path, health_interval: float) -> list[str]:
    """`gpuvisor device-plugin` for Node `name`: its state and node
    directories under d, its plugin and kubelet sockets under socks (the
    kubelet harness's `socks / "dp"` and `socks / "pr" / "kubelet.sock"`)."""
    return [
        *GPUVISOR,
        "device-plugin",
        f"--node-name={name}",
        f"--plugin-dir={socks / 'dp'}",
        f"--pod-resources-socket={socks / 'pr' / 'kubelet.sock'}",
        f"--state-dir={d / 'state'}",
        f"--lib-dir={LIBRARY.parent}",
        f"--node-dir={d / 'node'}",
        f"--health-interval={health_interval}",
    ]


@dataclass
class SimTopologyNode:
    """A Node with a simulated GPU node and a real device plugin behind it."""

    name: str
    dir: Path
    socks: Path
    sim_env: dict[str, str]
    kubelet: FakeKubelet
    plugin: subprocess.Popen[bytes]
    log: Path
    inventory: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def launch(
        cls,
        k8s: KubeTest,
        name: str,
        topo: Mapping[str, Any],
        workdir: Path,
        *,
        create_node: bool = True,
    ) -> SimTopologyNode:
        """Creates the Node (unless `create_node` is False), writes the
        topology, starts the kubelet harness and `gpuvisor device-plugin`.

        Call it from a thread that outlives the node: the plugin dies with
        the thread that started it (PR_SET_PDEATHSIG), so launch several
        from one thread and `wait_ready` each, rather than from a pool."""
        if create_node:
            k8s.create_node(name)
        d = workdir / name
        (d / "node").mkdir(parents=True)
        (d / "topology.json").write_text(json.dumps(topo))
        # unix socket paths are short (108 bytes): under /tmp, not the workdir
        socks = Path(tempfile.mkdtemp(prefix="gvcs", dir="/tmp"))
        env = clean_env()
        env.update(
            {
                "LD_LIBRARY_PATH": str(SIM_DIR),
                "GPUVISOR_SIM_STATE": str(d / "sim.state"),
                "GPUVISOR_SIM_TOPOLOGY": str(d / "topology.json"),
            }
        )
        kubelet = FakeKubelet(socks / "dp", socks / "pr" / "kubelet.sock", api=k8s.core)
        log = d / "device-plugin.log"
        argv = device_plugin_argv(name, d, socks, health_interval=0.5)
        with log.open("ab") as out:
            plugin = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**env, "KUBECONFIG": str(k8s.cluster.kubeconfig)},
                cwd=REPO_ROOT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        return cls(name, d, socks, env, kubelet, plugin, log)

    def wait_ready(self, k8s: KubeTest) -> None:
        """Waits until the plugin registered with the harness and published
        the Node's inventory (kept in `inventory`); stops the node and raises
        when it does not."""
        try:
            self._wait_ready(k8s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, k8s: KubeTest) -> None:
        deadline = time.monotonic() + PLUGIN_START
        while True:
            if self.plugin.poll() is not None:
                raise RuntimeError(
                    f"gpuvisor device-plugin for {self.name} exited with "
                    f"{self.plugin.returncode}: {self.log.read_text()[-3000:]}"
                )
            annotations = k8s.core.read_node(self.name).metadata.annotations or {}
            if NODE_INVENTORY in annotations and self.kubelet.registrations:
                self.inventory = json.loads(annotations[NODE_INVENTORY])
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"gpuvisor device-plugin for {self.name}: no inventory and registration "
                    f"after {PLUGIN_START:.0f}s: {self.log.read_text()[-3000:]}"
                )
            time.sleep(0.1)
        self.kubelet.wait_registered(timeout=30)

    @property
    def base_env(self) -> dict[str, str]:
        """The node's environment a container inherits (the simulated driver)."""
        return dict(self.sim_env)

    def admit(self, pod: kubernetes.client.V1Pod) -> tuple[Pod, dict[str, Any]]:
        """`admit` on this node's kubelet."""
        return admit(self.kubelet, pod)

    def serve(self, k8s: KubeTest) -> Serving:
        """kubelet's sync loop: `admit` each pod of the test bound here, as
        the bindings arrive; `Serving.results` keeps `admit`'s answers."""
        return self.kubelet.serve(self.name, k8s.namespace, self.admit)

    def run(self, resp: Any, code: str = PROBE, timeout: float = 60) -> dict[str, Any]:
        """The container's command (python -c code, printing one JSON line)
        with exactly Allocate's environment and mounts; its parsed output."""
        proc = run(resp, code, self.base_env, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{self.name}: the workload failed: {proc.stderr[-2000:]}")
        out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        return out

    def stop(self) -> None:
        stop_process(self.plugin)
        with contextlib.suppress(Exception):
            self.kubelet.stop()
        shutil.rmtree(self.socks, ignore_errors=True)


def limits_file(resp: Any) -> Path:
    """The host path of the container's limits file (Allocate's /etc/gpuvisor mount)."""
    for m in resp.mounts:
        if m.container_path == "/etc/gpuvisor":
            return Path(m.host_path) / "limits.env"
    raise AssertionError("Allocate returned no /etc/gpuvisor mount")
