"""kubelet's side of the device plugin API, for tests: the real gRPC
protocol over unix sockets, as kubelet's device manager speaks it.

- a Registration server on <plugin dir>/kubelet.sock that validates
  Register (version v1beta1, a bare endpoint file name in the same
  directory, a domain/name resource) and then dials the plugin back:
  GetDevicePluginOptions, and a ListAndWatch stream kept in a health map;
- admit(pod): per container, in order (init containers first, plain ones
  and sidecars as the manifest has them), reuse the pod's pool of devices
  (devicesToReuse: what plain init containers held; a sidecar's and an
  app container's leave it), choose healthy free IDs for the rest, asking
  GetPreferredAllocation when the plugin offers it (its answer is used
  only if it is a valid subset of the right size with must_include),
  call Allocate with one container request and record pod/container -> IDs;
- a PodResources server (v1 List and Get) that serves those records, for
  app containers and sidecars (not plain init containers);
- start(pod, container): PreStartContainer when the plugin requires it
  and the container has devices; then, given the API (`api`), the pod's
  status as kubelet reports it: the started containers running (a plain
  init container terminated once a later container started, a sidecar
  running on), phase Running once every app container started; the device
  plugin and the extender read it; start_all(pod) starts them in kubelet's
  order (start_order);
- serve(node, namespace, admit): kubelet's sync loop for a node: the pods
  bound to it, as their bindings arrive (each batch in creation order, as
  kubelet's HandlePodAdditions sorts it), admitted and started by `admit`;
- restart(): what a kubelet restart does to the directory (every socket in
  it removed, kubelet.sock created again), so the plugin must re-register;
- run(): the container's command on the simulated node with exactly the
  environment and mounts Allocate returned.  Without mount namespaces, the
  mounts are applied by translating each container path in the
  environment to its host path (a read-only mount is not enforced).

As in kubelet, admission is serial (one pod at a time) while container
starts run concurrently, a sidecar or app container reuses the devices of
the plain init containers before it first, and PodResources lists app
containers and sidecars, not plain init containers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from gpuvisor.cluster.deviceplugin.api import deviceplugin_v1beta1_pb2 as dp
from gpuvisor.cluster.deviceplugin.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from gpuvisor.cluster.deviceplugin.api import podresources_v1_pb2 as pr
from gpuvisor.cluster.deviceplugin.api import podresources_v1_pb2_grpc as pr_grpc

from tests.helpers import run_cmd

PRESTART_TIMEOUT = 30.0  # kubelet's
RESOURCE_RE = r"^[a-z0-9.-]+/[a-z0-9.-]+$"


@dataclass
class Container:
    name: str
    gpus: int  # replicas of the resource asked
    init: bool = False
    # an init container with restartPolicy: Always (KEP-753): it starts in the
    # init order and runs on beside the later init and the app containers
    sidecar: bool = False

    def __post_init__(self) -> None:
        assert self.init or not self.sidecar, f"{self.name}: a sidecar is an init container"

    @property
    def plain_init(self) -> bool:
        return self.init and not self.sidecar


@dataclass
class Pod:
    namespace: str
    name: str
    containers: list[Container]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass
class Registered:
    request: dp.RegisterRequest
    options: dp.DevicePluginOptions
    channel: grpc.Channel
    stub: dp_grpc.DevicePluginStub


class AdmissionError(Exception):
    pass


@dataclass
class _State:
    devices: dict[str, str] = field(default_factory=dict)  # ID -> health
    updates: int = 0
    assigned: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    pods: dict[tuple[str, str], Pod] = field(default_factory=dict)
    started: dict[str, list[str]] = field(default_factory=dict)  # pod key -> containers


class _Registration(dp_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def Register(self, request, context):
        problem = self.kubelet.validate(request)
        if problem:
            self.kubelet.refused.append(problem)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        # kubelet answers, then dials the plugin back
        threading.Thread(target=self.kubelet.connect, args=(request,), daemon=True).start()
        return dp.Empty()


class _PodResources(pr_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def List(self, request, context):
        return pr.ListPodResourcesResponse(pod_resources=self.kubelet.pod_resources())

    def Get(self, request, context):
        for p in self.kubelet.pod_resources():
            if p.name == request.pod_name and p.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=p)
        context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name}")
        return None


class FakeKubelet:
    def __init__(self, plugin_dir: Path, pod_resources_socket: Path, api: Any = None) -> None:
        self.plugin_dir = plugin_dir
        self.api = api  # kubernetes.client.CoreV1Api: pods' status reported there
        self.servings: list[Serving] = []
        self.pod_resources_socket = pod_resources_socket
        plugin_dir.mkdir(parents=True, exist_ok=True)
        pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
        self.cond = threading.Condition()
        self.state = _State()
        self.registered: Registered | None = None
        self.registrations: list[dp.RegisterRequest] = []
        self.refused: list[str] = []
        self._admit = threading.Lock()
        self._reg_server: grpc.Server | None = None
        self._pr_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pr_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), self._pr_server)
        self._pr_server.add_insecure_port(f"unix://{pod_resources_socket}")
        self._pr_server.start()
        self._start_registration()

    # ---- registration and the plugin's device list --------------------

    def _start_registration(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        dp_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.plugin_dir / 'kubelet.sock'}")
        server.start()
        self._reg_server = server

    def validate(self, r: dp.RegisterRequest) -> str:
        import re

        if r.version != "v1beta1":
            return f"version {r.version!r} is not supported"
        if not r.endpoint or "/" in r.endpoint or not (self.plugin_dir / r.endpoint).exists():
            return f"endpoint {r.endpoint!r} is not a socket in {self.plugin_dir}"
        if not re.match(RESOURCE_RE, r.resource_name):
            return f"resource name {r.resource_name!r} is not domain/name"
        return ""

    def connect(self, request: dp.RegisterRequest) -> None:
        channel = grpc.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        stub = dp_grpc.DevicePluginStub(channel)
        opts = stub.GetDevicePluginOptions(dp.Empty(), timeout=10)
        with self.cond:
            self.registered = Registered(request, opts, channel, stub)
            self.registrations.append(request)
            self.cond.notify_all()
        try:
            for reply in stub.ListAndWatch(dp.Empty()):
                with self.cond:
                    self.state.devices = {d.ID: d.health for d in reply.devices}
                    self.state.updates += 1
                    self.cond.notify_all()
        except grpc.RpcError:
            pass  # the plugin went away (restart, stop)

    def wait(self, predicate, timeout: float = 10.0) -> None:
        with self.cond:
            if not self.cond.wait_for(predicate, timeout):
                raise TimeoutError("kubelet harness: condition not reached")

    def wait_registered(self, count: int = 1, timeout: float = 10.0) -> Registered:
        self.wait(lambda: len(self.registrations) >= count and bool(self.state.devices), timeout)
        assert self.registered is not None
        return self.registered

    def restart(self) -> None:
        """kubelet restarts: its sockets and every plugin's socket are removed,
        then kubelet.sock is created again; the device list is forgotten."""
        assert self._reg_server is not None
        self._reg_server.stop(grace=None).wait()
        with self.cond:
            if self.registered is not None:
                self.registered.channel.close()
            self.registered = None
            self.state.devices = {}
        for sock in self.plugin_dir.iterdir():
            if sock.is_socket():
                sock.unlink()
        time.sleep(0.05)
        self._start_registration()

    def stop(self) -> None:
        for serving in self.servings:
            serving.stop()
        if self._reg_server is not None:
            self._reg_server.stop(grace=None).wait()
        self._pr_server.stop(grace=None).wait()
        if self.registered is not None:
            self.registered.channel.close()

    # ---- admission and container start -------------------------------

    def _free(self) -> list[str]:
        held = {d for ids in self.state.assigned.values() for d in ids}  # init's too
        return [d for d, h in self.state.devices.items() if h == "Healthy" and d not in held]

    def admit(self, pod: Pod) -> dict[str, dp.ContainerAllocateResponse]:
        """Allocate devices for every container of pod, as kubelet's device
        manager does at admission; AdmissionError if they cannot be had.

        Init containers first (plain ones and sidecars in manifest order),
        then app containers.  Each takes from the pod's pool (kubelet's
        devicesToReuse) first, without asking GetPreferredAllocation, and
        asks it for the rest with the reused ones as must_include.  A plain
        init container's devices are added to the pool; a sidecar's and an
        app container's are removed from it (they keep them)."""
        reg = self.registered
        assert reg is not None, "no plugin registered"
        out = {}
        reuse: list[str] = []
        with self._admit:
            for c in sorted(pod.containers, key=lambda c: not c.init):
                if c.gpus == 0:
                    continue
                ids = reuse[: c.gpus]  # init containers too (devicesToReuse)
                if len(ids) < c.gpus:
                    ids = self._choose(reg, pod, c, ids)
                resp = reg.stub.Allocate(
                    dp.AllocateRequest(
                        container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)]
                    ),
                    timeout=10,
                ).container_responses[0]
                with self.cond:
                    self.state.assigned[(pod.key, c.name)] = ids
                    self.state.pods[(pod.namespace, pod.name)] = pod
                if c.plain_init:
                    reuse = list(dict.fromkeys(reuse + ids))
                else:
                    reuse = [d for d in reuse if d not in ids]
                out[c.name] = resp
        return out

    def _choose(self, reg: Registered, pod: Pod, c: Container, must: list[str]) -> list[str]:
        with self.cond:
            free = [d for d in self._free() if d not in must]
        if len(free) + len(must) < c.gpus:
            raise AdmissionError(f"{pod.key}/{c.name}: {len(free)} free of {c.gpus}")
        ids = must + free[: c.gpus - len(must)]
        if reg.options.get_preferred_allocation_available:
            available = must + free
            want = reg.stub.GetPreferredAllocation(
                dp.PreferredAllocationRequest(
                    container_requests=[
                        dp.ContainerPreferredAllocationRequest(
                            available_deviceIDs=available,
                            must_include_deviceIDs=must,
                            allocation_size=c.gpus,
                        )
                    ]
                ),
                timeout=10,
            ).container_responses[0]
            got = list(want.deviceIDs)
            if (
                len(got) == c.gpus
                and len(set(got)) == c.gpus
                and set(got) <= set(available)
                and set(must) <= set(got)
            ):
                ids = got
        return ids

    def start(self, pod: Pod, container: str) -> None:
        """What kubelet does to start the container: PreStartContainer, when
        the plugin asked for it and the container has devices (grpc.RpcError
        when the plugin refuses: kubelet then fails the start); then, with
        `api`, the pod's status reports the container running."""
        reg = self.registered
        assert reg is not None
        ids = self.state.assigned.get((pod.key, container))
        if ids and reg.options.pre_start_required:
            reg.stub.PreStartContainer(
                dp.PreStartContainerRequest(devices_ids=ids), timeout=PRESTART_TIMEOUT
            )
        with self.cond:
            started = self.state.started.setdefault(pod.key, [])
            if container not in started:
                started.append(container)
            started = list(started)
        if self.api is not None:
            self.api.patch_namespaced_pod_status(
                pod.name, pod.namespace, {"status": pod_status(pod, started)}
            )

    def start_all(self, pod: Pod) -> None:
        """Start pod's containers as kubelet does (start_order): each plain
        init container run to completion before the next container starts,
        each sidecar started and left running, then the app containers."""
        for c in start_order(pod):
            self.start(pod, c.name)

    def serve(self, node: str, namespace: str, admit: Callable[[Any], object]) -> Serving:
        """kubelet's sync loop for `node` (needs `api`): each pod of
        `namespace` bound to it is handed to `admit` (which admits and starts
        it) once, in the order the bindings arrive, a batch seen at once in
        creation order, then name; its result (or exception) is kept."""
        assert self.api is not None, "serve needs the API"
        serving = Serving(self.api, node, namespace, admit)
        self.servings.append(serving)
        serving.thread.start()
        return serving

    def pod_resources(self) -> list[pr.PodResources]:
        resource = self.registered.request.resource_name if self.registered else ""
        with self.cond:
            out = []
            for (ns, name), pod in self.state.pods.items():
                containers = []
                # kubelet lists app containers (and restartable init ones), not
                # plain init containers
                for c in pod.containers:
                    if c.plain_init:
                        continue
                    ids = self.state.assigned.get((pod.key, c.name), [])
                    devs = [pr.ContainerDevices(resource_name=resource, device_ids=ids)]
                    containers.append(
                        pr.ContainerResources(name=c.name, devices=devs if ids else [])
                    )
                out.append(pr.PodResources(name=name, namespace=ns, containers=containers))
            return out

    def release(self, pod: Pod) -> None:
        """The pod is gone: its devices are free again."""
        with self.cond:
            for c in pod.containers:
                self.state.assigned.pop((pod.key, c.name), None)
            self.state.pods.pop((pod.namespace, pod.name), None)
            self.state.started.pop(pod.key, None)


