"""The device plugin's defaults, in a module that imports nothing, so that
the `gpuvisor` command line can describe `device-plugin` without loading
gRPC or NVML."""

from __future__ import annotations

from pathlib import Path

RESOURCE = "nvidia.com/gpu"
SPLIT_COUNT = 10  # replicas per GPU (HAMi's deviceSplitCount)
PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
ENDPOINT = "gpuvisor.sock"
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
# host paths (the plugin sees them at the same paths)
STATE_DIR = Path("/var/lib/gpuvisor/containers")
LIB_DIR = Path("/usr/local/gpuvisor/lib")
NODE_DIR = Path("/run/gpuvisor")
