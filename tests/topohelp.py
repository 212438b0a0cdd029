"""Topology files for the simulated node (GPUVISOR_SIM_TOPOLOGY) and a node
that uses one, for tests/test_sim_topology.py, test_mig.py and
test_inventory.py."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from tests.helpers import SimNode, run_py


def nvlink_pairs() -> dict[str, Any]:
    """Four A100s on two sockets, NVLinked in pairs (0-1, 2-3), each pair under one switch."""
    return {
        "gpus": [
            {"model": "NVIDIA A100-SXM4-80GB", "numa": s, "pcie_switch": s} for s in (0, 0, 1, 1)
        ],
        "nvlink": [[0, 1, 12], [2, 3, 12]],
    }


def dgx() -> dict[str, Any]:
    """A DGX-like box: eight H100s joined through NVSwitch, two per PCIe switch, two sockets."""
    return {
        "gpus": [
            {"model": "NVIDIA H100 80GB HBM3", "numa": i // 4, "pcie_switch": i // 2}
            for i in range(8)
        ],
        "nvswitch": True,
    }


def pcie_two_switches() -> dict[str, Any]:
    """PCIe only, two switches per socket: on socket 0 each switch behind its own host
    bridge (NODE between them), on socket 1 both behind one upstream switch (PXB)."""
    gpus: list[dict[str, Any]] = []
    for i in range(8):
        gpu: dict[str, Any] = {"model": "NVIDIA A30", "numa": i // 4, "pcie_switch": i // 2}
        if i < 4:
            gpu["host_bridge"] = i // 2
        else:
            gpu["pcie_upstream"] = 9
        gpus.append(gpu)
    return {"gpus": gpus}


# links[i][j] as nvidia-smi topo -m would print it
NVLINK_PAIRS_LINKS = [
    ["X", "NV12", "SYS", "SYS"],
    ["NV12", "X", "SYS", "SYS"],
    ["SYS", "SYS", "X", "NV12"],
    ["SYS", "SYS", "NV12", "X"],
]
DGX_LINKS = [["X" if i == j else "NV18" for j in range(8)] for i in range(8)]


def _pcie_link(i: int, j: int) -> str:
    if i == j:
        return "X"
    if i // 4 != j // 4:
        return "SYS"
    if i // 2 == j // 2:
        return "PIX"
    return "NODE" if i < 4 else "PXB"


PCIE_LINKS = [[_pcie_link(i, j) for j in range(8)] for i in range(8)]


def topo_node(tmp_path: Path, topology: dict[str, Any] | str) -> SimNode:
    """A fresh simulated node described by topology (a dict, or the file's raw text)."""
    node = SimNode.create(tmp_path)
    path = tmp_path / "topology.json"
    path.write_text(topology if isinstance(topology, str) else json.dumps(topology))
    del node.env["GPUVISOR_SIM_DEVICES"]
    node.env["GPUVISOR_SIM_TOPOLOGY"] = str(path)
    return node


def make_3g_instance(node: SimNode, start: int, then: str = "") -> str:
    """Through NVML: on GPU 0 (in MIG mode) a 3g.40gb GPU instance (profile
    9) at memory slice start, with a 3-slice compute instance; then the code
    `then` (NVML as n, GPU 0's handle as d).  The program's output."""
    made = run_py(
        textwrap.dedent(
            f"""
            import ctypes, pynvml as n
            n.nvmlInit()
            d = n.nvmlDeviceGetHandleByIndex(0)
            pl = n.c_nvmlGpuInstancePlacement_t({start}, 4)
            gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(d, 9, ctypes.byref(pl))
            n.nvmlGpuInstanceCreateComputeInstance(gi, n.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
            """
        )
        + then,
        node.env,
    )
    assert made.returncode == 0, made.stderr
    return made.stdout
