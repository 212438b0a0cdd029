"""Which pod and container hold a set of device IDs, from kubelet's
PodResources API (v1 `List`, GA since Kubernetes 1.28): by the time kubelet
calls PreStartContainer, its device manager has recorded the container's
devices, so the owner is a fact kubelet states, not a guess."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from gpuvisor.cluster.deviceplugin.api import podresources_v1_pb2_grpc as pr_grpc

from . import defaults
from .api import podresources_v1_pb2 as pr

DEFAULT_SOCKET = defaults.POD_RESOURCES_SOCKET


@dataclass(frozen=True)
class Owner:
    namespace: str
    pod: str
    container: str

    @property
    def pod_key(self) -> str:
        return f"{self.namespace}/{self.pod}"


@dataclass(frozen=True)
class Holders:
    owners: list[Owner]  # the containers whose devices are exactly the IDs
    pods: set[str]  # every pod kubelet lists ("namespace/name")
    devices: set[str]  # every ID of the resource a listed container holds
    # pods listed more than once: one deleted (terminating) and one created
    # again under its name (PodResources names pods, not UIDs)
    twice: set[str] = field(default_factory=set)


class OwnerLookup(Protocol):
    def holders(self, resource: str, device_ids: Collection[str]) -> Holders: ...


class PodResourcesOwners:
    """Asks kubelet's PodResources socket (one List per question)."""

    def __init__(self, socket: str = DEFAULT_SOCKET, timeout: float = 10.0) -> None:
        self.socket = socket
        self.timeout = timeout

    def holders(self, resource: str, device_ids: Collection[str]) -> Holders:
        """The containers whose devices of resource are exactly device_ids."""
        want = set(device_ids)
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            reply = pr_grpc.PodResourcesListerStub(channel).List(
                pr.ListPodResourcesRequest(), timeout=self.timeout
            )
        found = []
        pods = set()
        twice = set()
        held: set[str] = set()
        for pod in reply.pod_resources:
            key = f"{pod.namespace}/{pod.name}"
            if key in pods:
                twice.add(key)
            pods.add(key)
            for c in pod.containers:
                ids = {d for cd in c.devices if cd.resource_name == resource for d in cd.device_ids}
                held |= ids
                if ids and ids == want:
                    found.append(Owner(pod.namespace, pod.name, c.name))
        return Holders(found, pods, held, twice)
