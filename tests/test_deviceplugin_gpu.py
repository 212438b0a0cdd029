"""gpuvisor device-plugin against a real GPU's NVML (skipped without a GPU;
`make gpu-check` runs it).

Read-only: no request here asks for a MIG instance, so nothing changes a
GPU's MIG mode or any other setting, and the tests check that the MIG mode
is the same after them.  What they check:
- the node inventory (`gpuvisor inventory --json`) and the device
  plugin's published one agree with NVML's own answers;
- kubelet's side of the API (tests/kubelet_harness.py) sees every GPU
  `--split-count` times, healthy;
- a pod placed on the first GPU with 3000 MiB and 30 % of its SMs is
  admitted (GetPreferredAllocation, then Allocate) and started
  (PreStartContainer), and a PyTorch workload run with exactly the
  environment and mounts Allocate returned sees its quota in
  `torch.cuda.mem_get_info()` and gets `torch.OutOfMemoryError` beyond it.
Each test prints a `GPU-CHECK` line with what it saw, for the report.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pynvml
import pytest
from gpuvisor.cluster.deviceplugin.gpus import NvmlGpus
from gpuvisor.cluster.deviceplugin.publish import inventory_document
from gpuvisor.cluster.deviceplugin.service import DevicePluginService
from gpuvisor.cluster.inventory_model import load_inventory

from tests.helpers import clean_env, run_cmd
from tests.kubelet_harness import Container, FakeKubelet, Pod, run
from tests.test_deviceplugin import NODE, DictPods, annotation, serving

pytestmark = pytest.mark.gpu

MiB = 1 << 20

TORCH = """
import json, torch
free, total = torch.cuda.mem_get_info()
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
free_after, _ = torch.cuda.mem_get_info()
try:
    y = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
    err = None
except torch.OutOfMemoryError as e:
    err = type(e).__name__
print(json.dumps({"count": torch.cuda.device_count(), "total": total, "free": free,
                  "free_after_1g": free_after, "error": err}))
"""


def node_env() -> dict[str, str]:
    """This machine's environment as a container inherits it: clean of
    gpuvisor's and CUDA's variables, but with the loader's path, where the
    driver may live."""
    env = clean_env()
    if "LD_LIBRARY_PATH" in os.environ:
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    return env


def mig_modes() -> dict[str, object]:
    """Each GPU's current MIG mode as NVML reads it (None where it has none)."""
    pynvml.nvmlInit()
    modes: dict[str, object] = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        try:
            modes[str(pynvml.nvmlDeviceGetUUID(h))] = pynvml.nvmlDeviceGetMigMode(h)[0]
        except pynvml.NVMLError:
            modes[str(pynvml.nvmlDeviceGetUUID(h))] = None
    return modes


@pytest.fixture(autouse=True)
def _gpu_settings_untouched() -> Iterator[None]:
    before = mig_modes()
    yield
    assert mig_modes() == before


@dataclass
class Plugin:
    gpus: NvmlGpus
    pods: DictPods
    kubelet: FakeKubelet
    service: DevicePluginService


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[Plugin]:
    gpus = NvmlGpus()
    pods = DictPods()
    with serving(tmp_path, gpus, pods, health_interval=0.2) as (kubelet, _, service):
        yield Plugin(gpus, pods, kubelet, service)


def test_the_inventories_agree_with_nvml() -> None:
    pynvml.nvmlInit()
    want = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = int(pynvml.nvmlDeviceGetMemoryInfo(h).total) // MiB
        want.append((i, str(pynvml.nvmlDeviceGetUUID(h)), mem))
    proc = run_cmd(
        [
            sys.executable,
            "-c",
            "from gpuvisor.supervisor.cli import main; main()",
            "inventory",
            "--json",
            "--node",
            NODE,
        ],
        node_env(),
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    inv = load_inventory(doc)  # the reader the allocator uses accepts it
    got = [(g["index"], g["uuid"], g["memory_mib"]) for g in doc["gpus"]]
    assert got == want, (got, want)
    assert len(inv.gpus) == len(want)
    published = inventory_document(NODE, NvmlGpus().gpus(), {})
    assert [(g["index"], g["uuid"], g["memory_mib"]) for g in published["gpus"]] == want
    print(
        "GPU-CHECK inventory:",
        json.dumps(
            {
                "gpus": [
                    {k: g.get(k) for k in ("index", "model", "memory_mib", "numa", "mig")}
                    for g in doc["gpus"]
                ],
                "links": doc.get("links"),
                "driver": doc.get("driver_version"),
            }
        ),
    )


def test_kubelet_sees_every_gpu_split_and_healthy(plugin: Plugin) -> None:
    uuids = [g.uuid for g in plugin.gpus.gpus()]
    assert uuids
    want = {f"{u}-{i}": "Healthy" for u in uuids for i in range(10)}
    plugin.kubelet.wait(lambda: plugin.kubelet.state.devices == want)
    assert plugin.kubelet.refused == []
    print("GPU-CHECK devices:", len(want), "replicas of", len(uuids), "GPUs, all healthy")


def test_a_pytorch_workload_sees_its_pods_quota(plugin: Plugin) -> None:
    gpu = min(plugin.gpus.gpus(), key=lambda g: g.index)
    pod = Pod("default", "train", [Container("main", 1)])
    plugin.pods.annotations[(pod.namespace, pod.name)] = annotation(
        pod, {"main": [(gpu, 3000, 30)]}
    )
    resp = plugin.kubelet.admit(pod)["main"]
    # GetPreferredAllocation steered kubelet to the placed GPU
    assert plugin.kubelet.state.assigned[(pod.key, "main")][0].startswith(gpu.uuid + "-")
    assert dict(resp.envs)["CUDA_VISIBLE_DEVICES"] == gpu.uuid
    plugin.kubelet.start(pod, "main")
    proc = run(resp, TORCH, node_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print("GPU-CHECK device plugin + torch:", json.dumps(got))
    assert got["count"] == 1
    assert got["total"] == 3000 * MiB
    assert got["free"] < 3000 * MiB  # the context is charged
    assert got["free"] - got["free_after_1g"] == pytest.approx(1 << 30, abs=64 * MiB)
    assert got["error"] == "OutOfMemoryError"
