"""The device plugin's .proto files: the committed generated modules are what
the .proto files give, and the wire names and field numbers are kubelet's."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuvisor.cluster.deviceplugin.api import (
    deviceplugin_v1beta1_pb2 as dp,
)
from gpuvisor.cluster.deviceplugin.api import (
    podresources_v1_pb2 as pr,
)
from gpuvisor.cluster.deviceplugin.api.generate import HERE, generate

# Transcribed from kubelet's documented v1beta1 device plugin API and v1
# PodResources API: message -> {field name: number}.  A typo in our .proto
# (a renamed field, a shifted number) changes the wire format silently;
# this table catches it.
DEVICEPLUGIN_FIELDS = {
    "DevicePluginOptions": {"pre_start_required": 1, "get_preferred_allocation_available": 2},
    "RegisterRequest": {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4},
    "Empty": {},
    "ListAndWatchResponse": {"devices": 1},
    "TopologyInfo": {"nodes": 1},
    "NUMANode": {"ID": 1},
    "Device": {"ID": 1, "health": 2, "topology": 3},
    "PreStartContainerRequest": {"devices_ids": 1},
    "PreStartContainerResponse": {},
    "PreferredAllocationRequest": {"container_requests": 1},
    "ContainerPreferredAllocationRequest": {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    },
    "PreferredAllocationResponse": {"container_responses": 1},
    "ContainerPreferredAllocationResponse": {"deviceIDs": 1},
    "AllocateRequest": {"container_requests": 1},
    "ContainerAllocateRequest": {"devices_ids": 1},
    "CDIDevice": {"name": 1},
    "AllocateResponse": {"container_responses": 1},
    "ContainerAllocateResponse": {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    },
    "Mount": {"container_path": 1, "host_path": 2, "read_only": 3},
    "DeviceSpec": {"container_path": 1, "host_path": 2, "permissions": 3},
}
DEVICEPLUGIN_METHODS = {
    "Registration": {"Register": ("RegisterRequest", "Empty", False)},
    "DevicePlugin": {
        "GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "GetPreferredAllocation": (
            "PreferredAllocationRequest",
            "PreferredAllocationResponse",
            False,
        ),
        "Allocate": ("AllocateRequest", "AllocateResponse", False),
        "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    },
}
PODRESOURCES_FIELDS = {
    "ListPodResourcesRequest": {},
    "ListPodResourcesResponse": {"pod_resources": 1},
    "PodResources": {"name": 1, "namespace": 2, "containers": 3},
    "ContainerResources": {"name": 1, "devices": 2, "cpu_ids": 3, "memory": 4},
    "ContainerDevices": {"resource_name": 1, "device_ids": 2, "topology": 3},
    "ContainerMemory": {"memory_type": 1, "size": 2, "topology": 3},
    "TopologyInfo": {"nodes": 1},
    "NUMANode": {"ID": 1},
    "GetPodResourcesRequest": {"pod_name": 1, "pod_namespace": 2},
    "GetPodResourcesResponse": {"pod_resources": 1},
    "AllocatableResourcesRequest": {},
    "AllocatableResourcesResponse": {"devices": 1, "cpu_ids": 2, "memory": 3},
}
PODRESOURCES_METHODS = {
    "PodResourcesLister": {
        "List": ("ListPodResourcesRequest", "ListPodResourcesResponse", False),
        "Get": ("GetPodResourcesRequest", "GetPodResourcesResponse", False),
        "GetAllocatableResources": (
            "AllocatableResourcesRequest",
            "AllocatableResourcesResponse",
            False,
        ),
    },
}


def test_committed_modules_are_what_the_protos_give(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    made = generate(tmp_path)
    assert len(made) == 6
    for path in made:
        committed = HERE / path.name
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.name} is stale: run `make protos` and commit"
        )


@pytest.mark.parametrize(
    ("module", "package", "fields", "methods"),
    [
        (dp, "v1beta1", DEVICEPLUGIN_FIELDS, DEVICEPLUGIN_METHODS),
        (pr, "v1", PODRESOURCES_FIELDS, PODRESOURCES_METHODS),
    ],
)
def test_wire_names_and_numbers(module, package, fields, methods) -> None:
    desc = module.DESCRIPTOR
    assert desc.package == package
    assert set(desc.message_types_by_name) == set(fields)
    for name, want in fields.items():
        got = {f.name: f.number for f in desc.message_types_by_name[name].fields}
        assert got == want, name
    assert set(desc.services_by_name) == set(methods)
    for service, want_methods in methods.items():
        got_methods = {
            m.name: (m.input_type.name, m.output_type.name, m.server_streaming)
            for m in desc.services_by_name[service].methods
        }
        assert got_methods == want_methods, service
