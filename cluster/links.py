"""How every pair of GPUs is connected, in the vocabulary of `nvidia-smi topo -m`.

NVML answers the PCIe path (`nvmlDeviceGetTopologyCommonAncestor`) and the
NVLinks (`nvmlDeviceGetNvLinkState`, and what is at each link's other end)
separately; `nvidia-smi topo -m` shows a pair's NVLinks when it has any
(`NV<n>`), else its PCIe path.  A link to an NVSwitch reaches every GPU that
also has switch links: the pair then has as many links as the one with fewer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# NVML's PCIe levels (nvmlGpuTopologyLevel_t: INTERNAL, SINGLE, MULTIPLE,
# HOSTBRIDGE, NODE, SYSTEM), nearest first, and their `nvidia-smi topo -m`
# names.  pynvml is imported where NVML is called: importing the command
# line must not load it (`gpuvisor run` starts every container).
PCIE_NAMES: dict[int, str] = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
LEGEND: dict[str, str] = {
    "X": "itself",
    "NV#": "a bonded set of # NVLinks (directly, or through NVSwitch)",
    "PIX": "at most one PCIe switch",
    "PXB": "several PCIe switches, no PCIe host bridge",
    "PHB": "a PCIe host bridge (typically the CPU)",
    "NODE": "PCIe and the interconnect between host bridges within a NUMA node",
    "SYS": "PCIe and the interconnect between NUMA nodes (e.g. QPI/UPI, Infinity Fabric)",
}


@dataclass
class NvLinks:
    """The active NVLinks of one GPU: to each peer GPU (by PCI bus id), and to NVSwitches."""

    to_gpu: dict[str, int] = field(default_factory=dict)
    to_switch: int = 0


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML's bus ids in one spelling: 8-digit domain, upper case ("00000000:07:00.0")."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    parts = text.strip().upper().split(":")
    if len(parts) == 3:
        parts[0] = parts[0].rjust(8, "0")[-8:]
    return ":".join(parts)


def _remote(handle: Any, link: int) -> tuple[int | None, Any]:
    """What is at the other end of an active link: its device type and PCI info."""
    import pynvml

    try:
        kind: int | None = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
    except pynvml.NVMLError:
        kind = None  # an older driver: tell by the PCI info alone
    try:
        pci = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
    except pynvml.NVMLError:
        pci = None
    return kind, pci


def read_nvlinks(handle: Any) -> NvLinks:
    """Walk a GPU's NVLinks until NVML says there are no more (or none at all)."""
    import pynvml

    links = NvLinks()
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            active = pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            break  # no NVLink, or past its last link
        except pynvml.NVMLError_FunctionNotFound:
            break
        if active != pynvml.NVML_FEATURE_ENABLED:
            continue
        kind, pci = _remote(handle, link)
        if kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
            links.to_switch += 1
            continue
        if pci is None:
            continue
        bus = normalize_bus_id(pci.busId)
        links.to_gpu[bus] = links.to_gpu.get(bus, 0) + 1
    return links


def link_matrix(
    bus_ids: Sequence[str],
    nvlinks: Sequence[NvLinks],
    pcie_level: Callable[[int, int], int],
) -> list[list[str]]:
    """links[i][j]: `NV<n>` when GPUs i and j share NVLinks, else their PCIe path's name."""
    n = len(bus_ids)
    matrix = [["X"] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            direct = nvlinks[i].to_gpu.get(bus_ids[j], 0)
            switched = min(nvlinks[i].to_switch, nvlinks[j].to_switch)
            if direct + switched:
                matrix[i][j] = f"NV{direct + switched}"
            else:
                matrix[i][j] = PCIE_NAMES.get(pcie_level(i, j), "SYS")
    return matrix