def start_order(pod: Pod) -> list[Container]:
    """pod's containers in the order kubelet starts them: the init
    containers in manifest order (a plain one runs to completion before the
    next starts, a sidecar starts and runs on), then the app containers."""
    return [c for c in pod.containers if c.init] + [c for c in pod.containers if not c.init]


def pod_status(pod: Pod, started: Sequence[str]) -> dict[str, Any]:
    """The status kubelet reports for pod with the `started` containers up:
    those running (a plain init container terminated, Completed, once a
    container after it in start_order started; a sidecar running on), phase
    Running once every app container did."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    apps = [c.name for c in pod.containers if not c.init]
    order = [c.name for c in start_order(pod)]

    def status(c: Container) -> dict[str, Any]:
        state: dict[str, Any]
        later = order[order.index(c.name) + 1 :]
        if c.name not in started:
            state = {"waiting": {"reason": "ContainerCreating"}}
        elif c.plain_init and any(d in started for d in later):
            state = {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": now}}
        else:
            state = {"running": {"startedAt": now}}
        return {
            "name": c.name,
            "image": "harness",
            "imageID": "",
            "ready": c.name in started and not c.plain_init,
            "restartCount": 0,
            "state": state,
        }

    return {
        "phase": "Running" if all(c in started for c in apps) else "Pending",
        "initContainerStatuses": [status(c) for c in pod.containers if c.init],
        "containerStatuses": [status(c) for c in pod.containers if not c.init],
    }


class Serving:
    """One node's sync loop (FakeKubelet.serve); `stop` ends it."""

    POLL = 0.1

    def __init__(self, api: Any, node: str, namespace: str, admit: Callable[[Any], object]):
        self.api = api
        self.node = node
        self.namespace = namespace
        self.admit = admit
        self.results: dict[str, Any] = {}  # pod name -> admit's result or exception
        self.order: list[str] = []  # the pods in the order they were admitted
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"kubelet-{node}", daemon=True)

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                pods = self.api.list_namespaced_pod(
                    self.namespace, field_selector=f"spec.nodeName={self.node}"
                ).items
            except Exception:
                self.stopping.wait(self.POLL)
                continue
            new = [p for p in pods if p.metadata.name not in self.results]
            new.sort(key=lambda p: (p.metadata.creation_timestamp, p.metadata.name))
            for p in new:
                try:
                    result: Any = self.admit(p)
                except Exception as exc:
                    result = exc
                with self.cond:
                    self.results[p.metadata.name] = result
                    self.order.append(p.metadata.name)
                    self.cond.notify_all()
            self.stopping.wait(self.POLL)

    def wait(self, names: Sequence[str], timeout: float = 60.0) -> dict[str, Any]:
        """The results of the named pods, once each was admitted."""
        with self.cond:
            if not self.cond.wait_for(lambda: set(names) <= set(self.results), timeout):
                missing = sorted(set(names) - set(self.results))
                raise TimeoutError(f"kubelet harness on {self.node}: {missing} not admitted")
            return {n: self.results[n] for n in names}

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)


def host_env(resp: dp.ContainerAllocateResponse, base: Mapping[str, str]) -> dict[str, str]:
    """base, then Allocate's environment with every container path of its
    mounts translated to the mount's host path."""
    mounts = sorted(resp.mounts, key=lambda m: -len(m.container_path))
    env = dict(base)
    for k, v in resp.envs.items():
        for m in mounts:
            cp = m.container_path.rstrip("/")
            if v == cp or v.startswith(cp + "/"):
                v = m.host_path + v[len(cp) :]
                break
        env[k] = v
    return env


def container_base_env(node_env: Mapping[str, str]) -> dict[str, str]:
    """A simulated node's environment as a container inherits it: the
    simulated driver, without the region and node lock (Allocate gives
    those); `run`'s base."""
    return {
        k: v
        for k, v in node_env.items()
        if k not in ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "GPUVISOR_NODE_LOCK")
    }


def run(
    resp: dp.ContainerAllocateResponse,
    code: str,
    base: Mapping[str, str],
    args: Sequence[str] = (),
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """The container's command (`python -c code`) on the simulated node with
    exactly Allocate's environment and mounts."""
    return run_cmd(
        [sys.executable, "-c", textwrap.dedent(code), *args], host_env(resp, base), timeout
    )
